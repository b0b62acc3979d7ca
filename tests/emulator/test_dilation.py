"""Time dilation of the network (emulator/dilation.py): what the backends apply at K."""

import pytest

from emulator.dilation import DilatedLinks, dilate, undilate
from emulator.linkspec import LinkSpec
from emulator.plan import Plan, make_plan
from emulator.schema import ConfigError
from emulator.topology import load_topology

TOPOLOGY = "topologies/aws-4region.yaml"


def test_a_dilated_link_is_k_times_slower_with_the_same_queue_and_loss():
    spec = LinkSpec(one_way_delay_ms=40.0, rate_bit_s=100e6, jitter_ms=2.0, loss_fraction=0.01, queue_bytes=500_000)
    slow = dilate(spec, 4.0)
    assert (slow.one_way_delay_ms, slow.jitter_ms, slow.rate_bit_s) == (160.0, 8.0, 25e6)
    assert (slow.loss_fraction, slow.queue_bytes) == (0.01, 500_000)
    # the queue drains in K times its undilated time: bytes / (rate / K)
    assert slow.queue_bytes * 8 / slow.rate_bit_s == pytest.approx(4 * spec.queue_bytes * 8 / spec.rate_bit_s)
    assert undilate(slow, 4.0).one_way_delay_ms == pytest.approx(40.0)
    assert undilate(slow, 4.0).rate_bit_s == pytest.approx(100e6)
    assert dilate(spec, 1.0) is spec


def test_a_plan_at_k_applies_dilated_links_and_keeps_what_the_topology_said():
    topology = load_topology(TOPOLOGY)
    plain, slow = make_plan(topology), make_plan(topology, time_dilation=8)
    assert slow.time_dilation == 8.0
    for (src, dst, spec), (_, _, dilated) in zip(plain.pairs(), slow.pairs()):
        assert dilated.one_way_delay_ms == pytest.approx(8 * spec.one_way_delay_ms)
        assert dilated.rate_bit_s == pytest.approx(spec.rate_bit_s / 8)
        assert dilated.queue_bytes == spec.queue_bytes  # sized before dilation: the same BDP
        back = slow.emulated_link(slow.node(src.name), slow.node(dst.name))
        assert back.one_way_delay_ms == pytest.approx(spec.one_way_delay_ms)
        assert back.rate_bit_s == pytest.approx(spec.rate_bit_s)
    # the bandwidth-delay product is unchanged, so are the TCP buffers sized from it
    assert slow.tcp_buffer_max_bytes == plain.tcp_buffer_max_bytes
    again = Plan.from_json(slow.to_json())
    assert again.time_dilation == 8.0 and again.region_links == slow.region_links


def test_a_plan_saved_before_dilation_existed_reads_as_undilated():
    import json

    data = json.loads(make_plan(load_topology(TOPOLOGY)).to_json())
    del data["time_dilation"]
    assert Plan.from_json(json.dumps(data)).time_dilation == 1.0


@pytest.mark.parametrize("k", [0.5, 0, -2, 5000])
def test_an_unsupported_factor_is_refused_naming_the_field(k):
    with pytest.raises(ConfigError, match=r"aws-4region.yaml: time_dilation: time dilation .*from 1 \(none\) to 1000"):
        make_plan(load_topology(TOPOLOGY), time_dilation=k)


def test_dilated_links_dilate_what_they_pass_on():
    applied = []

    class Network:
        def set_link(self, src, dst, spec):
            applied.append((src, dst, spec))

    links = DilatedLinks(Network(), 3.0)
    links.set_link("a", "b", LinkSpec(one_way_delay_ms=10.0, rate_bit_s=30e6, queue_bytes=1000))
    links.set_link("b", "a", None)
    assert applied[0][2].one_way_delay_ms == 30.0 and applied[0][2].rate_bit_s == 10e6
    assert applied[1] == ("b", "a", None)
