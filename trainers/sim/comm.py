"""``SimComm``: the project's one comm layer on the simulator's network and clock.

Point-to-point messages are flows in the fluid network (``emulator.simnet``), started as gloo's
transport starts them (once the receiver has said it is ready: :class:`Exchange`): a send
completes when its last byte left, the receive when it arrived; messages are matched to receives
by source and tag, in posting order.
Collectives complete when the collective model (``trainers.sim.collectives``) says each rank is
done, counted from the moment each rank entered them; their results are exact (reduced in rank
order, so every rank gets the same bits; the coded ring, ``allreduce_coded_async``, gives the
bits its real counterpart gives, ``ring_coded_reference``). Background collectives
(``allreduce_async``, ``allgather_async``, ``allreduce_coded_async``) obey the comm's
``max_in_flight`` as the real comm's threads do: one launched while that many of this rank's are
unfinished enters when the earliest-launched waiting one can start, i.e. when one of the running ones finishes (queueing in virtual time). The base class's
accounting (bytes by the textbook model, blocked time) is unchanged, measured on the virtual clock.
A stand-in model (``Simulator.wire_scale``): every message's flow, every collective's bytes and
the byte counters are its real bytes x the scale (``Simulator.wire_bytes``); the tensors moved and
the results are the real model's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from trainers.comm import COMBINE, MAX_IN_FLIGHT, STREAM_TAG, Comm, tensor_nbytes
from trainers.comm.allreduce import DIRECT_MAX_BYTES, coded_chunk_bytes, ring_coded_reference

from . import collectives
from .engine import Completion, Simulator


@dataclass(eq=False)  # matched by identity: tensors have no truth value
class _Message:
    src: int
    dst: int
    tag: int
    data: torch.Tensor
    sent: Completion
    posted_at: float
    matched: bool = False
    receive: Optional["_Receive"] = None

    def delivered(self, sim: Simulator, delivery) -> None:
        """The network's callback: the last byte left now; it arrives at ``delivery.arrives_at``."""
        sim.complete(self.sent)
        sim.at(delivery.arrives_at, lambda: sim.exchange.fill(self.receive, self))


@dataclass(eq=False)  # matched by identity: tensors have no truth value
class _Receive:
    tensor: torch.Tensor
    src: Optional[int]             # None: any source in ``sources``
    sources: Optional[frozenset]
    tag: int
    done: Completion
    posted_at: float
    source: Optional[int] = None   # who it came from

    def matches(self, message: _Message) -> bool:
        if message.tag != self.tag:
            return False
        if self.src is not None:
            return message.src == self.src
        return self.sources is None or message.src in self.sources


@dataclass(eq=False)  # matched by identity: tensors have no truth value
class _Collective:
    op: str
    key: tuple
    entered: dict = field(default_factory=dict)    # rank -> virtual s
    inputs: dict = field(default_factory=dict)     # rank -> what it brought
    finish: dict = field(default_factory=dict)     # rank -> (tensor(s) to write, Completion)


class Exchange:
    """The job's point-to-point matching and collectives, shared by its ranks' SimComms.

    Point to point follows gloo's transport (``gloo/transport/tcp/pair.cc``): posting a receive
    sends the sender a "ready to receive" notice, posting a send a "ready to send" one, and the
    data moves only once the sender knows the receiver is ready. A message whose receive is
    posted at ``t_r`` and send at ``t_s`` therefore starts at ``max(t_s, t_r + delay(dst->src))``;
    a receive from any source learns of a sender from its notice (``t_s + delay(src->dst)``) and
    answers it, so the data starts one round trip after the notice left. Sends and receives
    between one pair with one tag are matched in the order they were posted.
    """

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.sends: dict[tuple, list[_Message]] = {}          # (src, dst, tag) -> unmatched, in order
        self.receives: dict[tuple, list[_Receive]] = {}       # (src, dst, tag) -> unmatched, in order
        self.any_receives: list[list[_Receive]] = [[] for _ in range(sim.world_size)]
        self.noticed: list[list[_Message]] = [[] for _ in range(sim.world_size)]  # notices at dst, in arrival order
        self.collectives: dict[int, _Collective] = {}
        self.stalled: list[_Collective] = []  # resolved while a path it needs was down
        self.killed: set[int] = set()  # ranks whose process was killed (a job on this comm takes none back)
        sim.on_network_change.append(self.retry_stalled)
        sim.on_crash.append(self.crashed)

    def crashed(self, rank: int) -> None:
        """``rank``'s process was killed: its flows stop, none starts to or from it any more, and
        what arrives for it later is not read (no callback of the dead process runs); each other
        rank's communication fails once the closed connection has reached it (one one-way delay):
        gloo's pairs, and the collectives built on them, do not survive a peer (the crash-tolerant
        comm is elastic.py)."""
        sim = self.sim
        self.killed.add(rank)
        sim.network.cancel_flows(sim.now, lambda flow: rank in (flow.src, flow.dst))
        for other in range(sim.world_size):
            if other != rank:
                error = ConnectionError(f"rank {rank} closed its connections (its process was killed at "
                                        f"{sim.now:.3f} s): this transport cannot go on without it")
                sim.at(sim.now + self._delay(rank, other),
                       lambda other=other, error=error: sim.break_comm(other, error))

    def _delay(self, src: int, dst: int) -> float:
        return float(self.sim.network.latency_s[src, dst])

    def send(self, message: _Message) -> None:
        key = (message.src, message.dst, message.tag)
        waiting = self.receives.get(key)
        if waiting:
            receive = waiting.pop(0)
            self._start(message, receive, max(message.posted_at, receive.posted_at + self._delay(message.dst, message.src)))
            return
        self.sends.setdefault(key, []).append(message)
        # its "ready to send" notice, which a receive from any source answers
        self.sim.at(message.posted_at + self._delay(message.src, message.dst), lambda: self._noticed(message))

    def _noticed(self, message: _Message) -> None:
        if message.matched:
            return
        for receive in self.any_receives[message.dst]:
            if receive.matches(message):
                self.any_receives[message.dst].remove(receive)
                self._match_any(message, receive)
                return
        self.noticed[message.dst].append(message)

    def post(self, rank: int, receive: _Receive) -> None:
        if receive.src is not None:
            key = (receive.src, rank, receive.tag)
            queued = self.sends.get(key)
            if queued:
                message = queued.pop(0)
                self._start(message, receive, max(message.posted_at, receive.posted_at + self._delay(rank, message.src)))
                return
            self.receives.setdefault(key, []).append(receive)
            return
        for message in self.noticed[rank]:
            if not message.matched and receive.matches(message):
                self.noticed[rank].remove(message)
                self._match_any(message, receive)
                return
        self.any_receives[rank].append(receive)

    def _match_any(self, message: _Message, receive: _Receive) -> None:
        """Now (the later of the notice's arrival and the receive's posting) the receiver answers."""
        self.sends[(message.src, message.dst, message.tag)].remove(message)
        self._start(message, receive, self.sim.now + self._delay(message.dst, message.src))

    def _start(self, message: _Message, receive: _Receive, at: float) -> None:
        message.matched, message.receive = True, receive
        if receive.tensor.numel() != message.data.numel():
            raise RuntimeError(f"rank {message.dst}: a receive of {receive.tensor.numel()} elements matched a "
                               f"message of {message.data.numel()} from rank {message.src}")
        size = self.sim.wire_bytes(message.data.numel() * message.data.element_size())
        at += float(self.sim.network.slow_start_s(message.src, message.dst, size, at)[0])
        self.sim.at(at, lambda: self._start_flow(message, size))

    def _start_flow(self, message: _Message, size: int) -> None:
        if message.src in self.killed or message.dst in self.killed:
            return  # gloo's data leaves only from a live process, to one whose pair is still open
        self.sim.network.start_flow(message.src, message.dst, size, self.sim.now, token=message)

    def fill(self, receive: _Receive, message: _Message) -> None:
        if message.dst in self.killed:
            return  # it arrived after its receiver was killed: nobody reads it
        with torch.no_grad():
            receive.tensor.view(-1).copy_(message.data.view(-1))
        receive.source = message.src
        self.sim.complete(receive.done)

    def enter(self, seq: int, op: str, key: tuple, rank: int, payload, finish: Callable,
              done: Optional[Completion] = None) -> Completion:
        """Rank ``rank`` enters its ``seq``-th collective now; when the last rank has entered, every
        rank's result is computed and written at its finish time. Returns its Completion (``done``
        when given: a queued background collective's, made at its launch)."""
        collective = self.collectives.setdefault(seq, _Collective(op, key))
        if (collective.op, collective.key) != (op, key):
            raise RuntimeError(f"collective #{seq}: rank {rank} called {op}{key}, another rank {collective.op}"
                               f"{collective.key}: every rank must call the same collectives in the same order")
        done = done or Completion(what=f"{op} #{seq}")
        collective.entered[rank] = self.sim.now
        collective.inputs[rank] = payload
        collective.finish[rank] = (finish, done)
        if len(collective.entered) == self.sim.world_size:
            del self.collectives[seq]
            self._resolve(collective)
        return done

    def retry_stalled(self) -> None:
        """After a link change: the collectives that could not finish on a down path start over
        from now (their ranks' entry times moved to now: what was sent before the path went down
        is counted again, a conservative model of TCP resuming after a partition)."""
        stalled, self.stalled = self.stalled, []
        for collective in stalled:
            collective.entered = {rank: max(t, self.sim.now) for rank, t in collective.entered.items()}
            self._resolve(collective)

    def _resolve(self, collective: _Collective) -> None:
        n = self.sim.world_size
        entered = np.array([collective.entered[r] for r in range(n)])
        op, key = collective.op, collective.key
        network = self.sim.network
        wire = self.sim.wire_bytes  # a stand-in model's collectives move its bytes, not the real model's
        if op == "all_reduce":
            algorithm, nbytes, reduce_op = key[0], wire(key[1]), key[2]
            model = {"ring": collectives.ring_allreduce, "direct": collectives.direct,
                     "recursive_doubling": collectives.recursive_doubling}[algorithm]
            times = model(entered, network, nbytes)
            result = collective.inputs[0].clone()
            for r in range(1, n):  # in rank order: the same bits on every rank
                COMBINE[reduce_op](result, collective.inputs[r])
            if reduce_op == "avg":
                result.div_(n)
            results = [result] * n
        elif op == "all_reduce_coded":  # the ring with encoded messages: key[1] is the n chunks' payloads
            nbytes, reduce_op = wire(key[1]), key[2]
            times = collectives.ring_allreduce(entered, network, nbytes)
            codec = collective.inputs[0][1]
            result = ring_coded_reference([collective.inputs[r][0] for r in range(n)], codec, reduce_op)
            results = [result] * n
        elif op == "broadcast":
            src, nbytes = key[0], wire(key[1])
            times = collectives.broadcast(entered, network, nbytes, src)
            results = [collective.inputs[src]] * n
        elif op == "all_gather":
            algorithm, nbytes = key[0], wire(key[1])  # gloo's own all_gather: modelled as the ring
            model = collectives.direct_allgather if algorithm == "direct" else collectives.ring_allgather
            times = model(entered, network, nbytes)
            results = [[collective.inputs[r] for r in range(n)]] * n
        elif op == "barrier":
            times = collectives.direct(entered, network, 0.0)
            results = [None] * n
        else:
            raise ValueError(op)
        if not np.isfinite(times).all():  # a path it needs is down: wait for a link change
            self.stalled.append(collective)
            return
        for rank in range(n):
            write, done = collective.finish[rank]
            self.sim.complete_at(float(times[rank]), done, (lambda write=write, value=results[rank]: write(value)))


class SimStreamDriver:
    """Runs ``MessageStreams``' background work as events (the simulator's counterpart of
    ``trainers.comm.ThreadedStreamDriver``): a stream message is a point-to-point message with the
    streams' tag, and its callback runs when the engine completes it (the last byte left; the
    message arrived), at that virtual time. Ranks run one at a time, so the lock is a no-op, and
    every rank-side call first pays the time the rank owes, so what its messages see is never
    ahead of its clock."""

    def __init__(self, comm: "SimComm"):
        self.comm = comm
        self.sim = comm.sim
        self.lock = nullcontext()
        self._waiting: Optional[Completion] = None

    def enter(self) -> None:
        self.sim.settle()

    def send(self, message: torch.Tensor, dst: int, on_done: Callable[[], None], tag: int = STREAM_TAG) -> None:
        sent = Completion(what=f"stream message to rank {dst}", callbacks=[on_done])
        self.comm.exchange.send(_Message(self.comm.rank, dst, tag, message.detach().clone(), sent, self.sim.now))

    def recv(self, buffer: torch.Tensor, src: int, on_done: Callable[[], None], locked: bool = True,
             tag: int = STREAM_TAG) -> None:
        """``locked`` changes nothing here: events run one at a time, and apply in no virtual time."""
        done = Completion(what=f"stream message from rank {src}", callbacks=[on_done])
        self.comm.exchange.post(self.comm.rank, _Receive(buffer, src, None, tag, done, self.sim.now))

    def recv_any(self, buffer: torch.Tensor, tag: int, on_done: Callable[[int], None]) -> None:
        receive = _Receive(buffer, None, None, tag, Completion(what="message from any rank"), self.sim.now)
        receive.done.callbacks.append(lambda: on_done(receive.source))
        self.comm.exchange.post(self.comm.rank, receive)

    def notify(self) -> None:
        if self._waiting is not None and not self._waiting.done:
            self.sim.complete(self._waiting)

    def wait(self, predicate: Callable[[], bool]) -> None:
        self.sim.settle()
        while not predicate():
            self._waiting = Completion(what="stream messages")
            self.sim.wait(self._waiting)
        self._waiting = None

    def close(self, timeout_s: float = 0.0) -> None:
        """Nothing runs in the background between events."""


class SimComm(Comm):
    """One rank's comm layer in a simulated job (see the module docstring)."""

    def __init__(self, sim: Simulator, rank: int, allreduce: str = "auto", max_in_flight: int = MAX_IN_FLIGHT):
        super().__init__(rank, sim.world_size, allreduce, max_in_flight)
        self.sim = sim
        if not hasattr(sim, "exchange"):
            sim.exchange = Exchange(sim)
        self.exchange: Exchange = sim.exchange
        self._collectives = 0
        self._running = 0          # background collectives entered and not finished (<= max_in_flight)
        self._queued: list = []    # launched beyond the limit, in launch order: their entries
        self.peak_in_flight = 0    # the most background collectives this rank had running at once

    @property
    def transport(self) -> str:
        return f"sim:{self.allreduce_algorithm}"

    def _allreduce_algorithm_for(self, tensor, op, algorithm):
        """As the base class, but ``auto`` picks direct or ring by the bytes charged (a stand-in's
        tensor, not the small model's: a 10B model's all-reduce is a ring, as it would be)."""
        resolved = super()._allreduce_algorithm_for(tensor, op, algorithm)
        requested = self.allreduce_algorithm if algorithm is None else algorithm
        if requested != "auto" or self.sim.wire_scale == 1.0:
            return resolved
        charged = self.sim.wire_bytes(tensor_nbytes(tensor))
        return "direct" if (self.world_size - 1) * charged <= DIRECT_MAX_BYTES else "ring"

    def account(self, op: str, sent: int, recv: int, blocked_s: float, calls: int = 1) -> None:
        """The base class's counters, in the bytes charged on the network (a stand-in model's:
        :meth:`Simulator.wire_bytes`), so records, summaries and bandwidths say what was moved."""
        super().account(op, round(self.sim.wire_bytes(sent)), round(self.sim.wire_bytes(recv)), blocked_s, calls)

    def _handle(self, done: Completion, result=None):
        return (lambda: (self.sim.wait(done), result)[1]), (lambda: self._poll(done))

    def _poll(self, done: Completion) -> bool:
        self.sim.settle()  # done by the time this rank has computed what it owes?
        return done.done

    # -- point to point ------------------------------------------------------------------------

    def _isend(self, tensor, dst, tag: int = 0):
        if not 0 <= dst < self.world_size or dst == self.rank:
            raise ValueError(f"rank {self.rank}: cannot send to rank {dst}")
        self.sim.settle()
        sent = Completion(what=f"send to rank {dst}")
        self.exchange.send(_Message(self.rank, dst, tag, tensor.detach().clone(), sent, self.sim.now))
        return self._handle(sent)

    def _irecv(self, tensor, src, tag: int = 0):
        self.sim.settle()
        receive = _Receive(tensor, src, None, tag, Completion(what=f"receive from rank {src}"), self.sim.now)
        self.exchange.post(self.rank, receive)
        return self._handle(receive.done, tensor)

    def _irecv_any(self, tensor, sources=None):
        self.sim.settle()
        # like TorchComm (gloo's irecv from any source), not elastic: from any rank, ``sources`` or not
        receive = _Receive(tensor, None, None, 0,
                           Completion(what="receive from any rank"), self.sim.now)
        self.exchange.post(self.rank, receive)
        return (lambda: (self.sim.wait(receive.done), receive.source)[1]), (lambda: self._poll(receive.done))

    def stream_driver(self) -> SimStreamDriver:
        return SimStreamDriver(self)

    # -- collectives -----------------------------------------------------------------------------

    def _collective(self, op: str, key: tuple, payload, write: Callable, background: bool = False):
        """Enter this rank's next collective (its sequence number taken now, at the call); a
        background one within ``max_in_flight`` (:meth:`_within_limit`)."""
        self.sim.settle()
        seq = self._collectives
        self._collectives += 1
        if not background:
            return self.exchange.enter(seq, op, key, self.rank, payload, write)
        return self._within_limit(lambda done: self.exchange.enter(seq, op, key, self.rank, payload, write, done),
                                f"{op} #{seq}")

    def _reduce(self, tensor: torch.Tensor, op: str, algorithm: str, background: bool = False):
        flat = tensor.detach().reshape(-1)

        def write(result):
            with torch.no_grad():
                tensor.view(-1).copy_(result)

        done = self._collective("all_reduce", (algorithm, tensor_nbytes(tensor), op, tensor.numel()),
                                flat.clone(), write, background)
        return self._handle(done, tensor)

    def _all_reduce(self, tensor, op):
        # gloo's own all_reduce, modelled as the bandwidth-optimal ring
        return self._reduce(tensor, op, "ring")

    def _launch(self, tensor: torch.Tensor, op: str, algorithm: str, tag: int):
        """:meth:`Comm.allreduce_async`'s exchange: the same algorithm, its time from the collective
        model instead of background threads (``tag`` is not needed: collectives are matched by
        their order), within ``max_in_flight`` (:meth:`_within_limit`)."""
        return self._reduce(tensor, op, algorithm, background=True)

    def _launch_allgather(self, outputs, tensor, algorithm: str, tag: int):
        """:meth:`Comm.allgather_async`'s exchange: the collective model of ``algorithm`` (direct
        or ring), within ``max_in_flight``; ``wait()`` returns ``outputs``."""
        return self._gather(outputs, tensor, algorithm, background=True, result=outputs)

    def _launch_coded(self, tensor: torch.Tensor, codec, op: str, tag: int):
        """:meth:`Comm.allreduce_coded_async`'s exchange: the ring's collective model charged with
        the payloads' bytes, the result :func:`ring_coded_reference` of every rank's input (the
        bits the real coded ring leaves), within ``max_in_flight``."""
        flat = tensor.detach().reshape(-1)
        payload_bytes = sum(coded_chunk_bytes(codec, flat, self.world_size))

        def write(result):
            with torch.no_grad():
                tensor.view(-1).copy_(result)

        done = self._collective("all_reduce_coded", (codec.name, payload_bytes, op, tensor.numel()),
                                (flat.clone(), codec), write, background=True)
        return self._handle(done, tensor)

    def _within_limit(self, enter: Callable[[Completion], Completion], what: str) -> Completion:
        """Enter a background collective now if fewer than ``max_in_flight`` of this rank's are
        running, else when the running ones have finished enough (in launch order), as the real
        comm's thread pool starts them. ``enter(done)`` enters it into the exchange."""
        done = Completion(what=what)
        done.callbacks.append(self._finished)
        if self._running < self.max_in_flight:
            self._start_background(enter, done)
        else:
            self._queued.append((enter, done))
        return done

    def _start_background(self, enter: Callable[[Completion], Completion], done: Completion) -> None:
        self._running += 1
        self.peak_in_flight = max(self.peak_in_flight, self._running)
        enter(done)

    def _finished(self) -> None:
        """A background collective of this rank finished (now, virtual): the next queued enters."""
        self._running -= 1
        if self._queued:
            self._start_background(*self._queued.pop(0))

    def _broadcast(self, tensor, src):
        def write(value):
            if self.rank != src:
                with torch.no_grad():
                    tensor.copy_(value)

        done = self._collective("broadcast", (src, tensor_nbytes(tensor), tensor.numel()),
                                tensor.detach().clone() if self.rank == src else None, write)
        return self._handle(done, tensor)

    def _all_gather(self, outputs, tensor):
        return self._gather(outputs, tensor, "gloo")

    def _gather(self, outputs, tensor, algorithm: str, background: bool = False, result=None):
        def write(gathered):
            with torch.no_grad():
                for output, value in zip(outputs, gathered):
                    output.copy_(value)

        done = self._collective("all_gather", (algorithm, tensor_nbytes(tensor), tensor.numel()),
                                tensor.detach().clone(), write, background)
        return self._handle(done, result)

    def _barrier(self):
        done = self._collective("barrier", (), None, lambda _: None)
        return self._handle(done)
