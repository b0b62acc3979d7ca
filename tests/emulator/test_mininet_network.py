"""Mininet backend on this machine: without sch_netem `up` must fail clearly and leave nothing behind;
with it, the RTT must be the configured one. Needs root and Debian's mininet + bridge-utils."""

import os
import subprocess
import time
from pathlib import Path

import pytest

from emulator.backends.base import BackendUnavailable, read_state
from emulator.backends.mininet import DRIVER_PATH, DelayNotApplied, MininetBackend, parse_ping_rtts_ms
from emulator.plan import make_plan
from emulator.topology import topology_from_dict

pytestmark = pytest.mark.integration

PREFIX = "wbmn"  # this backend's tests own this prefix; parallel colleagues use others
TWO_REGIONS = {
    "name": "two-regions",
    "regions": {"london": {"nodes": 1}, "tokyo": {"nodes": 1}},
    "links": [{"between": ["london", "tokyo"], "rtt": "215.7ms", "rate": "100Mbit"}],
}


def _unavailable_reason():
    if os.geteuid() != 0:
        return "needs root"
    try:
        MininetBackend.check_available()
    except BackendUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture
def plan(monkeypatch):
    reason = _unavailable_reason()
    if reason:
        pytest.skip(f"mininet backend unavailable: {reason}")
    monkeypatch.setenv("WANBENCH_PREFIX", PREFIX)
    plan = make_plan(topology_from_dict(TWO_REGIONS))
    assert not leftovers(), "objects with our prefix exist before the test; run wanbench clean"
    yield plan
    MininetBackend(plan).down()  # whatever the test did, leave nothing


def leftovers() -> list[str]:
    """Everything named with PREFIX that is still on the system: namespaces, links, processes."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(PREFIX + "-")]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True).stdout
    found += [f"link {line.split()[0]}" for line in links.splitlines() if line.startswith(PREFIX)]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        ours = f"mininet:{PREFIX}" in cmdline or (DRIVER_PATH.name in cmdline and f"/{PREFIX}/" in cmdline)
        if ours and state != "Z":
            found.append(f"process {entry.name}: {cmdline.strip()}")
    if Path(f"/etc/netns/{PREFIX}-london-0").exists():
        found.append("folder /etc/netns/...")
    return found


def test_up_fails_clearly_without_netem_or_delivers_the_rtt(plan):
    """On a kernel without sch_netem: the clear error and a clean system. With it: the real RTT."""
    backend = MininetBackend(plan)
    started = time.monotonic()
    try:
        backend.up()
    except DelayNotApplied as exc:
        message = str(exc)
        assert "the kernel has no sch_netem, the delay was not applied" in message
        assert "for 215.7 ms, london-0 -> tokyo-0 -> london-0" in message
        assert "use --backend tun" in message
        measured_ms = float(message.split("(measured ")[1].split(" ms")[0])
        assert measured_ms < 5.0  # an unshaped veth round trip
        assert leftovers() == []
        assert read_state(PREFIX) is None
    else:
        # netem exists here: node names resolve and the RTT is the configured one
        ping = subprocess.run(["ip", "netns", "exec", f"{PREFIX}-london-0", "ping", "-n", "-c", "3",
                               "-i", "0.2", "tokyo-0"], capture_output=True, text=True, timeout=20)
        rtts = parse_ping_rtts_ms(ping.stdout)
        assert rtts, ping.stdout + ping.stderr
        assert 0.95 * 215.7 <= min(rtts) <= 215.7 + 20.0
        backend.down()
        assert leftovers() == []
    assert time.monotonic() - started < 60


class Unshaped(MininetBackend):
    """Skips shaping and the delay check, to test the network itself on a kernel without netem."""

    def _shape(self):
        return {}

    def _check(self, tc_errors):
        pass


def test_network_layout_exec_and_down_from_another_process(plan):
    """Named namespaces, hosts file, sysctls, state; `down` from a new object (as the CLI does)."""
    Unshaped(plan).up()
    london = plan.node("london-0")
    # the generic exec path of every backend: ip netns exec, with /etc/netns/<ns>/hosts
    ping = subprocess.run(["ip", "netns", "exec", london.namespace, "ping", "-n", "-c", "1", "-W", "2",
                           "tokyo-0"], capture_output=True, text=True, timeout=10)
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert "10.201.0.2" in ping.stdout
    addr = subprocess.run(["ip", "-n", london.namespace, "-br", "addr", "show", "eth0"],
                          capture_output=True, text=True, check=True).stdout
    assert "10.201.0.1/16" in addr
    rmem = subprocess.run(["ip", "netns", "exec", london.namespace, "cat", "/proc/sys/net/ipv4/tcp_rmem"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert int(rmem[2]) == plan.tcp_buffer_max_bytes
    state, _ = read_state(PREFIX)
    assert state["backend"] == "mininet"
    assert set(state["host_pids"]) == {"london-0", "tokyo-0"}
    # nsenter by the recorded PID lands in the same namespace
    inode = os.stat(f"/proc/{state['host_pids']['london-0']}/ns/net").st_ino
    assert os.stat(f"/run/netns/{london.namespace}").st_ino == inode
    assert leftovers()  # something is up

    MininetBackend(plan).down()  # a fresh object, as `wanbench down` in another process
    assert leftovers() == []
    assert read_state(PREFIX) is None
    MininetBackend(plan).down()  # idempotent
    assert leftovers() == []


class InterruptedAfterAttach(MininetBackend):
    """Ctrl-C (a BaseException) after the namespaces are attached, before shaping."""

    def _configure_nodes(self):
        raise KeyboardInterrupt


def test_interrupted_up_tears_everything_down(plan):
    with pytest.raises(KeyboardInterrupt):
        InterruptedAfterAttach(plan).up()
    assert leftovers() == []
    assert read_state(PREFIX) is None


def test_driver_bench_mode_times_plain_mininet_and_leaves_nothing(plan):
    """The reference of bench/bench_updown.py: plain Mininet up and down, timed in the driver."""
    import json

    from emulator.backends.mininet import driver_argv, driver_spec

    spec = {**driver_spec(plan), "repeats": 2}
    result = subprocess.run(driver_argv("bench", PREFIX), input=json.dumps(spec), capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    runs = json.loads(result.stdout)["runs"]
    assert len(runs) == 2
    for run in runs:
        assert 0 < run["up_s"] < 30 and 0 < run["down_s"] < 30
        assert run["total_s"] == pytest.approx(run["up_s"] + run["down_s"])
    assert leftovers() == []
