"""A node's NIC on the tun backend, end to end: two iperf3 senders into one receiver whose NIC is
below the sum of their pairs' rates get, together, the NIC's rate (issue 21 §5).

Needs root and /dev/net/tun; a test-only prefix, torn down in `finally`. The bounds are wide on
purpose (a loaded machine): the point is that the sum follows the NIC, not the pairs.
"""

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TEST_PREFIX = f"wbn{os.getpid() % 1000:03d}"
POOL = "10.213.77.0/24"
NIC_MBIT = 20
PAIR_MBIT = 100

if os.geteuid() != 0:
    pytest.skip("needs root (namespaces, TUN devices)", allow_module_level=True)
if not Path("/dev/net/tun").exists():
    pytest.skip("needs /dev/net/tun (modprobe tun)", allow_module_level=True)

from emulator import netns  # noqa: E402
from emulator.backends.tun import TunBackend  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.processes import stop as stop_processes  # noqa: E402
from emulator.topology import topology_from_dict  # noqa: E402
from tests.conftest import network_up, prefix_env  # noqa: E402

TOPOLOGY = {
    "name": "tun-nic", "address_pool": POOL,
    "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}, "cc": {"nodes": 1, "nic": {"rate": f"{NIC_MBIT}Mbit"}}},
    "defaults": {"delay": "5ms", "rate": f"{PAIR_MBIT}Mbit"},
}


@pytest.fixture(scope="module")
def network():
    with prefix_env(TEST_PREFIX), network_up(TunBackend(make_plan(topology_from_dict(TOPOLOGY)))) as backend:
        yield backend


def test_two_senders_into_one_nic_share_its_rate(network):
    plan = network.plan
    receiver = plan.node("cc-0")
    servers = [subprocess.Popen(netns.exec_argv(receiver, ["iperf3", "-s", "-1", "-p", str(port)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for port in (5301, 5302)]
    try:
        time.sleep(0.5)
        clients = [subprocess.Popen(netns.exec_argv(plan.node(name), [
            "iperf3", "-c", receiver.address, "-p", str(port), "-t", "5", "-O", "1", "-J"]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for name, port in (("aa-0", 5301), ("bb-0", 5302))]
        outputs = [client.communicate(timeout=60)[0] for client in clients]
    finally:
        stop_processes(servers)
    received = [json.loads(out)["end"]["sum_received"]["bits_per_second"] for out in outputs]
    total = sum(received)
    # the pairs alone would carry 2 x 100 Mbit/s (measured here, loaded, with a 10 Gbit/s NIC: 59.5
    # in all, the delay line's own limit); the NIC in lets 20 through (TCP goodput at most 1448/1500
    # of it), shared between the two
    assert 0.6 * NIC_MBIT * 1e6 <= total <= 1.05 * NIC_MBIT * 1e6, received
    assert min(received) >= 0.15 * NIC_MBIT * 1e6, received   # neither sender starved
