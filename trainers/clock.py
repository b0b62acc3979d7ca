"""The one clock every time the trainers read or spend goes through.

Real runs use the wall clock (:class:`WallClock`). A simulated run (``trainers.sim``) installs a
virtual one: the runner, the records, the comm layer's accounting and the algorithms' compute
padding then read and advance simulated time, and the algorithms' code runs unchanged.

Compute is the one thing a virtual clock cannot observe by reading: :func:`compute_done` says
"the forward + backward that began at ``started`` is done"; the wall clock answers how long it
took, a virtual clock charges its compute model's time and answers that. :func:`attach` lets a
virtual clock spread the forward pass over the layers and the backward pass over the parameters'
gradient hooks, so communication that the backward pass launches (sync's buckets, P3's slices)
overlaps the rest of it, and what a layer waits for in the forward pass (P3's slices) overlaps the
layers before it, as it would.
"""

from __future__ import annotations

import time as _time
from typing import Optional, Protocol

from torch import nn


class Clock(Protocol):
    def perf_counter(self) -> float: ...
    def monotonic(self) -> float: ...
    def time(self) -> float: ...
    def sleep(self, seconds: float) -> None: ...
    def pad(self, seconds: float) -> None: ...
    def compute_done(self, started: float) -> float: ...
    def step_done(self) -> None: ...
    def training_starts(self) -> None: ...
    def attach(self, model: nn.Module, layer_shares: Optional[list] = None) -> None: ...


class WallClock:
    """Real time (the default)."""

    perf_counter = staticmethod(_time.perf_counter)
    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)
    # a layer's pad: a sleep, which the wall clock's compute_done (time since started) counts
    pad = staticmethod(_time.sleep)

    def compute_done(self, started: float) -> float:
        return _time.perf_counter() - started

    def step_done(self) -> None:
        """Nothing to charge: the step's own work took its real time."""

    def training_starts(self) -> None:
        """Nothing to hold: a real rank's start-up took its real time."""

    def attach(self, model: nn.Module, layer_shares: Optional[list] = None) -> None:
        """Nothing to do: real compute takes real time (pad_layers spreads a profile's, padding.py)."""


_clock: Clock = WallClock()


def install(clock: Clock) -> Clock:
    """Make ``clock`` the one every reading goes through; returns the one it replaces."""
    global _clock
    previous, _clock = _clock, clock
    return previous


def current() -> Clock:
    return _clock


def perf_counter() -> float:
    return _clock.perf_counter()


def monotonic() -> float:
    return _clock.monotonic()


def wall_time() -> float:
    """Seconds since the epoch (a virtual clock: its start's wall time plus simulated time)."""
    return _clock.time()


def sleep(seconds: float) -> None:
    _clock.sleep(seconds)


def pad(seconds: float) -> None:
    """Sleep as compute: a layer padded to its compute profile's share (trainers/padding.py).
    Counted by :func:`compute_done` as the forward + backward's time, so a step's own pad
    (``Algorithm.pad_compute``) tops up only what the layers did not reach."""
    _clock.pad(seconds)


def compute_done(started: float) -> float:
    """Seconds the compute begun at ``started`` (a :func:`perf_counter` reading) took."""
    return _clock.compute_done(started)


def step_done() -> None:
    """A training step's work outside forward + backward is done (a virtual clock charges it)."""
    _clock.step_done()


def training_starts() -> None:
    """This rank is about to begin its first step (a virtual clock may hold it there: a simulated
    job's start-up skew, ``trainers.sim.ComputeModel.start_offsets_s``)."""
    _clock.training_starts()


def attach(model: nn.Module, layer_shares: Optional[list] = None) -> None:
    """Let the clock see ``model``'s forward and backward passes (before any algorithm registers its
    hooks); ``layer_shares``: measured per-layer shares of the step (the config's; padding.py)."""
    _clock.attach(model, layer_shares)
