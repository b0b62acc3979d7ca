"""The delay line's link model, driven by an injected clock: exact delays, rates, drops and order."""

import math
import struct

import pytest

from emulator.delayline.packet import (
    VNET_GSO_TCPV4, VNET_HDR_BYTES, ipv4_destination, wire_bytes,
)
from emulator.delayline.scheduler import NS_PER_MS, Scheduler
from emulator.topology import LinkSpec

MS = NS_PER_MS


def make(spec: LinkSpec, **kwargs) -> Scheduler:
    scheduler = Scheduler(**kwargs)
    scheduler.add_pair("a>b", spec)
    return scheduler


def test_delay_is_exact_on_an_idle_fast_link():
    scheduler = make(LinkSpec(one_way_delay_ms=25.0, rate_bit_s=100e9, queue_bytes=1 << 20))
    assert scheduler.offer("a>b", "p", "dst", wire_bytes=100, now_ns=1_000 * MS)
    # 100 bytes at 100 Gbit/s take 8 ns on the wire.
    assert scheduler.next_due_ns() == pytest.approx(1_000 * MS + 25 * MS + 8)
    assert scheduler.pop_due(1_025 * MS) == []
    assert scheduler.pop_due(1_025 * MS + 8) == [(pytest.approx(1_025 * MS + 8), "dst", "p")]
    assert scheduler.pending() == 0


def test_back_to_back_packets_are_spaced_by_size_over_rate():
    rate_bit_s = 100e6
    scheduler = make(LinkSpec(one_way_delay_ms=10.0, rate_bit_s=rate_bit_s, queue_bytes=1 << 20))
    sizes = [1500, 1500, 64_000, 40, 1500]
    for index, size in enumerate(sizes):
        assert scheduler.offer("a>b", index, "dst", wire_bytes=size, now_ns=0)
    deliveries = scheduler.pop_due(math.inf)
    times = [t for t, _, _ in deliveries]
    expected, departure = [], 0.0
    for size in sizes:
        departure += size * 8 / rate_bit_s * 1e9
        expected.append(departure + 10 * MS)
    assert times == pytest.approx(expected)
    assert [p for _, _, p in deliveries] == list(range(len(sizes)))


def test_link_idle_again_after_serializing_starts_from_now():
    scheduler = make(LinkSpec(one_way_delay_ms=1.0, rate_bit_s=8e6, queue_bytes=1 << 20))  # 1 byte/us
    scheduler.offer("a>b", 0, "d", wire_bytes=1000, now_ns=0)            # busy until 1 ms
    scheduler.offer("a>b", 1, "d", wire_bytes=1000, now_ns=5 * MS)       # idle again by then
    times = [t for t, _, _ in scheduler.pop_due(math.inf)]
    assert times == pytest.approx([2 * MS, 7 * MS])


def test_throughput_over_time_matches_rate():
    rate_bit_s = 1e9
    scheduler = make(LinkSpec(one_way_delay_ms=0.0, rate_bit_s=rate_bit_s, queue_bytes=1 << 30))
    for index in range(10_000):
        scheduler.offer("a>b", index, "d", wire_bytes=1500, now_ns=0)
    last = scheduler.pop_due(math.inf)[-1][0]
    assert 10_000 * 1500 * 8 / (last / 1e9) == pytest.approx(rate_bit_s, rel=1e-9)


def test_drop_tail_when_queue_is_full():
    # 8 Mbit/s = 1 byte/us; a 10_000-byte queue holds 10 ms of backlog.
    scheduler = make(LinkSpec(one_way_delay_ms=5.0, rate_bit_s=8e6, queue_bytes=10_000))
    accepted = [scheduler.offer("a>b", i, "d", wire_bytes=1000, now_ns=0) for i in range(15)]
    assert accepted == [True] * 10 + [False] * 5
    link = scheduler.pairs["a>b"]
    assert (link.packets, link.bytes, link.drops_queue, link.dropped_bytes) == (10, 10_000, 5, 5_000)
    assert link.peak_backlog_bytes == 10_000
    # 3 ms later 3000 bytes have left the queue: exactly three more fit.
    more = [scheduler.offer("a>b", i, "d", wire_bytes=1000, now_ns=3 * MS) for i in range(4)]
    assert more == [True, True, True, False]
    assert link.backlog_bytes(3 * MS) == pytest.approx(10_000)


def test_idle_link_takes_a_packet_larger_than_the_queue():
    scheduler = make(LinkSpec(one_way_delay_ms=1.0, rate_bit_s=8e6, queue_bytes=3_000))
    assert scheduler.offer("a>b", 0, "d", wire_bytes=65_000, now_ns=0)
    assert not scheduler.offer("a>b", 1, "d", wire_bytes=100, now_ns=1 * MS)
    assert scheduler.offer("a>b", 2, "d", wire_bytes=100, now_ns=63 * MS)  # 2000 bytes left <= 3000


@pytest.mark.parametrize("loss_fraction", [0.01, 0.1, 0.5])
def test_loss_rate_within_binomial_tolerance(loss_fraction):
    trials = 20_000
    scheduler = make(LinkSpec(one_way_delay_ms=1.0, rate_bit_s=100e9, loss_fraction=loss_fraction,
                              queue_bytes=1 << 30), seed=7)
    for i in range(trials):
        scheduler.offer("a>b", i, "d", wire_bytes=100, now_ns=i * MS)
    drops = scheduler.pairs["a>b"].drops_loss
    sigma = math.sqrt(trials * loss_fraction * (1 - loss_fraction))
    assert abs(drops - trials * loss_fraction) < 4 * sigma
    assert scheduler.pairs["a>b"].packets == trials - drops


def test_loss_is_reproducible_with_a_seed():
    spec = LinkSpec(one_way_delay_ms=1.0, rate_bit_s=1e9, loss_fraction=0.3, queue_bytes=1 << 30)
    outcomes = []
    for _ in range(2):
        scheduler = make(spec, seed=42)
        outcomes.append([scheduler.offer("a>b", i, "d", 100, i * MS) for i in range(500)])
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_jitter_stays_in_bounds_and_never_reorders(distribution):
    delay_ms, jitter_ms = 20.0, 5.0
    scheduler = make(LinkSpec(one_way_delay_ms=delay_ms, rate_bit_s=100e9, jitter_ms=jitter_ms,
                              queue_bytes=1 << 30), seed=3, jitter_distribution=distribution)
    sent_at = {}
    for i in range(5_000):
        now = i * 0.1 * MS  # 10 packets per ms: far closer than the jitter, reordering would be common
        sent_at[i] = now
        scheduler.offer("a>b", i, "d", wire_bytes=100, now_ns=now)
    deliveries = scheduler.pop_due(math.inf)
    assert [p for _, _, p in deliveries] == list(range(5_000))
    extra_ms = [(t - sent_at[p]) / MS - delay_ms for t, _, p in deliveries]
    assert min(extra_ms) >= -jitter_ms
    assert max(extra_ms) <= jitter_ms + 1e-5  # + 8 ns of serialization
    # Jitter really varies the delay (not a constant offset).
    assert max(extra_ms) - min(extra_ms) > 1.0


def test_sparse_jitter_is_spread_over_the_whole_range():
    scheduler = make(LinkSpec(one_way_delay_ms=20.0, rate_bit_s=100e9, jitter_ms=5.0,
                              queue_bytes=1 << 30), seed=11)
    for i in range(2_000):
        scheduler.offer("a>b", i, "d", wire_bytes=100, now_ns=i * 100 * MS)  # far apart: no FIFO clamp
    extra_ms = sorted((t - p * 100 * MS) / MS - 20.0 for t, _, p in scheduler.pop_due(math.inf))
    assert extra_ms[0] < -4.5 and extra_ms[-1] > 4.5
    assert abs(extra_ms[len(extra_ms) // 2]) < 0.5  # uniform: median near zero


def test_pairs_are_independent_and_deliveries_merge_in_time_order():
    scheduler = Scheduler()
    scheduler.add_pair("a>b", LinkSpec(one_way_delay_ms=30.0, rate_bit_s=1e9, queue_bytes=1 << 20))
    scheduler.add_pair("a>c", LinkSpec(one_way_delay_ms=10.0, rate_bit_s=1e9, queue_bytes=1 << 20))
    scheduler.offer("a>b", "slow", "b", 1000, now_ns=0)
    scheduler.offer("a>c", "fast", "c", 1000, now_ns=0)
    assert [p for _, _, p in scheduler.pop_due(math.inf)] == ["fast", "slow"]
    counters = scheduler.counters()
    assert counters["a>b"]["packets"] == 1 and counters["a>c"]["bytes"] == 1000


def test_bad_arguments_fail_at_once():
    with pytest.raises(ValueError, match="jitter_distribution"):
        Scheduler(jitter_distribution="pareto")
    with pytest.raises(ValueError, match="queue_bytes"):
        Scheduler().add_pair("x", LinkSpec(one_way_delay_ms=1.0, rate_bit_s=1e6))


def _frame(payload_bytes: int, gso_type: int = 0, gso_size: int = 0, destination=(10, 201, 0, 2)) -> bytes:
    vnet = struct.pack("=BBHHHH", 0, gso_type, 0, gso_size, 0, 0)
    ip_header = bytes([0x45, 0]) + b"\0" * 10 + bytes([10, 201, 0, 1]) + bytes(destination)
    tcp_header = b"\0" * 12 + bytes([0x80]) + b"\0" * 19  # data offset 8 words: 32 bytes with options
    return vnet + ip_header + tcp_header + b"x" * payload_bytes


def test_packet_destination_and_plain_size():
    frame = _frame(1000)
    assert len(_frame(0)) == VNET_HDR_BYTES + 52
    assert ipv4_destination(frame) == bytes([10, 201, 0, 2])
    assert wire_bytes(frame) == 20 + 32 + 1000
    ipv6 = frame[:VNET_HDR_BYTES] + bytes([0x60]) + frame[VNET_HDR_BYTES + 1:]
    assert ipv4_destination(ipv6) is None


def test_gso_frame_is_charged_per_segment_headers():
    frame = _frame(10 * 1448 + 100, gso_type=VNET_GSO_TCPV4, gso_size=1448)
    # 11 segments on the wire: the 52 bytes of IP+TCP headers appear 11 times.
    assert wire_bytes(frame) == 10 * 1448 + 100 + 11 * 52


def test_lowering_the_delay_in_flight_never_reorders():
    from dataclasses import replace

    from emulator.delayline.scheduler import Scheduler
    from emulator.topology import LinkSpec

    spec = LinkSpec(one_way_delay_ms=100.0, rate_bit_s=1e9, queue_bytes=10**6)
    scheduler = Scheduler()
    link = scheduler.add_pair("ab", spec)
    assert scheduler.offer("ab", "first", "b", 1500, now_ns=0)
    link.set_spec(replace(spec, one_way_delay_ms=10.0))
    assert scheduler.offer("ab", "second", "b", 1500, now_ns=1_000_000)
    order = [packet for _, _, packet in scheduler.pop_due(10**12)]
    assert order == ["first", "second"]


# --- each node's NIC, shared by its pairs (chosen times; 8 Mbit/s is 1 byte per us) ---------------

US = 1_000


def with_nics(nic_bit_s: float, pair_bit_s: float, delay_ms: float = 1.0, nic_queue: int = 1 << 20,
              nodes=("a", "b", "c")) -> Scheduler:
    """Every ordered pair of `nodes`, keyed "a>b", each node with a NIC of `nic_bit_s` each way."""
    scheduler = Scheduler()
    for node in nodes:
        scheduler.add_nic(node, nic_bit_s, nic_queue)
    for src in nodes:
        for dst in nodes:
            if src != dst:
                scheduler.add_pair(f"{src}>{dst}", LinkSpec(one_way_delay_ms=delay_ms, rate_bit_s=pair_bit_s,
                                                            queue_bytes=1 << 20), src, dst)
    return scheduler


def test_a_node_s_sends_to_two_peers_share_its_nic_out():
    scheduler = with_nics(nic_bit_s=8e6, pair_bit_s=80e6)   # NIC 1 byte/us, each pair 10
    assert scheduler.offer("a>b", "to b", "B", wire_bytes=1000, now_ns=0)
    assert scheduler.offer("a>c", "to c", "C", wire_bytes=1000, now_ns=0)
    # the NIC sends them one after the other: 1000 us each; each pair's own 100 us is hidden
    assert scheduler.pop_due(math.inf) == [(pytest.approx(1000 * US + 1 * MS), "B", "to b"),
                                           (pytest.approx(2000 * US + 1 * MS), "C", "to c")]
    assert scheduler.nics["a"].out.bytes == 2000


def test_a_packet_alone_goes_at_the_slower_of_nic_and_pair_never_serialized_twice():
    fast_nic = with_nics(nic_bit_s=80e6, pair_bit_s=8e6)
    assert fast_nic.offer("a>b", "p", "B", wire_bytes=1000, now_ns=0)
    assert fast_nic.pop_due(math.inf) == [(pytest.approx(1000 * US + 1 * MS), "B", "p")]
    slow_nic = with_nics(nic_bit_s=8e6, pair_bit_s=80e6)
    assert slow_nic.offer("a>b", "p", "B", wire_bytes=1000, now_ns=0)
    assert slow_nic.pop_due(math.inf) == [(pytest.approx(1000 * US + 1 * MS), "B", "p")]


def test_two_senders_into_one_receiver_share_its_nic_in_in_arrival_order():
    scheduler = with_nics(nic_bit_s=8e6, pair_bit_s=80e6, delay_ms=1.0)
    assert scheduler.offer("a>c", "from a", "C", wire_bytes=1000, now_ns=0)
    assert scheduler.offer("b>c", "from b", "C", wire_bytes=1000, now_ns=0)
    # each sender's NIC out passes its packet in 1000 us, both reach c at 2000 us (1 ms later);
    # c's NIC in takes them one after the other: the second ends 1000 us after the first
    first_end = 1000 * US + 1 * MS
    assert scheduler.pop_due(first_end - 1) == []
    assert scheduler.pop_due(math.inf) == [(pytest.approx(first_end), "C", "from a"),
                                           (pytest.approx(first_end + 1000 * US), "C", "from b")]
    assert scheduler.nics["c"].into.packets == 2 and scheduler.pending() == 0


def test_the_receiving_nic_takes_packets_as_they_arrive_not_as_they_were_sent():
    scheduler = Scheduler()
    for node in "abc":
        scheduler.add_nic(node, 8e6, 1 << 20)
    scheduler.add_pair("a>c", LinkSpec(one_way_delay_ms=50.0, rate_bit_s=80e6, queue_bytes=1 << 20), "a", "c")
    scheduler.add_pair("b>c", LinkSpec(one_way_delay_ms=1.0, rate_bit_s=80e6, queue_bytes=1 << 20), "b", "c")
    assert scheduler.offer("a>c", "far", "C", wire_bytes=1000, now_ns=0)       # sent first, arrives late
    assert scheduler.offer("b>c", "near", "C", wire_bytes=1000, now_ns=1 * MS)
    assert scheduler.pop_due(math.inf) == [(pytest.approx(2 * MS + 1 * MS), "C", "near"),
                                           (pytest.approx(1 * MS + 50 * MS), "C", "far")]


def test_a_full_nic_queue_drops_and_counts():
    scheduler = with_nics(nic_bit_s=8e6, pair_bit_s=80e6, nic_queue=3000)
    sent = [scheduler.offer("a>b" if i % 2 else "a>c", i, "X", wire_bytes=1000, now_ns=0) for i in range(4)]
    # the queue counts the bytes not yet sent, the one on the wire included: 3 x 1000 fit, the 4th not
    assert sent == [True, True, True, False]
    out = scheduler.nics["a"].out.counters()
    assert out["drops_queue"] == 1 and out["dropped_bytes"] == 1000 and out["packets"] == 3
    assert scheduler.nic_counters()["a"]["out"] == out


def test_a_lone_packet_through_a_receiver_nic_slower_than_its_pair_takes_the_nic_s_time():
    scheduler = Scheduler()
    scheduler.add_nic("b", 8e6, 1 << 20)      # only the receiver has a NIC: 1 byte/us
    scheduler.add_pair("a>b", LinkSpec(one_way_delay_ms=1.0, rate_bit_s=80e6, queue_bytes=1 << 20), "a", "b")
    assert scheduler.offer("a>b", "p", "B", wire_bytes=1000, now_ns=0)
    # the pair sends it in 100 us; its first bit reaches b's NIC 1 ms after it left, which needs 1000 us
    assert scheduler.pop_due(math.inf) == [(pytest.approx(1 * MS + 1000 * US), "B", "p")]


def test_without_nics_a_pair_is_as_before():
    plain, nicless = Scheduler(), Scheduler()
    spec = LinkSpec(one_way_delay_ms=1.0, rate_bit_s=8e6, queue_bytes=1 << 20)
    plain.add_pair("a>b", spec)
    nicless.add_pair("a>b", spec, "a", "b")   # nodes named, none with a NIC
    for scheduler in (plain, nicless):
        for i in range(3):
            scheduler.offer("a>b", i, "B", wire_bytes=500, now_ns=i * 100 * US)
    assert plain.pop_due(math.inf) == nicless.pop_due(math.inf)


def test_a_nic_added_twice_or_with_no_rate_is_refused():
    scheduler = Scheduler()
    scheduler.add_nic("a", 1e9, 1 << 20)
    with pytest.raises(ValueError, match="added twice"):
        scheduler.add_nic("a", 1e9, 1 << 20)
    with pytest.raises(ValueError, match="rate_bit_s must be > 0"):
        scheduler.add_nic("b", 0.0, 1 << 20)
