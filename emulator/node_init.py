"""PID 1 of a node: sets up the node's own hostname and mounts, then reaps and, when told, ends all.

Started by `emulator.nodes` as
    nsenter --net=/run/netns/<ns> -- unshare --uts --ipc --mount --pid --fork --kill-child
        --propagation private -- python -S -E node_init.py --node NAME --namespace NS ...
so it runs in the node's network namespace and in a new UTS, IPC, mount and PID namespace, as the
PID namespace's init. It then
  - joins the node's cgroups (--cgroup; memory and pids limits),
  - sets the hostname to the node name,
  - mounts a fresh /proc (the node's own `ps`), a sysfs for the node's network namespace (as
    `ip netns exec` does), private tmpfs on /tmp and /dev/shm, the IPC namespace's own mqueue,
  - makes the host's system folders read-only in the node (/usr, /etc, /boot, /opt and /bin, /sbin,
    /lib* where they are not links into /usr); the rest of the host's tree stays writable, because
    run directories and the user's files live there,
  - bind-mounts every file of /etc/netns/<ns>/ over /etc/ (the hosts file), as `ip netns exec` does,
and writes "ready" (or "error: ...") on --ready-fd. None of these mounts is visible outside the node
(propagation private), and all of them go with the mount namespace when its last process ends.

As init it reaps every orphan (a daemon's double fork ends up here). On SIGTERM, SIGINT or SIGHUP it
sends SIGTERM to every process of the node, waits up to --grace seconds for them to go, and exits:
the kernel then SIGKILLs whatever is left in the PID namespace. Nothing in the node outlives it.

Standard library only, run with `-S -E` (no site, no environment), no argparse: this process lives
as long as the network and starts once per node, so it stays small and quick to start.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000

# Host folders made read-only inside a node (where they exist and are not symlinks).
READ_ONLY_DIRS = ("/usr", "/etc", "/boot", "/opt", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PRIVATE_TMPFS = ("/tmp", "/dev/shm")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]


def _bytes(text):
    return None if text is None else text.encode()


def mount(source, target: str, fstype, flags: int, data=None) -> None:
    if _libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {fstype or 'bind'} {source} on {target}: {os.strerror(errno)}")


def set_up(node: str, namespace: str, etc_dir: str) -> list[str]:
    """The node's hostname and mounts; returns the folders made read-only."""
    name = node.encode()
    if _libc.sethostname(name, len(name)) != 0:  # libc directly: `socket` costs ~6 ms to import
        errno = ctypes.get_errno()
        raise OSError(errno, f"sethostname {node}: {os.strerror(errno)}")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for folder in PRIVATE_TMPFS:
        if os.path.isdir(folder):
            mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    if os.path.isdir("/dev/mqueue"):
        mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    read_only = []
    for folder in READ_ONLY_DIRS:
        if os.path.isdir(folder) and not os.path.islink(folder):
            try:
                mount(folder, folder, None, MS_BIND | MS_REC)
                mount(None, folder, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
                read_only.append(folder)
            except OSError:
                pass  # "read-only where it can be": a folder we cannot remount stays as the host has it
    if os.path.isdir(etc_dir):
        for name in sorted(os.listdir(etc_dir)):
            target = os.path.join("/etc", name)
            if os.path.exists(target):
                mount(os.path.join(etc_dir, name), target, None, MS_BIND)
    return read_only


def _others() -> list[int]:
    """Live processes of this PID namespace other than us (zombies count as gone)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != "1":
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    state = handle.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != b"Z":
                alive.append(int(entry))
    return alive


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_all(grace_s: float) -> None:
    """SIGTERM to every process of the node; wait up to `grace_s` for them to go."""
    try:
        os.kill(-1, signal.SIGTERM)  # from the namespace's init: everyone in the namespace but us
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        _reap()
        if not _others():
            return
        time.sleep(0.02)


USAGE = ("usage: node_init.py --node NAME --namespace NS --etc DIR --ready-fd FD "
         "[--cgroup DIR ...] [--grace SECONDS] [--state DIR]")


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """`--key value` pairs and the --cgroup folders (argparse costs ~25 ms of start-up per node)."""
    if len(argv) % 2 or not all(key.startswith("--") for key in argv[::2]):
        raise SystemExit(USAGE)
    pairs = list(zip(argv[::2], argv[1::2]))
    options = {key[2:]: value for key, value in pairs if key != "--cgroup"}
    groups = [value for key, value in pairs if key == "--cgroup"]
    unknown = set(options) - {"node", "namespace", "etc", "ready-fd", "grace", "state"}
    if unknown or not {"node", "namespace", "etc", "ready-fd"} <= set(options):
        raise SystemExit(USAGE)
    return options, groups


def join_groups(groups: list[str]) -> None:
    """Move this process into the node's cgroups (done here, not in a preexec_fn of the starting
    process: that would make subprocess fork the whole caller instead of vfork, ~20 ms a node)."""
    for group in groups:
        with open(os.path.join(group, "cgroup.procs"), "w") as handle:
            handle.write("0")  # 0: the writing process itself (pid numbers differ in our PID namespace)
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("-1000")  # the OOM killer takes a node's workload, never its PID 1
    except OSError:
        pass  # needs CAP_SYS_RESOURCE; without it the holder (~10 MB) is rarely the largest


def main(argv=None) -> int:
    options, groups = parse(sys.argv[1:] if argv is None else argv)
    ready_fd = int(options["ready-fd"])
    waited = set(STOP_SIGNALS) | {signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        join_groups(groups)
        read_only = set_up(options["node"], options["namespace"], options["etc"])
    except OSError as exc:
        os.write(ready_fd, f"error: {exc}\n".encode())
        return 1
    os.write(ready_fd, f"ready {' '.join(read_only)}\n".encode())
    os.close(ready_fd)
    grace_s = float(options.get("grace", 3.0))
    while True:
        info = signal.sigwaitinfo(waited)
        if info.si_signo == signal.SIGCHLD:
            _reap()
            continue
        end_all(grace_s)
        return 0  # our exit SIGKILLs anything still in the namespace


if __name__ == "__main__":
    sys.exit(main())
