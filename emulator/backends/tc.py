"""`tc` backend: kernel shaping with htb + netem + bfifo, for kernels that have sch_netem.

Layout: every node namespace has `eth0`, a veth whose peer `<prefix>v<rank>` sits on a bridge inside
one extra namespace `<prefix>-core` (so the host's own namespace gains nothing).

The link model, the same as the tun backend's delay line (one model on every backend, so results
compare across backends), in two stages per ordered pair src -> dst:

1. Propagation, on src's `eth0` egress (`delay_stage`): htb classifies by destination (u32 on the
   destination address) into unshaped classes, each with a netem leaf: the one-way delay, jitter,
   loss. With jitter, netem also gets a `rate` (JITTER_RATE_FACTOR x the pair's rate) so that a
   pair's packets leave in order (netem then times each packet after the one before it; without
   a rate, its time-sorted queue reorders them). netem's packet `limit` only has to hold what is
   in flight, so it is generous (it must never be the bottleneck).
2. The bottleneck, on the core side of dst's veth (`bottleneck_stage`, egress of `<prefix>v<dst>`):
   htb classifies by source into a class at the pair's rate, with an explicit burst
   (BURST_TIME_MS of the rate: tc's default, one MTU at psched's ns clock, lets a high-rate class
   stall on timer slack), and a bfifo leaf: a drop-tail queue bounded in bytes (the plan's queue),
   which a packet count with 64 KB GSO packets is not. A drop here happens on the core side, after
   the sender's socket handed the packet over: like on a WAN, the sender learns of it only
   through the ACK clock (duplicate ACKs, SACK), not from a local `NET_XMIT_DROP`.

Each node's NIC (the plan's `Node.nic_rate_bit_s`, each way) is one more htb class, `1:2`, at the
NIC's rate: on the receiver's bottleneck port the per-source classes hang under it (the NIC in),
on the sender's eth0 the per-destination classes (the NIC out). A child is guaranteed its share of
the NIC (the NIC's rate over its siblings, never more than its own ceiling) and borrows up to its
ceiling (the pair's rate; on eth0 the NIC's), so the siblings together never pass the NIC. A NIC
that cannot bind (the rates of its pairs sum to no more than it) is left out: the tree is the one
without NICs.

All shaping of one namespace is one `tc -batch` (N node batches and one core batch, not 3·N²
processes); the commands are built by pure functions, so `--dry-run` prints exactly what would run
and tests compare it line by line. Per-pair counters come from `tc -s -j` (`counters`).
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
from dataclasses import replace
from typing import Optional

from .. import netns
from ..plan import Node, Plan
from ..topology import LinkSpec
from ..units import format_rate, format_time_ms
from .base import Backend, BackendUnavailable, clear_state, register

NODE_IFNAME = "eth0"
ETHERNET_HEADER_BYTES = 14  # in what a veth's qdisc counts, not in the IP bytes counters report
UNSHAPED_RATE_BIT_S = 100e9  # the delay stage's classes and traffic to no known node (ARP)
# htb's burst: this much time at the class's rate, and never under MIN_BURST_BYTES (two full
# frames). 1 ms at 1 Gbit/s is 125 KB, two GSO packets.
BURST_TIME_MS = 1.0
MIN_BURST_BYTES = 2 * 1514
HTB_QUANTUM_BYTES = 65536    # round-robin share among classes; >= the largest GSO packet
JITTER_RATE_FACTOR = 10      # netem `rate` with jitter: keeps a pair in order, never the bottleneck
MIN_NETEM_LIMIT_PACKETS = 1000  # netem's own default
# netem's limit counts packets; in flight on the delay stage are at most the bottleneck's BDP plus
# its queue, sent as packets as small as a bare ACK. Sized for that, the limit never drops.
SMALLEST_PACKET_BYTES = 64


def core_namespace(plan: Plan) -> str:
    return f"{plan.prefix}-core"


def bridge_name(plan: Plan) -> str:
    return f"{plan.prefix}br0"


def veth_core_name(plan: Plan, node: Node) -> str:
    """The peer of a node's eth0 on the bridge side (fits IFNAMSIZ: prefix <= 6 + 'v' + rank)."""
    return f"{plan.prefix}v{node.rank}"


def class_id(node: Node) -> str:
    """htb class / leaf handle minor for traffic to (delay stage) or from (bottleneck) `node`, in hex
    as tc expects (1: is the root, 1:1 the default class)."""
    return f"{node.rank + 10:x}"


def netem_limit_packets(spec: LinkSpec, packet_bytes: int = SMALLEST_PACKET_BYTES) -> int:
    """Packets the delay stage's netem may hold: everything the bottleneck lets be in flight (and
    its queue), counted in packets of `packet_bytes`."""
    in_flight = spec.rate_bit_s * (spec.one_way_delay_ms + spec.jitter_ms) / 1000.0 / 8.0
    total = in_flight + (spec.queue_bytes or 0)
    return max(MIN_NETEM_LIMIT_PACKETS, math.ceil(total / packet_bytes))


def burst_bytes(rate_bit_s: float) -> int:
    """htb burst (and cburst) for a class at `rate_bit_s`."""
    return max(MIN_BURST_BYTES, math.ceil(rate_bit_s / 8.0 * BURST_TIME_MS / 1000.0))


def htb_class_args(rate_bit_s: float, ceil_bit_s: Optional[float] = None) -> list[str]:
    """htb arguments of a class guaranteed `rate_bit_s` that may borrow up to `ceil_bit_s`
    (default: the rate, no borrowing)."""
    ceil_bit_s = rate_bit_s if ceil_bit_s is None else ceil_bit_s
    return ["htb", "rate", format_rate(rate_bit_s), "ceil", format_rate(ceil_bit_s),
            "burst", str(burst_bytes(rate_bit_s)), "cburst", str(burst_bytes(ceil_bit_s)),
            "quantum", str(HTB_QUANTUM_BYTES)]


NIC_CLASS = "1:2"  # a node's NIC class (1:1 is the default class, nodes' classes start at 1:a)


def binding_nic(nic_rate_bit_s: Optional[float], pair_rates_bit_s: list[float]) -> Optional[float]:
    """The NIC rate when it can bind (the pairs' rates sum to more than it), else None."""
    if nic_rate_bit_s is None or sum(pair_rates_bit_s) <= nic_rate_bit_s:
        return None
    return nic_rate_bit_s


def nic_child_args(nic_bit_s: float, siblings: int, ceil_bit_s: float) -> list[str]:
    """A class under the NIC: guaranteed the NIC's equal share among `siblings` (never more than
    its ceiling), borrowing up to `ceil_bit_s`."""
    return htb_class_args(min(ceil_bit_s, float(int(nic_bit_s / siblings))), ceil_bit_s)


def netem_args(spec: LinkSpec, always_loss: bool = False, limit: Optional[int] = None) -> list[str]:
    """The delay stage's netem for one pair: delay, jitter (in order), loss, limit.

    always_loss: write `loss 0%` too (a change must reset a link that was down).
    limit: netem's packet limit (default: netem_limit_packets, never the bottleneck)."""
    args = ["netem", "delay", format_time_ms(spec.one_way_delay_ms)]
    if spec.jitter_ms:
        args += [format_time_ms(spec.jitter_ms), "rate", format_rate(spec.rate_bit_s * JITTER_RATE_FACTOR)]
    if spec.loss_fraction or always_loss:
        args += ["loss", f"{spec.loss_fraction * 100:g}%"]
    args += ["limit", str(netem_limit_packets(spec) if limit is None else limit)]
    return args


def queue_args(spec: LinkSpec) -> list[str]:
    """The bottleneck's drop-tail queue, bounded in bytes."""
    return ["bfifo", "limit", str(spec.queue_bytes or MIN_BURST_BYTES)]


def _root(dev: str) -> list[list[str]]:
    return [
        ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
        ["class", "add", "dev", dev, "parent", "1:", "classid", "1:1", *htb_class_args(UNSHAPED_RATE_BIT_S)],
    ]


def delay_stage(plan: Plan, src: Node) -> list[list[str]]:
    """tc arguments (after `tc -n <src ns>`) for src's eth0: per destination, an unshaped htb class
    with a netem leaf (delay, jitter, loss) and a u32 filter on the destination address."""
    dev = NODE_IFNAME
    cmds = _root(dev)
    others = [dst for dst in plan.nodes if dst is not src]
    nic = binding_nic(src.nic_rate_bit_s, [plan.link(src, dst).rate_bit_s for dst in others])
    parent = "1:"
    if nic is not None:  # the NIC out: every destination's class borrows from it
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", NIC_CLASS, *htb_class_args(nic)])
        parent = NIC_CLASS
    for dst in others:
        spec, minor = plan.link(src, dst), class_id(dst)
        shape = htb_class_args(UNSHAPED_RATE_BIT_S) if nic is None else nic_child_args(nic, len(others), nic)
        cmds += [
            ["class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}", *shape],
            ["qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", *netem_args(spec)],
            ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{dst.address}/32", "flowid", f"1:{minor}"],
        ]
    return cmds


def bottleneck_stage(plan: Plan, dst: Node, dev: str, sources: Optional[list[Node]] = None) -> list[list[str]]:
    """tc arguments for `dev`, the device that delivers to `dst` (the core-side veth peer; on the
    mininet backend the switch port): per source, an htb class at the pair's rate with a bfifo leaf
    bounded in bytes and a u32 filter on the source address. `sources`: these only (default all)."""
    cmds = _root(dev)
    senders = [src for src in (plan.nodes if sources is None else sources) if src is not dst]
    nic = binding_nic(dst.nic_rate_bit_s, [plan.link(src, dst).rate_bit_s for src in senders])
    parent = "1:"
    if nic is not None:  # the NIC in: every source's class borrows from it, up to its pair's rate
        cmds.append(["class", "add", "dev", dev, "parent", "1:", "classid", NIC_CLASS, *htb_class_args(nic)])
        parent = NIC_CLASS
    for src in senders:
        spec, minor = plan.link(src, dst), class_id(src)
        shape = htb_class_args(spec.rate_bit_s) if nic is None else nic_child_args(nic, len(senders), spec.rate_bit_s)
        cmds += [
            ["class", "add", "dev", dev, "parent", parent, "classid", f"1:{minor}", *shape],
            ["qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", *queue_args(spec)],
            ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "src", f"{src.address}/32", "flowid", f"1:{minor}"],
        ]
    return cmds


def core_batch(plan: Plan) -> list[list[str]]:
    """Every bottleneck of the tc backend: one batch in the core namespace."""
    return [cmd for dst in plan.nodes for cmd in bottleneck_stage(plan, dst, veth_core_name(plan, dst))]


def batches(plan: Plan) -> list[tuple[str, list[list[str]]]]:
    """(namespace, tc arguments) for every `tc -n NS -batch -` the tc backend runs."""
    return [(node.namespace, delay_stage(plan, node)) for node in plan.nodes] + \
        [(core_namespace(plan), core_batch(plan))]


def segmentation_command() -> list[str]:
    """`ip` arguments that make a node with a lossy outgoing link send one wire packet per skb.

    netem drops what it is given, and the qdisc sits before the driver cuts a GSO skb into
    segments, so a dropped GSO skb would take up to ~44 packets with it. `ethtool -K eth0 tso off
    gso off` does not prevent that: TCP always builds GSO skbs (sk_setup_caps), only their size
    follows the device's gso_max_segs. So gso_max_segs 1 on the node's eth0 (Plan.segments_egress).
    """
    return ["link", "set", NODE_IFNAME, "gso_max_segs", "1"]


def link_batches(plan: Plan) -> list[tuple[str, list[list[str]]]]:
    """(namespace, ip arguments) for every `ip -n NS -batch -` that wires the nodes to the bridge.
    The core namespace's batch runs first: it creates each node's eth0 inside the node."""
    core, bridge = core_namespace(plan), bridge_name(plan)
    core_cmds = [["link", "set", "lo", "up"], ["link", "add", bridge, "type", "bridge"],
                 ["link", "set", bridge, "up"]]
    node_batches = []
    for node in plan.nodes:
        peer = veth_core_name(plan, node)
        core_cmds += [
            ["link", "add", peer, "type", "veth", "peer", "name", NODE_IFNAME, "netns", node.namespace],
            ["link", "set", peer, "master", bridge, "up"],
        ]
        node_cmds = [["addr", "add", f"{node.address}/{plan.prefix_length}", "dev", NODE_IFNAME],
                     ["link", "set", NODE_IFNAME, "up"]]
        if plan.segments_egress(node):
            node_cmds.append(segmentation_command())
        node_batches.append((node.namespace, node_cmds))
    return [(core, core_cmds), *node_batches]


def change_commands(plan: Plan, src: Node, dst: Node, spec: Optional[LinkSpec]) -> list[list[str]]:
    """Full tc commands that change src->dst in place: its netem on src's eth0 and its bottleneck
    class on dst's core-side port (None: the link is down, 100% loss)."""
    base = plan.link(src, dst)
    spec = spec or replace(base, loss_fraction=1.0)
    minor_dst, minor_src = class_id(dst), class_id(src)
    # the class sits where bottleneck_stage put it: under dst's NIC when the plan's rates let it bind
    senders = [n for n in plan.nodes if n is not dst]
    nic = binding_nic(dst.nic_rate_bit_s, [plan.link(n, dst).rate_bit_s for n in senders])
    parent, shape = ("1:", htb_class_args(spec.rate_bit_s)) if nic is None else (
        NIC_CLASS, nic_child_args(nic, len(senders), spec.rate_bit_s))
    return [
        ["tc", "-n", src.namespace, "qdisc", "change", "dev", NODE_IFNAME, "parent", f"1:{minor_dst}",
         "handle", f"{minor_dst}:", *netem_args(spec, always_loss=True)],
        ["tc", "-n", core_namespace(plan), "class", "change", "dev", veth_core_name(plan, dst), "parent", parent,
         "classid", f"1:{minor_src}", *shape],
    ]


def _heredoc(tool: str, namespace: str, cmds: list[list[str]]) -> list[str]:
    return [f"{tool} -n {namespace} -batch - <<'EOF'", *(shlex.join(c) for c in cmds), "EOF"]


def script(plan: Plan) -> str:
    """The whole build as a shell script a person can read and run (what `--dry-run` prints)."""
    lines = ["#!/bin/sh", f"# wanbench tc backend: {plan.topology_name}, {len(plan.nodes)} nodes", "set -e"]
    lines.append("# node namespaces (built with pyroute2; equivalent commands):")
    for node in plan.nodes:
        lines.append(f"ip netns add {node.namespace}")
        lines.append(f"ip -n {node.namespace} link set lo up")
        for key, value in plan.sysctls().items():
            lines.append(f"ip netns exec {node.namespace} sysctl -q -w {shlex.quote(f'{key}={value}')}")
        lines.append(f"mkdir -p /etc/netns/{node.namespace}")
        lines.append(f"printf %s {shlex.quote(plan.hosts_file())} > /etc/netns/{node.namespace}/hosts")
    lines.append("# links: every node's eth0 to the bridge in the core namespace")
    lines.append(f"ip netns add {core_namespace(plan)}")
    for namespace, cmds in link_batches(plan):
        lines += _heredoc("ip", namespace, cmds)
    for namespace, cmds in batches(plan):
        what = "bottlenecks (rate, drop-tail queue in bytes) on the core side" \
            if namespace == core_namespace(plan) else f"propagation (delay, jitter, loss) of {namespace}"
        lines.append(f"# {what}")
        lines += _heredoc("tc", namespace, cmds)
    return "\n".join(lines) + "\n"


def netem_works() -> tuple[bool, str]:
    """Try a netem qdisc in a throwaway namespace (the module may be built in, so /proc/modules lies)."""
    from ..plan import prefix

    probe = f"{prefix()}-netemprobe"
    try:
        subprocess.run(["ip", "netns", "add", probe], check=True, capture_output=True)
        result = subprocess.run(
            ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True, text=True)
        return result.returncode == 0, result.stderr.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        return False, str(exc)
    finally:
        netns.remove_namespace(probe)


class CommandFailed(netns.SystemCheckError):
    """A system command failed; the message is one line: the command and its error."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run_commands(cmds: list[list[str]]) -> None:
    """Execute commands in order; stop at the first failure with its stderr (never ignore an error)."""
    for cmd in cmds:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise CommandFailed(f"{shlex.join(cmd)}: {_one_line(result.stderr) or f'exit {result.returncode}'}")


BATCH_FAILED_LINE = re.compile(r"Command failed -:(\d+)")


def run_batch(tool: str, namespace: Optional[str], cmds: list[list[str]]) -> None:
    """Run `cmds` as one `tool [-n namespace] -batch -`; on failure raise CommandFailed naming the
    failing line as a full command, with tool's error (tc and ip stop at the first error)."""
    head = [tool, *(["-n", namespace] if namespace else [])]
    try:
        result = subprocess.run([*head, "-batch", "-"], input="".join(shlex.join(c) + "\n" for c in cmds),
                                capture_output=True, text=True)
    except OSError as exc:
        raise CommandFailed(f"{shlex.join(head)} -batch -: {exc}") from None
    if result.returncode == 0:
        return
    error = [line for line in result.stderr.splitlines() if not BATCH_FAILED_LINE.search(line)]
    failed = BATCH_FAILED_LINE.search(result.stderr)
    if failed and 0 < int(failed.group(1)) <= len(cmds):
        what = shlex.join([*head, *cmds[int(failed.group(1)) - 1]])
    else:
        what = f"{shlex.join(head)} -batch -"
    raise CommandFailed(f"{what}: {_one_line(' '.join(error)) or f'exit {result.returncode}'}")


def read_json(argv: list[str]) -> list:
    """Run a `tc -j ...` query and parse its output (an empty list when there is nothing)."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise CommandFailed(f"{shlex.join(argv)}: {_one_line(result.stderr) or f'exit {result.returncode}'}")
    return json.loads(result.stdout or "[]")


def pair_counters(plan: Plan, core_stats: dict[str, list], delay_stats: dict[str, list]) -> list[dict]:
    """Per-pair counters from `tc -s -j qdisc show` output (pure: tests feed it recorded JSON).

    Args:
        core_stats: dst node name -> the qdiscs of its bottleneck port (bfifo leaves, per source).
        delay_stats: src node name -> the qdiscs of its eth0 (netem leaves, per destination).
    Returns one row per ordered pair, in the tun backend's counter names: packets and bytes (IP,
    headers included) delivered through the bottleneck, drops_queue (tail drops), drops_loss (netem's loss),
    backlog_bytes (queued now), offered_packets (what the sender put on the pair).
    """
    def by_handle(qdiscs: list) -> dict[str, dict]:
        return {q.get("handle", ""): q for q in qdiscs}

    rows = []
    for src, dst, _ in plan.pairs():
        queue = by_handle(core_stats.get(dst.name, [])).get(f"{class_id(src)}:", {})
        delay = by_handle(delay_stats.get(src.name, [])).get(f"{class_id(dst)}:", {})
        rows.append({
            "src": src.name, "dst": dst.name,
            # IP bytes, as the Backend.counters contract and the tun backend count them: the
            # bottleneck sees Ethernet frames (one header per segment: qdisc packet counts are
            # segments)
            "packets": queue.get("packets", 0),
            "bytes": queue.get("bytes", 0) - ETHERNET_HEADER_BYTES * queue.get("packets", 0),
            "drops_queue": queue.get("drops", 0), "drops_loss": delay.get("drops", 0),
            "backlog_bytes": queue.get("backlog", 0),
            # netem under htb does not count what it passes on, so: everything that reached the
            # bottleneck (sent, dropped, queued), plus netem's drops and what it holds in flight
            "offered_packets": (queue.get("packets", 0) + queue.get("drops", 0) + queue.get("qlen", 0)
                                + delay.get("drops", 0) + delay.get("qlen", 0)),
        })
    return rows


@register
class TcBackend(Backend):
    """Kernel shaping: netem per destination on each node, htb + bfifo per source on the core side."""

    name = "tc"

    @classmethod
    def check_available(cls) -> None:
        netns.check_root()
        ok, why = netem_works()
        if not ok:
            raise BackendUnavailable(
                f"tc backend: this kernel has no sch_netem ({why or 'netem qdisc refused'}); "
                f"load it with 'modprobe sch_netem' or use --backend tun")

    def up(self) -> None:
        netns.check_address_pool_free(self.plan.address_pool)
        try:
            netns.create_nodes(self.plan)
            run_commands([["ip", "netns", "add", core_namespace(self.plan)]])
            for namespace, cmds in link_batches(self.plan):
                run_batch("ip", namespace, cmds)
            for namespace, cmds in batches(self.plan):
                run_batch("tc", namespace, cmds)
            self.write_state()
        except BaseException:
            self.down()
            raise

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        for src in self.plan.nodes:
            for dst in self.plan.nodes:
                if src is not dst and src.region == src_region and dst.region == dst_region:
                    run_commands(change_commands(self.plan, src, dst, spec))

    def counters(self, fresh: bool = False) -> list[dict]:
        """Per-pair counters read from the kernel now (`tc -s -j qdisc show`): always fresh."""
        core = core_namespace(self.plan)
        try:
            core_stats = {dst.name: read_json(["tc", "-s", "-j", "-n", core, "qdisc", "show", "dev",
                                               veth_core_name(self.plan, dst)]) for dst in self.plan.nodes}
            delay_stats = {src.name: read_json(["tc", "-s", "-j", "-n", src.namespace, "qdisc", "show",
                                                "dev", NODE_IFNAME]) for src in self.plan.nodes}
        except (CommandFailed, ValueError):
            return []
        return pair_counters(self.plan, core_stats, delay_stats)

    def down(self) -> None:
        netns.remove_nodes(self.plan)
        netns.remove_namespace(core_namespace(self.plan))  # takes the bridge and veth peers with it
        clear_state(self.plan.prefix)


# Real hosts (`wanbench shape`): the matrix on one host's own interface -----------------------------
# The root qdisc carries this handle (0x5742, "WB"), so `unshape` removes only what shape added.
HOST_ROOT_HANDLE = "5742:"


FULL_PACKET_BYTES = 1514


def host_netem_limit(spec: LinkSpec) -> int:
    """netem's limit on a real host, where it holds both what is in flight and the queue behind
    the rate: the bandwidth-delay product plus the plan's queue, in full-size packets."""
    return netem_limit_packets(spec, FULL_PACKET_BYTES)


def host_stage(dev: str, destinations: list[tuple[str, LinkSpec]]) -> list[list[str]]:
    """tc arguments that shape `dev` of a real host for its outgoing links (`wanbench shape`).

    Per destination address: an htb class at the pair's rate (with an explicit burst, as the
    bottleneck stage), a netem leaf with the one-way delay, jitter and loss, and a u32 filter on
    the destination. Other traffic (SSH, DNS, the cluster's own) takes the unshaped default class.
    Unlike the emulated backends, rate and queue are applied on the sender itself: a host has no
    core side, so a drop at the rate limit is reported to the sending socket at once (TCP's local
    congestion signal) rather than only through the ACK clock; and the queue is netem's packet
    limit (packets in flight plus the plan's queue, counted in full-size packets: host_netem_limit)
    rather than a byte-bounded bfifo. docs/REAL_HOSTS.md says so.
    """
    major = HOST_ROOT_HANDLE
    cmds = [
        ["qdisc", "add", "dev", dev, "root", "handle", major, "htb", "default", "1"],
        ["class", "add", "dev", dev, "parent", major, "classid", f"{major}1", *htb_class_args(UNSHAPED_RATE_BIT_S)],
    ]
    for index, (address, spec) in enumerate(destinations):
        minor = f"{index + 10:x}"
        cmds += [
            ["class", "add", "dev", dev, "parent", major, "classid", f"{major}{minor}", *htb_class_args(spec.rate_bit_s)],
            ["qdisc", "add", "dev", dev, "parent", f"{major}{minor}", "handle", f"{minor}:",
             *netem_args(spec, limit=host_netem_limit(spec))],
            ["filter", "add", "dev", dev, "parent", major, "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{address}/32", "flowid", f"{major}{minor}"],
        ]
    return cmds


def host_script(dev: str, cmds: list[list[str]], title: str) -> str:
    """What `wanbench shape --dry-run` prints: a script that replaces our root qdisc on `dev`."""
    lines = ["#!/bin/sh", f"# {title}", "set -e",
             f"tc qdisc del dev {shlex.quote(dev)} root handle {HOST_ROOT_HANDLE} 2>/dev/null || true",
             "tc -batch - <<'EOF'", *(shlex.join(c) for c in cmds), "EOF"]
    return "\n".join(lines) + "\n"


def host_root_handle(dev: str, namespace: Optional[str] = None) -> Optional[str]:
    """The handle of `dev`'s root qdisc (e.g. "5742:"), None when it has the kernel's default."""
    head = ["tc", *(["-n", namespace] if namespace else []), "-j", "qdisc", "show", "dev", dev, "root"]
    result = subprocess.run(head, capture_output=True, text=True)
    if result.returncode != 0:
        raise CommandFailed(f"{shlex.join(head)}: {_one_line(result.stderr) or f'exit {result.returncode}'}")
    qdiscs = json.loads(result.stdout or "[]")
    for qdisc in qdiscs:
        if qdisc.get("root") and qdisc.get("handle") not in (None, "0:"):
            return qdisc["handle"]
    return None


def apply_host(dev: str, cmds: list[list[str]]) -> None:
    """Replace our shaping on `dev` (never another tool's root qdisc) with `cmds`."""
    handle = host_root_handle(dev)
    if handle == HOST_ROOT_HANDLE:
        run_commands([["tc", "qdisc", "del", "dev", dev, "root"]])
    elif handle is not None:
        raise CommandFailed(f"{dev} already has a root qdisc {handle} that wanbench did not add; "
                            f"remove it first (tc qdisc del dev {dev} root)")
    run_batch("tc", None, cmds)


def remove_host(dev: str) -> bool:
    """Remove what `apply_host` added to `dev`; False when there was nothing of ours."""
    handle = host_root_handle(dev)
    if handle != HOST_ROOT_HANDLE:
        return False
    run_commands([["tc", "qdisc", "del", "dev", dev, "root"]])
    return True
