"""The tun backend's kernel shortcut: node pairs whose round trip is shorter than the delay line
can time are carried by the kernel, not by the delay line.

Why: the delay line is a userspace loop. A frame that reaches it while it sleeps waits for the
loop to wake (17-110 us at p50 on this VM, more under load), and each pass through Python and the
TUN paths costs tens of microseconds. A 0.1 ms intra-region round trip is shorter than that: on
the delay line it measured 0.2-0.35 ms with iputils ping at 1-5 Hz (docs/RESULTS.md, issue 12 §3).
The kernel forwards such a pair in a few tens of microseconds (a veth pair and a bridge), so it is
closer to the specification, and never late.

What: every node of a shortcut pair gets a second interface, `lan0`, a veth whose peer sits on a
bridge in one extra namespace `<prefix>-core` (the tc backend's layout and names). A /32 route per
shortcut peer sends the pair's packets over `lan0`; everything else keeps the node's default route
through its TUN device and the delay line. The rate and the drop-tail queue (in bytes) are the tc
backend's bottleneck stage on the core side of the receiver's port (htb per source + bfifo), so
the link model is the tc backend's; the delay is the kernel's own, which the docs measure.

Each node's NIC holds on the shortcut too, in the kernel: its NIC in is the parent class of its
port's per-source classes (tc.bottleneck_stage), its NIC out one htb class on its lan0 (`nic_batches`),
each where the shortcut pairs' rates could exceed it. The delay line enforces the same NIC on the
node's other pairs; the two are separate buckets (a node busy on both paths at once can move up to
a NIC's worth on each), which binds only when intra-region and inter-region traffic together pass
the NIC: with the default 10 Gbit/s NIC and 1 Gbit/s inter-region pairs, a node needs ten busy
inter-region peers before the delay line's share matters.

A pair is eligible when both directions have no loss and no jitter and their round trip is at
most `max_rtt_ms` (as applied, i.e. dilated). The delay line keeps every pair configured; a link
change that makes a pair ineligible (a partition, a slower link) removes its routes after the delay
line has the change, so the pair's packets fall back to the delay line, and a change back restores
them. Pure functions build the `ip` and `tc` commands; `tests/emulator/test_tun_shortcut.py` reads
them line by line.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional

from ..delayline.device import DEVICE_MTU
from ..linkspec import LinkSpec
from ..plan import Node, Plan
from ..schema import ConfigError
from . import tc

NODE_IFNAME = "lan0"
# Round trips up to this (ms, as applied) go through the kernel. The delay line's own error on a
# sparse pair is +0.15-0.3 ms; the kernel's path is 0.03-0.05 ms (its error: that minus the spec).
DEFAULT_MAX_RTT_MS = 0.2

# The environment can change the limit or turn the shortcut off, for a whole run (the harness and
# `wanbench` start the backend in other processes): a number of ms, or "off".
ENV_VAR = "WANBENCH_TUN_SHORTCUT_MS"

Pair = tuple[Node, Node]  # (lower rank, higher rank)


def limit_from_environment(default: Optional[float]) -> Optional[float]:
    """The round-trip limit (ms) in force: WANBENCH_TUN_SHORTCUT_MS when set ("off": None), else
    `default`. Bad values raise ConfigError naming the variable."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return default
    if value.strip().lower() == "off":
        return None
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not 0 <= limit <= 10:  # also refuses NaN
        raise ConfigError(ENV_VAR, f"{value!r}: a round trip in ms from 0 to 10, or 'off'", source="environment")
    return limit


def eligible(forward: Optional[LinkSpec], back: Optional[LinkSpec], max_rtt_ms: float) -> bool:
    """True when a pair with these two directions can go through the kernel (None: link down)."""
    if forward is None or back is None:
        return False
    return (forward.one_way_delay_ms + back.one_way_delay_ms <= max_rtt_ms
            and not (forward.jitter_ms or back.jitter_ms or forward.loss_fraction or back.loss_fraction))


def shortcut_pairs(plan: Plan, max_rtt_ms: float,
                   links: Optional[Mapping[tuple[str, str], Optional[LinkSpec]]] = None) -> list[Pair]:
    """The node pairs the kernel carries, lower rank first, in rank order.

    links: region pair -> the spec in force (None: down); default the plan's own. Only pairs whose
    specs are the plan's can use the shortcut: its classes are built from the plan.
    """
    links = plan.region_links if links is None else links
    pairs = []
    for a in plan.nodes:
        for b in plan.nodes:
            if a.rank >= b.rank:
                continue
            forward, back = (links.get((a.region, b.region)), links.get((b.region, a.region)))
            if forward != plan.link(a, b) or back != plan.link(b, a):
                continue
            if eligible(forward, back, max_rtt_ms):
                pairs.append((a, b))
    return pairs


def _members(pairs: Iterable[Pair]) -> list[Node]:
    return sorted({node for pair in pairs for node in pair}, key=lambda n: n.rank)


def peers(pairs: Iterable[Pair], node: Node) -> list[Node]:
    """The nodes `node` reaches through the kernel."""
    return sorted((b if a is node else a for a, b in pairs if node in (a, b)), key=lambda n: n.rank)


def link_batches(plan: Plan, pairs: list[Pair]) -> list[tuple[str, list[list[str]]]]:
    """(namespace, ip arguments) that wire every shortcut node's lan0 to the core bridge; the core
    namespace's batch first (it creates lan0 inside each node)."""
    core_cmds = [["link", "set", "lo", "up"], ["link", "add", tc.bridge_name(plan), "type", "bridge"],
                 ["link", "set", tc.bridge_name(plan), "up"]]
    node_batches = []
    for node in _members(pairs):
        port = tc.veth_core_name(plan, node)
        core_cmds += [
            ["link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", node.namespace],
            ["link", "set", port, "master", tc.bridge_name(plan), "up"],
        ]
        node_batches.append((node.namespace, [["link", "set", NODE_IFNAME, "mtu", str(DEVICE_MTU), "up"]]))
    return [(tc.core_namespace(plan), core_cmds), *node_batches]


def route_batches(pairs: list[Pair], action: str) -> list[tuple[str, list[list[str]]]]:
    """(namespace, ip arguments) that add (`action` "add") or delete ("del") the /32 routes of
    `pairs` on both of their nodes. The source is the node's own address (it sits on its TUN)."""
    batches = []
    for node in _members(pairs):
        batches.append((node.namespace, [
            ["route", action, f"{peer.address}/32", "dev", NODE_IFNAME, "src", node.address]
            for peer in peers(pairs, node)]))
    return batches


def tc_batch(plan: Plan, pairs: list[Pair]) -> list[list[str]]:
    """The bottlenecks of the shortcut pairs, on the core side of each receiver's port: htb per
    source at the pair's rate with a bfifo leaf bounded in bytes (tc.bottleneck_stage)."""
    return [cmd for dst in _members(pairs)
            for cmd in tc.bottleneck_stage(plan, dst, tc.veth_core_name(plan, dst), sources=peers(pairs, dst))]


def nic_batches(plan: Plan, pairs: list[Pair]) -> list[tuple[str, list[list[str]]]]:
    """(namespace, tc arguments) that cap each shortcut node's lan0 at its NIC out, for the nodes
    whose shortcut peers' rates sum to more than the NIC (elsewhere the NIC cannot bind)."""
    batches = []
    for node in _members(pairs):
        nic = tc.binding_nic(node.nic_rate_bit_s, [plan.link(node, peer).rate_bit_s for peer in peers(pairs, node)])
        if nic is not None:
            batches.append((node.namespace, [
                ["qdisc", "add", "dev", NODE_IFNAME, "root", "handle", "1:", "htb", "default", "1"],
                ["class", "add", "dev", NODE_IFNAME, "parent", "1:", "classid", "1:1", *tc.htb_class_args(nic)]]))
    return batches


def build(plan: Plan, pairs: list[Pair]) -> None:
    """Create the core namespace, the lan0 links, the bottlenecks and the routes (raises
    tc.CommandFailed with one line naming the command; the caller tears down)."""
    tc.run_commands([["ip", "netns", "add", tc.core_namespace(plan)]])
    for namespace, cmds in link_batches(plan, pairs):
        tc.run_batch("ip", namespace, cmds)
    tc.run_batch("tc", tc.core_namespace(plan), tc_batch(plan, pairs))
    for namespace, cmds in nic_batches(plan, pairs):
        tc.run_batch("tc", namespace, cmds)
    set_routes(pairs, "add")


def set_routes(pairs: list[Pair], action: str) -> None:
    for namespace, cmds in route_batches(pairs, action):
        tc.run_batch("ip", namespace, cmds)


def counters(plan: Plan, pairs: list[Pair]) -> list[dict]:
    """Per-pair counters of the shortcut pairs (both directions), read from the kernel now, in the
    delay line's counter names (tc.pair_counters)."""
    if not pairs:
        return []
    core = tc.core_namespace(plan)
    core_stats = {dst.name: tc.read_json(["tc", "-s", "-j", "-n", core, "qdisc", "show", "dev",
                                          tc.veth_core_name(plan, dst)]) for dst in _members(pairs)}
    wanted = {(a.name, b.name) for a, b in pairs} | {(b.name, a.name) for a, b in pairs}
    return [row for row in tc.pair_counters(plan, core_stats, {}) if (row["src"], row["dst"]) in wanted]


def add_counters(row: dict, kernel: Optional[dict]) -> dict:
    """A pair's delay-line counters plus its kernel counters (every numeric field; None: the row)."""
    if kernel is None:
        return row
    return {key: value + kernel[key] if isinstance(value, (int, float)) and key in kernel else value
            for key, value in row.items()}


def remove(plan: Plan) -> None:
    """Remove the core namespace (the bridge and the core-side ports go with it; lan0 goes with
    each node's namespace). Idempotent."""
    from .. import netns

    netns.remove_namespace(tc.core_namespace(plan))
