"""When the delay line sleeps and when it spins: staged sleeps sized from measured wake-up latency.

Pure logic with the time passed in (the runtime feeds it real overshoots, tests feed chosen ones).

Why staged: a timed sleep on this VM wakes late by an amount that grows with its length (measured
with select() at SCHED_FIFO, timer slack 1 ns: a 20 ms sleep p50 110 us / p99 1.5 ms late, a 0.5 ms
sleep 17 us / 92 us), and a delivery due while the loop is still asleep goes out late by that much.
So a wait for a delivery `remaining` ns away is cut into
  1. one long sleep that ends `long_margin` before the short stage (margin = p99 overshoot of past
     long sleeps, plus room), so even a late wake-up leaves time;
  2. short sleeps of at most SHORT_SLEEP_NS until `spin` before the delivery;
  3. a spin (polling, no sleep) for the last `spin` ns, sized from the p99 overshoot of past short
     sleeps, so a late short wake-up still lands before the delivery.
Every sleep's overshoot is recorded and the margins follow the machine: a quiet machine spins
less, a loaded one wakes earlier.

Why a duty guard: the loop runs SCHED_FIFO, and Linux throttles real-time tasks that use more than
sched_rt_runtime_us of every sched_rt_period_us (950 ms of 1 s by default) by taking the CPU away
for the rest of the period. Spinning before every delivery and busy-polling after every frame keep
the loop awake all the time under dense traffic (iperf3 at link rate): it was throttled for ~50 ms
each second, and 1.3-1.7% of deliveries went out over 1 ms late (max 41-52 ms; 0% without the
spin/poll). So the planner watches what fraction of each DUTY_WINDOW_NS the loop slept; below
MIN_SLEEP_FRACTION it is "saturated" for the next window: no busy polling, spin SATURATED_SPIN_NS.
"""

from __future__ import annotations

import math

NS_PER_US = 1_000
SHORT_SLEEP_NS = 500_000           # the short stage's sleep length (0.5 ms)
LONG_SLEEP_NS = 1_000_000          # a requested sleep this long or longer counts as "long"
SPIN_MIN_NS = 20_000               # never spin less than this before a delivery
SPIN_MAX_NS = 400_000              # ... nor more (CPU cost per delivery is bounded by it)
SPIN_ROOM_NS = 10_000              # added to the measured p99 overshoot of short sleeps
LONG_MARGIN_MIN_NS = 500_000
LONG_MARGIN_MAX_NS = 5_000_000
LONG_MARGIN_ROOM_NS = 200_000      # added to the measured p99 overshoot of long sleeps
DEFAULT_SPIN_NS = 120_000          # before any measurement: short sleeps' p99 here was 92 us
DEFAULT_LONG_MARGIN_NS = 2_000_000  # before any measurement: long sleeps' p99 here was 1.5 ms
SAMPLES = 256                      # overshoots kept per kind (a ring)
DUTY_WINDOW_NS = 50_000_000        # the sleep fraction is judged per 50 ms window
MIN_SLEEP_FRACTION = 0.2           # below this the loop is saturated for the next window
SATURATED_SPIN_NS = 30_000         # spin window while saturated (the policy before issue 12)


def percentile_ns(values: list[int], fraction: float) -> int:
    """Nearest-rank percentile of `values` (any order); 0 for no values."""
    if not values:
        return 0
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


class SleepPlanner:
    """Decides how long the loop may sleep before a delivery and learns from each wake-up.

    Args:
        spin_ns: initial spin window (ns), until measurements replace it.
        long_margin_ns: initial margin (ns) a long sleep leaves before the short stage.
        fixed_spin_ns: when not None, always spin exactly this long and never adapt (0 with
            short_sleep_ns=None and long_margin 0 gives the old single-sleep behaviour).
        staged: False sleeps once until `spin` before the delivery (no long/short stages).
        max_sleep_ns: no sleep longer than this (ns), also when nothing is pending; None: no cap.
            Short sleeps keep wake-ups fast (a frame arriving during a long idle sleep is read,
            and stamped, one slow wake-up late) at the price of waking 1/max_sleep times a second.
    """

    __slots__ = ("spin_ns", "long_margin_ns", "fixed_spin_ns", "staged", "max_sleep_ns",
                 "_short", "_long", "_short_next", "_long_next", "wakeups_short", "wakeups_long",
                 "saturated", "saturated_windows", "_window_start", "_window_slept")

    def __init__(self, spin_ns: int = DEFAULT_SPIN_NS, long_margin_ns: int = DEFAULT_LONG_MARGIN_NS,
                 fixed_spin_ns: int | None = None, staged: bool = True, max_sleep_ns: int | None = None):
        if fixed_spin_ns is not None and fixed_spin_ns < 0:
            raise ValueError(f"fixed_spin_ns must be >= 0, got {fixed_spin_ns}")
        if max_sleep_ns is not None and max_sleep_ns <= 0:
            raise ValueError(f"max_sleep_ns must be > 0, got {max_sleep_ns}")
        self.max_sleep_ns = max_sleep_ns
        self.fixed_spin_ns = fixed_spin_ns
        self.spin_ns = int(fixed_spin_ns if fixed_spin_ns is not None else spin_ns)
        self.long_margin_ns = int(long_margin_ns)
        self.staged = staged
        self._short: list[int] = []
        self._long: list[int] = []
        self._short_next = self._long_next = 0
        self.wakeups_short = self.wakeups_long = 0
        self.saturated = False      # the last duty window slept less than MIN_SLEEP_FRACTION
        self.saturated_windows = 0
        self._window_start: int | None = None
        self._window_slept = 0

    def duty(self, now_ns: int) -> bool:
        """Close the duty window if it is over and return whether the loop is saturated: then it
        must not busy-poll, and sleep_ns spins only SATURATED_SPIN_NS (see the module doc)."""
        if self._window_start is None:
            self._window_start = now_ns
        elapsed = now_ns - self._window_start
        if elapsed >= DUTY_WINDOW_NS:
            self.saturated = self._window_slept < MIN_SLEEP_FRACTION * elapsed
            self.saturated_windows += self.saturated
            self._window_start = now_ns
            self._window_slept = 0
        return self.saturated

    def slept(self, actual_ns: int) -> None:
        """Note that the loop slept `actual_ns` (however the sleep ended)."""
        self._window_slept += actual_ns

    def sleep_ns(self, remaining_ns: float) -> int:
        """How long to sleep now (ns) when the next delivery is `remaining_ns` away; 0: spin."""
        spin = SATURATED_SPIN_NS if self.saturated and self.spin_ns > SATURATED_SPIN_NS else self.spin_ns
        budget = remaining_ns - spin
        if budget <= 0:
            return 0
        if not self.staged:
            sleep = budget
        elif budget > self.long_margin_ns + SHORT_SLEEP_NS:
            sleep = budget - self.long_margin_ns
        else:
            sleep = min(budget, SHORT_SLEEP_NS)
        if self.max_sleep_ns is not None and sleep > self.max_sleep_ns:
            sleep = self.max_sleep_ns
        return int(sleep)

    def record(self, requested_ns: int, overshoot_ns: int) -> None:
        """Note that a sleep of `requested_ns` ended `overshoot_ns` after its deadline (timer wake-ups only)."""
        if overshoot_ns < 0:
            return  # woken early by an arrival or a signal: says nothing about timer latency
        if requested_ns >= LONG_SLEEP_NS:
            self.wakeups_long += 1
            self._long_next = self._store(self._long, self._long_next, overshoot_ns)
        else:
            self.wakeups_short += 1
            self._short_next = self._store(self._short, self._short_next, overshoot_ns)

    @staticmethod
    def _store(ring: list[int], index: int, value: int) -> int:
        if len(ring) < SAMPLES:
            ring.append(value)
        else:
            ring[index] = value
        return (index + 1) % SAMPLES

    def adapt(self) -> None:
        """Resize the spin window and the long margin from the overshoots seen so far."""
        if self.fixed_spin_ns is None and len(self._short) >= 16:
            spin = percentile_ns(self._short, 0.99) + SPIN_ROOM_NS
            self.spin_ns = max(SPIN_MIN_NS, min(SPIN_MAX_NS, spin))
        if self.staged and len(self._long) >= 8:
            margin = percentile_ns(self._long, 0.99) + LONG_MARGIN_ROOM_NS
            self.long_margin_ns = max(LONG_MARGIN_MIN_NS, min(LONG_MARGIN_MAX_NS, margin))

    def as_dict(self) -> dict:
        """Current windows and the measured overshoots (us), for the counters file."""
        return {
            "spin_us": round(self.spin_ns / NS_PER_US, 1),
            "long_margin_us": round(self.long_margin_ns / NS_PER_US, 1),
            "short_sleeps": self.wakeups_short,
            "short_overshoot_p50_us": round(percentile_ns(self._short, 0.50) / NS_PER_US, 1),
            "short_overshoot_p99_us": round(percentile_ns(self._short, 0.99) / NS_PER_US, 1),
            "long_sleeps": self.wakeups_long,
            "long_overshoot_p50_us": round(percentile_ns(self._long, 0.50) / NS_PER_US, 1),
            "long_overshoot_p99_us": round(percentile_ns(self._long, 0.99) / NS_PER_US, 1),
            "saturated_windows": self.saturated_windows,
        }
