"""The simulated network against closed-form answers: latency, rate, max-min sharing, caps."""

import numpy as np
import pytest

from emulator.linkspec import LinkSpec
from emulator.plan import make_plan
from emulator.simnet import FluidNetwork, max_min_rates
from emulator.topology import load_topology

MB = 1e6


def network(n=3, latency_s=0.05, rate_bytes=125e6, nic=None, window=1e12, jitter_s=0.0):
    lat = np.full((n, n), latency_s)
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), rate_bytes), jitter_s=np.full((n, n), jitter_s),
                        loss=np.zeros((n, n)), tcp_window=window, nic=nic, region_of=tuple(f"r{i}" for i in range(n)))


# (the fluid's own tests call start_flow directly: slow start is added by the caller, trainers.sim)


def run_until_idle(net, until=100.0):
    deliveries = []
    while net.in_flight():
        deliveries += net.advance(min(net.next_completion(), until))
    return {d.token: d for d in deliveries}


def test_one_flow_takes_size_over_rate_plus_the_one_way_delay():
    net = network()
    net.start_flow(0, 1, 10 * MB, 0.0, token="a")
    done = run_until_idle(net)
    assert done["a"].sent_at == pytest.approx(10 * MB / 125e6)
    assert done["a"].arrives_at == pytest.approx(10 * MB / 125e6 + 0.05)


def test_flows_on_one_pair_share_its_rate_and_a_finished_flow_frees_it():
    net = network(rate_bytes=1 * MB)
    net.start_flow(0, 1, 1 * MB, 0.0, token="short")
    net.start_flow(0, 1, 3 * MB, 0.0, token="long")
    done = run_until_idle(net)
    assert done["short"].sent_at == pytest.approx(2.0)   # half of 1 MB/s each
    assert done["long"].sent_at == pytest.approx(4.0)    # 2 MB left at the whole 1 MB/s


def test_flows_to_different_peers_do_not_share_without_a_nic():
    net = network(rate_bytes=1 * MB)
    net.start_flow(0, 1, 1 * MB, 0.0, token="a")
    net.start_flow(0, 2, 1 * MB, 0.0, token="b")
    done = run_until_idle(net)
    assert done["a"].sent_at == pytest.approx(1.0) and done["b"].sent_at == pytest.approx(1.0)


def test_a_nic_is_shared_max_min_fair():
    # node 0's NIC carries 1 MB/s; its flow to 2 is held to 0.2 MB/s by the path: max-min gives
    # the flow to 1 the remaining 0.8 MB/s, not an equal 0.5
    net = network(nic=1 * MB, rate_bytes=10 * MB)
    net.rate[0, 2] = 0.2 * MB
    net._base["rate"][0, 2] = 0.2 * MB
    net.start_flow(0, 1, 0.8 * MB, 0.0, token="wide")
    net.start_flow(0, 2, 0.2 * MB, 0.0, token="narrow")
    done = run_until_idle(net)
    assert done["wide"].sent_at == pytest.approx(1.0)
    assert done["narrow"].sent_at == pytest.approx(1.0)


def test_max_min_rates_closed_form():
    # three flows on resource 0 (cap 3), one of them also on resource 1 (cap 0.5):
    # that one gets 0.5, the other two share 2.5
    rates = max_min_rates([np.array([0, 0, 0]), np.array([1, -1, -1])], np.array([3.0, 0.5]), np.full(3, np.inf))
    assert rates == pytest.approx([0.5, 1.25, 1.25])
    # a flow's own cap binds before the resource
    rates = max_min_rates([np.array([0, 0])], np.array([2.0]), np.array([0.3, np.inf]))
    assert rates == pytest.approx([0.3, 1.7])


def test_one_connection_is_capped_by_its_window_per_round_trip():
    net = network(latency_s=0.1, window=1 * MB, rate_bytes=125e6)  # 1 MB per 0.2 s RTT = 5 MB/s
    net.start_flow(0, 1, 5 * MB, 0.0, token="a")
    assert run_until_idle(net)["a"].sent_at == pytest.approx(1.0)


def test_a_link_down_stalls_its_flows_until_it_is_restored():
    net = network(rate_bytes=1 * MB)
    net.start_flow(0, 1, 2 * MB, 0.0, token="a")
    net.advance(0.5)
    net.set_link("r0", "r1", LinkSpec(one_way_delay_ms=50, rate_bit_s=8e6, loss_fraction=1.0))
    assert net.next_completion() == float("inf")
    net.advance(10.5)   # ten seconds down: nothing moves
    net.set_link("r0", "r1", None)
    assert run_until_idle(net)["a"].sent_at == pytest.approx(12.0)


def test_jitter_never_reorders_a_pairs_messages():
    net = network(rate_bytes=1e9, jitter_s=0.02)
    done = {}
    for i in range(50):
        done.update({d.token: d for d in net.advance(i * 1e-4)})
        net.start_flow(0, 1, 100, i * 1e-4, token=i)
    done.update(run_until_idle(net))
    arrivals = [done[i].arrives_at for i in range(50)]
    assert arrivals == sorted(arrivals)
    assert max(arrivals) - min(arrivals) > 0.005  # the jitter is there


def test_from_plan_takes_the_topology_matrix():
    plan = make_plan(load_topology("topologies/aws-4region.yaml"))
    net = FluidNetwork.from_plan(plan, nic_rate_bit_s=10e9)
    ranks = {node.name: node.rank for node in plan.nodes}
    rtt = net.rtt_s()
    assert rtt[ranks["london-0"], ranks["tokyo-0"]] == pytest.approx(0.2157)
    assert rtt[ranks["oregon-0"], ranks["ohio-0"]] == pytest.approx(0.0681)
    assert net.rate[0, 1] == pytest.approx(1e9 / 8)
    assert net.nic == pytest.approx(10e9 / 8)


def test_messages_posted_together_on_one_connection_share_its_window():
    """One ordered pair is one TCP connection: eight 14-segment messages posted at once (DTS with
    8 all-reduces in flight) leave in flights 2, 2, 3, 3, 3, 4, 4, 4 of slow start from the
    initial window of 10 (10, 20, 40, 80 segments), not all in flight 2 as eight connections
    would; the busy period's first window is paced (13 / 20 RTT for the first message's 14
    segments, 19 / 20 RTT once the period holds a whole window of 20). A message on another pair
    is not delayed by them."""
    net = network(n=3, latency_s=0.10785, rate_bytes=125e6)
    rtt = 0.2157
    leaves = [0.001 * i + net.slow_start_s(0, 1, 14 * 1448, 0.001 * i)[0] for i in range(8)]
    assert leaves[0] == pytest.approx(13 / 20 * rtt + rtt)
    assert [round((t - 19 / 20 * rtt) / rtt, 6) for t in leaves[1:]] == [1, 2, 2, 2, 3, 3, 3]
    # eight calls, each with two pairs (the collectives' vector form), then a ninth message on
    # pair (0, 2): 126 segments queued, flight 4
    net = network(n=3, latency_s=0.10785, rate_bytes=125e6)
    for _ in range(8):
        net.slow_start_s([0, 0], [1, 2], 14 * 1448, 0.0)
    assert net.slow_start_s(0, 2, 14 * 1448, 0.0)[0] == pytest.approx(19 / 20 * rtt + 3 * rtt)
    assert net.slow_start_s(2, 1, 14 * 1448, 0.0)[0] == pytest.approx(13 / 20 * rtt + rtt)  # another pair
    # one call takes a pair once: a second message on it is the next call's
    with pytest.raises(ValueError, match="each \\(src, dst\\) pair once"):
        net.slow_start_s([1, 1], [0, 0], 1000, 1.0)


def test_slow_start_and_pacing_of_a_message_on_an_idle_connection():
    net = network(n=2, latency_s=0.10785, rate_bytes=125e6)   # london-tokyo: 215.7 ms RTT, 1 Gbit/s
    rtt = 0.2157
    # one segment leaves at once; 14 (the digits MLP's 19 KB) are paced from the initial window,
    # 2 x 10 segments per RTT: 13 / 20 RTT later (measured on tun: 0.154 s)
    assert net.slow_start_s(0, 1, 1000, 0.0)[0] == pytest.approx(0.0)
    net.slow_start_s(1, 0, 14 * 1448, 0.0)            # a fresh connection: 2 flights, its window grows
    # the steady state of a digits MLP's sync: a step later (idle > RTT, < RTO), only the pacing
    assert net.slow_start_s(1, 0, 14 * 1448, 0.66)[0] == pytest.approx(13 / 20 * rtt)
    # 100 segments from a window of 10: ceil(log2(100 / 10 + 1)) = 4 flights, 3 round trips more,
    # and the first window paced
    net = network(n=2, latency_s=0.10785, rate_bytes=125e6)
    assert net.slow_start_s(0, 1, 100 * 1448, 0.0)[0] == pytest.approx(3 * rtt + 19 / 20 * rtt)
    # posted 0.1 s later, while the first is still in slow start: it queues behind it on the one
    # connection, 200 segments from the window of 10 need 5 flights, the last 4 RTTs after the
    # first window's pacing
    assert net.slow_start_s(0, 1, 100 * 1448, 0.1)[0] == pytest.approx(4 * rtt + 19 / 20 * rtt - 0.1)
    # once the connection has sent them, its window is open: no extra time
    assert net.slow_start_s(0, 1, 100 * 1448, 5 * rtt)[0] == pytest.approx(0.0)
    # idle for many RTOs (RTT + 200 ms each): the window halved back to the initial one
    assert net.slow_start_s(0, 1, 100 * 1448, 10.0)[0] == pytest.approx(3 * rtt + 19 / 20 * rtt)
    # idle for one RTO only: the window (160 after 4 flights from 10) halves to 80, still
    # enough for 14 segments: only the pacing
    net.slow_start_s(0, 1, 100 * 1448, 20.0)
    assert net.slow_start_s(0, 1, 14 * 1448, 20.0 + 3 * rtt + 19 / 20 * rtt + 0.5)[0] == pytest.approx(13 / 20 * rtt)
