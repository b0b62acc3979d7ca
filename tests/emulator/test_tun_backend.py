"""The tun backend end to end: namespaces, delay line, real RTTs, real TCP throughput, clean teardown.

Needs root and /dev/net/tun. Every object carries a test-only prefix, set by the fixture, and the
fixture tears down in `finally` whatever happens.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
# Per-process prefixes, so two runs of this file at once (CI and a developer) never meet.
TEST_PREFIX = f"tu{os.getpid() % 10000:04d}"
DOWN_TEST_PREFIX = f"td{os.getpid() % 10000:04d}"
POOL = "10.213.0.0/24"

if os.geteuid() != 0:
    pytest.skip("needs root (namespaces, TUN devices)", allow_module_level=True)
if not Path("/dev/net/tun").exists():
    pytest.skip("needs /dev/net/tun (modprobe tun)", allow_module_level=True)

from emulator import netns  # noqa: E402
from emulator.backends.base import read_state  # noqa: E402
from emulator.backends.tun import TunBackend, is_our_delayline  # noqa: E402
from emulator.delayline.device import device_name  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.processes import stop as stop_processes  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from tests.conftest import network_up, prefix_env  # noqa: E402

# One-way delays (ms) and rates (Mbit/s) per region pair.
TOPOLOGY = f"""
name: tun-test
address_pool: {POOL}
regions:
  aa: {{nodes: 1}}
  bb: {{nodes: 1}}
  cc: {{nodes: 1}}
intra_region: {{delay: 0.05ms, rate: 1Gbit}}
links:
  - {{between: [aa, bb], delay: 10ms, rate: 100Mbit}}
  - {{between: [aa, cc], delay: 20ms, rate: 50Mbit, loss: 10%}}
  - {{between: [bb, cc], delay: 30ms, rate: 200Mbit}}
"""


def _ns_run(node, argv, **kwargs):
    return subprocess.run(netns.exec_argv(node, argv), capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """An up 3-node network under the test prefix; always torn down."""
    path = tmp_path_factory.mktemp("topo") / "tun-test.yaml"
    path.write_text(TOPOLOGY)
    with prefix_env(TEST_PREFIX), network_up(TunBackend(make_plan(load_topology(path)))) as backend:
        yield backend


class _Server:
    """A process started inside a node's namespace, terminated by its pid."""

    def __init__(self, node, argv):
        self.process = subprocess.Popen(netns.exec_argv(node, argv), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)

    def stop(self):
        stop_processes([self.process])


def _probe(network, src, dst, count=60, interval_ms=5.0, port=9100):
    server = _Server(dst, [sys.executable, "-m", "emulator.measure.probe", "server", "--port", str(port)])
    try:
        assert "probe server" in server.process.stdout.readline()
        result = _ns_run(src, [sys.executable, "-m", "emulator.measure.probe", "client", "--host",
                               dst.address, "--port", str(port), "--count", str(count),
                               "--interval-ms", str(interval_ms), "--json"], cwd=REPO, timeout=30)
    finally:
        server.stop()
    return json.loads(result.stdout)


def test_devices_carry_node_addresses(network):
    plan = network.plan
    assert netns.list_namespaces(TEST_PREFIX) == sorted(n.namespace for n in plan.nodes)
    for node in plan.nodes:
        out = _ns_run(node, ["ip", "-o", "-4", "addr", "show", "dev", device_name(TEST_PREFIX)]).stdout
        assert f"{node.address}/{plan.prefix_length}" in out
        assert "mtu 1500" in _ns_run(node, ["ip", "link", "show", device_name(TEST_PREFIX)]).stdout
    state, _ = read_state(TEST_PREFIX)
    assert is_our_delayline(state["delayline_pid"], TEST_PREFIX)


@pytest.mark.parametrize("src_name,dst_name,one_way_ms", [
    ("aa-0", "bb-0", 10.0), ("bb-0", "cc-0", 30.0), ("cc-0", "aa-0", 20.0)])
def test_round_trip_time_is_twice_the_one_way_delay(network, src_name, dst_name, one_way_ms):
    plan = network.plan
    result = _probe(network, plan.node(src_name), plan.node(dst_name))
    assert result["received"] > 0
    # Both directions delayed, and never early; the median's distance from the spec is the delay
    # line's accuracy, measured by bench/bench_delayline.py (rtt cases): here it only has to stay
    # under 1.5x, which a machine whose cores other jobs keep busy still does (a delay line that
    # could not get SCHED_FIFO there read 1.9 ms over at the median).
    assert result["min_ms"] >= 2 * one_way_ms - 0.05, result
    assert result["p50_ms"] < 1.5 * 2 * one_way_ms, result


def test_loss_matches_the_configured_fraction(network):
    plan = network.plan
    count = 400
    result = _probe(network, plan.node("aa-0"), plan.node("cc-0"), count=count, interval_ms=2.0, port=9101)
    # 10% loss each way: a probe and its echo both survive with probability 0.81.
    expected_lost = count * (1 - 0.9 * 0.9)
    sigma = (count * 0.19 * 0.81) ** 0.5
    assert abs(result["lost"] - expected_lost) < 4 * sigma, result


def test_tcp_throughput_matches_the_rate(network):
    plan = network.plan
    server_node, client_node = plan.node("bb-0"), plan.node("aa-0")
    server = _Server(server_node, ["iperf3", "-s", "-1", "-p", "5299"])
    try:
        time.sleep(0.3)
        out = _ns_run(client_node, ["iperf3", "-c", server_node.address, "-p", "5299", "-t", "3",
                                    "-O", "1", "-J"], timeout=30)
    finally:
        server.stop()
    report = json.loads(out.stdout)
    received_bit_s = report["end"]["sum_received"]["bits_per_second"]
    rate_bit_s = plan.link(client_node, server_node).rate_bit_s
    # TCP goodput can reach at most 1448/1500 of the rate: the link carries IP and TCP headers.
    assert 0.85 * rate_bit_s <= received_bit_s <= 1.02 * rate_bit_s, received_bit_s

    counters = {(p["src"], p["dst"]): p for p in _counters_after_next_write(network)["pairs"]}
    forward = counters[("aa-0", "bb-0")]
    assert forward["bytes"] >= report["end"]["sum_received"]["bytes"]
    assert forward["packets"] > 0


def _counters_after_next_write(network, timeout_s=3.0):
    path = network.counters_path
    before = path.stat().st_mtime_ns if path.exists() else 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} not rewritten within {timeout_s} s")


def test_counters_count_deliveries_and_unknown_traffic_is_dropped(network):
    plan = network.plan
    status = _counters_after_next_write(network)
    assert status["prefix"] == TEST_PREFIX
    assert len(status["pairs"]) == 6
    assert status["write_errors"] == 0
    # Known traffic on a loss-free pair: each echo and each reply is one packet on its pair's link
    # and one delivery.
    src, dst = plan.node("aa-0"), plan.node("bb-0")
    ping = _ns_run(src, ["ping", "-n", "-q", "-c", "20", "-i", "0.01", dst.address], timeout=30)
    assert " 20 received" in ping.stdout, ping.stdout
    after = _counters_after_next_write(network)
    pairs_before = {(p["src"], p["dst"]): p for p in status["pairs"]}
    pairs_after = {(p["src"], p["dst"]): p for p in after["pairs"]}
    for pair in [("aa-0", "bb-0"), ("bb-0", "aa-0")]:
        assert pairs_after[pair]["packets"] - pairs_before[pair]["packets"] >= 20, pair
    lag = after["lag"]
    assert lag["deliveries"] - status["lag"]["deliveries"] >= 40
    assert 0 <= lag["late_over_1ms"] <= lag["deliveries"]
    # The share of late deliveries is a performance figure, not asserted here:
    # bench/bench_delayline.py's late_deliveries_pct. It depends on the machine: 2.5 % over 1 ms
    # late with both cores busy, half of them where the delay line could not get SCHED_FIFO too.
    assert lag["mean_us"] <= lag["max_us"] and (lag["late_over_1ms"] == 0 or lag["max_us"] > 1000), lag
    # An address of the pool with no node behind it: routed to the device, dropped, counted.
    before = after["unknown_destination"]["aa-0"]
    _ns_run(src, ["ping", "-c", "2", "-i", "0.05", "-W", "0.2", "10.213.0.200"])
    assert _counters_after_next_write(network)["unknown_destination"]["aa-0"] >= before + 2


def test_second_up_is_refused(network):
    with pytest.raises(RuntimeError, match="already up"):
        TunBackend(network.plan).up()


def test_down_removes_everything_and_is_idempotent(tmp_path, monkeypatch):
    """Separate network: up, kill -9 the delay line (devices vanish), down twice."""
    monkeypatch.setenv("WANBENCH_PREFIX", DOWN_TEST_PREFIX)
    path = tmp_path / "two.yaml"
    path.write_text(TOPOLOGY.replace(POOL, "10.214.0.0/24"))
    backend = TunBackend(make_plan(load_topology(path)))
    try:
        backend.up()
        state, _ = read_state(DOWN_TEST_PREFIX)
        pid = state["delayline_pid"]
        node = backend.plan.nodes[0]
        assert device_name(DOWN_TEST_PREFIX) in _ns_run(node, ["ip", "link"]).stdout
        backend.down()
        assert netns.list_namespaces(DOWN_TEST_PREFIX) == []
        assert not Path(f"/proc/{pid}").exists() or not is_our_delayline(pid, DOWN_TEST_PREFIX)
        assert read_state(DOWN_TEST_PREFIX) is None
        backend.down()  # idempotent

        # Crash safety: a killed delay line takes its TUN devices with it.
        backend.up()
        pid = read_state(DOWN_TEST_PREFIX)[0]["delayline_pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while device_name(DOWN_TEST_PREFIX) in _ns_run(node, ["ip", "link"]).stdout:
            assert time.monotonic() < deadline, "TUN device outlived its delay line"
            time.sleep(0.05)
    finally:
        backend.down()
    assert netns.list_namespaces(DOWN_TEST_PREFIX) == []
