"""The backend interface: one class per file, registered by name; only backends touch the system.

A backend turns a `Plan` into a running network and back. `up` may leave background processes
(the tun delay line) running; everything it needs to tear down is written to the run-state folder so
that `down` works from another process (the CLI returns to the shell after `up`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar, Optional, Type

from ..files import write_json_atomic
from ..plan import Plan
from ..linkspec import LinkSpec

STATE_ROOT = Path(os.environ.get("WANBENCH_STATE_DIR", "/run/wanbench"))


class BackendUnavailable(RuntimeError):
    """This backend cannot run on this machine; the message says why and what to use instead."""


class Backend:
    """Base class. Subclasses set `name`, implement `check_available`, `up` and `down`."""

    name: ClassVar[str] = ""

    def __init__(self, plan: Plan):
        self.plan = plan

    @classmethod
    def check_available(cls) -> None:
        """Raise BackendUnavailable (with how to fix it) when this machine cannot run the backend."""

    def up(self) -> None:
        """Build the network for `self.plan`. On failure, undo what was built, then raise."""
        raise NotImplementedError

    def down(self) -> None:
        """Tear down what `up` built. Idempotent."""
        raise NotImplementedError

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        """Change every node pair from `src_region` to `dst_region` while the network is up.

        `spec` None takes the link down (every packet dropped). Used by fault injection.
        """
        raise NotImplementedError(f"the {self.name} backend cannot change links while up")

    def counters(self, fresh: bool = False) -> list[dict]:
        """Per-pair counters where the backend keeps them: one dict per ordered node pair with
        `src`, `dst` (node names), `packets`, `bytes` (wire bytes, IP headers included) and drops.

        `fresh`: as of now (the backend asks its shaper for a new reading), not as of its last
        periodic write; a per-job difference needs it.
        """
        return []

    # Run state, so that `down` and `exec` work from another process than `up`.
    @staticmethod
    def state_dir(prefix: str) -> Path:
        return STATE_ROOT / prefix

    def write_state(self, **extra) -> None:
        folder = self.state_dir(self.plan.prefix)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "plan.json").write_text(self.plan.to_json())
        write_json_atomic(folder / "state.json", {"backend": self.name, **extra}, indent=None)


REGISTRY: dict[str, Type[Backend]] = {}


def register(cls: Type[Backend]) -> Type[Backend]:
    if not cls.name or cls.name in REGISTRY:
        raise ValueError(f"backend name {cls.name!r} empty or registered twice")
    REGISTRY[cls.name] = cls
    return cls


def read_state(prefix: str) -> tuple[dict, Plan] | None:
    """The state and plan of the network that is up under `prefix`, or None."""
    folder = Backend.state_dir(prefix)
    try:
        state = json.loads((folder / "state.json").read_text())
        plan = Plan.from_json((folder / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    return state, plan


def clear_state(prefix: str) -> None:
    folder = Backend.state_dir(prefix)
    for name in ("state.json", "plan.json", "state.json.tmp"):
        (folder / name).unlink(missing_ok=True)
