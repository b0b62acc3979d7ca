"""What a process in a node must see of the host, wherever it lives: the interpreter running us
(its venv and its base installation), the project's code, the folders on the import path, the
working folder, and what the caller adds (a run directory, a scenario's folder and `mounts:`).

A node has its own /tmp and /dev/shm (node_init.py); every other folder of the host it sees as
the host does. `node_enter.py` carries in what the node does not see (open_tree + move_mount) and
makes again the symbolic links on the way to it; here is the list of what to carry and the check
that it can be carried, made before anything is built so that a bad path is one line, not a
traceback from inside a node.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable

from .node_enter import visible_plan

PROJECT_ROOT = Path(__file__).absolute().parent.parent  # not resolved: a link on the way is carried too
# Folders a node has of its own (node_init.py's mounts): a path there would be the node's, not the
# host's, and carrying the host's over them would hide what the node needs.
NODE_OWN_ROOTS = ("/proc", "/sys", "/dev")
NODE_SHARED_UNDER_OWN = ("/dev/shm",)


class NotVisibleError(ValueError):
    """A path that cannot be made visible inside a node; the message names it and says why."""


def interpreter_folders() -> list[str]:
    """The running interpreter's folders: its venv (sys.prefix, bin/ with torchrun), the
    installation it was made from, and the executable's folder as the caller named it."""
    found = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.abspath(sys.executable))]
    return [folder for folder in dict.fromkeys(found) if folder and os.path.isdir(folder)]


def import_path_folders() -> list[str]:
    """Folders on the import path (PYTHONPATH, the project, site-packages) that exist."""
    return [folder for folder in dict.fromkeys(sys.path) if folder and os.path.isdir(folder)]


def default_folders() -> list[str]:
    """What every process entered into a node sees: interpreter, project, import path."""
    return list(dict.fromkeys([*interpreter_folders(), str(PROJECT_ROOT), *import_path_folders()]))


def venv_bin() -> str:
    """The bin/ folder of the interpreter's venv (torchrun, the user's tools), or of its installation."""
    return os.path.join(sys.prefix, "bin")


def path_with_venv_first(path: str | None) -> str:
    """PATH with the venv's bin/ first (once): `python` and `torchrun` in a node are ours, as for
    a user whose venv is active, even when wanbench was started as .venv/bin/wanbench or by sudo."""
    parts = [p for p in (path or os.defpath).split(os.pathsep) if p and p != venv_bin()]
    return os.pathsep.join([venv_bin(), *parts])


def check_visible(paths: Iterable[str | os.PathLike], what: str = "") -> list[str]:
    """Raise NotVisibleError (one line naming the path) for a path a node cannot be given: missing,
    not a folder, or inside a folder the node has of its own (/proc, /sys, /dev). Returns the real
    folders."""
    real = []
    for path in paths:
        text = os.path.abspath(os.fspath(path))
        try:
            folders, _ = visible_plan([text])
        except OSError as exc:
            raise NotVisibleError(f"{what}{' ' if what else ''}{exc.strerror}") from None
        for folder in folders:
            own = [root for root in NODE_OWN_ROOTS if folder == root or folder.startswith(root + "/")]
            if own and not any(folder == s or folder.startswith(s + "/") for s in NODE_SHARED_UNDER_OWN):
                raise NotVisibleError(f"{what}{' ' if what else ''}{path}: inside {own[0]}, which each node "
                                      f"has of its own; use a folder elsewhere")
        real += folders
    return real
