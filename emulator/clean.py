"""`wanbench clean`: remove everything carrying our prefix that a crash may have left behind.

Idempotent, and it touches only objects named with the prefix: namespaces `<prefix>-*` (and the
processes inside them, which only we start there), host links `<prefix>*`, our background
processes (identified by their command line naming our state folder), cgroups `<prefix>-*`,
/etc/netns/<prefix>-* and the run state. It never kills by a broad process name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from pyroute2 import IPRoute

from . import netns
from .backends.base import Backend, clear_state

CGROUP_ROOTS = [Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup")]


def _pids_in_namespace(name: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def our_background_pids(prefix: str) -> list[int]:
    """Processes whose command line names our state folder (the delay line, the mininet driver)."""
    marker = str(Backend.state_dir(prefix)).encode() + b"/"
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and b"emulator." in cmdline:
            pids.append(int(entry.name))
    return pids


def terminate_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL whatever is still alive after `grace_s`."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists()]
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def clean(prefix: str) -> list[str]:
    """Remove every object with `prefix`; return what was removed (empty when nothing was left)."""
    removed: list[str] = []
    namespaces = netns.list_namespaces(prefix)
    inside = [pid for name in namespaces for pid in _pids_in_namespace(name)]
    background = our_background_pids(prefix)
    if inside or background:
        terminate_pids(inside + background)
        removed += [f"process {pid}" for pid in inside + background]
    for name in namespaces:
        netns.remove_namespace(name)
        removed.append(f"namespace {name}")
    with IPRoute() as ipr:
        for link in ipr.get_links():
            name = link.get_attr("IFLA_IFNAME")
            if name and name.startswith(prefix) and name != "lo":
                try:
                    ipr.link("del", index=link["index"])
                    removed.append(f"link {name}")
                except Exception:  # already gone with its peer  # noqa: BLE001
                    pass
    for folder in netns.NETNS_ETC_DIR.glob(f"{prefix}-*") if netns.NETNS_ETC_DIR.exists() else []:
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    for root in CGROUP_ROOTS:
        if root.is_dir():
            for group in root.glob(f"{prefix}-*"):
                try:
                    group.rmdir()  # cgroup folders are removed with rmdir once empty
                    removed.append(f"cgroup {group}")
                except OSError:
                    pass
    clear_state(prefix)
    folder = Backend.state_dir(prefix)
    # Logs and counters of networks that are gone: files, not system objects, so not counted.
    shutil.rmtree(folder, ignore_errors=True)
    return removed
