"""Run a command inside a node: the node's cgroups and namespaces, signals passed on, status returned.

    python -S -E node_enter.py --holder PID --namespace NS [--cgroup DIR ...] [--share DIR ...]
        -- CMD [ARGS...]

Joins the node's cgroups (memory, pids, cpu: what the holder is in), enters the namespaces of the
node's holder (`node_init.py`, PID 1 of the node: network, UTS, IPC, PID, mount), keeps the working
folder, forks CMD into the node's PID namespace and waits for it. The working folder and each
--share path (a run directory, the interpreter, the project: `visible_plan`) are mounted into the
node where it does not see them already (under the host's /tmp: the node's /tmp is its own), and a
symbolic link on the way to one (a clone's .venv linked to a shared venv) is made again inside the
node where the node lacks it. This process stands for CMD:
  - a signal sent to it (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH) is passed on,
    the ending ones followed by SIGCONT so that a stopped CMD acts on them (as systemd does); one
    sent by the terminal to the whole process group already reached CMD and is not sent twice;
  - SIGKILL cannot be passed on, so CMD has PR_SET_PDEATHSIG=SIGKILL: killing this process kills CMD;
  - it exits with CMD's status, or dies by CMD's signal (an OOM kill reads as -9, as for CMD itself).
That is what `subprocess.Popen(exec_argv(...)).terminate()/.kill()/.returncode` rely on.

Why not `nsenter -t PID -a`: entering a PID namespace, nsenter forks and waits but passes no signal
on, so SIGTERM to it leaves CMD running in the node with no one to answer for it.

Exit status 125 (and one line on stderr) when the node cannot be entered.
"""

from __future__ import annotations

import ctypes
import os
import resource
import select
import signal
import sys

NAMESPACES = ("ipc", "uts", "net", "pid", "mnt")  # nsenter's order: the mount namespace last
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGWINCH)
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1
# open_tree(2)/move_mount(2) (Linux 5.2); the same numbers on every architecture
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
AT_FDCWD = -100
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
AT_RECURSIVE = 0x8000
MOVE_MOUNT_F_EMPTY_PATH = 0x4
EXIT_CANNOT_ENTER = 125
EXIT_NOT_FOUND = 127
HOLDER_MARK = b"node_init.py"

_libc = ctypes.CDLL(None, use_errno=True)


def _fail(message: str) -> None:
    sys.stderr.write(f"wanbench: {message}\n")
    sys.exit(EXIT_CANNOT_ENTER)


def _setns(fd: int, what: str) -> None:
    if _libc.setns(fd, 0) != 0:
        errno = ctypes.get_errno()
        _fail(f"cannot enter the node's {what} namespace: {os.strerror(errno)}")


def parse(argv: list[str]) -> tuple[int, str, list[str], list[str], list[str]]:
    holder, namespace, groups, shared = None, None, [], []
    i = 0
    while i < len(argv) and argv[i] != "--":
        key = argv[i]
        if i + 1 >= len(argv):
            _fail(f"node_enter: {key} needs a value")
        value = argv[i + 1]
        if key == "--holder":
            holder = int(value)
        elif key == "--namespace":
            namespace = value
        elif key == "--cgroup":
            groups.append(value)
        elif key == "--share":
            shared.append(value)
        else:
            _fail(f"node_enter: unknown option {key}")
        i += 2
    command = argv[i + 1:]
    if holder is None or namespace is None or not command:
        _fail("usage: node_enter.py --holder PID --namespace NS [--cgroup DIR ...] [--share DIR ...] "
              "-- CMD [ARGS...]")
    return holder, namespace, groups, shared, command


MAX_LINKS = 40  # as the kernel's ELOOP limit on links followed in one path


def resolve_links(path: str) -> tuple[str, list[tuple[str, str]]]:
    """`path` (absolute) with every symbolic link on the way followed: (the real path, the links
    met as (link path, its target as written)), in the order met. Raises OSError on a loop."""
    links: list[tuple[str, str]] = []
    pending = [part for part in os.path.normpath(path).split("/") if part]
    current = "/"
    while pending:
        part = pending.pop(0)
        candidate = os.path.join(current, part)
        if os.path.islink(candidate):
            if len(links) >= MAX_LINKS:
                raise OSError(40, f"too many levels of symbolic links in {path}")
            target = os.readlink(candidate)
            links.append((candidate, target))
            # the target replaces the link's component; a relative one starts at the link's folder
            pending = [p for p in target.split("/") if p] + pending
            current = "/" if os.path.isabs(target) else current
        elif part == "..":
            current = os.path.dirname(current)
        elif part != ".":
            current = candidate
    return current, links


def visible_plan(paths) -> tuple[list[str], list[tuple[str, str]]]:
    """What makes each of `paths` (folders, absolute) visible in a node: the real folders to carry
    in, and the symbolic links met on the way (to make again in the node where it lacks them).
    Raises OSError naming the path when one does not exist or is not a folder."""
    folders: list[str] = []
    links: list[tuple[str, str]] = []
    for path in paths:
        real, met = resolve_links(os.path.abspath(path))
        if not os.path.isdir(real):
            raise OSError(2 if not os.path.exists(real) else 20,
                          f"{path}: " + ("no such folder" if not os.path.exists(real) else "not a folder"))
        folders.append(real)
        links += [link for link in met if link not in links]
    return list(dict.fromkeys(folders)), links


def outermost(folders: list[str]) -> list[str]:
    """`folders` without those that lie inside another of them (its clone carries them in)."""
    ordered = sorted(set(folders), key=len)
    kept: list[str] = []
    for folder in ordered:
        if not any(folder == k or folder.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(folder)
    return kept


def _make_links(links: list[tuple[str, str]]) -> None:
    """In the node: each link of the host that the node lacks (its folder is the node's own tmpfs)."""
    for link, target in links:
        if os.path.lexists(link):
            continue
        try:
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(target, link)
        except OSError as exc:
            _fail(f"cannot make the link {link} -> {target} in the node: {exc.strerror}")


def _clone_if_hidden(holder: int, folder: str, probe: bool = False):
    """A detached copy of the host's `folder` (open_tree) if the node does not see that folder.

    The node's /tmp is its own; a run directory or working folder under the host's /tmp is brought
    in with open_tree(OPEN_TREE_CLONE) + move_mount, the one way to carry a mount across mount
    namespaces (a bind mount from /proc/<pid>/root cannot). None when the node sees it already;
    `probe`: True instead of a copy when it does not.
    """
    host = os.stat(folder)
    try:
        inside = os.stat(f"/proc/{holder}/root{folder}")  # the path as the node resolves it
        if (inside.st_dev, inside.st_ino) == (host.st_dev, host.st_ino):
            return None
    except OSError:
        pass
    if probe:
        return True
    fd = _libc.syscall(SYS_OPEN_TREE, AT_FDCWD, folder.encode(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE)
    if fd < 0:
        _fail(f"cannot share {folder} with node: open_tree: {os.strerror(ctypes.get_errno())}")
    return fd


def _attach(fd: int, folder: str) -> None:
    """Mount the detached tree `fd` at `folder` in the (node's) current mount namespace."""
    os.makedirs(folder, exist_ok=True)
    if _libc.syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, folder.encode(), MOVE_MOUNT_F_EMPTY_PATH) != 0:
        _fail(f"cannot share {folder} with the node: move_mount: {os.strerror(ctypes.get_errno())}")
    os.close(fd)


def enter(holder: int, namespace: str, groups: list[str], shared: list[str] = ()) -> None:
    """Join the cgroups, then the holder's namespaces; keep the working folder and make it and
    the `shared` folders visible in the node."""
    try:
        with open(f"/proc/{holder}/cmdline", "rb") as handle:
            cmdline = handle.read().split(b"\0")
    except OSError:
        cmdline = []
    if not any(HOLDER_MARK in part for part in cmdline) or namespace.encode() not in cmdline:
        _fail(f"node {namespace} is not running (no holder process {holder}); is the network up?")
    for group in groups:
        try:
            with open(os.path.join(group, "cgroup.procs"), "w") as handle:
                handle.write(str(os.getpid()))
        except OSError as exc:
            _fail(f"cannot join the node's cgroup {group}: {exc.strerror}")
    fds = [(name, os.open(f"/proc/{holder}/ns/{name}", os.O_RDONLY)) for name in NAMESPACES]
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    try:
        folders, links = visible_plan([*shared, cwd])
    except OSError as exc:
        _fail(f"not visible in the node: {exc.strerror}")
    # Carry in only what the node does not see, and of nested folders the outermost: its clone
    # holds the rest (a folder the node sees, / say, never hides one under /tmp).
    hidden = [folder for folder in folders if _clone_if_hidden(holder, folder, probe=True)]
    clones = [(folder, _clone_if_hidden(holder, folder)) for folder in outermost(hidden)]
    for name, fd in fds:
        _setns(fd, name)
        os.close(fd)
    for folder, fd in clones:
        if fd is not None:
            _attach(fd, folder)
    _make_links(links)
    try:
        os.chdir(cwd)
    except OSError:
        # e.g. a folder under the host's /tmp, which the node does not see (its /tmp is its own)
        sys.stderr.write(f"wanbench: {cwd} does not exist in node {namespace}; running in /\n")
        os.chdir("/")


def run_child(command: list[str], parent_alive_read: int) -> None:
    """In the forked child: die with the parent, then become CMD."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    readable, _, _ = select.select([parent_alive_read], [], [], 0)
    if readable:  # EOF: the parent died before PDEATHSIG was armed
        os._exit(EXIT_CANNOT_ENTER)
    os.close(parent_alive_read)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        sys.stderr.write(f"wanbench: {command[0]}: {exc.strerror}\n")
        os._exit(EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else 126)


def wait_passing_signals(child: int) -> int:
    """Pass signals on to `child` until it ends; return its wait status."""
    waited = set(PASSED_ON) | {signal.SIGCHLD}
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid == child:
                return status
            continue
        # si_code > 0: sent by the kernel, e.g. the terminal's Ctrl-C to the whole foreground
        # process group, which CMD is part of; it has it already.
        if info.si_code <= 0:
            try:
                os.kill(child, info.si_signo)
                if info.si_signo in ENDING:
                    os.kill(child, signal.SIGCONT)  # a stopped command must be able to act on it
            except ProcessLookupError:
                pass


def mirror(status: int) -> None:
    """Exit as the child did: its code, or death by its signal."""
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child dumped core already if it did
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # these two cannot be caught or reset
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        os.kill(os.getpid(), signum)
        sys.exit(128 + signum)  # a signal whose default is not to terminate
    sys.exit(os.waitstatus_to_exitcode(status))


def main(argv: list[str]) -> None:
    holder, namespace, groups, shared, command = parse(argv)
    waited = set(PASSED_ON) | {signal.SIGCHLD}
    # Blocked before the fork, so no signal is lost between fork and the wait loop.
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    enter(holder, namespace, groups, shared)
    alive_read, alive_write = os.pipe()
    child = os.fork()  # the first child after setns(pid): PID 2.. of the node
    if child == 0:
        os.close(alive_write)
        run_child(command, alive_read)
    os.close(alive_read)
    mirror(wait_passing_signals(child))


if __name__ == "__main__":
    main(sys.argv[1:])
