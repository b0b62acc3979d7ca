"""`wanbench clean`: remove everything carrying our prefix that a crash may have left behind.

Idempotent, and it touches only objects named with the prefix: node holders (command line: the
holder script and our state folder; ending one ends every process of its node), namespaces
`<prefix>-*` (and the processes inside them, which only we start there), host links `<prefix>*`, our
background processes (identified by their command line naming our state folder), the harness's
host helpers (the off-wire evaluator, a sim job's process: by the PID files emulator/helpers.py
keeps under our state folder, each checked to be the very process recorded, and only once the run
that started it has ended: a live run's helper is no leftover), cgroups
`<prefix>-*` (cpu, memory, pids), /etc/netns/<prefix>-* and the run state. Mounts need nothing: a
node's exist only in its mount namespace, gone with its last process. It never kills by a broad
process name.

A prefix whose network a run still uses (emulator/helpers.py `network_owner`: the run recorded
itself before building it) is left alone whole, with a warning: tearing it down under the run
failed its jobs. A network `wanbench up` built, or one whose run was killed, is removed.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from pyroute2 import IPRoute

from . import cgroups, netns, nodes
from .helpers import HELPERS_FOLDER, is_recorded_helper, leftover_helpers, network_owner, owner_of
from .backends import base as backends_base
from .backends.base import Backend, clear_state
from .processes import stop_pids

log = logging.getLogger(__name__)

CGROUP_ROOTS = [Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup/cpu,cpuacct"), Path("/sys/fs/cgroup/memory"),
                Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")]


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


def _etc_folders(prefix: str | None = None) -> list[Path]:
    """/etc/netns folders `<prefix>-*` (every one with a dash in its name: prefix None)."""
    if not netns.NETNS_ETC_DIR.is_dir():
        return []
    return sorted(netns.NETNS_ETC_DIR.glob(f"{prefix}-*" if prefix else "*-*"))


def _cgroups(prefix: str | None = None) -> list[Path]:
    """Cgroups `<prefix>-*` under every root of CGROUP_ROOTS (every one with a dash: prefix None)."""
    return [group for root in CGROUP_ROOTS if root.is_dir()
            for group in sorted(root.glob(f"{prefix}-*" if prefix else "*-*")) if group.is_dir()]


def leftover_prefixes(pattern: re.Pattern) -> list[str]:
    """Prefixes matching `pattern` (whole) under which something of ours is still on the system.

    Looks where `clean` removes, through the same look-ups: named namespaces, /etc/netns folders
    and cgroups `<prefix>-*`, state folders `<state root>/<prefix>` (node holders and background
    processes name theirs, so a live one keeps its folder). Host links are not read: their names
    carry the prefix with no separator, so a prefix cannot be told from the rest of the name.
    """
    names = [*netns.all_namespaces(), *(path.name for path in _etc_folders() + _cgroups())]
    found = {name.split("-", 1)[0] for name in names if "-" in name}
    if backends_base.STATE_ROOT.is_dir():
        found.update(entry.name for entry in backends_base.STATE_ROOT.iterdir() if entry.is_dir())
    return sorted(name for name in found if pattern.fullmatch(name))


def clean(prefix: str) -> list[str]:
    """Remove every object with `prefix`; return what was removed (empty when nothing was left)."""
    removed: list[str] = []
    user = network_owner(prefix)
    if user is not None:
        log.warning("left alone: prefix %s, the network of run process %d, which still runs (end that run first)",
                    prefix, user)
        return removed
    namespaces = netns.list_namespaces(prefix)
    # Node holders first (found by command line, even when their namespace lost its name): their
    # PID 1 ends every process of its node, daemons included, when it gets SIGTERM.
    holders = nodes.leftover_holders(prefix)
    inside = [pid for found in netns.pids_in_each(namespaces).values() for pid in found if pid not in holders]
    background = [pid for pid in our_background_pids(prefix) if pid not in holders]
    if holders or inside or background:
        stop_pids(holders + inside + background)
        removed += [f"process {pid}" for pid in holders + inside + background]
    owners = {pid: owner_of(prefix, pid) for pid in leftover_helpers(prefix)}
    live = {pid: owner for pid, owner in owners.items() if owner is not None}
    helpers = [pid for pid in owners if pid not in live]
    for pid, owner in live.items():
        log.warning("left alone: process %d, a helper of run process %d, which still runs (end that run first)",
                    pid, owner)
    if helpers:
        stop_pids(helpers, is_ours=is_recorded_helper(prefix))
        removed += [f"process {pid} (a run's helper)" for pid in helpers]
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
    for folder in _etc_folders(prefix):
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(f"folder {folder}")
    for group in _cgroups(prefix):
        try:
            # rmdir once empty; the processes just killed may take a moment to leave it
            cgroups.remove(group, timeout_s=2.0)
            removed.append(f"cgroup {group}")
        except OSError:
            pass
    clear_state(prefix)
    folder = Backend.state_dir(prefix)
    # Logs and counters of networks that are gone: files, not system objects, so not counted. A
    # live run's helper records stay, for a `clean` after that run has ended.
    for entry in (folder.iterdir() if live and folder.is_dir() else [folder]):
        if entry.name == HELPERS_FOLDER and live:
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return removed
