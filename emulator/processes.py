"""Ending processes we started, always by PID or Popen handle (never by a name pattern).

`stop` ends Popen handles (the harness's ranks, verify's probers); `stop_pids` ends PIDs recorded
elsewhere (the delay line, the mininet driver, what `clean` finds in our namespaces), checking
before each signal that the PID still is the process we mean (PIDs get reused).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterable, Optional


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


def cmdline(pid: int) -> str:
    """The command line of `pid`, arguments joined by spaces ("" when gone or unreadable)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def alive(pid: int) -> bool:
    """Running and not a zombie (a zombie waits for a parent that may not be us)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status if it is our child, so it does not stay a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` (s) for every PID to exit (reaping our children); return the living."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while True:
        for pid in waiting:
            _reap(pid)
        waiting = [pid for pid in waiting if alive(pid)]
        if not waiting or time.monotonic() >= deadline:
            return waiting
        time.sleep(0.02)


def send_signal(pid: int, signum: int) -> None:
    """Send `signum` to `pid`; a process that is already gone is not an error."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def stop_pids(pids: Iterable[int], grace_s: float = 3.0,
              is_ours: Callable[[int], bool] = lambda pid: True) -> None:
    """SIGTERM each PID that `is_ours`, then SIGKILL those still alive (and ours) after `grace_s` (s)."""
    targets = [pid for pid in pids if pid != os.getpid() and alive(pid) and is_ours(pid)]
    for pid in targets:
        send_signal(pid, signal.SIGTERM)
    for pid in wait_gone(targets, grace_s):
        if is_ours(pid):
            send_signal(pid, signal.SIGKILL)
    wait_gone(targets, grace_s)
