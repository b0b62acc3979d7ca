"""Network backends, one per file; importing this package registers them all."""

from .base import REGISTRY, Backend, BackendUnavailable, clear_state, read_state, register
from . import tc  # noqa: F401  (registers "tc")

__all__ = ["REGISTRY", "Backend", "BackendUnavailable", "clear_state", "read_state", "register"]
