"""Ending the processes we started: SIGTERM, a grace period, then SIGKILL, always by Popen handle."""

from __future__ import annotations

import subprocess
import time
from typing import Iterable, Optional


def stop(procs: Iterable[Optional[subprocess.Popen]], grace_s: float = 5.0) -> None:
    """Terminate every running process in `procs`, kill those still alive after `grace_s` (s)."""
    procs = [p for p in procs if p is not None]
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
