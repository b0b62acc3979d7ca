"""Message streams: keyed messages of one fixed size between every pair of ranks, the transport
of a parameter-server exchange (``p3``, ``ps_sync``): :class:`MessageStreams`.

One stream per ordered pair of ranks, sent one at a time per destination in priority or FIFO
order, with every expected receive posted up front. What runs their background work is the comm's
stream driver (:meth:`Comm.stream_driver <trainers.comm.base.Comm.stream_driver>`): threads over
the comm's tagged point-to-point messages here (:class:`ThreadedStreamDriver`), events on the
simulator (``trainers.sim.comm.SimStreamDriver``). Both offer the same methods: ``lock``,
``enter``, ``send``, ``recv``, ``recv_any``, ``notify``, ``wait``, ``close``; ``send``, ``recv`` and
``recv_any`` take a message tag (the streams' own by default; SwarmSGD's pairwise averaging uses
the two after it, :mod:`trainers.algorithms.swarmsgd`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainers import clock

from .allreduce import BACKGROUND_TAGS

# The background tag of :class:`MessageStreams`' messages: past those the all-reduces cycle through.
STREAM_TAG = BACKGROUND_TAGS
STREAM_KEY_BYTES = 8  # each stream message starts with its key, one int64
# How long closing the streams waits for their threads, in all (s). At the normal end every
# operation is done and the threads only have to see the end; on an error, an operation still
# waiting after a moment waits on a peer that is not answering, and the error should not wait
# for it (the thread is a daemon, left behind and named in a warning).
STREAM_CLOSE_S = 10.0
STREAM_CLOSE_ON_ERROR_S = 2.0

log = logging.getLogger(__name__)


class ThreadedStreamDriver:
    """Runs :class:`MessageStreams`' background work on threads: one per peer and direction, each
    waiting for its operations in the order they were started (a pair's messages arrive in the
    order sent) and then running their callbacks under :attr:`lock` (a receive posted with
    ``locked=False``: without it, so that different peers' callbacks run at once; eawild's
    concurrent server, ``trainers.algorithms.ps_common``). The simulator's driver
    (``trainers.sim.comm``) runs the same callbacks as events on the virtual clock.

    Args:
        comm: the comm whose ``tagged_isend`` / ``tagged_irecv`` carry the messages.
    """

    def __init__(self, comm: "Comm"):
        self.comm = comm
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._workers: dict[tuple[str, int], tuple[queue.SimpleQueue, threading.Thread]] = {}
        self.error: Optional[BaseException] = None

    def enter(self) -> None:
        """Called first by every :class:`MessageStreams` method, on the rank's thread (nothing to do
        here; a simulated rank first catches up with virtual time)."""

    def send(self, message: torch.Tensor, dst: int, on_done: Callable[[], None], tag: int = STREAM_TAG) -> None:
        """Start sending ``message`` (message tag ``tag``); ``on_done()`` once it is handed to the transport."""
        wait_fn, _ = self.comm.tagged_isend(message, dst, tag)
        self._after(("send", dst, tag), wait_fn, on_done)

    def recv(self, buffer: torch.Tensor, src: int, on_done: Callable[[], None], locked: bool = True,
             tag: int = STREAM_TAG) -> None:
        """Post a receive into ``buffer`` (message tag ``tag``); ``on_done()`` once a message arrived in it.

        locked: run ``on_done`` under :attr:`lock` (the default). False: run it without, on
        ``src``'s receiving thread, so that receives from different sources are handled at the
        same time (a parameter server's per-connection service, ``ps_common``); ``on_done`` then
        takes the lock itself for what it shares, and for any call into this driver.
        """
        wait_fn, _ = self.comm.tagged_irecv(buffer, src, tag)
        self._after(("recv", src, tag), wait_fn, on_done, locked)

    def recv_any(self, buffer: torch.Tensor, tag: int, on_done: Callable[[int], None]) -> None:
        """Post a receive from any source with message tag ``tag`` into ``buffer``; ``on_done(src)``
        once a message arrived in it, under :attr:`lock` (SwarmSGD's requests: who asks is not known in advance)."""
        wait_fn, _ = self.comm.tagged_irecv_any(buffer, tag)
        source: list[int] = []
        self._after(("recv_any", -1, tag), lambda: source.append(wait_fn()), lambda: on_done(source[0]))

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
        for (direction, peer, _), (_, thread) in workers.items():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("rank %d: message stream thread %s (%s, peer rank %d) still waits on its operation "
                            "%.1f s after close; left running", self.comm.rank, thread.name, direction, peer, timeout_s)

    def _after(self, key: tuple[str, int, int], wait_fn: Callable, on_done: Callable[[], None],
               locked: bool = True) -> None:
        if key not in self._workers:
            work: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=self._work, args=(work,), daemon=True,
                                      name=f"stream-{key[0]}-{key[1]}-rank{self.comm.rank}")
            self._workers[key] = (work, thread)
            thread.start()
        self._workers[key][0].put((wait_fn, on_done, locked))

    def _work(self, work: queue.SimpleQueue) -> None:
        while (item := work.get()) is not None:
            wait_fn, on_done, locked = item
            try:
                wait_fn()
                if locked:
                    with self.lock:
                        on_done()
                else:
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

    def __init__(self, comm: "Comm", payload_numel: int, dtype: torch.dtype,
                 on_message: Callable[[int, int, torch.Tensor], None], order: str = "priority",
                 log_size: int = 100_000):
        if order not in ("priority", "fifo"):
            raise ValueError(f"order: {order!r} is not one of ('priority', 'fifo')")
        if payload_numel < 1:
            raise ValueError(f"payload_numel: must be >= 1, got {payload_numel}")
        self.comm = comm
        self.driver = comm.stream_driver()
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
            self.comm.account("irecv", 0, 0, clock.perf_counter() - started, calls=0)

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
        self.comm.account("isend", self.message_bytes, 0, 0.0)
        self.driver.send(message, dst, lambda: self._handed_over(dst))

    def _handed_over(self, dst: int) -> None:
        self._in_flight[dst] = False
        self._start_next(dst)
        self.driver.notify()

    def _arrived(self, src: int, buffer: torch.Tensor) -> None:
        self.comm.account("irecv", 0, self.message_bytes, 0.0)
        key = int(buffer[:STREAM_KEY_BYTES].view(torch.int64)[0])
        self.on_message(src, key, buffer[STREAM_KEY_BYTES:].view(self.dtype))
        self._free.append(buffer)
        self.driver.notify()


