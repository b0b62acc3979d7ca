"""The discrete-event engine of a simulated job: every rank a thread, one running at a time.

SMPI-style: the ranks run their real code (the runner, the algorithm, the model's math), but
never at once. The engine holds a heap of events in virtual time and a fluid network
(``emulator.simnet.FluidNetwork``, handed in by the harness); its loop takes the earliest event
(a rank to resume, a message to deliver, a fault to apply) or the network's next completion,
sets the clock to it and runs it. A resumed rank runs until it spends virtual time (compute,
sleep) or waits for something (a message, a collective), then hands control back. Ties are
broken by the order events were made, so the same seed gives the same run, bit for bit.

Virtual time is spent only where the code says so (``trainers.clock``): compute charges the
compute model's time, waits last until what they wait for completes. Everything else (Python,
the optimizer step, copying tensors) takes no virtual time beyond the model's per-step overhead.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

from trainers.comm import ProcessKilled


class SimAborted(BaseException):
    """Raised in a rank's thread to unwind it when the simulation ends early (another rank
    failed, or every rank waits for something that will never come)."""


class Deadlock(RuntimeError):
    """Every unfinished rank waits and no event is left that could wake one."""


@dataclass
class Completion:
    """Something ranks can wait for: done at a virtual time, waking whoever waits and running its
    callbacks (at once, on whichever thread completes it: the engine's, or a running rank's)."""

    done: bool = False
    at: Optional[float] = None
    waiters: list = field(default_factory=list)  # (rank, life) of each rank waiting
    what: str = ""
    callbacks: list = field(default_factory=list)


@dataclass(frozen=True)
class ComputeModel:
    """Virtual time a rank's compute takes.

    Args:
        forward_backward_s: one forward + backward (before a compute profile's ``min_compute_s``
            padding, which still applies).
        step_overhead_s: per step outside forward + backward (optimizer, copies).
        forward_fraction: the share of ``forward_backward_s`` that is the forward pass, spent layer
            by layer as the forward runs; the rest is spread over the backward pass's gradients,
            so that communication launched during backward overlaps what is left of it (both in
            proportion to the layers' multiply-accumulates: ``trainers.sim.SimClock.attach``).
        source: where the numbers come from (for records).
        start_offsets_s: start-up skew, per rank: seconds from the job's first rank's first step
            to this rank's first step (on tun: process start-up, data loading and the first
            broadcast put ranks 0.3-1.2 s apart). Empty (the default): no start-up term, each
            rank begins its first step when its setup is done. Given: every rank's first step is
            held until every rank has reached it (at T, the simulated setup's end) and then until
            T + its offset (:meth:`Simulator.training_starts`); a rank not listed has offset 0.
    """

    forward_backward_s: float
    step_overhead_s: float = 0.0
    forward_fraction: float = 1.0 / 3.0
    source: str = ""
    start_offsets_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.forward_backward_s >= 0 or not self.step_overhead_s >= 0:
            raise ValueError(f"compute times must be >= 0, got {self.forward_backward_s}, {self.step_overhead_s}")
        if not 0 <= self.forward_fraction <= 1:
            raise ValueError(f"forward_fraction must be in [0, 1], got {self.forward_fraction}")
        offsets = tuple(float(s) for s in self.start_offsets_s)  # a list from sim.json
        if not all(0 <= s <= 3600 for s in offsets):  # also refuses NaN
            raise ValueError(f"start_offsets_s must be seconds in [0, 3600], got {list(self.start_offsets_s)}")
        object.__setattr__(self, "start_offsets_s", offsets)


class Simulator:
    """The event loop, the virtual clock and the ranks' threads (see the module docstring).

    A rank's process can be killed (:meth:`crash`, an injected node_crash): its thread unwinds
    at once (``ProcessKilled``), the engine never resumes it again, and the comm layers drop what
    it had in flight (``on_crash``). :meth:`restart` starts a fresh process for the rank, a new
    thread running ``respawn(rank, generation)``, where the job can take a rank back. Each
    process of a rank is one *life*, numbered by its restarts (``generation``): whatever was
    scheduled for an earlier life is ignored.

    Args:
        world_size: ranks.
        network: the fluid network (``start_flow``, ``advance``, ``next_completion``, ``set_link``).
        compute: the compute model.
        max_time_s: virtual time after which the run is ended (None: no limit).
        wire_scale: every message and collective is charged this many times its real bytes (a
            stand-in model: the stand-in's bytes over the real model's; :meth:`wire_bytes`).
    """

    def __init__(self, world_size: int, network, compute: ComputeModel, max_time_s: Optional[float] = None,
                 wire_scale: float = 1.0):
        if not (wire_scale > 0 and math.isfinite(wire_scale)):
            raise ValueError(f"wire_scale must be a finite number > 0, got {wire_scale!r}")
        self.world_size = world_size
        self.network = network
        self.compute = compute
        self.wire_scale = float(wire_scale)
        self.compute_factor: dict[int, float] = {}  # rank -> slowdown (stragglers)
        self.max_time_s = max_time_s
        self.now = 0.0
        self._events: list = []
        self._order = itertools.count()
        self._wake = [threading.Semaphore(0) for _ in range(world_size)]
        self._back = threading.Semaphore(0)
        self._local = threading.local()
        self._aborting = False
        self._finished: set[int] = set()
        self._threads: list[threading.Thread] = []
        self.errors: dict[int, BaseException] = {}
        self.waiting_on: dict[int, str] = {}
        self.on_network_change: list[Callable[[], None]] = []  # called after every timed action
        # Crashes and restarts (faults): each rank's current life (its restarts), the lives killed,
        # when each rank was last killed, what a life's failed communication raises, what it waits
        # on, and what is called when a rank is killed (the comm layers' exchanges).
        self.generation = [0] * world_size
        self._killed: set[tuple[int, int]] = set()
        self.crashed_at: dict[int, float] = {}
        self._broken: dict[tuple[int, int], BaseException] = {}
        self._blocked: dict[tuple[int, int], Completion] = {}
        self.on_crash: list[Callable[[int], None]] = []
        # How to start a rank's process again: (rank, generation) -> its body; None: this job
        # cannot take a rank back, for the reason in ``restart_refusal``.
        self.respawn: Optional[Callable[[int, int], Callable[[], None]]] = None
        self.restart_refusal = "the job cannot take a rank back"
        # Start-up (compute.start_offsets_s): the first processes' ranks yet to reach their first
        # step, and the start line, done when none is left (None: no start-up term)
        if len(compute.start_offsets_s) > world_size:
            raise ValueError(f"start_offsets_s has {len(compute.start_offsets_s)} ranks, the job {world_size}")
        self._start_line: Optional[Completion] = (Completion(what="the other ranks' start-up")
                                                  if compute.start_offsets_s else None)
        self._not_started: set[int] = set(range(world_size))

    # -- scheduling (engine side) ------------------------------------------------------------

    def wire_bytes(self, nbytes: float) -> float:
        """What ``nbytes`` of real tensor bytes are charged on the network: ``nbytes`` x
        ``wire_scale``, the one place a stand-in's size enters the simulation (messages' flows,
        collectives' models and the comms' byte counters all take it from here)."""
        return nbytes * self.wire_scale

    def at(self, time_s: float, action: Callable[[], None]) -> None:
        """Run ``action`` at virtual time ``time_s`` (not before now)."""
        heapq.heappush(self._events, (max(time_s, self.now), next(self._order), action))

    def run(self, targets: list[Callable[[], None]], actions=()) -> None:
        """Run every rank's ``targets[rank]`` to its end; ``actions``: (virtual s, fn(simulator)).

        The run ends when every rank's current process has ended: an action still due then (a
        restart after the others finished) is not applied."""
        for time_s, action in sorted(actions, key=lambda a: a[0]):
            self.at(time_s, lambda action=action: self._apply(action))
        for rank, target in enumerate(targets):
            self._start(rank, target)
        try:
            self._loop()
        finally:
            self._abort_all()
            for thread in self._threads:
                thread.join(timeout=10)

    def _start(self, rank: int, target: Callable[[], None]) -> None:
        """A thread for the current life of ``rank``, resumed now."""
        life = self.generation[rank]
        thread = threading.Thread(target=self._rank_main, args=(rank, life, target),
                                  name=f"sim-rank{rank}" + (f"-life{life}" if life else ""), daemon=True)
        self._threads.append(thread)
        thread.start()
        self.at(self.now, lambda: self._resume(rank, life))

    def _loop(self) -> None:
        network = self.network
        while len(self._finished) < self.world_size:
            if self.errors:
                return
            next_flow = network.next_completion()
            next_event = self._events[0][0] if self._events else float("inf")
            when = min(next_flow, next_event)
            if when == float("inf"):
                blocked = ", ".join(f"rank {r}: {w}" for r, w in sorted(self.waiting_on.items()))
                raise Deadlock(f"at {self.now:.6f} s every unfinished rank waits and nothing can wake one ({blocked})")
            if self.max_time_s is not None and when > self.max_time_s:
                raise TimeoutError(f"simulated time passed max_time_s {self.max_time_s:g} s")
            self.now = float(when)  # never a numpy scalar: times end up in records and snapshots
            for delivery in network.advance(when):
                delivery.token.delivered(self, delivery)
            if self._events and self._events[0][0] <= when:
                _, _, action = heapq.heappop(self._events)
                action()

    def _apply(self, action: Callable) -> None:
        """A timed action (a fault); afterwards whatever waited on a path that was down retries."""
        action(self)
        for retry in list(self.on_network_change):
            retry()

    def _resume(self, rank: int, life: int) -> None:
        if rank in self._finished or life != self.generation[rank]:
            return  # ended, or an earlier life's wake-up
        self.waiting_on.pop(rank, None)
        self._wake[rank].release()
        self._back.acquire()

    def _abort_all(self) -> None:
        self._aborting = True
        for rank in range(self.world_size):
            if rank not in self._finished:
                self._wake[rank].release()
                self._back.acquire(timeout=10)

    # -- crashes and restarts (engine side: faults) ----------------------------------------------

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s current process runs (not ended, not killed)."""
        return rank not in self._finished

    def crash(self, rank: int) -> str:
        """Kill ``rank``'s process now, as SIGKILL does: its thread unwinds without another record,
        the engine never resumes it, the comm layers drop its flows (``on_crash``). Returns what
        was done, for the record."""
        if not self.alive(rank):
            return f"rank {rank} had already ended: nothing to kill"
        key = (rank, self.generation[rank])
        self._killed.add(key)
        self.crashed_at[rank] = self.now
        self.waiting_on.pop(rank, None)
        blocked = self._blocked.pop(key, None)
        if blocked is not None and key in blocked.waiters:
            blocked.waiters.remove(key)
        for hook in list(self.on_crash):
            hook(rank)
        if key[1] == 0:
            self._started(rank)  # a first process killed in its start-up never reaches the start line
        self._wake[rank].release()  # it raises ProcessKilled where it waits and unwinds
        self._back.acquire()
        return f"rank {rank} killed"

    def restart(self, rank: int) -> str:
        """Start a fresh process for ``rank`` now (its restart count one more: torchrun's
        TORCHELASTIC_RESTART_COUNT), if it is not running and the job can take it back."""
        if self.alive(rank):
            return f"rank {rank} still running; not restarted"
        if self.respawn is None:
            return f"not restarted: {self.restart_refusal}"
        self.generation[rank] += 1
        self._finished.discard(rank)
        self._start(rank, self.respawn(rank, self.generation[rank]))
        return f"rank {rank} restarted (restart {self.generation[rank]})"

    def break_comm(self, rank: int, error: BaseException) -> None:
        """From now on every wait of ``rank``'s current process for communication raises ``error``,
        the one it is in too (a transport whose connection to a crashed peer closed)."""
        if not self.alive(rank):
            return
        key = (rank, self.generation[rank])
        self._broken.setdefault(key, error)
        blocked = self._blocked.pop(key, None)
        if blocked is not None and key in blocked.waiters:  # else it is done and about to resume
            blocked.waiters.remove(key)
            self.at(self.now, lambda: self._resume(*key))

    # -- the ranks' side -----------------------------------------------------------------------

    def _rank_main(self, rank: int, life: int, target: Callable[[], None]) -> None:
        self._wake[rank].acquire()
        self._local.rank, self._local.life = rank, life
        try:
            if not self._aborting and (rank, life) not in self._killed:
                target()
                self.settle()
        except (SimAborted, ProcessKilled):
            pass
        except BaseException as error:  # noqa: BLE001 - reported by run_simulated
            self.errors[rank] = error
        finally:
            self._finished.add(rank)
            if life == 0:
                self._started(rank)  # ended without a step: the others need not wait for it
            self._back.release()

    @property
    def rank(self) -> int:
        """The rank whose thread calls this."""
        return self._local.rank

    def _yield(self) -> None:
        """Hand control back to the engine until this rank is resumed."""
        rank, life = self._local.rank, self._local.life
        if (rank, life) in self._killed:  # unwinding a killed process: it never waits again
            raise ProcessKilled(f"rank {rank}: its process was killed")
        self._back.release()
        self._wake[rank].acquire()
        if self._aborting:
            raise SimAborted(f"rank {rank}: the simulation ended")
        if (rank, life) in self._killed:
            raise ProcessKilled(f"rank {rank}: its process was killed")

    def training_starts(self) -> None:
        """This rank is about to begin its first step. Without start offsets, nothing. With them
        (``compute.start_offsets_s``), the rank waits until every rank's first process has got
        here (the latest at T) and then until T + its offset, so the ranks' first steps are as
        far apart as the offsets say, whatever their simulated setup took (a restarted process
        is not held)."""
        line, rank, life = self._start_line, self._local.rank, self._local.life
        if line is None or life > 0:
            return
        self.settle()
        self._started(rank)
        self.wait(line)
        offsets = self.compute.start_offsets_s
        self.sleep(line.at + (offsets[rank] if rank < len(offsets) else 0.0) - self.now)
        self.settle()

    def _started(self, rank: int) -> None:
        """``rank``'s first process reached its first step (or will never): the start line is
        done when no rank is left."""
        line = self._start_line
        self._not_started.discard(rank)
        if line is not None and not line.done and not self._not_started:
            self.complete(line)

    def sleep(self, seconds: float) -> None:
        """Spend ``seconds`` of virtual time on this rank.

        Lazily: the time is owed, and paid (the rank yields until the engine's clock reaches it)
        when the rank next does something others can see or reads the clock (:meth:`settle`).
        What a rank computes between two such points cannot be observed in between, so the
        result is the same as yielding at once, with fewer thread switches.
        """
        if seconds > 0:
            self._local.owed = getattr(self._local, "owed", 0.0) + seconds

    def settle(self) -> None:
        """Pay the time this rank owes: resume it when the engine's clock has reached it."""
        owed = getattr(self._local, "owed", 0.0)
        if owed <= 0:
            return
        self._local.owed = 0.0
        rank, life = self._local.rank, self._local.life
        self.waiting_on[rank] = f"computing until {self.now + owed:.6f} s"
        self.at(self.now + owed, lambda: self._resume(rank, life))
        self._yield()

    def wait(self, completion: Completion) -> None:
        """Block this rank until ``completion`` is done (or its communication broke: the error)."""
        self.settle()
        key = (self._local.rank, self._local.life)
        while not completion.done:
            if key in self._broken:
                raise self._broken[key]
            completion.waiters.append(key)
            self._blocked[key] = completion
            self.waiting_on[key[0]] = completion.what or "a completion"
            self._yield()
            self._blocked.pop(key, None)

    def complete(self, completion: Completion) -> None:
        """Mark ``completion`` done now and wake its waiters (engine side, or a running rank)."""
        completion.done = True
        completion.at = self.now
        waiters, completion.waiters = completion.waiters, []
        for rank, life in waiters:
            self.at(self.now, lambda rank=rank, life=life: self._resume(rank, life))
        callbacks, completion.callbacks = completion.callbacks, []
        for callback in callbacks:
            callback()

    def complete_at(self, time_s: float, completion: Completion, then: Optional[Callable[[], None]] = None) -> None:
        """Complete ``completion`` at ``time_s``, first running ``then`` (e.g. writing a result)."""
        def action():
            if then is not None:
                then()
            self.complete(completion)
        self.at(time_s, action)
