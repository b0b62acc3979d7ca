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
