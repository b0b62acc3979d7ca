"""The plan (names, addresses, queues, buffers) and the exact tc script for a 3-node matrix."""

import textwrap

import pytest

from emulator.backends import tc
from emulator.plan import Plan, bdp_bytes, make_plan
from emulator.schema import ConfigError
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
    with pytest.raises(ConfigError, match="WANBENCH_PREFIX"):
        make_plan(topology_from_dict(THREE_NODES))


def test_a_prefix_given_is_used_instead_of_the_environment(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "Bad-Prefix!")  # not read when the caller names one
    plan = make_plan(topology_from_dict(THREE_NODES), prefix="wbu")
    assert plan.prefix == "wbu" and [n.namespace for n in plan.nodes] == ["wbu-x-0", "wbu-y-0", "wbu-z-0"]
    with pytest.raises(ConfigError, match="prefix: 'X'"):
        make_plan(topology_from_dict(THREE_NODES), prefix="X")


def test_exact_tc_script_for_three_nodes(plan):
    """The link model: propagation (netem per destination) on the sender's eth0, the bottleneck
    (htb at the pair's rate + bfifo in bytes, per source) on the core side of the receiver's veth."""
    big = "htb rate 100Gbit ceil 100Gbit burst 12500000 cburst 12500000 quantum 65536"
    lines = [" ".join(cmd) for cmd in tc.delay_stage(plan, plan.node("y-0"))]
    assert lines == [
        "qdisc add dev eth0 root handle 1: htb default 1",
        f"class add dev eth0 parent 1: classid 1:1 {big}",
        f"class add dev eth0 parent 1: classid 1:a {big}",
        # in flight 125 KB + queue 256 KiB (the floor), counted as 64-byte packets
        "qdisc add dev eth0 parent 1:a handle a: netem delay 10ms limit 6050",
        "filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.99.0.1/32 flowid 1:a",
        f"class add dev eth0 parent 1: classid 1:c {big}",
        # jitter keeps the pair in order: netem times each packet after the one before (rate 10x)
        "qdisc add dev eth0 parent 1:c handle c: netem delay 5ms 1ms rate 100Mbit limit 4214",
        "filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.99.0.3/32 flowid 1:c",
    ]
    x_lines = [" ".join(cmd) for cmd in tc.delay_stage(plan, plan.node("x-0"))]
    # 1 Gbit/s, 50 ms one-way: 6.25 MB in flight + 12.5 MB queue, counted as 64-byte packets
    assert "qdisc add dev eth0 parent 1:c handle c: netem delay 50ms loss 1% limit 292969" in x_lines

    core = [" ".join(cmd) for cmd in tc.bottleneck_stage(plan, plan.node("z-0"), "wbtv2")]
    assert core == [
        "qdisc add dev wbtv2 root handle 1: htb default 1",
        f"class add dev wbtv2 parent 1: classid 1:1 {big}",
        # x -> z: 1 Gbit/s, burst 1 ms of it; queue one BDP (12.5 MB) in bytes
        "class add dev wbtv2 parent 1: classid 1:a htb rate 1Gbit ceil 1Gbit burst 125000 cburst 125000 quantum 65536",
        "qdisc add dev wbtv2 parent 1:a handle a: bfifo limit 12500000",
        "filter add dev wbtv2 parent 1: protocol ip prio 1 u32 match ip src 10.99.0.1/32 flowid 1:a",
        # y -> z: 10 Mbit/s, 1 ms is 1250 B, under two frames: the floor
        "class add dev wbtv2 parent 1: classid 1:b htb rate 10Mbit ceil 10Mbit burst 3028 cburst 3028 quantum 65536",
        f"qdisc add dev wbtv2 parent 1:b handle b: bfifo limit {plan.link(plan.node('y-0'), plan.node('z-0')).queue_bytes}",
        "filter add dev wbtv2 parent 1: protocol ip prio 1 u32 match ip src 10.99.0.2/32 flowid 1:b",
    ]


def test_one_tc_batch_per_namespace(plan):
    batches = tc.batches(plan)
    assert [ns for ns, _ in batches] == ["wbt-x-0", "wbt-y-0", "wbt-z-0", "wbt-core"]
    core_cmds = dict(batches)["wbt-core"]
    assert len(core_cmds) == 3 * (2 + 3 * 2)  # per node: root + default class, 3 lines per source


def test_link_batches_wire_every_node_to_the_core_bridge(plan):
    batches = tc.link_batches(plan)
    core_ns, core = batches[0]
    assert core_ns == "wbt-core"
    lines = [" ".join(cmd) for cmd in core]
    assert lines[:3] == ["link set lo up", "link add wbtbr0 type bridge", "link set wbtbr0 up"]
    assert "link add wbtv2 type veth peer name eth0 netns wbt-z-0" in lines
    # z -> x loses 1%: z sends wire-sized packets (per-packet loss), y loses nothing
    assert dict(batches)["wbt-z-0"] == [["addr", "add", "10.99.0.3/24", "dev", "eth0"],
                                         ["link", "set", "eth0", "up"],
                                         ["link", "set", "eth0", "gso_max_segs", "1"]]
    assert dict(batches)["wbt-y-0"] == [["addr", "add", "10.99.0.2/24", "dev", "eth0"],
                                         ["link", "set", "eth0", "up"]]
    assert len(batches) == 1 + 3


def test_dry_run_script_is_the_commands(plan):
    text = tc.script(plan)
    assert text.startswith("#!/bin/sh\n")
    assert "tc -n wbt-core -batch - <<'EOF'\n" in text
    for cmd in tc.core_batch(plan) + tc.delay_stage(plan, plan.node("z-0")):
        assert "\n" + " ".join(cmd) + "\n" in text
    # Running the script's batches is running tc.batches: same lines in the same order.
    for namespace, cmds in tc.batches(plan):
        body = "\n".join(" ".join(c) for c in cmds)
        assert f"tc -n {namespace} -batch - <<'EOF'\n{body}\nEOF" in text


def test_link_change_commands_for_faults(plan):
    from dataclasses import replace

    x, z = plan.node("x-0"), plan.node("z-0")
    down = [" ".join(c) for c in tc.change_commands(plan, x, z, None)]
    assert down == [
        "tc -n wbt-x-0 qdisc change dev eth0 parent 1:c handle c: netem delay 50ms loss 100% limit 292969",
        "tc -n wbt-core class change dev wbtv2 parent 1: classid 1:a htb rate 1Gbit ceil 1Gbit "
        "burst 125000 cburst 125000 quantum 65536",
    ]
    slower = replace(plan.link(x, z), rate_bit_s=10e6, one_way_delay_ms=80.0, loss_fraction=0.0)
    lines = [" ".join(c) for c in tc.change_commands(plan, x, z, slower)]
    assert "netem delay 80ms loss 0% limit" in lines[0]  # a link coming back up resets its loss
    assert lines[1].endswith("htb rate 10Mbit ceil 10Mbit burst 3028 cburst 3028 quantum 65536")


def test_pair_counters_from_tc_json(plan):
    """`tc -s -j qdisc show` output (as the guest printed it) -> the tun backend's counter names."""
    core = {"z-0": [{"kind": "htb", "handle": "1:", "bytes": 9, "packets": 1, "drops": 0, "backlog": 0},
                    {"kind": "bfifo", "handle": "a:", "parent": "1:a", "bytes": 3000, "packets": 2,
                     "drops": 5, "backlog": 1500, "qlen": 1}]}
    delay = {"x-0": [{"kind": "netem", "handle": "c:", "parent": "1:c", "bytes": 4500, "packets": 3,
                      "drops": 7, "backlog": 0, "qlen": 4}]}
    rows = {(r["src"], r["dst"]): r for r in tc.pair_counters(plan, core, delay)}
    assert len(rows) == 6
    assert rows[("x-0", "z-0")] == {"src": "x-0", "dst": "z-0", "packets": 2, "bytes": 3000 - 2 * 14,
                                    "drops_queue": 5, "drops_loss": 7, "backlog_bytes": 1500,
                                    "offered_packets": 2 + 5 + 1 + 7 + 4}
    assert rows[("y-0", "z-0")]["packets"] == 0


def test_a_failing_batch_line_is_named_as_a_full_command(monkeypatch):
    import subprocess

    def fake_run(argv, **kwargs):
        return subprocess.CompletedProcess(argv, 1, "", "Error: Specified qdisc kind is unknown.\n"
                                                         "Command failed -:2\n")
    monkeypatch.setattr(subprocess, "run", fake_run)
    cmds = [["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb"],
            ["qdisc", "add", "dev", "eth0", "parent", "1:a", "netem", "delay", "5ms"]]
    with pytest.raises(tc.CommandFailed) as err:
        tc.run_batch("tc", "wbt-x-0", cmds)
    assert str(err.value) == ("tc -n wbt-x-0 qdisc add dev eth0 parent 1:a netem delay 5ms: "
                              "Error: Specified qdisc kind is unknown.")


def test_a_nic_that_can_bind_is_the_parent_of_the_pairs_classes(monkeypatch):
    """y's NIC of 50 Mbit/s is less than its pairs' rates (100 + 10 out, 100 + 20 in): on the
    receiver's port one class 1:2 at the NIC's rate, each source's class under it, guaranteed the
    NIC's share (25 Mbit/s, or its pair's rate if lower) and borrowing up to its pair's rate; on
    y's eth0 the same over its destinations' netem classes, each borrowing up to the NIC. x and z
    keep the tree without NICs (10 Gbit/s each, more than their pairs)."""
    monkeypatch.setenv("WANBENCH_PREFIX", "wbt")
    doc = {**THREE_NODES, "regions": {**THREE_NODES["regions"], "y": {"nodes": 1, "nic": {"rate": "50Mbit"}}}}
    plan = make_plan(topology_from_dict(doc))
    big = "htb rate 100Gbit ceil 100Gbit burst 12500000 cburst 12500000 quantum 65536"
    core = [" ".join(cmd) for cmd in tc.bottleneck_stage(plan, plan.node("y-0"), "wbtv1")]
    assert core[:3] == [
        "qdisc add dev wbtv1 root handle 1: htb default 1",
        f"class add dev wbtv1 parent 1: classid 1:1 {big}",
        "class add dev wbtv1 parent 1: classid 1:2 htb rate 50Mbit ceil 50Mbit burst 6250 cburst 6250 quantum 65536",
    ]
    assert core[3] == ("class add dev wbtv1 parent 1:2 classid 1:a htb rate 25Mbit ceil 100Mbit "
                       "burst 3125 cburst 12500 quantum 65536")
    assert core[6] == ("class add dev wbtv1 parent 1:2 classid 1:c htb rate 20Mbit ceil 20Mbit "
                       "burst 3028 cburst 3028 quantum 65536")
    # the filters still classify at the root; the leaves are the same bfifo queues
    assert core[5].startswith("filter add dev wbtv1 parent 1: ") and core[4].startswith("qdisc add dev wbtv1 parent 1:a ")
    out = [" ".join(cmd) for cmd in tc.delay_stage(plan, plan.node("y-0"))]
    assert out[2] == "class add dev eth0 parent 1: classid 1:2 htb rate 50Mbit ceil 50Mbit burst 6250 cburst 6250 quantum 65536"
    assert out[3] == "class add dev eth0 parent 1:2 classid 1:a htb rate 25Mbit ceil 50Mbit burst 3125 cburst 6250 quantum 65536"
    assert "qdisc add dev eth0 parent 1:a handle a: netem delay 10ms limit" in out[4]
    # a fault's class change keeps the class under the NIC
    change = [" ".join(c) for c in tc.change_commands(plan, plan.node("x-0"), plan.node("y-0"), None)]
    assert change[1] == ("tc -n wbt-core class change dev wbtv1 parent 1:2 classid 1:a htb rate 25Mbit ceil 100Mbit "
                         "burst 3125 cburst 12500 quantum 65536")
    # x (10 Gbit/s NIC, pairs of 100 Mbit/s + 1 Gbit/s): no NIC class
    assert not any("1:2" in " ".join(cmd) for cmd in tc.delay_stage(plan, plan.node("x-0")))
    assert tc.binding_nic(10e9, [1e9, 100e6]) is None and tc.binding_nic(None, [1e12]) is None
    assert tc.binding_nic(50e6, [100e6]) == 50e6
