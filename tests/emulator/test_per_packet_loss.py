"""Loss per wire packet: which nodes segment, and the commands/flags each backend uses (no root)."""

import pytest

from emulator.backends.tc import NODE_IFNAME, link_batches, script, segmentation_command
from emulator.delayline.device import TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, offload_flags
from emulator.plan import make_plan
from emulator.topology import topology_from_dict


@pytest.fixture
def lossy_plan(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wb2u")
    return make_plan(topology_from_dict({
        "name": "lossy", "address_pool": "10.219.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}, "cc": {"nodes": 1}},
        "links": [{"from": "aa", "to": "bb", "delay": "5ms", "rate": "100Mbit", "loss": "1%"},
                  {"from": "bb", "to": "aa", "delay": "5ms", "rate": "100Mbit"},
                  {"between": ["aa", "cc"], "delay": "5ms", "rate": "100Mbit", "loss": "100%"},
                  {"between": ["bb", "cc"], "delay": "5ms", "rate": "100Mbit"}],
    }))


def test_only_nodes_with_a_lossy_outgoing_link_segment(lossy_plan):
    # aa -> bb loses 1%: aa segments. bb loses nothing outgoing. cc's only loss is 100% (a link
    # that is down drops everything whatever the frame size), so segmenting would buy nothing.
    assert [n.name for n in lossy_plan.nodes if lossy_plan.segments_egress(n)] == ["aa-0"]


def test_tc_backend_limits_gso_to_one_segment_on_lossy_nodes(lossy_plan):
    aa = lossy_plan.node("aa-0")
    batches = dict(link_batches(lossy_plan))
    assert segmentation_command() == ["link", "set", NODE_IFNAME, "gso_max_segs", "1"]
    assert [ns for ns, cmds in batches.items() if segmentation_command() in cmds] == [aa.namespace]
    assert f"ip -n {aa.namespace} -batch - <<'EOF'\naddr add 10.219.0.1/24 dev {NODE_IFNAME}\n" \
           f"link set {NODE_IFNAME} up\nlink set {NODE_IFNAME} gso_max_segs 1\nEOF" in script(lossy_plan)


def test_tun_refuses_tso_only_when_segmenting():
    assert offload_flags(segment=True) == TUN_F_CSUM
    assert offload_flags(segment=False) == TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6
