"""Per-node cgroups: CPU share, memory and pids limits; v1 (`cpu`, `memory`, `pids`) or v2.

Every node has one group `<prefix>-<node>` per hierarchy (v1: under /sys/fs/cgroup/memory and
pids, and under cpu once a CPU share is set; v2: one group under the unified root), created when
the node starts (`emulator.nodes`) and removed when it stops. The node's holder lives in them, and
every process entered into the node joins them before it execs, so nothing a node runs escapes its
limits. Used for the node's memory and pids limits (topology or scenario `node_limits`), its CPU
share (`cpu_share`, in cores) and straggler faults (the share divided by a factor).
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


def memory_root() -> Optional[Path]:
    """Where memory groups go, or None where the machine has no memory controller."""
    if _v2():
        return CGROUP_ROOT if "memory" in _v2_controllers() else None
    return CGROUP_ROOT / "memory" if (CGROUP_ROOT / "memory" / "memory.limit_in_bytes").exists() else None


def pids_root() -> Optional[Path]:
    """Where pids groups go, or None where the machine has no pids controller."""
    if _v2():
        return CGROUP_ROOT if "pids" in _v2_controllers() else None
    return CGROUP_ROOT / "pids" if (CGROUP_ROOT / "pids" / "cgroup.procs").exists() else None


def _v2_controllers() -> set[str]:
    try:
        return set((CGROUP_ROOT / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def enable_v2_controllers() -> None:
    """v2: let child groups of the root use cpu, memory and pids (no-op on v1 or when enabled)."""
    if not _v2():
        return
    wanted = {"cpu", "memory", "pids"} & _v2_controllers()
    enabled = set((CGROUP_ROOT / "cgroup.subtree_control").read_text().split())
    for name in sorted(wanted - enabled):
        (CGROUP_ROOT / "cgroup.subtree_control").write_text(f"+{name}")


def node_groups(prefix: str, node_name: str, with_cpu: bool = False) -> list[Path]:
    """The node's group in each hierarchy (one path on v2), whether or not it exists.

    Without `with_cpu` (what a node is made with and its holder joins): memory and pids. The CPU
    group stays apart on v1 and is made only for a CPU share (`create`): a v1 cpu group starts with
    no real-time budget (cpu.rt_runtime_us 0), so SCHED_FIFO -- the verify prober's -- fails in it.
    """
    roots = [memory_root(), pids_root()]
    if with_cpu:
        try:
            roots.insert(0, cpu_root())
        except RuntimeError:
            pass
    unique: list[Path] = []
    for root in roots:
        if root is not None and root / f"{prefix}-{node_name}" not in unique:
            unique.append(root / f"{prefix}-{node_name}")
    return unique


def memory_group(prefix: str, node_name: str) -> Optional[Path]:
    root = memory_root()
    return None if root is None else root / f"{prefix}-{node_name}"


def create_node_groups(prefix: str, node_name: str, memory_bytes: Optional[int] = None,
                       pids_max: Optional[int] = None) -> list[Path]:
    """Create the node's groups and set its memory (bytes) and pids limits; return the groups.

    A limit given on a machine without its controller is an error (never a silent no-op).
    """
    if memory_bytes is not None and memory_root() is None:
        raise RuntimeError("memory limit asked but this machine has no cgroup memory controller")
    if pids_max is not None and pids_root() is None:
        raise RuntimeError("pids limit asked but this machine has no cgroup pids controller")
    enable_v2_controllers()
    groups = node_groups(prefix, node_name)
    for group in groups:
        group.mkdir(exist_ok=True)
    if memory_bytes is not None:
        set_memory_limit(memory_group(prefix, node_name), memory_bytes)
    if pids_max is not None:
        set_pids_limit(pids_root() / f"{prefix}-{node_name}", pids_max)
    return groups


def set_memory_limit(path: Path, limit_bytes: int) -> None:
    """Memory (RAM, and swap on v2) of everything in the group; over it the kernel OOM-kills in it."""
    if _v2():
        (path / "memory.max").write_text(str(limit_bytes))
        if (path / "memory.swap.max").exists():
            (path / "memory.swap.max").write_text("0")  # a limit that swapping cannot dodge
    else:
        (path / "memory.limit_in_bytes").write_text(str(limit_bytes))


def set_pids_limit(path: Path, pids_max: int) -> None:
    (path / "pids.max").write_text(str(pids_max))


def oom_kills(prefix: str, node_name: str) -> int:
    """How many processes the kernel's OOM killer ended in the node's memory group so far."""
    group = memory_group(prefix, node_name)
    name, field = ("memory.events", "oom_kill") if _v2() else ("memory.oom_control", "oom_kill")
    try:
        text = (group / name).read_text() if group is not None else ""
    except OSError:
        return 0
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == field:
            return int(value)
    return 0


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


def join_all_hook(paths: list[Path]):
    """A Popen preexec_fn that moves the child into every group of `paths` before it execs."""
    procs = [str(path / "cgroup.procs") for path in paths]

    def hook():
        for name in procs:
            with open(name, "w") as handle:
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
