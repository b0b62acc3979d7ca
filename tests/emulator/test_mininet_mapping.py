"""Mininet backend, pure parts: names, driver spec, tc batch, the delay check and its message."""

from pathlib import Path

import pytest

from emulator.backends import mininet, tc
from emulator.backends.base import Backend
from emulator.plan import make_plan
from emulator.topology import load_topology, topology_from_dict

ROOT = Path(__file__).resolve().parents[2]
IFNAMSIZ = 15  # the kernel's interface name limit, without the terminating NUL

from tests.emulator.test_plan_and_tc import THREE_NODES  # noqa: E402  (one 3-node matrix for both tc users)


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wbmn")
    return make_plan(topology_from_dict(THREE_NODES))


@pytest.fixture
def aws(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wbmn")
    return make_plan(load_topology(ROOT / "topologies" / "aws-4region.yaml"))


def test_names_fit_ifnamsiz_for_the_longest_prefix_and_largest_plan(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "abcdef")  # 6 characters, the longest allowed
    big = make_plan(topology_from_dict({"name": "big", "regions": {"r": {"nodes": 1024}, "s": {"nodes": 1024},
                                                                    "t": {"nodes": 1024}, "u": {"nodes": 1024}},
                                        "links": [{"between": [a, b], "rtt": "1ms"} for a, b in
                                                  [("r", "s"), ("r", "t"), ("r", "u"), ("s", "t"), ("s", "u"), ("t", "u")]]}))
    last = big.nodes[-1]
    assert last.rank == 4095
    assert mininet.port_name(big, last) == "abcdefs0-4095"
    assert len(mininet.port_name(big, last)) <= IFNAMSIZ
    assert len(mininet.host_name(big, last)) <= IFNAMSIZ
    assert len(mininet.switch_name(big)) <= IFNAMSIZ


def test_driver_spec_has_one_host_per_node_with_plan_addresses(aws):
    spec = mininet.driver_spec(aws)
    assert spec["switch"] == "wbmns0"
    assert spec["hosts"][0] == {"name": "wbmnh0", "ip": "10.201.0.1/16", "intf": "eth0", "port": "wbmns0-0"}
    assert [h["ip"] for h in spec["hosts"]] == [f"{n.address}/16" for n in aws.nodes]
    # LinuxBridge.start only enslaves interfaces whose name contains the bridge's name
    assert all(spec["switch"] in h["port"] for h in spec["hosts"])
    assert len({h["port"] for h in spec["hosts"]}) == len(aws.nodes)


def test_shaping_batch_is_the_tc_backend_layout_without_the_tc_n_head(plan):
    node = plan.node("y-0")
    batch = mininet.shaping_batch(plan, node).splitlines()
    assert batch == [" ".join(cmd) for cmd in tc.delay_stage(plan, node)]
    assert batch[0] == "qdisc add dev eth0 root handle 1: htb default 1"
    # y -> z: one-way 5 ms with 1 ms jitter (kept in order by a netem rate), only for z's address
    assert "qdisc add dev eth0 parent 1:c handle c: netem delay 5ms 1ms rate 100Mbit limit 4214" in batch
    assert ("filter add dev eth0 parent 1: protocol ip prio 1 u32 match ip dst 10.99.0.3/32 flowid 1:c"
            in batch)


def test_bottleneck_batch_shapes_the_switch_ports(plan):
    lines = mininet.bottleneck_batch(plan).splitlines()
    port_z = mininet.port_name(plan, plan.node("z-0"))
    assert lines == [" ".join(cmd) for node in plan.nodes
                     for cmd in tc.bottleneck_stage(plan, node, mininet.port_name(plan, node))]
    # y -> z at 10 Mbit/s on the port that delivers to z, classified by y's address
    assert any(line.startswith(f"class add dev {port_z} parent 1: classid 1:b htb rate 10Mbit ceil 10Mbit")
               for line in lines)
    assert f"filter add dev {port_z} parent 1: protocol ip prio 1 u32 match ip src 10.99.0.2/32 flowid 1:b" in lines


def test_check_pair_is_the_largest_rtt(aws):
    src, dst = mininet.check_pair(aws)
    assert (src.name, dst.name) == ("london-0", "tokyo-0")
    assert mininet.expected_rtt_ms(aws, src, dst) == pytest.approx((215.7, 215.7))


def test_expected_rtt_is_asymmetric_sum_and_jitter_lowers_the_floor(plan):
    y, z = plan.node("y-0"), plan.node("z-0")
    rtt, lowest = mininet.expected_rtt_ms(plan, y, z)
    assert rtt == pytest.approx(12.0)    # 5 ms there + 7 ms back
    assert lowest == pytest.approx(11.0)  # minus y->z's 1 ms jitter


def test_parse_ping_output():
    output = """PING 10.201.0.2 (10.201.0.2) 56(84) bytes of data.
64 bytes from 10.201.0.2: icmp_seq=1 ttl=64 time=216 ms
64 bytes from 10.201.0.2: icmp_seq=2 ttl=64 time=215.8 ms
64 bytes from 10.201.0.2: icmp_seq=3 ttl=64 time=0.031 ms

--- 10.201.0.2 ping statistics ---
3 packets transmitted, 3 received, 0% packet loss, time 401ms
rtt min/avg/max/mdev = 0.031/143.9/216/101.7 ms
"""
    assert mininet.parse_ping_rtts_ms(output) == [216.0, 215.8, 0.031]
    assert mininet.parse_ping_rtts_ms("3 packets transmitted, 0 received, 100% packet loss") == []


@pytest.mark.parametrize("lowest, measured, applied", [
    (215.7, 0.05, False),   # no netem: the bare veth round trip
    (215.7, 216.3, True),
    (215.7, 194.2, True),   # just above 90%
    (215.7, 194.0, False),  # just below
    (0.1, 0.03, True),      # below 1 ms a ping cannot decide; tc's error decides instead
])
def test_delay_applied(lowest, measured, applied):
    assert mininet.delay_applied(lowest, measured) is applied


def test_no_delay_message_names_netem_and_the_fix(aws):
    src, dst = mininet.check_pair(aws)
    errors = {"london-0": "Error: Specified qdisc kind is unknown. Command failed -:4"}
    assert mininet.no_delay_message(src, dst, 215.7, 0.05, errors) == (
        "mininet backend: the kernel has no sch_netem, the delay was not applied (measured 0.05 ms "
        "for 215.7 ms, london-0 -> tokyo-0 -> london-0); use --backend tun")
    other = mininet.no_delay_message(src, dst, 215.7, 0.05, {})
    assert other.startswith("mininet backend: the delay was not applied (measured 0.05 ms")
    assert "sch_netem" not in other


def test_patterns_match_only_our_objects():
    links = mininet.root_link_pattern("wbmn")
    assert all(links.match(n) for n in ["wbmns0", "wbmns0-0", "wbmns0-31", "wbmnh7"])
    # other prefixes, the tc backend's bridge and veths, anything else
    assert not any(links.match(n) for n in ["wbmnxs0", "wbmns0x", "wbmnbr0", "wbmnv3", "eth0", "wbmn-core"])
    shells = mininet.shell_pattern("wbmn")
    assert shells.search("bash --norc --noediting -is mininet:wbmnh12")
    assert shells.search("bash --norc --noediting -is mininet:wbmns0")
    assert not shells.search("bash --norc --noediting -is mininet:wbmnxh1")
    assert not shells.search("bash --norc --noediting -is mininet:h1")


def test_driver_command_line_is_what_clean_looks_for(monkeypatch):
    argv = mininet.driver_argv("serve", "wbmn")
    line = " ".join(argv)
    # emulator.clean.our_background_pids: the state folder with a slash, and an `emulator.` module
    assert f"{Backend.state_dir('wbmn')}/" in line
    assert "emulator." in line
    assert argv[1] == "-I"  # the venv's PYTHONPATH must not leak into the system Python
    assert argv[2].endswith("emulator/backends/mininet_driver.py")


def test_check_available_says_how_to_fix(monkeypatch):
    from emulator.backends.base import BackendUnavailable

    monkeypatch.setattr(mininet.os, "geteuid", lambda: 1000)
    with pytest.raises(BackendUnavailable, match="needs root.*sudo"):
        mininet.MininetBackend.check_available()

    monkeypatch.setattr(mininet.os, "geteuid", lambda: 0)
    monkeypatch.setattr(mininet.shutil, "which", lambda tool: None if tool == "brctl" else f"/usr/bin/{tool}")
    with pytest.raises(BackendUnavailable, match="`brctl` not found; apt-get install bridge-utils"):
        mininet.MininetBackend.check_available()

    monkeypatch.setattr(mininet.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(mininet, "MININET_PYTHON", "/nonexistent/python3")
    with pytest.raises(BackendUnavailable, match="cannot import mininet.*apt-get install mininet bridge-utils"):
        mininet.MininetBackend.check_available()
