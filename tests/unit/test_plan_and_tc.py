"""The plan (names, addresses, queues, buffers) and the exact tc script for a 3-node matrix."""

import textwrap

import pytest

from emulator.backends import tc
from emulator.plan import Plan, bdp_bytes, make_plan
from emulator.topology import topology_from_dict

THREE_NODES = {
    "name": "tri",
    "address_pool": "10.99.0.0/24",
    "regions": {"x": {"nodes": 1}, "y": {"nodes": 1}, "z": {"nodes": 1}},
    "links": [
        {"between": ["x", "y"], "rtt": "20ms", "rate": "100Mbit"},
        {"between": ["x", "z"], "rtt": "100ms", "rate": "1Gbit", "loss": "1%"},
        {"from": "y", "to": "z", "delay": "5ms", "rate": "10Mbit", "jitter": "1ms"},
        {"from": "z", "to": "y", "delay": "7ms", "rate": "20Mbit"},
    ],
}


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wbt")
    return make_plan(topology_from_dict(THREE_NODES))


def test_plan_names_addresses_and_roundtrip(plan):
    assert [n.name for n in plan.nodes] == ["x-0", "y-0", "z-0"]
    assert [n.namespace for n in plan.nodes] == ["wbt-x-0", "wbt-y-0", "wbt-z-0"]
    assert [n.address for n in plan.nodes] == ["10.99.0.1", "10.99.0.2", "10.99.0.3"]
    assert Plan.from_json(plan.to_json()) == plan
    assert "10.99.0.3\tz-0" in plan.hosts_file()


def test_queue_and_buffers_follow_bdp(plan):
    xz = plan.link(plan.node("x-0"), plan.node("z-0"))
    assert bdp_bytes(xz) == 12_500_000  # 1 Gbit/s * 100 ms / 8
    assert xz.queue_bytes == 12_500_000
    # 4 x the largest BDP (50 MB) rounded up to 6 MiB (Linux's default) times a power of two
    assert plan.tcp_buffer_max_bytes == 6 * 1024 * 1024 * 8
    assert plan.sysctls()["net.ipv4.tcp_rmem"] == f"4096 131072 {plan.tcp_buffer_max_bytes}"


def test_prefix_is_validated(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "Bad-Prefix!")
    with pytest.raises(ValueError, match="WANBENCH_PREFIX"):
        make_plan(topology_from_dict(THREE_NODES))


def test_exact_tc_script_for_three_nodes(plan):
    lines = [" ".join(cmd) for cmd in tc.shaping_commands(plan, plan.node("y-0"))]
    assert lines == [
        "tc -n wbt-y-0 qdisc add dev eth0 root handle 1: htb default 1",
        "tc -n wbt-y-0 class add dev eth0 parent 1: classid 1:1 htb rate 100Gbit",
        "tc -n wbt-y-0 class add dev eth0 parent 1: classid 1:a htb rate 100Mbit ceil 100Mbit",
        "tc -n wbt-y-0 qdisc add dev eth0 parent 1:a handle a: netem delay 10ms limit 1000",
        "tc -n wbt-y-0 filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.99.0.1/32 flowid 1:a",
        "tc -n wbt-y-0 class add dev eth0 parent 1: classid 1:c htb rate 10Mbit ceil 10Mbit",
        "tc -n wbt-y-0 qdisc add dev eth0 parent 1:c handle c: netem delay 5ms 1ms limit 1000",
        "tc -n wbt-y-0 filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.99.0.3/32 flowid 1:c",
    ]
    x_lines = [" ".join(cmd) for cmd in tc.shaping_commands(plan, plan.node("x-0"))]
    # 1 Gbit/s, 50 ms one-way: 6.25 MB in flight + 12.5 MB queue = 12500 packets of 1500 B
    assert "tc -n wbt-x-0 qdisc add dev eth0 parent 1:c handle c: netem delay 50ms loss 1% limit 12500" in x_lines


def test_link_commands_wire_every_node_to_the_core_bridge(plan):
    lines = [" ".join(cmd) for cmd in tc.link_commands(plan)]
    assert lines[:4] == [
        "ip netns add wbt-core",
        "ip -n wbt-core link set lo up",
        "ip -n wbt-core link add wbtbr0 type bridge",
        "ip -n wbt-core link set wbtbr0 up",
    ]
    assert "ip -n wbt-core link add wbtv2 type veth peer name eth0 netns wbt-z-0" in lines
    assert "ip -n wbt-z-0 addr add 10.99.0.3/24 dev eth0" in lines
    assert len(lines) == 4 + 4 * 3


def test_dry_run_script_is_the_commands(plan):
    text = tc.script(plan)
    assert text.startswith("#!/bin/sh\n")
    for cmd in tc.link_commands(plan) + tc.shaping_commands(plan, plan.node("z-0")):
        assert " ".join(cmd) in text


def test_link_change_commands_for_faults(plan):
    from dataclasses import replace

    x, z = plan.node("x-0"), plan.node("z-0")
    down = [" ".join(c) for c in tc.change_commands(plan, x, z, None)]
    assert down == [
        "tc -n wbt-x-0 class change dev eth0 parent 1: classid 1:c htb rate 1Gbit ceil 1Gbit",
        "tc -n wbt-x-0 qdisc change dev eth0 parent 1:c handle c: netem delay 50ms loss 100% limit 12500",
    ]
    slower = replace(plan.link(x, z), rate_bit_s=10e6, one_way_delay_ms=80.0)
    lines = [" ".join(c) for c in tc.change_commands(plan, x, z, slower)]
    assert lines[0].endswith("htb rate 10Mbit ceil 10Mbit")
    assert "netem delay 80ms loss 1% limit" in lines[1]
