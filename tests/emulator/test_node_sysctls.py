"""Node sysctls without root: `node_sysctls:` checked (file + field in a one-line error), a
scenario's overriding the topology's key by key, carried by the plan to every backend (and to the
dry-run script), and the simulator's slow start after idle against its closed form."""

import json

import numpy as np
import pytest

from emulator.backends import tc
from emulator.plan import Plan, make_plan
from emulator.schema import ConfigError
from emulator.simnet import INITIAL_WINDOW_SEGMENTS, MSS_BYTES, RTO_MIN_S, FluidNetwork
from emulator.topology import load_topology
from harness.scenario import load_scenario

BASE = """
name: t
regions: {london: {nodes: 1}, tokyo: {nodes: 1}}
links: [{between: [london, tokyo], rtt: 200ms, rate: 1Gbit}]
"""
SSAI = "net.ipv4.tcp_slow_start_after_idle"


def test_topology_sysctls_are_checked_and_carried_by_the_plan(write_yaml):
    topology = load_topology(write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 0, "
                                        "net.ipv4.tcp_congestion_control: reno, net.ipv4.tcp_wmem: [4096, 16KiB, 64MiB]}\n"))
    plan = make_plan(topology)
    assert plan.node_sysctls == {SSAI: "0", "net.ipv4.tcp_congestion_control": "reno",
                                 "net.ipv4.tcp_wmem": "4096 16384 67108864"}
    # the user's buffers win over the ones sized for the BDP; the others stay
    assert plan.sysctls()["net.ipv4.tcp_wmem"] == "4096 16384 67108864"
    assert plan.sysctls()["net.ipv4.tcp_rmem"] == f"4096 131072 {plan.tcp_buffer_max_bytes}"
    assert plan.sysctls()[SSAI] == "0" and not plan.slow_start_after_idle()
    assert Plan.from_json(plan.to_json()).node_sysctls == plan.node_sysctls
    # the dry-run script sets them in every node
    script = tc.script(plan)
    for node in plan.nodes:
        assert f"ip netns exec {node.namespace} sysctl -q -w {SSAI}=0" in script


def test_without_node_sysctls_nothing_changes(write_yaml):
    plan = make_plan(load_topology(write_yaml(BASE)))
    assert plan.node_sysctls == {} and set(plan.sysctls()) == {"net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}
    assert plan.slow_start_after_idle()
    # a plan saved before node_sysctls existed still loads
    data = json.loads(plan.to_json())
    del data["node_sysctls"]
    assert Plan.from_json(json.dumps(data)).node_sysctls == {}


@pytest.mark.parametrize("sysctls, field, words", [
    ("{net.ipv4.tcp_slow_start_after_idle: 2}", "node_sysctls", "tcp_slow_start_after_idle: expected one of 0, 1"),
    ("{net.ipv4.tcp_slow_start_after_idle: 'no'}", "node_sysctls", "expected one of 0, 1"),
    ("{net.ipv4.tcp_slow_start_after_idle: '0'}", "node_sysctls", "got '0' (a number: write it without quotes)"),
    ("{kernel.pid_max: 100}", "node_sysctls", "not a per-namespace net.* sysctl"),
    ("{net.core.rmem_max: 100}", "node_sysctls", "not one wanbench knows"),
    ("{net.ipv4.tcp_rmem: 4096 131072}", "node_sysctls", "three sizes"),
    ("{net.ipv4.tcp_rmem: 9000 4096 1000000}", "node_sysctls", "min <= default <= max"),
    ("{net.ipv4.tcp_congestion_control: 'BB R'}", "node_sysctls", "congestion control's name"),
    ("[1, 2]", "node_sysctls", "expected a mapping"),
])
def test_a_bad_key_or_value_is_one_line_naming_file_and_field(write_yaml, sysctls, field, words):
    path = write_yaml(BASE + f"node_sysctls: {sysctls}\n")
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {field}: ") and words in message and "\n" not in message


SCENARIO = """
name: s
topology: topo.yaml
backend: sim
workload: {{model: {{name: mlp}}, dataset: {{name: digits}}}}
algorithms: [{{name: sync}}]
{extra}
"""


def test_a_scenarios_sysctls_override_the_topologys_key_by_key(write_yaml):
    write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 0, net.ipv4.tcp_no_metrics_save: 1}\n")
    scenario = load_scenario(write_yaml(SCENARIO.format(extra="node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 1}"),
                                        "s.yaml"))
    plan = make_plan(scenario.topology)
    assert plan.node_sysctls == {SSAI: "1", "net.ipv4.tcp_no_metrics_save": "1"}
    bad = write_yaml(SCENARIO.format(extra="node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 3}"), "bad.yaml")
    with pytest.raises(ConfigError, match=r"bad.yaml: node_sysctls: net.ipv4.tcp_slow_start_after_idle: expected"):
        load_scenario(bad)


def two_nodes(slow_start_after_idle, rtt_s=0.2, rate_bytes=125e6):
    lat = np.array([[0.0, rtt_s / 2], [rtt_s / 2, 0.0]])
    return FluidNetwork(latency_s=lat, rate=np.full((2, 2), rate_bytes), jitter_s=np.zeros((2, 2)),
                        loss=np.zeros((2, 2)), tcp_window=1e12, region_of=("a", "b"),
                        slow_start_after_idle=slow_start_after_idle)


@pytest.mark.parametrize("idle_rtos", [1, 3, 10])
def test_sim_slow_start_after_idle_against_the_closed_form(idle_rtos):
    """A connection opened to W = 160 segments (4 flights from 10), then idle for k RTOs, sends S
    segments. On: the window is max(10, W / 2^k) and the message takes ceil(log2(S / w + 1)) - 1
    round trips more than one flight; off: the window stays W, no round trip more. Both pay the
    same pacing of a window after idleness ((min(S, 20) - 1) / 20 RTT)."""
    rtt, segments = 0.2, 150
    paced = (min(segments, 2 * INITIAL_WINDOW_SEGMENTS) - 1) / (2 * INITIAL_WINDOW_SEGMENTS) * rtt
    extra = {}
    for on in (True, False):
        net = two_nodes(on, rtt_s=rtt)
        first = net.slow_start_s(0, 1, 100 * MSS_BYTES, 0.0)[0]   # 100 segments from 10: 4 flights
        assert net._cwnd[0, 1] == 160
        idle_from = first
        start = idle_from + idle_rtos * (rtt + RTO_MIN_S) + 1e-6
        extra[on] = net.slow_start_s(0, 1, segments * MSS_BYTES, start)[0]
    window = max(INITIAL_WINDOW_SEGMENTS, 160 / 2 ** idle_rtos)
    ramp = (np.ceil(np.log2(segments / window + 1)) - 1) * rtt
    assert extra[True] == pytest.approx(ramp + paced)
    assert extra[False] == pytest.approx(paced)
    assert extra[True] > extra[False]


def test_sim_takes_the_setting_from_the_plan(write_yaml):
    off = make_plan(load_topology(write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 0}\n")))
    on = make_plan(load_topology(write_yaml(BASE, "on.yaml")))
    assert not FluidNetwork.from_plan(off).slow_start_after_idle
    assert FluidNetwork.from_plan(on).slow_start_after_idle


def test_job_record_reads_every_key_the_plan_sets(write_yaml, monkeypatch):
    """harness.byo.node_stack reads the plan's keys in the nodes, node_sysctls included."""
    from harness import byo

    plan = make_plan(load_topology(write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_notsent_lowat: 131072}\n")))
    asked = []

    class Done:
        def __init__(self, argv, **_):
            asked.append(argv)

        def communicate(self, timeout=None):
            return "net.ipv4.tcp_notsent_lowat = 131072\n", ""

    monkeypatch.setattr(byo.subprocess, "Popen", Done)
    monkeypatch.setattr("emulator.netns.exec_argv", lambda node, argv, share=(): argv)
    stack = byo.node_stack(plan)
    assert all("net.ipv4.tcp_notsent_lowat" in argv and SSAI in argv for argv in asked) and len(asked) == 2
    assert stack["sysctls"]["net.ipv4.tcp_notsent_lowat"] == "131072"


def fake_proc(tmp_path, available, allowed):
    ipv4 = tmp_path / "net" / "ipv4"
    ipv4.mkdir(parents=True)
    (ipv4 / "tcp_available_congestion_control").write_text(available + "\n")
    (ipv4 / "tcp_allowed_congestion_control").write_text(allowed + "\n")
    return tmp_path


def test_a_congestion_control_is_checked_against_the_kernel_before_building(tmp_path, write_yaml, monkeypatch):
    from emulator import netns

    monkeypatch.setattr(netns, "PROC_SYS", fake_proc(tmp_path / "proc", "reno bbr cubic", "reno bbr"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no modprobe to run: what is missing stays missing
    monkeypatch.setattr(netns.shutil, "which", lambda *a, **k: None)

    def plan_with(name):
        return make_plan(load_topology(write_yaml(BASE + f"node_sysctls: {{net.ipv4.tcp_congestion_control: {name}}}\n",
                                                  f"{name}.yaml")))

    netns.check_node_sysctls(plan_with("bbr"))  # available and allowed: nothing to say
    netns.check_node_sysctls(make_plan(load_topology(write_yaml(BASE, "none.yaml"))))  # none asked for
    with pytest.raises(netns.SystemCheckError, match=r"node_sysctls.net.ipv4.tcp_congestion_control: this kernel "
                                                     r"has no congestion control 'vegas' \(available: reno bbr cubic"):
        netns.check_node_sysctls(plan_with("vegas"))
    with pytest.raises(netns.SystemCheckError, match=r"'cubic' is available but the host does not allow it.*"
                                                     r"tcp_allowed_congestion_control='reno bbr cubic'"):
        netns.check_node_sysctls(plan_with("cubic"))


def test_bbr_has_no_restart_after_idle(write_yaml):
    """Linux skips the restart after idle for BBR (tcp_slow_start_after_idle_check returns early
    for a congestion control with cong_control), so the sim's connections keep their windows."""
    plan = make_plan(load_topology(write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_congestion_control: bbr}\n")))
    assert not plan.slow_start_after_idle()
    plan = make_plan(load_topology(write_yaml(BASE + "node_sysctls: {net.ipv4.tcp_congestion_control: cubic}\n")))
    assert plan.slow_start_after_idle()
