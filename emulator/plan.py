"""The plan: nodes, names, addresses and the per-pair link matrix, as pure data.

`make_plan(topology)` decides everything a backend needs — namespace names, addresses, queue sizes,
TCP buffer sysctls — without touching the system, so it can be printed, saved with a run, and tested.
The one thing it reads from outside is the object-name prefix: WANBENCH_PREFIX unless the caller
passes `prefix=`.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Optional

from .dilation import check_time_dilation, dilate, undilate
from .linkspec import LinkSpec
from .schema import ConfigError

if TYPE_CHECKING:  # plan.py is imported by the delay line, which must not pay for pydantic
    from .topology import Topology

# Everything we create on the system carries this prefix (namespaces, links, cgroups, run files).
# Tests and parallel CI jobs may pick their own with WANBENCH_PREFIX so they never touch each other.
DEFAULT_PREFIX = "wanb"
PREFIX_PATTERN = re.compile(r"^[a-z][a-z0-9]{1,5}$")
# The prefixes the test suite draws, one per test ("wt" + 4 hex digits); `wanbench clean
# --test-prefixes` sweeps what an interrupted test run left under them.
TEST_PREFIX_PATTERN = re.compile(r"^wt[0-9a-f]{4}$")

# The delay line and TCP need room for a full bandwidth-delay product; below this a queue cannot
# even absorb one TSO burst (64 KB segments) per flow.
MIN_AUTO_QUEUE_BYTES = 256 * 1024
# Linux's own default TCP buffer maxima (tcp_rmem[2] = 6 MB); we only ever raise them.
DEFAULT_TCP_BUFFER_MAX_BYTES = 6 * 1024 * 1024
MAX_TCP_BUFFER_BYTES = 1 << 30


def prefix() -> str:
    """The object-name prefix in force (WANBENCH_PREFIX, default "wanb")."""
    return checked_prefix(os.environ.get("WANBENCH_PREFIX", DEFAULT_PREFIX), "WANBENCH_PREFIX", "environment")


def checked_prefix(value: str, field: str = "prefix", source: str = "make_plan") -> str:
    """`value` if it is a usable object-name prefix; ConfigError naming `field` and `source` if not."""
    if not isinstance(value, str) or not PREFIX_PATTERN.match(value):
        raise ConfigError(field, f"{value!r}: use 2-6 lower-case letters/digits starting with a letter", source=source)
    return value


_prefix_in_force = prefix  # make_plan's `prefix` argument hides the function's name there


@dataclass(frozen=True)
class Node:
    name: str          # "<region>-<index>", what users type
    region: str
    index: int         # within the region
    rank: int          # position in the plan, 0..N-1 (region order of the file, then index)
    namespace: str     # "<prefix>-<name>"
    address: str       # IPv4 inside the namespaces only
    # the node's NIC each way (bit/s, as applied: dilated like the links); None: no NIC limit
    # (a plan.json written before nodes had NICs)
    nic_rate_bit_s: Optional[float] = None


@dataclass(frozen=True)
class Plan:
    """Everything needed to build the network; derived from a Topology, no side effects."""

    topology_name: str
    topology_file: str
    prefix: str
    address_pool: str
    prefix_length: int
    nodes: tuple[Node, ...]
    region_links: dict  # (src_region, dst_region) -> LinkSpec as applied (dilated), intra-region included, queues resolved
    tcp_buffer_max_bytes: int
    cpu_share: Optional[float] = None  # cores per node, a cgroup CPU quota (0.5: half a core; None: unlimited)
    memory_bytes: Optional[int] = None  # per node, everything it runs (cgroup memory; None: unlimited)
    pids_max: Optional[int] = None      # processes and threads per node (cgroup pids; None: unlimited)
    # The network is slowed by this factor (emulator/dilation.py): region_links are the topology's
    # links dilated; `emulated_link` gives back what the topology said.
    time_dilation: float = 1.0
    # sysctls the topology or scenario sets in every node (`node_sysctls:`, checked there), as
    # written to /proc/sys; they override the TCP buffers sized here
    node_sysctls: dict = field(default_factory=dict)

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise KeyError(f"no node {name!r} (nodes: {known})")

    def link(self, src: Node, dst: Node) -> LinkSpec:
        """The one-way spec from node `src` to node `dst`, as the backends apply it (dilated)."""
        return self.region_links[(src.region, dst.region)]

    def emulated_link(self, src: Node, dst: Node) -> LinkSpec:
        """The one-way spec from `src` to `dst` as the topology states it (before dilation)."""
        return undilate(self.link(src, dst), self.time_dilation)

    def emulated_nic_bit_s(self, node: Node) -> Optional[float]:
        """`node`'s NIC rate each way (bit/s) as the topology states it (before dilation)."""
        return None if node.nic_rate_bit_s is None else node.nic_rate_bit_s * self.time_dilation

    def nic_can_bind(self, node: Node) -> bool:
        """True when `node`'s NIC is below what its pairs could carry at once, out or in (the sum
        of their rates): a NIC that cannot bind need not be built (tc, the delay line)."""
        if node.nic_rate_bit_s is None:
            return False
        counts: dict[str, int] = {}
        for other in self.nodes:
            counts[other.region] = counts.get(other.region, 0) + 1
        counts[node.region] -= 1
        out = sum(n * self.region_links[(node.region, r)].rate_bit_s for r, n in counts.items())
        into = sum(n * self.region_links[(r, node.region)].rate_bit_s for r, n in counts.items())
        return max(out, into) > node.nic_rate_bit_s

    def nic_queue_bytes(self, node: Node) -> int:
        """The drop-tail queue (bytes) of each direction of `node`'s NIC on the delay line: the
        largest queue of a link it sends or receives on (a bandwidth-delay product or the
        topology's `queue`), so a NIC never drops what its busiest link would keep."""
        return max([MIN_AUTO_QUEUE_BYTES] + [spec.queue_bytes or 0 for (src, dst), spec in self.region_links.items()
                                             if node.region in (src, dst)])

    def emulated_region_links(self) -> dict:
        """Region pair -> the topology's LinkSpec (before dilation)."""
        return {pair: undilate(spec, self.time_dilation) for pair, spec in self.region_links.items()}

    def pairs(self):
        """Every ordered pair of distinct nodes with its spec."""
        for src in self.nodes:
            for dst in self.nodes:
                if src is not dst:
                    yield src, dst, self.link(src, dst)

    def segments_egress(self, node: Node) -> bool:
        """True when some link leaving `node` loses packets (0 < loss < 100%).

        Such a node must hand its links wire-sized packets, not 64 KB GSO/TSO frames: a link drops
        what it is given, and a dropped GSO frame takes up to ~44 segments with it, which is not
        the per-packet loss the spec states. Backends disable segmentation offload on its device.
        """
        return any(0.0 < self.link(node, dst).loss_fraction < 1.0 for dst in self.nodes if dst is not node)

    def hosts_file(self) -> str:
        """/etc/hosts content for every node's namespace, so `ping tokyo-0` resolves."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{n.address}\t{n.name}" for n in self.nodes]
        return "\n".join(lines) + "\n"

    def sysctls(self) -> dict[str, str]:
        """Per-namespace sysctls every backend sets in every node: TCP buffers large enough for the
        largest bandwidth-delay product, then the topology's or scenario's `node_sysctls` (which
        win where they name the same key).

        TCP autotuning grows to tcp_rmem/tcp_wmem[2], which are per namespace. net.core.rmem_max
        (the cap for explicit SO_RCVBUF) is read-only inside a namespace here, so it is not listed.
        """
        top = self.tcp_buffer_max_bytes
        return {
            "net.ipv4.tcp_rmem": f"4096 131072 {top}",
            "net.ipv4.tcp_wmem": f"4096 16384 {top}",
            **self.node_sysctls,
        }

    def slow_start_after_idle(self) -> bool:
        """Whether the nodes restart slow start after an idle RTO (Linux's default, 1). Never
        with BBR: Linux's tcp_slow_start_after_idle_check returns early for a congestion control
        with its own control loop (``cong_control``), whatever the sysctl says."""
        if str(self.node_sysctls.get("net.ipv4.tcp_congestion_control", "")).strip() == "bbr":
            return False
        return str(self.node_sysctls.get("net.ipv4.tcp_slow_start_after_idle", "1")).strip() != "0"

    def to_json(self) -> str:
        data = asdict(self)
        data["region_links"] = [
            {"src": s, "dst": d, **asdict(spec)} for (s, d), spec in self.region_links.items()
        ]
        return json.dumps(data, indent=2)

    @staticmethod
    def from_json(text: str) -> "Plan":
        data = json.loads(text)
        data["nodes"] = tuple(Node(**n) for n in data["nodes"])
        data["region_links"] = {
            (entry.pop("src"), entry.pop("dst")): LinkSpec(**entry) for entry in data["region_links"]
        }
        return Plan(**data)


def bdp_bytes(spec: LinkSpec) -> int:
    """Bandwidth-delay product of a path whose RTT is twice this direction's delay (+ jitter)."""
    rtt_s = 2.0 * (spec.one_way_delay_ms + spec.jitter_ms) / 1000.0
    return int(spec.rate_bit_s * rtt_s / 8.0)


def auto_queue_bytes(spec: LinkSpec) -> int:
    """A drop-tail queue of one BDP lets one TCP flow fill the pipe without standing delay forever."""
    return max(MIN_AUTO_QUEUE_BYTES, bdp_bytes(spec))


def tcp_buffer_bytes(specs) -> int:
    """TCP buffer maximum for the largest BDP, as a power of two.

    Measured here (1 Gbit/s, 200 ms RTT, one flow): default buffers 138 Mbit/s, 16 MB 442, 64 MB 798.
    Linux gives the application half of tcp_rmem (tcp_adv_win_scale), and CUBIC overshoots, so we
    allow 4x the BDP.
    """
    need = max((4 * bdp_bytes(s) for s in specs), default=0)
    size = DEFAULT_TCP_BUFFER_MAX_BYTES
    while size < need and size < MAX_TCP_BUFFER_BYTES:
        size *= 2
    return size


def make_plan(topology: Topology, cpu_share: Optional[float] = None, time_dilation: float = 1.0,
              prefix: Optional[str] = None) -> Plan:
    """Name and address every node of `topology` and resolve its link matrix, dilated by
    `time_dilation` (queues sized before dilation: a dilated queue keeps its bytes, see dilation.py).

    `prefix`: the object-name prefix the plan's namespaces and run files carry; None takes the one
    in force (WANBENCH_PREFIX, default "wanb"), the only input that is not an argument.
    """
    try:
        time_dilation = check_time_dilation(time_dilation)
    except ValueError as exc:
        raise ConfigError("time_dilation", str(exc), source=topology.source_file) from None
    pfx = _prefix_in_force() if prefix is None else checked_prefix(prefix)
    pool = ipaddress.IPv4Network(topology.address_pool)
    hosts = pool.hosts()
    nodes = []
    for region, count in topology.regions.items():
        for index in range(count):
            name = f"{region}-{index}"
            nodes.append(Node(
                name=name, region=region, index=index, rank=len(nodes),
                namespace=f"{pfx}-{name}", address=str(next(hosts)),
                nic_rate_bit_s=topology.region_nic_bit_s(region) / time_dilation,
            ))
    region_links = {}
    for src in topology.regions:
        for dst in topology.regions:
            spec = topology.link(src, dst)
            if spec.queue_bytes is None:
                spec = replace(spec, queue_bytes=auto_queue_bytes(spec))
            region_links[(src, dst)] = dilate(spec, time_dilation)
    return Plan(
        topology_name=topology.name,
        topology_file=topology.source_file,
        prefix=pfx,
        address_pool=str(pool),
        prefix_length=pool.prefixlen,
        nodes=tuple(nodes),
        region_links=region_links,
        tcp_buffer_max_bytes=tcp_buffer_bytes(region_links.values()),
        cpu_share=cpu_share,
        memory_bytes=topology.memory_bytes,
        pids_max=topology.pids_max,
        time_dilation=time_dilation,
        node_sysctls=dict(topology.node_sysctls),
    )
