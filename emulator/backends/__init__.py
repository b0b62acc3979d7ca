"""Network backends, one per file; importing this package registers them all."""

from .base import REGISTRY, Backend, BackendUnavailable, clear_state, read_state, register
from . import mininet, tc, tun  # noqa: F401  (each registers itself)

__all__ = ["REGISTRY", "Backend", "BackendUnavailable", "clear_state", "read_state", "register"]
