"""Node sysctls on a real network (root): what `node_sysctls:` sets is what `sysctl` shows inside
every node through `wanbench exec`, on tun and tc, and the host keeps its own; a congestion control
the kernel lacks stops `up` before any node exists, naming it."""

import uuid
from pathlib import Path

import pytest

from emulator import netns
from emulator.backends.tun import TunBackend
from emulator.clean import clean
from emulator.plan import make_plan
from emulator.topology import load_topology
from tests.conftest import run_wanbench

pytestmark = pytest.mark.integration

TOPOLOGY = """
name: sysctls
address_pool: 10.246.0.0/24
regions: {london: {nodes: 1}, tokyo: {nodes: 1}}
links: [{between: [london, tokyo], rtt: 20ms, rate: 100Mbit}]
node_sysctls: {net.ipv4.tcp_slow_start_after_idle: 0, net.ipv4.tcp_notsent_lowat: 131072, %s}
"""
SSAI = "net.ipv4.tcp_slow_start_after_idle"


@pytest.fixture
def prefix(monkeypatch):
    value = "wbs" + uuid.uuid4().hex[:3]
    monkeypatch.setenv("WANBENCH_PREFIX", value)
    yield value
    clean(value)


def host_value(key):
    return (Path("/proc/sys") / key.replace(".", "/")).read_text().split()


@pytest.mark.parametrize("backend", ["tun", "tc", "mininet"])
def test_sysctl_inside_every_node_shows_the_value(prefix, write_yaml, backend):
    import emulator.backends.mininet  # noqa: F401  (registers itself)
    from emulator.backends import REGISTRY, BackendUnavailable

    try:
        REGISTRY[backend].check_available()
        if backend == "mininet":  # it shapes with netem too, and says so only once built
            REGISTRY["tc"].check_available()
    except BackendUnavailable as exc:
        pytest.skip(f"{backend} backend unavailable here: {exc}")
    host = host_value(SSAI)
    congestion = "reno" if host_value("net.ipv4.tcp_congestion_control") != ["reno"] else "bbr"
    path = write_yaml(TOPOLOGY % f"net.ipv4.tcp_congestion_control: {congestion}")
    run_wanbench("up", path, "--backend", backend, timeout=120)
    try:
        for node in ("london-0", "tokyo-0"):
            shown = run_wanbench("exec", node, "--", "sysctl", SSAI, "net.ipv4.tcp_notsent_lowat",
                                 "net.ipv4.tcp_congestion_control").stdout
            assert shown.splitlines() == [f"{SSAI} = 0", "net.ipv4.tcp_notsent_lowat = 131072",
                                          f"net.ipv4.tcp_congestion_control = {congestion}"]
    finally:
        run_wanbench("down", timeout=120)
    assert host_value(SSAI) == host  # per namespace: the host's own is untouched


def test_a_congestion_control_the_kernel_lacks_is_refused_before_building(prefix, write_yaml):
    plan = make_plan(load_topology(write_yaml(TOPOLOGY % "net.ipv4.tcp_congestion_control: nosuchcc")))
    with pytest.raises(netns.SystemCheckError, match=r"no congestion control 'nosuchcc'.*modprobe tcp_nosuchcc"):
        TunBackend(plan).up()
    assert netns.list_namespaces(prefix) == []
