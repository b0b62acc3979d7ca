"""CPU limits per node: one cgroup `<prefix>-<node>` per node, v1 `cpu` controller or v2 `cpu.max`.

Used for a node's CPU share (scenario `cpu_share`, in cores) and for straggler faults (the share
divided by a factor). Processes join their node's group before they exec (see `join_argv_hook`),
so nothing a node runs escapes the limit.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _v2() -> bool:
    return (CGROUP_ROOT / "cgroup.controllers").exists()


def cpu_root() -> Path:
    """Folder under which our groups go (v1: the cpu hierarchy; v2: the unified root)."""
    if _v2():
        return CGROUP_ROOT
    for name in ("cpu", "cpu,cpuacct"):
        if (CGROUP_ROOT / name / "cpu.cfs_quota_us").exists():
            return CGROUP_ROOT / name
    raise RuntimeError("no cgroup cpu controller found under /sys/fs/cgroup (v1 cpu or v2 cpu.max)")


def group_path(prefix: str, node_name: str) -> Path:
    return cpu_root() / f"{prefix}-{node_name}"


def create(prefix: str, node_name: str) -> Path:
    path = group_path(prefix, node_name)
    path.mkdir(exist_ok=True)
    return path


def set_cpu_limit(path: Path, cores: Optional[float]) -> None:
    """Limit the group to `cores` CPUs (e.g. 0.5); None removes the limit."""
    if cores is not None and cores <= 0:
        raise ValueError(f"cores must be > 0, got {cores}")
    quota = -1 if cores is None else max(1000, int(cores * PERIOD_US))
    if _v2():
        (path / "cpu.max").write_text(f"{'max' if quota < 0 else quota} {PERIOD_US}")
    else:
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(quota))


def cpu_limit(path: Path) -> Optional[float]:
    if _v2():
        quota, period = (path / "cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    quota = int((path / "cpu.cfs_quota_us").read_text())
    period = int((path / "cpu.cfs_period_us").read_text())
    return None if quota < 0 else quota / period


def add_pid(path: Path, pid: int) -> None:
    (path / "cgroup.procs").write_text(str(pid))


def join_hook(path: Path):
    """A Popen preexec_fn that moves the child into `path` before it execs."""
    procs = str(path / "cgroup.procs")

    def hook():
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))

    return hook


def remove(path: Path, timeout_s: float = 5.0) -> None:
    """Remove a group once its processes are gone (rmdir fails while any is left)."""
    deadline = time.monotonic() + timeout_s
    while path.exists():
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
