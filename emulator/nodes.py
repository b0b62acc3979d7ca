"""Container-grade nodes: each node its own hostname, IPC, PID space and mounts, cgroup limits.

A node is its network namespace (`netns.py`) plus a holder: a process started with util-linux
`nsenter --net` + `unshare --uts --ipc --mount --pid --fork --kill-child`, whose forked child
`node_init.py` is PID 1 of the node. It sets the hostname to the node name, mounts the node's own
/proc, sysfs, /tmp, /dev/shm and mqueue, makes the host's system folders read-only, and reaps
orphans. The holder lives in the node's cgroups (`cgroups.create_node_groups`: memory and pids
limits from the plan); a process entered into the node also joins the node's CPU group where a CPU
share made one.

Entering a node (`enter_argv`, used by `netns.exec_argv` for `wanbench exec`, verify and the
harness) runs `node_enter.py`, which joins the node's cgroups and the holder's namespaces and forks
the command there, passing signals on.

Ending a node (`stop`): SIGTERM to its PID 1, which passes SIGTERM to every process of the node and
exits after a grace period; the kernel then SIGKILLs whatever is left in the PID namespace -- a
daemon or a double fork included. Then the node's cgroups go. Mounts need no clean-up: they exist
only in the node's mount namespace (propagation private), which ends with its last process.

Run state: `<state dir>/nodes/<node>.pid` holds "<init pid> <launcher pid>", checked against the
process's command line before any signal; `wanbench clean` finds holders by their command line
(the holder script and our state folder), so a crash that lost the pid files leaves nothing behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Optional

from . import cgroups, processes
from .backends.base import Backend
from .plan import Node, Plan

INIT_SCRIPT = Path(__file__).with_name("node_init.py")
ENTER_SCRIPT = Path(__file__).with_name("node_enter.py")
NETNS_RUN_DIR = Path("/run/netns")
NETNS_ETC_DIR = Path("/etc/netns")
# Starting one holder costs ~30 ms of CPU (nsenter, unshare, a Python without site); on a loaded
# machine many starting at once take longer.
READY_TIMEOUT_BASE_S = 10.0
READY_TIMEOUT_PER_NODE_S = 0.2
STOP_GRACE_S = 3.0          # between the SIGTERM to a node's processes and the SIGKILL

_launchers: dict[int, subprocess.Popen] = {}  # ours to reap (bench and harness up/down many times)


class NodeStartError(RuntimeError):
    """A node's holder did not start; the message names the node and says why."""


def prefix_of(node: Node) -> str:
    return node.namespace[: -len(node.name) - 1]


def nodes_dir(prefix: str) -> Path:
    return Backend.state_dir(prefix) / "nodes"


def pid_file(prefix: str, node_name: str) -> Path:
    return nodes_dir(prefix) / f"{node_name}.pid"


def state_marker(prefix: str) -> str:
    """In every holder's command line: how `clean` knows a holder of this prefix."""
    return str(Backend.state_dir(prefix)) + "/"


def holder_argv(node: Node, ready_fd: int, groups: Iterable[Path] = (),
                grace_s: float = STOP_GRACE_S) -> list[str]:
    """The command line of a node's holder (pure)."""
    prefix = prefix_of(node)
    cgroup_args = [arg for group in groups for arg in ("--cgroup", str(group))]
    return ["nsenter", f"--net={NETNS_RUN_DIR / node.namespace}", "--",
            "unshare", "--uts", "--ipc", "--mount", "--pid", "--fork", "--kill-child",
            "--propagation", "private", "--",
            sys.executable, "-S", "-E", str(INIT_SCRIPT), "--node", node.name,
            "--namespace", node.namespace, "--etc", str(NETNS_ETC_DIR / node.namespace),
            "--ready-fd", str(ready_fd), *cgroup_args, "--grace", f"{grace_s:g}", "--state", state_marker(prefix)]


def _cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def is_holder(pid: int, namespace: str) -> bool:
    """Is `pid` the holder (launcher or init) of the node with this namespace? (pid reuse check)"""
    parts = _cmdline(pid)
    return any(INIT_SCRIPT.name.encode() in p for p in parts) and namespace.encode() in parts


def _init_pid(launcher: int) -> Optional[int]:
    """The launcher's one child: the node's PID 1, as the host numbers it."""
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
        return int(children[0]) if children else None
    except OSError:
        pass  # a kernel without CONFIG_PROC_CHILDREN (e.g. a user-mode-linux guest): scan /proc
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == launcher:
                    return int(entry.name)
            except (OSError, IndexError, ValueError):
                continue
    return None


def start(plan: Plan, nodes: Optional[Iterable[Node]] = None) -> None:
    """Start every node's holder (in parallel) and wait until each is ready; raise NodeStartError.

    The network namespaces must exist (and /etc/netns/<ns>/ be written). On failure the holders
    already started are stopped again.
    """
    nodes = list(plan.nodes if nodes is None else nodes)
    folder = nodes_dir(plan.prefix)
    folder.mkdir(parents=True, exist_ok=True)
    started: list[tuple[Node, subprocess.Popen, int]] = []
    try:
        for node in nodes:
            groups = cgroups.create_node_groups(plan.prefix, node.name, plan.memory_bytes, plan.pids_max)
            ready_read, ready_write = os.pipe()
            try:
                with open(folder / f"{node.name}.log", "wb") as log:
                    # no preexec_fn: subprocess can vfork; the holder joins its cgroups itself
                    launcher = subprocess.Popen(
                        holder_argv(node, ready_write, groups), stdin=subprocess.DEVNULL, stdout=log,
                        stderr=log, pass_fds=(ready_write,), start_new_session=True)
            except BaseException:
                os.close(ready_read)
                raise
            finally:
                os.close(ready_write)
            _launchers[launcher.pid] = launcher
            started.append((node, launcher, ready_read))
        deadline = time.monotonic() + READY_TIMEOUT_BASE_S + READY_TIMEOUT_PER_NODE_S * len(nodes)
        for node, launcher, ready_read in started:
            line = _read_line(ready_read, deadline)
            init = _init_pid(launcher.pid) if line.startswith("ready") else None
            if init is None:
                log_lines = (folder / f"{node.name}.log").read_text(errors="replace").strip().splitlines()
                why = (line.removeprefix("error: ") if line else
                       log_lines[-1] if log_lines else "no answer before the timeout")
                raise NodeStartError(f"node {node.name}: holder did not start: {why}")
            pid_file(plan.prefix, node.name).write_text(f"{init} {launcher.pid}\n")
            (folder / f"{node.name}.log").unlink(missing_ok=True)
    except BaseException:
        for node, launcher, _ in started:
            if launcher.poll() is None:
                launcher.kill()  # --kill-child: its PID 1 and with it the whole node go too
        stop(plan, nodes)
        raise
    finally:
        for _, _, ready_read in started:
            os.close(ready_read)


def _read_line(fd: int, deadline: float) -> str:
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").strip()


def holder_pids(prefix: str, node: Node) -> tuple[Optional[int], Optional[int]]:
    """(init pid, launcher pid) of a running node, from its pid file, each checked; else None."""
    try:
        init, launcher = (int(x) for x in pid_file(prefix, node.name).read_text().split())
    except (OSError, ValueError):
        return None, None
    return (init if is_holder(init, node.namespace) else None,
            launcher if is_holder(launcher, node.namespace) else None)


def enter_argv(node: Node, argv: list[str], share: Iterable[os.PathLike | str] = ()) -> list[str]:
    """The argument list that runs `argv` inside a running node (all its namespaces and cgroups).

    The caller's working folder, the interpreter, the project and the import path
    (`visibility.default_folders`) and the `share` folders (e.g. a job's output folder) are made
    visible inside the node where they are not (the node's /tmp is its own).
    """
    from .visibility import default_folders
    prefix = prefix_of(node)
    init, _ = holder_pids(prefix, node)
    if init is None:
        raise RuntimeError(f"node {node.name} is not running (no holder in {pid_file(prefix, node.name)}); "
                           f"is the network up under prefix {prefix!r}?")
    groups = [g for g in cgroups.node_groups(prefix, node.name, with_cpu=True) if g.exists()]
    head = [sys.executable, "-S", "-E", str(ENTER_SCRIPT), "--holder", str(init), "--namespace", node.namespace]
    for group in groups:
        head += ["--cgroup", str(group)]
    for folder in dict.fromkeys([*default_folders(), *(str(f) for f in share)]):
        head += ["--share", folder]
    return [*head, "--", *argv]


def _reap_launchers(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for pid, launcher in list(_launchers.items()):
        try:
            launcher.wait(timeout=max(0.0, deadline - time.monotonic()))
            del _launchers[pid]
        except subprocess.TimeoutExpired:
            pass


def end_holders(pids_by_init: dict[int, Optional[int]], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each node's PID 1 (it ends its node's processes), SIGKILL after the grace period.

    `pids_by_init`: init pid -> its launcher pid (or None), both checked by the caller. The PID 1
    of a namespace can always be SIGKILLed from outside, and its death kills the whole namespace.
    """
    inits = list(pids_by_init)
    for pid in inits:
        processes.send_signal(pid, signal.SIGTERM)
    for pid in processes.wait_gone(inits, grace_s + 1.0):
        processes.send_signal(pid, signal.SIGKILL)
    launchers = [pid for pid in pids_by_init.values() if pid is not None]
    for pid in processes.wait_gone(launchers, 2.0):
        processes.send_signal(pid, signal.SIGKILL)  # --kill-child: it dies with its child anyway
    _reap_launchers(1.0)


def stop(plan: Plan, nodes: Optional[Iterable[Node]] = None, grace_s: float = STOP_GRACE_S) -> None:
    """End every process of the nodes (holders first), then remove their cgroups and pid files.

    Idempotent; a node that is not running is skipped.
    """
    nodes = list(plan.nodes if nodes is None else nodes)
    holders: dict[int, Optional[int]] = {}
    for node in nodes:
        init, launcher = holder_pids(plan.prefix, node)
        if init is not None:
            holders[init] = launcher
        elif launcher is not None:
            holders[launcher] = None  # PID 1 is gone; the launcher still waits (not expected)
    if holders:
        end_holders(holders, grace_s)
    for node in nodes:
        for group in cgroups.node_groups(plan.prefix, node.name, with_cpu=True):
            try:
                cgroups.remove(group, timeout_s=2.0)
            except OSError:
                pass  # something outside the node joined it; `wanbench clean` tries again
        pid_file(plan.prefix, node.name).unlink(missing_ok=True)
        (nodes_dir(plan.prefix) / f"{node.name}.log").unlink(missing_ok=True)
    try:
        nodes_dir(plan.prefix).rmdir()
    except OSError:
        pass


def leftover_holders(prefix: str) -> list[int]:
    """Holder processes (launchers and inits) of `prefix`, found by command line (for clean)."""
    marker = state_marker(prefix).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parts = _cmdline(int(entry.name))
            if marker in parts and any(INIT_SCRIPT.name.encode() in p for p in parts):
                found.append(int(entry.name))
    return found
