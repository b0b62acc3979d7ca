"""The one communication layer: every byte an algorithm exchanges goes through a :class:`Comm`.

Algorithms never call ``torch.distributed`` directly. :class:`TorchComm` implements the interface
with a torch.distributed process group; a virtual-clock simulator can implement the same
interface later. The base class does the accounting, per operation:

* ``bytes_sent`` / ``bytes_recv``: logical payload bytes by the textbook model of each collective
  (ring all-reduce: 2(n-1)/n of the tensor each way; broadcast from a flat root: the root sends
  (n-1) copies, every other rank receives one; ring all-gather: (n-1) tensors each way;
  point-to-point: exactly the tensor). Transport headers are not counted.
* ``blocked_s``: wall time the caller spent inside a blocking call or in ``Work.wait()``. The
  time an asynchronous operation runs in the background while the caller computes is not blocked.

Measured on the emulated WAN: gloo all_reduce is round-trip bound (about 7 round trips for 10 MB
between 2 ranks), while isend/irecv moves 100 MB about 4x faster; choose per algorithm.

:meth:`Comm.allreduce_async` is our own non-blocking all-reduce over point-to-point messages
(ring, direct exchange, recursive doubling, or the backend's own collective), run by background
threads (started in launch order, each with its own message tag), so it progresses while the
caller computes. ``auto``
picks the direct exchange (one round trip) for small payloads and the ring (2(n-1)/n of the
tensor per rank) for large ones; see :data:`DIRECT_MAX_BYTES`.

:class:`MessageStreams` carries a parameter-server exchange (``p3``, ``ps_sync``): fixed-size keyed
messages, one stream per ordered pair of ranks, sent one at a time per destination in priority or
FIFO order, with every expected receive posted up front; background threads on gloo, events on
the simulator (its ``_stream_driver``).
"""

from __future__ import annotations

import datetime
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from trainers import clock
from concurrent.futures import Future, ThreadPoolExecutor
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

import torch

ReduceOp = Literal["sum", "avg", "max", "min"]
AllReduceAlgorithm = Literal["auto", "ring", "direct", "recursive_doubling", "gloo"]
ALLREDUCE_ALGORITHMS = ("auto", "ring", "direct", "recursive_doubling", "gloo")
# ``auto`` uses the direct exchange while (world - 1) x tensor bytes (what one rank sends) is at
# most this, and the ring above it. Direct costs about one one-way delay L plus (n-1) S / B of
# sending, the ring 2(n-1) L plus 2(n-1)/n S / B: direct wins while (n-1)(1 - 2/n) S < (2n-3) L B.
# With L = 100 ms, B = 1 Gbit/s, n = 4 that is S < 42 MB, i.e. (n-1) S < 125 MB. Measured on the
# emulated aws-4region WAN (one-way 34-108 ms, 1 Gbit/s per pair, 4 ranks; docs/RESULTS.md,
# bench/bench_allreduce.py): direct is faster than the ring up to 16 MB tensors (0.62x), a tie at
# 32 MB (0.80x and 1.07x in two runs), slower at 64 MB (1.67x): the crossover is ~32 MB per tensor,
# (n-1) S ~ 96 MB (the delay line's CPU makes extra bytes dearer than the model says). 64 MiB
# switches to the ring at ~22 MB per tensor for 4 ranks, on the safe side of the tie.
DIRECT_MAX_BYTES = 64 * 2**20
# Background all-reduces run at once (more wait for a thread, started in launch order), and the
# number of distinct message tags they cycle through (far more than can be in flight).
BACKGROUND_THREADS = 4
BACKGROUND_TAGS = 1024
# The background tag of :class:`MessageStreams`' messages: past those the all-reduces cycle through.
STREAM_TAG = BACKGROUND_TAGS
STREAM_KEY_BYTES = 8  # each stream message starts with its key, one int64
# How long closing the streams waits for their threads, in all (s). At the normal end every
# operation is done and the threads only have to see the end; on an error, an operation still
# waiting after a moment waits on a peer that is not answering, and the error should not wait
# for it (the thread is a daemon, left behind and named in a warning).
STREAM_CLOSE_S = 10.0
STREAM_CLOSE_ON_ERROR_S = 2.0
OPS = ("all_reduce", "broadcast", "all_gather", "send", "recv", "isend", "irecv", "barrier", "external")

log = logging.getLogger(__name__)


@dataclass
class OpStats:
    """Totals for one kind of operation."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    blocked_s: float = 0.0


@dataclass
class CommStats:
    """Running totals over all operations, and per operation name."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    blocked_s: float = 0.0
    per_op: dict[str, OpStats] = field(default_factory=lambda: {op: OpStats() for op in OPS})

    def snapshot(self) -> tuple[int, int, float]:
        """(bytes_sent, bytes_recv, blocked_s) now; subtract two snapshots for an interval."""
        return self.bytes_sent, self.bytes_recv, self.blocked_s


class PeerLost(ConnectionError):
    """A peer crashed, left, or was dropped from the membership; ``rank`` says which.

    Only elastic backends (``Comm.elastic``) raise it; crash-tolerant algorithms catch it and go
    on without that peer.
    """

    def __init__(self, rank: int, why: str):
        super().__init__(f"rank {rank} {why}")
        self.rank = rank


class ProcessKilled(BaseException):
    """Unwinds a simulated rank whose process was killed (``trainers.sim``: an injected crash).

    A killed process runs nothing more: the runner lets this pass without a status record and the
    comm says no goodbye, so the rank's records end where a SIGKILL would have ended them. Never
    raised in a real process. A BaseException, so that no ``except Exception`` stops it.
    """


class Work:
    """Handle of an asynchronous operation. ``wait()`` blocks, is accounted, and returns the result.

    ``then(fn)`` returns a handle whose ``wait()`` returns ``fn(result)``; gradient-exchange
    wrappers (e.g. compression) use it to decode after the exchange finishes.

    Args:
        comm: the Comm that accounts the blocked time.
        op: operation name for accounting.
        wait_fn: blocks until the operation is done and returns its result (called at most once).
        poll_fn: returns True once the operation is done without blocking (None: unknown -> False).
        accounted: whether time in ``wait()`` counts as blocked (False for derived handles).
    """

    def __init__(
        self,
        comm: "Comm",
        op: str,
        wait_fn: Callable[[], Optional[torch.Tensor]],
        poll_fn: Optional[Callable[[], bool]] = None,
        accounted: bool = True,
    ):
        self._comm = comm
        self._op = op
        self._wait_fn = wait_fn
        self._poll_fn = poll_fn
        self._accounted = accounted
        self._done = False
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> Optional[torch.Tensor]:
        """Block until done; return the result tensor (None for operations without one)."""
        if not self._done:
            start = clock.perf_counter()
            self._result = self._wait_fn()
            if self._accounted:
                self._comm._account(self._op, 0, 0, clock.perf_counter() - start, calls=0)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        """True if ``wait()`` would not block."""
        return self._done or bool(self._poll_fn and self._poll_fn())

    def then(self, fn: Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]]) -> "Work":
        """A handle whose result is ``fn`` applied to this handle's result.

        Only the inner wait is accounted as blocked time (``fn`` is local work, e.g. decoding).
        """
        return Work(self._comm, self._op, lambda: fn(self.wait()), self.is_completed, accounted=False)


class Comm(ABC):
    """Interface and accounting shared by every communication backend.

    Collectives must be called by every rank in the same order. Tensors are updated in place;
    asynchronous calls (``async_op=True``, ``isend``, ``irecv``) return a :class:`Work`.

    Args:
        rank: this process's global rank.
        world_size: number of ranks.
    """

    # True for a backend that survives a peer's crash (raises PeerLost, admits restarted ranks).
    elastic = False
    # Restarts of this rank's process before this one (torchrun's TORCHELASTIC_RESTART_COUNT); an
    # elastic backend's restarted process rejoins (trainers/comm_tcp.py).
    generation = 0

    def __init__(self, rank: int, world_size: int, allreduce: AllReduceAlgorithm = "gloo"):
        if allreduce not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"allreduce: {allreduce!r} is not one of {ALLREDUCE_ALGORITHMS}")
        self.rank = rank
        self.world_size = world_size
        self.stats = CommStats()
        # The algorithm ``allreduce_async`` uses when none is named (comm.allreduce in the config).
        self.allreduce_algorithm: AllReduceAlgorithm = allreduce
        self._accounting = threading.Lock()
        self._background: Optional[ThreadPoolExecutor] = None
        self._launched = 0  # background all-reduces launched so far: the same count on every rank

    @property
    def transport(self) -> str:
        """Which all-reduce this comm runs by default, for the records: "gloo" (the backend's own
        collective) or "ours:<algorithm>" (:meth:`allreduce_async` over point-to-point messages)."""
        if self.allreduce_algorithm == "gloo":
            return "gloo"
        return f"ours:{self.allreduce_algorithm}"

    # -- membership (fixed for a non-elastic backend) -------------------------------------------

    def live_ranks(self) -> list[int]:
        """Ranks taking part now, this one included, in order."""
        return list(range(self.world_size))

    def is_live(self, rank: int) -> bool:
        """Whether ``rank`` takes part now (exchanges with it can be started)."""
        return 0 <= rank < self.world_size

    # -- public API ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Optional[Work]:
        """Reduce ``tensor`` over all ranks in place (op: sum | avg | max | min)."""
        n = self.world_size
        nbytes = tensor_nbytes(tensor)
        ring_bytes = 2 * (n - 1) * nbytes // n
        return self._run("all_reduce", ring_bytes, ring_bytes, async_op, lambda: self._all_reduce(tensor, op))

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Copy ``tensor`` from rank ``src`` to every rank, in place."""
        nbytes = tensor_nbytes(tensor)
        sent = nbytes * (self.world_size - 1) if self.rank == src else 0
        recv = 0 if self.rank == src else nbytes
        return self._run("broadcast", sent, recv, async_op, lambda: self._broadcast(tensor, src))

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False) -> Optional[Work]:
        """Gather ``tensor`` from every rank into ``outputs`` (one tensor per rank, same shape)."""
        if len(outputs) != self.world_size:
            raise ValueError(f"outputs: need {self.world_size} tensors, got {len(outputs)}")
        nbytes = tensor_nbytes(tensor) * (self.world_size - 1)
        return self._run("all_gather", nbytes, nbytes, async_op, lambda: self._all_gather(outputs, tensor))

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``; blocks until it is handed to the transport."""
        self._run("send", tensor_nbytes(tensor), 0, False, lambda: self._isend(tensor, dst))

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Receive into ``tensor`` from rank ``src``; blocks until it arrived."""
        self._run("recv", 0, tensor_nbytes(tensor), False, lambda: self._irecv(tensor, src))

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        """Start sending ``tensor`` to ``dst``; do not modify it before ``wait()``."""
        return self._run("isend", tensor_nbytes(tensor), 0, True, lambda: self._isend(tensor, dst))

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        """Start receiving into ``tensor`` from ``src``; its content is valid after ``wait()``."""
        return self._run("irecv", 0, tensor_nbytes(tensor), True, lambda: self._irecv(tensor, src))

    def irecv_any(self, tensor: torch.Tensor) -> Work:
        """Start receiving into ``tensor`` from whichever rank sends first; ``wait()`` returns that rank (int).

        Accounted as an ``irecv``. Messages between one pair of ranks still arrive in the order sent.
        """
        return self._run("irecv", 0, tensor_nbytes(tensor), True, lambda: self._irecv_any(tensor))

    def recv_any(self, tensor: torch.Tensor, sources: Optional[list[int]] = None) -> int:
        """Receive into ``tensor`` from whichever rank sends first; blocks; returns the sender's rank.

        ``sources``: the ranks expected to send. An elastic backend waits only for them and raises
        :class:`PeerLost` when one of them is gone with nothing left to deliver; other backends
        receive from any rank.
        """
        return self._run("recv", 0, tensor_nbytes(tensor), True, lambda: self._irecv_any(tensor, sources)).wait()

    def ring_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over all ranks in place with the ring of :meth:`allreduce_async`; blocks; returns it.

        On a WAN this needs far fewer round trips than gloo's all_reduce (measured: 100 MB between
        2 ranks at 25 ms one-way, all_reduce 3.3 s, one isend/irecv 0.76 s).
        """
        self.allreduce_async(tensor, op, algorithm="ring").wait()
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = "sum",
                        algorithm: Optional[AllReduceAlgorithm] = None) -> Work:
        """Start reducing ``tensor`` over all ranks in place; returns a :class:`Work` (``wait()`` returns it).

        Runs on this comm's background threads (up to BACKGROUND_THREADS all-reduces at once,
        started in launch order, each with its own message tag; every rank must launch the same
        sequence), so it progresses while the caller computes; only ``wait()`` is blocked time.
        Results are bitwise equal on every rank and from run to run.

        Args:
            tensor: contiguous tensor, the same shape on every rank; not to be touched before ``wait()``.
            op: sum | avg | max | min (avg: sum, then divide by the world size).
            algorithm: ring (reduce-scatter + all-gather: each rank sends 2(n-1)/n of the tensor in
                2(n-1) steps; bandwidth-optimal) | direct (every rank sends its tensor to every
                other and sums all n in rank order: one one-way delay, (n-1) tensors sent) |
                recursive_doubling (log2(n) rounds of whole-tensor exchange; extra ranks of a
                non-power-of-two world fold in first) | gloo (the backend's own all_reduce) |
                auto (direct while (n-1) x bytes <= DIRECT_MAX_BYTES, else ring) | None (this
                comm's ``allreduce_algorithm``).
        """
        algorithm = self._allreduce_algorithm_for(tensor, op, algorithm)
        if algorithm == "gloo":
            return self.all_reduce(tensor, op, async_op=True)
        n = self.world_size
        if n == 1:
            return self._run("all_reduce", 0, 0, True, lambda: ((lambda: tensor), (lambda: True)))
        flat = tensor.view(-1)
        run = {"ring": self._ring, "direct": self._direct, "recursive_doubling": self._recursive_doubling}[algorithm]
        sent, recv = allreduce_bytes(algorithm, self.rank, n, flat)

        # Each all-reduce has its own message tag, so several can run at once (DTS with t >= 1
        # keeps t + 1 in flight) without their messages crossing; they start in launch order.
        tag = self._launched % BACKGROUND_TAGS
        self._launched += 1

        def launch():
            if self._background is None:
                self._background = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix=f"allreduce-rank{self.rank}")
            future: Future = self._background.submit(run, flat, op, tag)
            return (lambda: (future.result(), tensor)[1]), future.done

        return self._run("all_reduce", sent, recv, True, launch)

    def _allreduce_algorithm_for(self, tensor: torch.Tensor, op: ReduceOp,
                                 algorithm: Optional[AllReduceAlgorithm]) -> str:
        """The all-reduce :meth:`allreduce_async` runs for ``tensor``: the one named, else this
        comm's; ``auto`` resolved by size (see :data:`DIRECT_MAX_BYTES`). Checks the arguments."""
        algorithm = self.allreduce_algorithm if algorithm is None else algorithm
        if algorithm not in ALLREDUCE_ALGORITHMS:
            raise ValueError(f"algorithm: {algorithm!r} is not one of {ALLREDUCE_ALGORITHMS}")
        if op not in COMBINE:
            raise ValueError(f"op: {op!r} is not one of {tuple(COMBINE)}")
        if algorithm == "gloo":
            return algorithm
        if not tensor.is_contiguous():
            raise ValueError("allreduce_async: tensor must be contiguous")
        if algorithm == "auto":
            return "direct" if (self.world_size - 1) * tensor_nbytes(tensor) <= DIRECT_MAX_BYTES else "ring"
        return algorithm

    # -- the background all-reduce algorithms (on the background thread; not accounted here) ------

    def _p2p(self, tag: int, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post every receive and send, then wait for all; empty tensors are skipped."""
        waits = [self._isend_background(t, peer, tag)[0] for t, peer in sends if t.numel()]
        waits = [self._irecv_background(t, peer, tag)[0] for t, peer in recvs if t.numel()] + waits
        for wait in waits:
            wait()

    def _isend_background(self, tensor: torch.Tensor, dst: int, tag: int):
        """The background all-reduce's send; ``tag`` (0 .. BACKGROUND_TAGS-1) tells its all-reduce apart
        (:data:`STREAM_TAG`, past them: :class:`MessageStreams`' messages)."""
        raise NotImplementedError(f"{type(self).__name__} has no tagged point-to-point for allreduce_async")

    def _irecv_background(self, tensor: torch.Tensor, src: int, tag: int):
        """The background all-reduce's receive (see :meth:`_isend_background`)."""
        raise NotImplementedError(f"{type(self).__name__} has no tagged point-to-point for allreduce_async")

    def _stream_driver(self) -> "ThreadedStreamDriver":
        """What runs :class:`MessageStreams`' background work on this comm: threads over the tagged
        point-to-point messages of the background all-reduce (the simulator has its own)."""
        if type(self)._isend_background is Comm._isend_background:
            raise NotImplementedError(f"{type(self).__name__} has no tagged point-to-point messages, which message "
                                      "streams (p3, ps_sync) need: use comm backend gloo")
        return ThreadedStreamDriver(self)

    def _ring(self, flat: torch.Tensor, op: ReduceOp, tag: int) -> None:
        n = self.world_size
        chunks = list(torch.tensor_split(flat, n))
        right, left = (self.rank + 1) % n, (self.rank - 1) % n
        combine = COMBINE[op]
        scratch = torch.empty_like(chunks[0])
        for step in range(n - 1):  # reduce-scatter: rank r ends owning the reduced chunk r+1
            send_index, recv_index = (self.rank - step) % n, (self.rank - step - 1) % n
            incoming = scratch[: chunks[recv_index].numel()]
            self._p2p(tag, [(chunks[send_index], right)], [(incoming, left)])
            combine(chunks[recv_index], incoming)
        for step in range(n - 1):  # all-gather: pass the reduced chunks around the ring
            send_index, recv_index = (self.rank - step + 1) % n, (self.rank - step) % n
            self._p2p(tag, [(chunks[send_index], right)], [(chunks[recv_index], left)])
        if op == "avg":
            flat.div_(n)

    def _direct(self, flat: torch.Tensor, op: ReduceOp, tag: int) -> None:
        n = self.world_size
        peers = [r for r in range(n) if r != self.rank]
        parts = {r: torch.empty_like(flat) for r in peers}
        parts[self.rank] = flat.clone()
        self._p2p(tag, [(parts[self.rank], r) for r in peers], [(parts[r], r) for r in peers])
        flat.copy_(parts[0])
        for r in range(1, n):  # in rank order: the same bits on every rank
            COMBINE[op](flat, parts[r])
        if op == "avg":
            flat.div_(n)

    def _recursive_doubling(self, flat: torch.Tensor, op: ReduceOp, tag: int) -> None:
        n, rank = self.world_size, self.rank
        power = 1 << (n.bit_length() - 1)  # the largest power of two <= n
        extra = n - power
        combine = COMBINE[op]
        incoming = torch.empty_like(flat)
        if rank >= power:  # fold into rank - power, get the result back at the end
            self._p2p(tag, [(flat, rank - power)], [])
            self._p2p(tag, [], [(flat, rank - power)])
        else:
            if rank < extra:
                self._p2p(tag, [], [(incoming, rank + power)])
                combine(flat, incoming)
            distance = 1
            while distance < power:
                partner = rank ^ distance
                self._p2p(tag, [(flat, partner)], [(incoming, partner)])
                combine(flat, incoming)  # IEEE a + b == b + a: both partners get the same bits
                distance <<= 1
            if rank < extra:
                self._p2p(tag, [(flat, rank + power)], [])
        if op == "avg":
            flat.div_(n)

    def barrier(self) -> None:
        """Block until every rank reached the barrier."""
        self._run("barrier", 0, 0, False, self._barrier)

    def account_external(self, bytes_sent: int, bytes_recv: int, blocked_s: float = 0.0) -> None:
        """Account traffic moved by a component outside this layer (torch DDP's own reducer)."""
        self._account("external", bytes_sent, bytes_recv, blocked_s)

    def shutdown(self) -> None:
        """Release the backend (idempotent)."""
        self._stop_background()

    def _stop_background(self) -> None:
        """End the background all-reduce thread; an all-reduce nobody waited for is dropped."""
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
            self._background = None

    # -- backend hooks: each returns a wait function (blocks, returns the result tensor) ---------

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> tuple[Callable, Callable]: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> tuple[Callable, Callable]: ...

    @abstractmethod
    def _all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> tuple[Callable, Callable]: ...

    @abstractmethod
    def _isend(self, tensor: torch.Tensor, dst: int) -> tuple[Callable, Callable]: ...

    @abstractmethod
    def _irecv(self, tensor: torch.Tensor, src: int) -> tuple[Callable, Callable]: ...

    @abstractmethod
    def _barrier(self) -> tuple[Callable, Callable]: ...

    def _irecv_any(self, tensor: torch.Tensor, sources=None) -> tuple[Callable, Callable]:
        """Receive from any source; the wait function returns the sender's rank. Optional for backends."""
        raise NotImplementedError(f"{type(self).__name__} cannot receive from any source (recv_any/irecv_any)")

    # -- accounting -----------------------------------------------------------------------------

    def _run(self, op: str, sent: int, recv: int, async_op: bool, launch: Callable) -> Optional[Work]:
        start = clock.perf_counter()
        wait_fn, poll_fn = launch()
        work = Work(self, op, wait_fn, poll_fn)
        self._account(op, sent, recv, clock.perf_counter() - start)
        if async_op:
            return work
        work.wait()
        return None

    def _account(self, op: str, sent: int, recv: int, blocked_s: float, calls: int = 1) -> None:
        with self._accounting:  # a background all-reduce may be launched from a hook thread
            per_op = self.stats.per_op[op]
            per_op.calls += calls
            per_op.bytes_sent += sent
            per_op.bytes_recv += recv
            per_op.blocked_s += blocked_s
            self.stats.bytes_sent += sent
            self.stats.bytes_recv += recv
            self.stats.blocked_s += blocked_s


class ThreadedStreamDriver:
    """Runs :class:`MessageStreams`' background work on threads: one per peer and direction, each
    waiting for its operations in the order they were started (a pair's messages arrive in the
    order sent) and then running their callbacks under :attr:`lock`. The simulator's driver
    (``trainers.sim.comm``) runs the same callbacks as events on the virtual clock.

    Args:
        comm: the comm whose ``_isend_background`` / ``_irecv_background`` carry the messages.
    """

    def __init__(self, comm: Comm):
        self.comm = comm
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._workers: dict[tuple[str, int], tuple[queue.SimpleQueue, threading.Thread]] = {}
        self.error: Optional[BaseException] = None

    def enter(self) -> None:
        """Called first by every :class:`MessageStreams` method, on the rank's thread (nothing to do
        here; a simulated rank first catches up with virtual time)."""

    def send(self, message: torch.Tensor, dst: int, on_done: Callable[[], None]) -> None:
        """Start sending ``message``; ``on_done()`` once it is handed to the transport."""
        wait_fn, _ = self.comm._isend_background(message, dst, STREAM_TAG)
        self._after(("send", dst), wait_fn, on_done)

    def recv(self, buffer: torch.Tensor, src: int, on_done: Callable[[], None]) -> None:
        """Post a receive into ``buffer``; ``on_done()`` once a message arrived in it."""
        wait_fn, _ = self.comm._irecv_background(buffer, src, STREAM_TAG)
        self._after(("recv", src), wait_fn, on_done)

    def notify(self) -> None:
        """Wake :meth:`wait` to look again (called with the lock held)."""
        self._changed.notify_all()

    def wait(self, predicate: Callable[[], bool]) -> None:
        """Block until ``predicate()`` (evaluated under the lock) holds; a worker's error is raised here."""
        with self.lock:
            while True:
                if self.error is not None:
                    raise RuntimeError(f"rank {self.comm.rank}: a message stream failed: {self.error}") from self.error
                if predicate():
                    return
                self._changed.wait()

    def close(self, timeout_s: float = STREAM_CLOSE_S) -> None:
        """End the worker threads (each after its queued operations), waiting ``timeout_s`` for
        all of them; one still running then (its operation waits on its peer) is left behind, a
        daemon, with a warning that names it. Never raises."""
        with self.lock:  # a worker's callback may start an operation (and a worker) meanwhile
            workers, self._workers = self._workers, {}
            for work, _ in workers.values():
                work.put(None)
        deadline = time.monotonic() + timeout_s  # real threads: the wall clock, never a virtual one
        for (direction, peer), (_, thread) in workers.items():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("rank %d: message stream thread %s (%s, peer rank %d) still waits on its operation "
                            "%.1f s after close; left running", self.comm.rank, thread.name, direction, peer, timeout_s)

    def _after(self, key: tuple[str, int], wait_fn: Callable, on_done: Callable[[], None]) -> None:
        if key not in self._workers:
            work: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=self._work, args=(work,), daemon=True,
                                      name=f"stream-{key[0]}-{key[1]}-rank{self.comm.rank}")
            self._workers[key] = (work, thread)
            thread.start()
        self._workers[key][0].put((wait_fn, on_done))

    def _work(self, work: queue.SimpleQueue) -> None:
        while (item := work.get()) is not None:
            wait_fn, on_done = item
            try:
                wait_fn()
                with self.lock:
                    on_done()
            except BaseException as error:  # noqa: BLE001 - raised on the rank's thread by wait()
                with self.lock:
                    self.error = self.error or error
                    self._changed.notify_all()
                return


@dataclass(frozen=True)
class StreamMessage:
    """A message built in place (:meth:`MessageStreams.new_message`): ``payload`` is the view of
    ``buffer`` after the key, to fill before handing the message to :meth:`MessageStreams.put`."""

    buffer: torch.Tensor
    payload: torch.Tensor


class MessageStreams:
    """Keyed messages of one fixed size between every pair of ranks, over one stream per ordered
    pair: the transport of a parameter-server exchange (``p3``, ``ps_sync``).

    Sending: each destination has a queue, and one message at a time is in flight to it (handed to
    the transport and waited for); the next is the queue's first by ``order``: ``priority`` (the
    smallest ``priority`` first, ties in put order: a message put later with a smaller priority
    overtakes the queued ones, never the one in flight, as in P3) or ``fifo`` (put order).
    Receiving: the caller says how many messages it expects from each source (:meth:`expect`) and
    their receives are posted at once, so no message waits for its receiver's "ready" notice; a
    stream delivers in order, so each receive is handed to ``on_message`` as it arrives, whatever
    its key. A message names itself (its key, the first 8 bytes): no flags or probes cross the wire.

    ``on_message(src, key, payload)`` runs under :attr:`lock` (on a receiving thread, or as an
    event in the simulator) and may :meth:`put`; the payload is valid only during the call. A put
    to this rank itself calls it at once. Every other method runs on the rank's own thread.

    A payload gathered from several tensors is best built in the message itself
    (:meth:`new_message`), so that it is written once: a tensor handed to :meth:`put` is copied.

    Accounting: a message's bytes (payload and key) under ``isend`` when it is handed to the
    transport and under ``irecv`` when it arrives; time in :meth:`wait_until` is blocked time.

    Args:
        comm: the comm layer (gloo's tagged point-to-point on threads, or the simulator's).
        payload_numel: elements of every message's payload.
        dtype: the payloads' dtype.
        on_message: the receiving side's callback (above).
        order: ``priority`` | ``fifo``.
        log_size: how many of the latest sends :attr:`sent` keeps, as (destination, key).
    """

    def __init__(self, comm: Comm, payload_numel: int, dtype: torch.dtype,
                 on_message: Callable[[int, int, torch.Tensor], None], order: str = "priority",
                 log_size: int = 100_000):
        if order not in ("priority", "fifo"):
            raise ValueError(f"order: {order!r} is not one of ('priority', 'fifo')")
        if payload_numel < 1:
            raise ValueError(f"payload_numel: must be >= 1, got {payload_numel}")
        self.comm = comm
        self.driver = comm._stream_driver()
        self.lock = self.driver.lock
        self.payload_numel = payload_numel
        self.dtype = dtype
        self.message_bytes = STREAM_KEY_BYTES + payload_numel * torch.empty(0, dtype=dtype).element_size()
        self.on_message = on_message
        self.order = order
        peers = [r for r in range(comm.world_size) if r != comm.rank]
        self._queues: dict[int, list] = {peer: [] for peer in peers}
        self._in_flight: dict[int, bool] = {peer: False for peer in peers}
        self._put_order = itertools.count()
        self._free: list[torch.Tensor] = []  # receive buffers whose message was handed on
        self._closed = False  # closed on an error: nothing more is sent
        self.sent: deque = deque(maxlen=log_size)  # (destination, key), in the order handed to the transport

    def new_message(self) -> StreamMessage:
        """An empty message of this stream's size: fill its ``payload`` (uninitialised, every
        element of it) and hand it to :meth:`put`, which sends it without a copy."""
        buffer = torch.empty(self.message_bytes, dtype=torch.uint8)
        return StreamMessage(buffer, buffer[STREAM_KEY_BYTES:].view(self.dtype))

    def put(self, destinations: list[int], key: int, payload: torch.Tensor | StreamMessage, priority=0) -> None:
        """Queue ``payload`` under ``key`` for each destination: a tensor (``payload_numel``
        elements) is copied now; a :class:`StreamMessage` from :meth:`new_message` is sent as it
        is, and belongs to the streams from now on (not to be written again, nor put twice)."""
        self.driver.enter()
        message = None
        if isinstance(payload, StreamMessage):
            if payload.buffer.numel() != self.message_bytes:
                raise ValueError(f"payload: a message of {payload.buffer.numel()} bytes, this stream's are "
                                 f"{self.message_bytes}")
            message, payload = payload.buffer, payload.payload
            message[:STREAM_KEY_BYTES].view(torch.int64)[0] = key
        else:
            payload = payload.detach().reshape(-1)
            if payload.numel() != self.payload_numel or payload.dtype != self.dtype:
                raise ValueError(f"payload: need {self.payload_numel} elements of {self.dtype}, "
                                 f"got {payload.numel()} of {payload.dtype}")
        with self.lock:
            for dst in destinations:
                if dst == self.comm.rank:
                    self.on_message(dst, key, payload)
                    continue
                if message is None:
                    message = torch.empty(self.message_bytes, dtype=torch.uint8)
                    message[:STREAM_KEY_BYTES].view(torch.int64)[0] = key
                    message[STREAM_KEY_BYTES:].view(self.dtype).copy_(payload)
                rank = (priority, next(self._put_order)) if self.order == "priority" else (next(self._put_order),)
                heapq.heappush(self._queues[dst], (rank, key, message))
                self._start_next(dst)

    def expect(self, src: int, count: int) -> None:
        """Post ``count`` receives from ``src`` (after those already posted)."""
        self.driver.enter()
        with self.lock:
            for _ in range(count):
                buffer = self._free.pop() if self._free else torch.empty(self.message_bytes, dtype=torch.uint8)
                self.driver.recv(buffer, src, lambda buffer=buffer: self._arrived(src, buffer))

    def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Block until ``predicate()`` holds (evaluated under the lock, again after every message
        that arrived or left); accounted as blocked time."""
        self.driver.enter()
        started = clock.perf_counter()
        try:
            self.driver.wait(predicate)
        finally:
            self.comm._account("irecv", 0, 0, clock.perf_counter() - started, calls=0)

    def idle(self) -> bool:
        """Whether nothing is queued or in flight to any destination (call under the lock)."""
        return not any(self._queues.values()) and not any(self._in_flight.values())

    def close(self, drain: bool = True, timeout_s: Optional[float] = None) -> None:
        """Stop the background work, its threads waited for ``timeout_s`` (default
        :data:`STREAM_CLOSE_S`, or :data:`STREAM_CLOSE_ON_ERROR_S` without ``drain``).

        drain: first wait until every queued message is handed to the transport (the normal end;
            raises a stream's error). False, on an error: drop what is queued and start nothing
            more; never raises, so that the error being handled is the one raised.
        """
        if drain:
            self.wait_until(self.idle)
            self.driver.close(STREAM_CLOSE_S if timeout_s is None else timeout_s)
            return
        try:
            with self.lock:
                self._closed = True
                for waiting in self._queues.values():
                    waiting.clear()
            self.driver.close(STREAM_CLOSE_ON_ERROR_S if timeout_s is None else timeout_s)
        except Exception as error:  # noqa: BLE001 - the caller is handling an error already
            log.warning("rank %d: closing the message streams after an error failed too: %s: %s",
                        self.comm.rank, type(error).__name__, error)

    def _start_next(self, dst: int) -> None:
        if self._closed or self._in_flight[dst] or not self._queues[dst]:
            return
        _, key, message = heapq.heappop(self._queues[dst])
        self._in_flight[dst] = True
        self.sent.append((dst, key))
        self.comm._account("isend", self.message_bytes, 0, 0.0)
        self.driver.send(message, dst, lambda: self._handed_over(dst))

    def _handed_over(self, dst: int) -> None:
        self._in_flight[dst] = False
        self._start_next(dst)
        self.driver.notify()

    def _arrived(self, src: int, buffer: torch.Tensor) -> None:
        self.comm._account("irecv", 0, self.message_bytes, 0.0)
        key = int(buffer[:STREAM_KEY_BYTES].view(torch.int64)[0])
        self.on_message(src, key, buffer[STREAM_KEY_BYTES:].view(self.dtype))
        self._free.append(buffer)
        self.driver.notify()


def _max_(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.maximum(target, other, out=target)


def require_torchrun_env(env) -> None:
    """Fail clearly unless the torchrun variables every backend's rendezvous needs are set."""
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
    if missing:
        raise RuntimeError(f"environment variables {missing} are not set: start one process per node with "
                           "torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT yourself")


def _min_(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.minimum(target, other, out=target)


# In-place combination of a received chunk into the local one, per reduce op ("avg": sum, then divide).
COMBINE = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "max": _max_, "min": _min_}


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements: what sending it puts on the wire (payload, no framing)."""
    return tensor.numel() * tensor.element_size()


def allreduce_bytes(algorithm: str, rank: int, n: int, flat: torch.Tensor) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` in one background all-reduce of ``flat``: exactly
    the tensors it puts on and takes off the transport."""
    size = flat.element_size()
    if algorithm == "ring":
        chunk = [c.numel() * size for c in torch.tensor_split(flat, n)]
        sent = sum(chunk[(rank - step) % n] + chunk[(rank - step + 1) % n] for step in range(n - 1))
        recv = sum(chunk[(rank - step - 1) % n] + chunk[(rank - step) % n] for step in range(n - 1))
        return sent, recv
    whole = flat.numel() * size
    if algorithm == "direct":
        return (n - 1) * whole, (n - 1) * whole
    power = 1 << (n.bit_length() - 1)
    if rank >= power:
        return whole, whole
    rounds = power.bit_length() - 1
    folded = 1 if rank < n - power else 0
    return (rounds + folded) * whole, (rounds + folded) * whole


_TORCH_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
BACKGROUND_TAG_BASE = 0x57420000  # "WB": torch.distributed message tags of the background all-reduces


class TorchComm(Comm):
    """Comm over a torch.distributed process group (gloo or nccl).

    With gloo and CUDA tensors the payload is staged through a CPU copy and copied back on
    ``wait()``, so algorithms can keep their tensors on the GPU for either backend.

    Args:
        backend: gloo | nccl.
        timeout_s: how long a collective may wait for peers before failing (s).
        device: torch device of the model's tensors.
    """

    def __init__(self, backend: str = "gloo", timeout_s: float = 300.0, device: torch.device | str = "cpu",
                 allreduce: AllReduceAlgorithm = "gloo"):
        import torch.distributed as dist

        self._dist = dist
        self.backend = backend
        self.device = torch.device(device)
        if not dist.is_initialized():
            require_torchrun_env(os.environ)
            kwargs = {}
            if backend == "nccl":
                kwargs["device_id"] = self.device
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        # NCCL's own all-reduce is already bandwidth-optimal on GPUs, and its point-to-point calls
        # are not safe from a second thread: "auto" means NCCL's collective there.
        if backend == "nccl" and allreduce == "auto":
            allreduce = "gloo"
        super().__init__(dist.get_rank(), dist.get_world_size(), allreduce)

    @property
    def transport(self) -> str:
        return self.backend if self.allreduce_algorithm == "gloo" else super().transport

    @property
    def process_group(self):
        """The underlying torch.distributed group (only for the `ddp` reference algorithm)."""
        return self._dist.group.WORLD

    def shutdown(self) -> None:
        self._stop_background()
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

    def _staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """CPU copy for gloo when the tensor lives on a GPU, and the copy-back to run on completion."""
        if self.backend == "gloo" and tensor.is_cuda:
            host = tensor.detach().to("cpu")
            return host, lambda: tensor.copy_(host)
        return tensor, lambda: None

    def _finish(self, work, copy_back: Callable[[], None], result: Optional[torch.Tensor], post=None):
        def wait_fn():
            if work is not None:
                work.wait()
            if post is not None:
                post()
            copy_back()
            return result

        return wait_fn, (lambda: work is None or work.is_completed())

    def _all_reduce(self, tensor, op):
        payload, copy_back = self._staged(tensor)
        work = self._dist.all_reduce(payload, op=getattr(self._dist.ReduceOp, _TORCH_OPS[op]), async_op=True)
        # gloo has no AVG: sum, then divide once the sum has arrived.
        post = (lambda: payload.div_(self.world_size)) if op == "avg" else None
        return self._finish(work, copy_back, tensor, post)

    def _broadcast(self, tensor, src):
        payload, copy_back = self._staged(tensor)
        work = self._dist.broadcast(payload, src=src, async_op=True)
        return self._finish(work, copy_back, tensor)

    def _all_gather(self, outputs, tensor):
        payload, _ = self._staged(tensor)
        staged = [self._staged(o) for o in outputs]
        work = self._dist.all_gather([s[0] for s in staged], payload, async_op=True)

        def copy_back():
            for _, back in staged:
                back()

        return self._finish(work, copy_back, None)

    def _isend(self, tensor, dst, tag: int = 0):
        payload, _ = self._staged(tensor)
        work = self._dist.isend(payload, dst=dst, tag=tag)
        return self._finish(work, lambda: None, None)

    def _irecv(self, tensor, src, tag: int = 0):
        payload, copy_back = self._staged(tensor)
        work = self._dist.irecv(payload, src=src, tag=tag)
        return self._finish(work, copy_back, tensor)

    # Tags above the caller's (0) keep each background all-reduce's messages apart.
    def _isend_background(self, tensor, dst, tag):
        return self._isend(tensor, dst, tag=BACKGROUND_TAG_BASE + tag)

    def _irecv_background(self, tensor, src, tag):
        return self._irecv(tensor, src, tag=BACKGROUND_TAG_BASE + tag)

    def _stream_driver(self) -> ThreadedStreamDriver:
        if self.backend == "nccl":  # its point-to-point calls are not safe from a second thread
            raise NotImplementedError("message streams (p3, ps_sync) send from background threads, which NCCL "
                                      "does not allow: use comm backend gloo (CUDA tensors are staged through the CPU)")
        return super()._stream_driver()

    def _irecv_any(self, tensor, sources=None):
        payload, copy_back = self._staged(tensor)
        work = self._dist.irecv(payload, src=None)  # src None: any source (gloo; nccl cannot)

        def wait_fn() -> int:
            work.wait()
            copy_back()
            return work._source_rank()  # what torch.distributed.recv itself returns for src=None

        return wait_fn, work.is_completed

    def _barrier(self):
        work = self._dist.barrier(async_op=True)
        return self._finish(work, lambda: None, None)
