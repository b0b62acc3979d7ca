"""Node namespaces: create, configure (loopback, sysctls, hosts file), enter, list and remove.

Shared by every backend that builds nodes as named network namespaces. Uses pyroute2 (netlink and
setns) rather than one `ip` process per object: creating 32 configured namespaces takes ~0.1 s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterable

from pyroute2 import IPRoute, NetNS, netns

from .plan import Node, Plan
from .processes import stop_pids

log = logging.getLogger(__name__)

NETNS_RUN_DIR = Path("/run/netns")
NETNS_ETC_DIR = Path("/etc/netns")  # `ip netns exec` bind-mounts /etc/netns/<ns>/hosts on /etc/hosts
PROC_SYS = Path("/proc/sys")
CONGESTION_CONTROL = "net.ipv4.tcp_congestion_control"


class SystemCheckError(RuntimeError):
    """The machine cannot do what was asked; the message says how to fix it."""


def check_root() -> None:
    if os.geteuid() != 0:
        raise SystemCheckError(
            "building namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run with sudo")


def check_address_pool_free(pool: str) -> None:
    """Refuse a pool that overlaps a route of the host: our addresses must never leave our namespaces."""
    network = ipaddress.IPv4Network(pool)
    with IPRoute() as ipr:
        for route in ipr.get_routes(family=2):
            dst = route.get_attr("RTA_DST")
            length = route["dst_len"]
            if dst is None or length == 0:
                continue  # the default route overlaps everything by definition
            host_net = ipaddress.IPv4Network(f"{dst}/{length}", strict=False)
            if host_net.overlaps(network):
                raise SystemCheckError(
                    f"address_pool {pool} overlaps the host route {host_net}; choose another "
                    f"private range in the topology's address_pool")


def _sysctl_path(key: str) -> Path:
    return PROC_SYS / key.replace(".", "/")


def _read_words(key: str) -> list[str]:
    try:
        return _sysctl_path(key).read_text().split()
    except OSError:
        return []


def check_node_sysctls(plan: Plan) -> None:
    """Refuse, before any node exists, a congestion control the nodes cannot use.

    A namespace other than the host's may only make a congestion control its default when the
    kernel has it (tcp_available_congestion_control; modprobe tcp_<name> loads a module) and the
    host allows it (tcp_allowed_congestion_control), else the kernel refuses the write.
    """
    name = plan.node_sysctls.get(CONGESTION_CONTROL)
    if name is None:
        return
    if name not in _read_words("net.ipv4.tcp_available_congestion_control"):
        modprobe = shutil.which("modprobe", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
        if modprobe is not None:
            subprocess.run([modprobe, "-q", f"tcp_{name}"], capture_output=True, timeout=30)
        available = _read_words("net.ipv4.tcp_available_congestion_control")
        if name not in available:
            raise SystemCheckError(
                f"{plan.topology_file}: node_sysctls.{CONGESTION_CONTROL}: this kernel has no congestion control "
                f"{name!r} (available: {' '.join(available) or '?'}; `modprobe tcp_{name}` did not add it)")
    allowed = _read_words("net.ipv4.tcp_allowed_congestion_control")
    if name not in allowed:
        raise SystemCheckError(
            f"{plan.topology_file}: node_sysctls.{CONGESTION_CONTROL}: {name!r} is available but the host does not "
            f"allow it in namespaces (allowed: {' '.join(allowed)}); allow it with "
            f"sysctl -w net.ipv4.tcp_allowed_congestion_control='{' '.join([*allowed, name])}'")


def apply_sysctls(plan: Plan, node: Node) -> None:
    """Write the plan's sysctls inside `node`'s namespace and read each back: a value the kernel
    did not take is an error naming the node, the key and what is in force."""
    with entered(node.namespace):
        for key, value in plan.sysctls().items():
            path = _sysctl_path(key)
            try:
                path.write_text(value)
                in_force = path.read_text().split()
            except OSError as exc:
                raise SystemCheckError(f"node {node.name}: cannot set {key} = {value}: {exc.strerror or exc}") from None
            if in_force != value.split():
                raise SystemCheckError(f"node {node.name}: {key} is {' '.join(in_force)} after writing {value} "
                                       f"(the kernel did not take it)")


@contextlib.contextmanager
def entered(namespace: str):
    """Run the body with this thread inside `namespace` (for /proc/sys and TUN devices)."""
    netns.pushns(namespace)
    try:
        yield
    finally:
        netns.popns()


def create_node(plan: Plan, node: Node) -> None:
    """Create one node's namespace: loopback up, the plan's sysctls (TCP buffers, node_sysctls), hosts file."""
    netns.create(node.namespace)
    with NetNS(node.namespace) as ns:
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
    apply_sysctls(plan, node)
    etc = NETNS_ETC_DIR / node.namespace
    etc.mkdir(parents=True, exist_ok=True)
    (etc / "hosts").write_text(plan.hosts_file())


def create_nodes(plan: Plan) -> None:
    """Every node's namespace, then its holder (own hostname, IPC, PID space, mounts, cgroups)."""
    from . import nodes  # nodes -> backends.base -> plan; imported late to keep netns light

    check_node_sysctls(plan)
    for node in plan.nodes:
        create_node(plan, node)
    nodes.start(plan)


def all_namespaces() -> list[str]:
    """Every named namespace on the system (/run/netns), ours or not."""
    return sorted(netns.listnetns())


def list_namespaces(prefix: str) -> list[str]:
    """Named namespaces that carry our prefix."""
    return [name for name in all_namespaces() if name.startswith(prefix + "-")]


def remove_namespace(name: str) -> None:
    """Remove one namespace and its /etc/netns folder; missing ones are fine (idempotent)."""
    if (NETNS_RUN_DIR / name).exists():
        try:
            netns.remove(name)
        except OSError as exc:
            log.warning("could not remove namespace %s: %s", name, exc)
    shutil.rmtree(NETNS_ETC_DIR / name, ignore_errors=True)


def pids_in_each(names: Iterable[str]) -> dict[str, list[int]]:
    """Processes in each named network namespace (as `ip netns pids`), in one pass over /proc."""
    names = list(names)
    by_inode = {}
    for name in names:
        try:
            target = os.stat(NETNS_RUN_DIR / name)
        except OSError:
            continue
        by_inode[(target.st_dev, target.st_ino)] = name
    found: dict[str, list[int]] = {name: [] for name in names}
    if not by_inode:
        return found
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                ns = os.stat(entry / "ns" / "net")
            except OSError:
                continue
            name = by_inode.get((ns.st_dev, ns.st_ino))
            if name is not None:
                found[name].append(int(entry.name))
    return found


def pids_in(name: str) -> list[int]:
    """Processes whose network namespace is the named one."""
    return pids_in_each([name])[name]


def end_processes(names: Iterable[str], grace_s: float = 3.0, spare: Iterable[int] = ()) -> list[int]:
    """SIGTERM every process in the named namespaces (but `spare`), SIGKILL after `grace_s`.

    For what a node's holder did not end: processes put in the namespace by plain `ip netns exec`
    or by another tool. Returns the pids signalled.
    """
    spared = set(spare)
    pids = [pid for found in pids_in_each(names).values() for pid in found if pid not in spared]
    stop_pids(pids, grace_s)
    return pids


def remove_nodes(plan: Plan) -> None:
    """End every process of the nodes (holders, then any other process in their namespaces),
    then remove the namespaces. Nothing of a node survives, a daemon included."""
    from . import nodes

    nodes.stop(plan)
    end_processes(node.namespace for node in plan.nodes)
    for node in plan.nodes:
        remove_namespace(node.namespace)


def interface_of(node: Node) -> str:
    """The name of the interface that holds the node's address inside its namespace.

    Processes in a node must bind there: gloo and NCCL otherwise resolve the (shared) host name and
    may pick 127.0.0.1, which other nodes cannot reach.
    """
    with NetNS(node.namespace) as ns:
        for addr in ns.get_addr(family=2):
            if addr.get_attr("IFA_ADDRESS") == node.address:
                return ns.get_links(addr["index"])[0].get_attr("IFLA_IFNAME")
    raise RuntimeError(f"node {node.name}: no interface holds {node.address} in {node.namespace}")


def exec_argv(node: Node, argv: list[str], share: Iterable[os.PathLike | str] = ()) -> list[str]:
    """The argument list that runs `argv` inside a running node: its network, UTS, IPC, PID and
    mount namespaces (hosts file, private /tmp and /dev/shm) and its cgroups (`nodes.enter_argv`).

    The process it starts stands for `argv`: signals are passed on, its exit status is argv's, and
    killing it kills argv. The working folder, the interpreter (its venv), the project, the
    import path and the `share` folders (a job's output folder) are visible inside the node even
    where they lie under the host's /tmp (emulator/visibility.py).
    """
    from . import nodes

    return nodes.enter_argv(node, argv, share)
