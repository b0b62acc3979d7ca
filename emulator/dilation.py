"""Time dilation (Gupta et al., "To Infinity and Beyond: Time-Warped Network Emulation", NSDI'06).

A network dilated by K is the topology's network slowed K times: every delay and jitter x K, every
rate / K. Queues keep their size in bytes, so they are kept *in time*: a queue of B bytes drains
in B / (R / K) = K x B / R seconds, K times its undilated drain time, like everything else; the
bandwidth-delay product (R / K) x (K x RTT) is unchanged, and so are the TCP buffers sized from
it. Loss is a fraction and stays.

A job on a network dilated by K, whose times are divided by K when reported, behaves like the same
job on the undilated network with processors K times faster than this machine's: real models, real
math, real bytes, K times less compute per emulated second. What is *not* dilated is everything
timed by a clock we do not control: the kernel's TCP timers (minimum RTO 200 ms, delayed ACK up
to 40 ms), its scheduler tick, and the delay line's wake-up error (tens of microseconds). At K
their share of a reported time shrinks by K (a 200 ms RTO reads as 200 / K ms), which is the error
dilation leaves; docs/TIME_DILATION.md shows it measured.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from .linkspec import LinkSpec

MIN_TIME_DILATION = 1.0
MAX_TIME_DILATION = 1000.0


def check_time_dilation(k: float) -> float:
    """`k` if it is a dilation factor we support (1 <= k <= 1000), else ValueError."""
    if not isinstance(k, (int, float)) or isinstance(k, bool) or not MIN_TIME_DILATION <= k <= MAX_TIME_DILATION:
        raise ValueError(f"time dilation {k!r}: give a factor from {MIN_TIME_DILATION:g} (none) "
                         f"to {MAX_TIME_DILATION:g}")
    return float(k)


def dilate(spec: LinkSpec, k: float) -> LinkSpec:
    """The link `spec` slowed by `k`: delay and jitter x k, rate / k, queue bytes and loss kept."""
    if k == 1.0:
        return spec
    return replace(spec, one_way_delay_ms=spec.one_way_delay_ms * k, jitter_ms=spec.jitter_ms * k,
                   rate_bit_s=spec.rate_bit_s / k)


def undilate(spec: LinkSpec, k: float) -> LinkSpec:
    """The inverse of `dilate`: what the topology said, from what a dilated network applies."""
    return dilate(spec, 1.0 / k) if k != 1.0 else spec


class DilatedLinks:
    """A link control (anything with ``set_link(src_region, dst_region, spec)``, e.g. a backend)
    that takes specs in emulated units and applies them dilated by `k`; None (down) passes."""

    def __init__(self, network, k: float):
        self.network = network
        self.k = k

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        self.network.set_link(src_region, dst_region, None if spec is None else dilate(spec, self.k))
