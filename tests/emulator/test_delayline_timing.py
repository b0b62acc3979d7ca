"""The delay line's sleep planner: staged sleeps, spin window from measured overshoot (no root)."""

import pytest

from emulator.delayline.timing import (
    DUTY_WINDOW_NS, LONG_MARGIN_MAX_NS, SATURATED_SPIN_NS, SHORT_SLEEP_NS, SPIN_MAX_NS, SPIN_MIN_NS, SPIN_ROOM_NS, SleepPlanner,
    percentile_ns,
)

MS = 1_000_000
US = 1_000


def test_a_long_wait_is_cut_into_a_long_sleep_short_sleeps_and_a_spin():
    planner = SleepPlanner(spin_ns=100 * US, long_margin_ns=2 * MS)
    remaining = 20 * MS
    slept = []
    while True:
        sleep = planner.sleep_ns(remaining)
        if sleep == 0:
            break
        slept.append(sleep)
        remaining -= sleep  # a punctual wake-up
    # One long sleep that stops 2 ms + 0.1 ms short of the delivery, then 0.5 ms sleeps, then a spin.
    assert slept[0] == 20 * MS - 100 * US - 2 * MS
    assert slept[1:] == [SHORT_SLEEP_NS] * 4
    assert remaining == 100 * US


def test_a_wake_up_as_late_as_the_margin_still_lands_before_the_delivery():
    planner = SleepPlanner(spin_ns=100 * US, long_margin_ns=2 * MS)
    remaining = 50 * MS
    first = planner.sleep_ns(remaining)
    remaining -= first + int(1.9 * MS)  # the long sleep woke 1.9 ms late
    assert remaining > 0
    second = planner.sleep_ns(remaining)
    assert 0 < second <= SHORT_SLEEP_NS


def test_single_sleep_mode_sleeps_once_up_to_the_spin_window():
    planner = SleepPlanner(fixed_spin_ns=30 * US, staged=False)
    assert planner.sleep_ns(20 * MS) == 20 * MS - 30 * US
    assert planner.sleep_ns(25 * US) == 0
    for _ in range(100):
        planner.record(SHORT_SLEEP_NS, 300 * US)
    planner.adapt()
    assert planner.spin_ns == 30 * US  # fixed: never adapts


def test_spin_window_follows_measured_short_sleep_overshoot_within_bounds():
    planner = SleepPlanner()
    for overshoot_us in [10] * 95 + [80] * 5:
        planner.record(SHORT_SLEEP_NS, overshoot_us * US)
    planner.adapt()
    assert planner.spin_ns == 80 * US + SPIN_ROOM_NS
    for _ in range(300):  # a loaded machine: the ring forgets the quiet samples
        planner.record(SHORT_SLEEP_NS, 5 * MS)
    planner.adapt()
    assert planner.spin_ns == SPIN_MAX_NS
    quiet = SleepPlanner()
    for _ in range(50):
        quiet.record(SHORT_SLEEP_NS, 1 * US)
    quiet.adapt()
    assert quiet.spin_ns == SPIN_MIN_NS


def test_long_margin_follows_long_sleep_overshoot_and_early_wake_ups_are_ignored():
    planner = SleepPlanner(long_margin_ns=2 * MS)
    for _ in range(20):
        planner.record(20 * MS, 9 * MS)
        planner.record(20 * MS, -5 * MS)  # woken by an arrival: not a timer overshoot
    planner.adapt()
    assert planner.long_margin_ns == LONG_MARGIN_MAX_NS
    assert planner.as_dict()["long_sleeps"] == 20
    assert planner.as_dict()["long_overshoot_p99_us"] == 9000.0


def test_percentile_is_nearest_rank():
    assert percentile_ns([], 0.5) == 0
    assert percentile_ns(list(range(1, 101)), 0.99) == 99
    assert percentile_ns([5, 1, 3], 0.5) == 3


def test_bad_spin_is_refused():
    with pytest.raises(ValueError, match="fixed_spin_ns"):
        SleepPlanner(fixed_spin_ns=-1)


def test_a_sleep_cap_holds_even_when_nothing_is_pending():
    planner = SleepPlanner(spin_ns=100 * US, long_margin_ns=2 * MS, max_sleep_ns=SHORT_SLEEP_NS)
    assert planner.sleep_ns(1000 * MS) == SHORT_SLEEP_NS
    assert planner.sleep_ns(300 * US) == 200 * US
    with pytest.raises(ValueError, match="max_sleep_ns"):
        SleepPlanner(max_sleep_ns=0)


def test_a_loop_that_hardly_sleeps_is_saturated_and_spins_briefly_until_it_sleeps_again():
    """A SCHED_FIFO loop awake > 80% of a 50 ms window would be throttled by the kernel: the
    planner says so (no busy polling) and shrinks the spin to 30 us; a window with enough sleep
    ends it."""
    planner = SleepPlanner(spin_ns=300_000)
    start = 1_000_000_000
    assert planner.duty(start) is False
    assert planner.sleep_ns(1_000_000) == 500_000  # short stage: the 300 us spin is kept
    planner.slept(int(0.1 * DUTY_WINDOW_NS))      # slept 10% of the window
    assert planner.duty(start + DUTY_WINDOW_NS) is True
    assert planner.sleep_ns(400_000) == 400_000 - SATURATED_SPIN_NS
    assert planner.sleep_ns(SATURATED_SPIN_NS) == 0
    planner.slept(int(0.5 * DUTY_WINDOW_NS))
    assert planner.duty(start + DUTY_WINDOW_NS + DUTY_WINDOW_NS // 2) is True  # window not over yet
    assert planner.duty(start + 2 * DUTY_WINDOW_NS) is False
    assert planner.sleep_ns(400_000) == 100_000
    assert planner.as_dict()["saturated_windows"] == 1
