"""Network backends, one per file; importing this package registers them all."""

from __future__ import annotations

from typing import Type

from .base import REGISTRY, Backend, BackendUnavailable, clear_state, read_state, register
from . import mininet, tc, tun  # noqa: F401  (each registers itself)

__all__ = ["REGISTRY", "Backend", "BackendUnavailable", "choose_backend", "clear_state", "read_state",
           "register"]


def choose_backend(name: str) -> tuple[Type[Backend], str]:
    """The backend class for `--backend NAME`, and why it was chosen ("" when it was named).

    `auto` takes tc where the kernel has sch_netem, else tun; the reason then says why not tc.
    Raises BackendUnavailable when the backend (or, for auto, neither) can run here.
    """
    if name != "auto":
        cls = REGISTRY[name]
        cls.check_available()
        return cls, ""
    tc_backend = REGISTRY["tc"]
    try:
        tc_backend.check_available()
        return tc_backend, "auto: tc (the kernel has sch_netem)"
    except BackendUnavailable as why_not_tc:
        tun_backend = REGISTRY["tun"]
        tun_backend.check_available()
        return tun_backend, f"auto: tun ({why_not_tc})"
