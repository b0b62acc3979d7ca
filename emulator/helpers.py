"""PID files of the host processes a run starts outside the nodes (the off-wire evaluator, a sim
job's process), so that `wanbench clean` can end them after the harness itself was killed.

A helper runs in a session of its own (a Ctrl-C in the terminal reaches only the harness, which
ends it in order), so a SIGKILL of the harness's process group does not reach it. Two things end
it then: it dies with the harness (`die_with_parent`, PR_SET_PDEATHSIG; the evaluator also watches
its parent itself), and `clean` finds it here, under the prefix's state folder
(`<state>/<prefix>/helpers/<pid>.json`: PID, the kernel's start time, command line, and the same
PID and start time of the harness that started it) and ends it by PID after checking that the PID
is still that process (PIDs get reused). Never by a name. A helper whose harness still runs is not
a leftover: `clean` leaves it alone (ending it failed that run's job).

The network a run brings up is recorded the same way (`claim_network`: `<state>/<prefix>/owner.json`,
the run's PID and start time, written before the network is built and removed after it is torn
down): while that process runs, `clean` leaves the whole prefix alone. A network `wanbench up`
built has no owner (it outlives the command, for `down` or `clean`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
from pathlib import Path
from typing import Optional

from .files import write_json_atomic

HELPERS_FOLDER = "helpers"
OWNER_FILE = "owner.json"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def helpers_dir(prefix: str) -> Path:
    from .backends.base import Backend  # (the state folder's root: WANBENCH_STATE_DIR)

    return Backend.state_dir(prefix) / HELPERS_FOLDER


def start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None when gone.
    Together with the PID it names one process: a reused PID has a later start."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def register(prefix: str, pid: int, argv: list[str], owner: Optional[int] = None) -> Optional[Path]:
    """Record helper `pid` (started with `argv` by process `owner`, default this one) for `clean`;
    its file, or None where the state folder cannot be written (a run without root: nothing else of
    ours is there for clean either)."""
    ticks = start_ticks(pid)
    owner = os.getpid() if owner is None else owner
    owner_ticks = start_ticks(owner)
    if ticks is None:
        return None
    path = helpers_dir(prefix) / f"{pid}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"pid": pid, "start_ticks": ticks, "argv": [str(a) for a in argv],
                                 "owner_pid": owner, "owner_start_ticks": owner_ticks})
    except OSError:
        return None
    return path


def unregister(path: Optional[Path]) -> None:
    """Forget a helper that has ended (its file may be gone with its network's state already)."""
    if path is not None:
        Path(path).unlink(missing_ok=True)


def leftover_helpers(prefix: str) -> list[int]:
    """The recorded helpers of `prefix` still running as the very process recorded; files of
    helpers that are gone are removed."""
    folder = helpers_dir(prefix)
    pids = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            pid, ticks = int(record["pid"]), int(record["start_ticks"])
        except (OSError, ValueError, KeyError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if start_ticks(pid) == ticks:
            pids.append(pid)
        else:
            path.unlink(missing_ok=True)
    return pids


def _live_owner(record_path: Path) -> Optional[int]:
    """The owner a record names (owner_pid, owner_start_ticks), if it still runs as that process."""
    try:
        record = json.loads(Path(record_path).read_text())
        owner, ticks = int(record["owner_pid"]), record["owner_start_ticks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return owner if ticks is not None and start_ticks(owner) == ticks else None


def owner_of(prefix: str, pid: int) -> Optional[int]:
    """The PID of the harness that started recorded helper `pid`, if it still runs as the process
    recorded; None when it is gone (the helper is a leftover) or was not recorded."""
    return _live_owner(helpers_dir(prefix) / f"{pid}.json")


def claim_network(prefix: str, owner: Optional[int] = None) -> Optional[Path]:
    """Record process `owner` (default this one) as the user of `prefix`'s network, so that `clean`
    leaves it alone while it runs; the record, or None where the state folder cannot be written."""
    from .backends.base import Backend

    owner = os.getpid() if owner is None else owner
    path = Backend.state_dir(prefix) / OWNER_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {"owner_pid": owner, "owner_start_ticks": start_ticks(owner)})
    except OSError:
        return None
    return path


def release_network(prefix: str) -> None:
    """Forget the owner of `prefix`'s network (it is down)."""
    from .backends.base import Backend

    (Backend.state_dir(prefix) / OWNER_FILE).unlink(missing_ok=True)


def network_owner(prefix: str) -> Optional[int]:
    """The PID of the run whose network `prefix` is, while it runs as the process recorded; None when
    no run claimed it or that run is gone (its network is then a leftover)."""
    from .backends.base import Backend

    return _live_owner(Backend.state_dir(prefix) / OWNER_FILE)


def is_recorded_helper(prefix: str):
    """`is_ours` for processes.stop_pids: the PID still runs as the process its file recorded."""
    def check(pid: int) -> bool:
        try:
            record = json.loads((helpers_dir(prefix) / f"{pid}.json").read_text())
        except (OSError, ValueError):
            return False
        return start_ticks(pid) == record.get("start_ticks")
    return check


def die_with_parent(parent_pid: int, signum: int = signal.SIGTERM):
    """A Popen preexec_fn: the child gets `signum` when the thread that started it ends
    (PR_SET_PDEATHSIG; the harness starts its helpers from its main thread, so: when the harness
    ends, SIGKILL included), and gets it at once if that parent already died before the call."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls it

    def preexec() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl: what it would have sent
            os.kill(os.getpid(), signum)
    return preexec
