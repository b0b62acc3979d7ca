"""`tc` backend: kernel shaping with htb + netem, for kernels that have sch_netem.

Layout: every node namespace has `eth0`, a veth whose peer sits on a bridge inside one extra
namespace `<prefix>-core` (so the host's own namespace gains nothing). On each node's egress:
an htb root, one class per destination node (its rate), a netem leaf (delay, jitter, loss, `limit`
sized from the BDP — netem's default of 1000 packets caps throughput), a u32 filter on the
destination address. The commands are built by pure functions (`link_commands`, `shaping_commands`),
so `--dry-run` prints exactly what would run and tests compare it line by line.
"""

from __future__ import annotations

import math
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
# netem counts packets, not bytes; TSO lets one skb carry up to 64 KB, but a flow on a slow path
# sends MTU-sized ones, so we size the limit as if every packet were 1500 bytes.
PACKET_BYTES = 1500
MIN_NETEM_LIMIT_PACKETS = 1000  # netem's own default
DEFAULT_CLASS_RATE = "100Gbit"  # traffic to no known node (ARP is not IP and never queues here)


def core_namespace(plan: Plan) -> str:
    return f"{plan.prefix}-core"


def bridge_name(plan: Plan) -> str:
    return f"{plan.prefix}br0"


def veth_core_name(plan: Plan, node: Node) -> str:
    """The peer of a node's eth0 on the bridge side (fits IFNAMSIZ: prefix <= 6 + 'v' + rank)."""
    return f"{plan.prefix}v{node.rank}"


def class_id(dst: Node) -> str:
    """htb class / netem handle minor for traffic to `dst`, in hex as tc expects (1: is the root)."""
    return f"{dst.rank + 10:x}"


def netem_limit_packets(spec: LinkSpec) -> int:
    """Packets netem must hold: everything in flight on the delay plus the queue."""
    in_flight = spec.rate_bit_s * (spec.one_way_delay_ms + spec.jitter_ms) / 1000.0 / 8.0
    total = in_flight + (spec.queue_bytes or 0)
    return max(MIN_NETEM_LIMIT_PACKETS, math.ceil(total / PACKET_BYTES))


def link_commands(plan: Plan) -> list[list[str]]:
    """`ip` commands that wire every node's eth0 to the bridge in the core namespace."""
    core, bridge = core_namespace(plan), bridge_name(plan)
    cmds = [
        ["ip", "netns", "add", core],
        ["ip", "-n", core, "link", "set", "lo", "up"],
        ["ip", "-n", core, "link", "add", bridge, "type", "bridge"],
        ["ip", "-n", core, "link", "set", bridge, "up"],
    ]
    for node in plan.nodes:
        peer = veth_core_name(plan, node)
        cmds += [
            ["ip", "-n", core, "link", "add", peer, "type", "veth", "peer", "name", NODE_IFNAME,
             "netns", node.namespace],
            ["ip", "-n", core, "link", "set", peer, "master", bridge, "up"],
            ["ip", "-n", node.namespace, "addr", "add", f"{node.address}/{plan.prefix_length}",
             "dev", NODE_IFNAME],
            ["ip", "-n", node.namespace, "link", "set", NODE_IFNAME, "up"],
        ]
    return cmds


def shaping_commands(plan: Plan, src: Node) -> list[list[str]]:
    """tc commands for `src`'s egress: htb root, per-destination class + netem leaf + u32 filter."""
    ns, dev = src.namespace, NODE_IFNAME
    cmds = [
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
        ["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
         "rate", DEFAULT_CLASS_RATE],
    ]
    for dst in plan.nodes:
        if dst is src:
            continue
        spec = plan.link(src, dst)
        minor = class_id(dst)
        rate = format_rate(spec.rate_bit_s)
        netem = ["netem", "delay", format_time_ms(spec.one_way_delay_ms)]
        if spec.jitter_ms:
            netem.append(format_time_ms(spec.jitter_ms))
        if spec.loss_fraction:
            netem += ["loss", f"{spec.loss_fraction * 100:g}%"]
        netem += ["limit", str(netem_limit_packets(spec))]
        cmds += [
            ["tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}",
             "htb", "rate", rate, "ceil", rate],
            ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle",
             f"{minor}:", *netem],
            ["tc", "-n", ns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
             "1", "u32", "match", "ip", "dst", f"{dst.address}/32", "flowid", f"1:{minor}"],
        ]
    return cmds


def change_commands(plan: Plan, src: Node, dst: Node, spec: Optional[LinkSpec]) -> list[list[str]]:
    """tc commands that change the src->dst class and netem leaf in place (None: 100% loss)."""
    ns, dev, minor = src.namespace, NODE_IFNAME, class_id(dst)
    base = plan.link(src, dst)
    spec = spec or replace(base, loss_fraction=1.0)
    rate = format_rate(spec.rate_bit_s)
    netem = ["netem", "delay", format_time_ms(spec.one_way_delay_ms)]
    if spec.jitter_ms:
        netem.append(format_time_ms(spec.jitter_ms))
    netem += ["loss", f"{spec.loss_fraction * 100:g}%", "limit", str(netem_limit_packets(spec))]
    return [
        ["tc", "-n", ns, "class", "change", "dev", dev, "parent", "1:", "classid", f"1:{minor}",
         "htb", "rate", rate, "ceil", rate],
        ["tc", "-n", ns, "qdisc", "change", "dev", dev, "parent", f"1:{minor}", "handle", f"{minor}:", *netem],
    ]


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
    lines.append("# links")
    lines += [shlex.join(cmd) for cmd in link_commands(plan)]
    for node in plan.nodes:
        lines.append(f"# egress shaping of {node.name}")
        lines += [shlex.join(cmd) for cmd in shaping_commands(plan, node)]
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


class CommandFailed(RuntimeError):
    pass


def run_commands(cmds: list[list[str]]) -> None:
    """Execute commands in order; stop at the first failure with its stderr (never ignore an error)."""
    for cmd in cmds:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise CommandFailed(f"{shlex.join(cmd)}: {result.stderr.strip() or result.returncode}")


@register
class TcBackend(Backend):
    """Kernel shaping: htb per destination + netem leaves on veth links to a bridge."""

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
            run_commands(link_commands(self.plan))
            for node in self.plan.nodes:
                run_commands(shaping_commands(self.plan, node))
            self.write_state()
        except BaseException:
            self.down()
            raise

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        for src in self.plan.nodes:
            for dst in self.plan.nodes:
                if src is not dst and src.region == src_region and dst.region == dst_region:
                    run_commands(change_commands(self.plan, src, dst, spec))

    def down(self) -> None:
        netns.remove_nodes(self.plan)
        netns.remove_namespace(core_namespace(self.plan))  # takes the bridge and veth peers with it
        clear_state(self.plan.prefix)
