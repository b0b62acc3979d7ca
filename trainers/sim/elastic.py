"""``ElasticSimComm``: the elastic comm (``trainers.comm.tcp.TcpComm``) on the simulator's network
and clock, for the jobs that run on it on tun (a crash-tolerant algorithm in a scenario that
crashes nodes: ``trainers.loading.uses_elastic_comm``).

What it keeps of TcpComm, on the fluid network (``emulator.simnet``):

* One TCP connection per pair of processes. A message leaves as soon as it is sent (the kernel
  buffers it: no "ready to receive" rendezvous, unlike gloo's transport in :mod:`.comm`) and is
  handed to the receives in the order it was sent on its connection; a send is done when its last
  byte left, a receive when its message arrived.
* Membership: every process sees each peer ``live``, ``joining`` or ``gone``, changed only by
  what reaches it over the network. A killed process's peers mark it gone when its closed
  connection (the FIN, behind the data it had sent) arrives: one one-way delay after the kill.
  From then on sends to it and receives from it raise :class:`PeerLost` (messages that arrived
  before are still delivered); sends to it not yet out fail, their flows stop. A process that
  ends says goodbye the same way (``left (finished)``), once its data is out.
* A restarted process (generation > 0) connects to rank 0 (a round trip), says hello and waits
  for the address table (another round trip), then connects to every other rank in turn (a round
  trip each; a dead one refuses). Each peer sees it ``joining`` when its hello arrives, rank 0
  sees it ready when its READY (:meth:`ElasticSimComm.ready_to_join`) arrives, and
  :meth:`ElasticSimComm.set_membership` admits it, as on TcpComm. Its connections start with
  TCP's initial window.
* Collectives: TcpComm's star through rank 0 over the live ranks (``StarCollectives``, the same
  code).

Not modelled: TcpComm's receive timeout (a receive from a live peer waits as long as it takes;
the engine reports a deadlock if nothing can end it); the seconds a restarted process takes to
start on tun (Python, torch, the data set: none here, as for every rank at the start); the socket
buffer (a send is done when its last byte left, not when the kernel took it).

The start-up mesh (every first process connected to every other) is made lazily, a pair at a time
when either end uses it, so that a large job pays only for the pairs that talk.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Optional

import torch

from trainers.comm import PeerLost, tensor_nbytes
from trainers.comm.tcp import COORDINATOR, StarCollectives

from .engine import Completion, Simulator

CRASHED = "crashed (its connection closed without a goodbye)"  # TcpComm's words for a FIN with no BYE
LEFT = "left (finished)"
REFUSED = "is unreachable (connection refused)"


@dataclass(eq=False)
class _Stream:
    """One direction of a connection: what the sender posted, what the receiver got, in order."""

    sent: int = 0                                  # messages posted (the next one's index)
    unsent: dict = field(default_factory=dict)     # index -> message whose last byte has not left
    last_arrival: float = 0.0                      # when the last message out arrives (a FIN comes after)
    goodbye: Optional[str] = None                  # the sender closed; the FIN follows what is unsent
    early: dict = field(default_factory=dict)      # index -> message arrived before an earlier one
    arrived: int = 0                               # messages handed over in order so far
    inbox: dict = field(default_factory=dict)      # index -> (arrival seq, message), not claimed yet
    claimed: int = 0                               # receives posted: each claims the next index
    waiting: dict = field(default_factory=dict)    # index -> receive waiting for it


@dataclass(eq=False)
class _Process:
    """One process of a rank (its first, or a restarted one: ``generation``) and its views."""

    rank: int
    generation: int
    alive: bool = True
    closed_at: Optional[float] = None              # when it was killed or ended
    close_why: str = ""
    views: dict = field(default_factory=dict)      # peer rank -> _View (made lazily: _peek)
    any_receives: list = field(default_factory=list)


@dataclass(eq=False)
class _Connection:
    """One TCP connection between two processes: a stream each way."""

    ends: dict                                     # rank -> _Process
    streams: dict                                  # sender rank -> _Stream
    attached: set = field(default_factory=set)     # ranks whose end has it (the hello arrived)
    closed: set = field(default_factory=set)       # ranks whose end closed it

    @classmethod
    def between(cls, a: _Process, b: _Process) -> "_Connection":
        return cls({a.rank: a, b.rank: b}, {a.rank: _Stream(), b.rank: _Stream()})


@dataclass(eq=False)
class _View:
    """What one process knows of one peer (TcpComm's ``_Peer``)."""

    state: str = "gone"                            # live | joining | gone
    why: str = "is not connected"
    generation: int = 0
    ready: bool = False                            # a joining peer connected to everyone
    admit: Optional[int] = None                    # generation admitted before its connection arrived
    connection: Optional[_Connection] = None


@dataclass(eq=False)  # matched by identity: tensors have no truth value
class _Message:
    exchange: "ElasticExchange"
    connection: _Connection
    src: int
    dst: int
    index: int
    data: torch.Tensor
    sent: Completion
    flow: Optional[int] = None
    cancelled: bool = False
    lost: Optional[tuple[int, str]] = None         # the send failed: (peer, why)

    def delivered(self, sim: Simulator, delivery) -> None:
        """The network's callback: the last byte left now; it arrives at ``delivery.arrives_at``."""
        self.exchange.last_byte_left(self, delivery)


@dataclass(eq=False)
class _Receive:
    tensor: torch.Tensor
    done: Completion
    candidates: Optional[list] = None              # a receive from any of these ranks
    source: Optional[int] = None
    lost: Optional[tuple[int, str]] = None


class ElasticExchange:
    """The job's connections and every process's views of its peers (see the module docstring),
    shared by its ranks' :class:`ElasticSimComm`; engine-side events change them."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.first = [_Process(rank, 0) for rank in range(sim.world_size)]
        self.processes = list(self.first)          # each rank's current process
        self._mesh: dict[tuple[int, int], _Connection] = {}
        self._arrivals = itertools.count()
        sim.on_crash.append(self.crashed)

    def delay(self, src: int, dst: int) -> float:
        return float(self.sim.network.latency_s[src, dst])

    # -- views ------------------------------------------------------------------------------------

    def _start_up_state(self, proc: _Process, peer: int) -> tuple[str, str]:
        """A first process's view of a first peer nothing changed yet: live until the peer's
        close (kill or end) has reached it."""
        other = self.first[peer]
        if other.closed_at is not None and self.sim.now >= other.closed_at + self.delay(peer, proc.rank):
            return "gone", other.close_why
        return "live", "is connected"

    def peek(self, proc: _Process, peer: int) -> tuple[str, int]:
        """(state, generation) of ``proc``'s view of ``peer``, without making the view."""
        view = proc.views.get(peer)
        if view is not None:
            return view.state, view.generation
        if proc.generation == 0:
            return self._start_up_state(proc, peer)[0], 0
        return "gone", 0

    def view(self, proc: _Process, peer: int) -> _View:
        """``proc``'s view of ``peer``, made on first use (a first process: the start-up mesh)."""
        view = proc.views.get(peer)
        if view is not None:
            return view
        if proc.generation > 0:  # a restarted process's views are made as it connects
            view = proc.views[peer] = _View()
            return view
        key = (min(proc.rank, peer), max(proc.rank, peer))
        connection = self._mesh.get(key)
        if connection is None:
            connection = self._mesh[key] = _Connection.between(self.first[key[0]], self.first[key[1]])
            connection.attached.update(key)
        state, why = self._start_up_state(proc, peer)
        view = proc.views[peer] = _View(state, why, 0, connection=connection)
        if state == "gone":
            connection.closed.add(proc.rank)
        other = self.first[peer]
        if other.closed_at is not None and state == "live":  # its FIN is still on the way
            self.sim.at(other.closed_at + self.delay(peer, proc.rank),
                        lambda: self._fin_arrived(proc, peer, connection, other.close_why))
        if other.alive:  # both ends, so that a close at either end reaches the other
            self.view(other, proc.rank)
        return view

    # -- point to point ---------------------------------------------------------------------------

    def send(self, proc: _Process, dst: int, tensor: torch.Tensor, allow_joining: bool) -> _Message:
        view = self.view(proc, dst)
        if view.state == "gone" or (view.state == "joining" and not allow_joining):
            raise PeerLost(dst, view.why if view.state == "gone" else "is joining (not admitted yet)")
        connection = view.connection
        stream = connection.streams[proc.rank]
        message = _Message(self, connection, proc.rank, dst, stream.sent, tensor.detach().clone(),
                           Completion(what=f"send to rank {dst}"))
        stream.sent += 1
        stream.unsent[message.index] = message
        size = self.sim.wire_bytes(tensor_nbytes(tensor))
        network, now = self.sim.network, self.sim.now
        starts = now + float(network.slow_start_s(proc.rank, dst, size, now)[0])
        self.sim.at(starts, lambda: self._start_flow(message, size))
        return message

    def _start_flow(self, message: _Message, size: int) -> None:
        if not message.cancelled:
            message.flow = self.sim.network.start_flow(message.src, message.dst, size, self.sim.now, token=message)

    def last_byte_left(self, message: _Message, delivery) -> None:
        stream = message.connection.streams[message.src]
        stream.unsent.pop(message.index, None)
        stream.last_arrival = max(stream.last_arrival, delivery.arrives_at)
        if message.lost is None:
            self.sim.complete(message.sent)
        self.sim.at(delivery.arrives_at, lambda: self._arrive(message))
        if stream.goodbye is not None and not stream.unsent:  # the FIN follows the last data out
            self._send_fin(message.connection, message.src, stream.goodbye)

    def _arrive(self, message: _Message) -> None:
        connection = message.connection
        receiver = connection.ends[message.dst]
        if not receiver.alive:
            return
        if message.dst not in connection.attached:  # data comes after the hello on its connection
            self._attach(receiver, message.src, connection)
        if self.view(receiver, message.src).connection is not connection or message.dst in connection.closed:
            return  # closed at this end: nobody reads it
        stream = connection.streams[message.src]
        stream.early[message.index] = message
        while stream.arrived in stream.early:  # in the order sent, as TCP delivers
            arrived = stream.early.pop(stream.arrived)
            receive = stream.waiting.pop(stream.arrived, None)
            if receive is not None:
                self._fill(receive, arrived)
            else:
                stream.inbox[stream.arrived] = (next(self._arrivals), arrived)
            stream.arrived += 1
        self._serve_any(receiver)

    def _fill(self, receive: _Receive, message: _Message) -> None:
        if receive.tensor.numel() != message.data.numel():
            raise RuntimeError(f"rank {message.dst}: a receive of {receive.tensor.numel()} elements got a "
                               f"message of {message.data.numel()} from rank {message.src}")
        with torch.no_grad():
            receive.tensor.view(-1).copy_(message.data.view(-1))
        receive.source = message.src
        self.sim.complete(receive.done)

    def receive(self, proc: _Process, src: int, tensor: torch.Tensor) -> _Receive:
        view = self.view(proc, src)
        stream = view.connection.streams[src] if view.connection is not None else None
        if view.state != "live" and not (stream is not None and stream.claimed in stream.inbox):
            raise PeerLost(src, view.why)
        receive = _Receive(tensor, Completion(what=f"receive from rank {src}"))
        ticket = stream.claimed
        stream.claimed += 1
        if ticket in stream.inbox:
            self._fill(receive, stream.inbox.pop(ticket)[1])
        else:
            stream.waiting[ticket] = receive
        return receive

    def receive_any(self, proc: _Process, tensor: torch.Tensor, sources) -> _Receive:
        candidates = [r for r in (range(self.sim.world_size) if sources is None else sources) if r != proc.rank]
        for rank in candidates:
            self.view(proc, rank)  # so that a close of any of them reaches this receive
        receive = _Receive(tensor, Completion(what=f"receive from any of {len(candidates)} ranks"), candidates)
        proc.any_receives.append(receive)
        self._serve_any(proc)
        return receive

    def _serve_any(self, proc: _Process) -> None:
        """Give each waiting receive from any source the message that arrived first, or
        :class:`PeerLost` for a source that is gone with nothing left to deliver (as TcpComm)."""
        waiting, proc.any_receives = proc.any_receives, []
        for receive in waiting:
            best = None
            for rank in receive.candidates:
                connection = proc.views[rank].connection
                if connection is None:
                    continue
                stream = connection.streams[rank]
                entry = stream.inbox.get(stream.claimed)
                if entry is not None and (best is None or entry[0] < best[0]):
                    best = (entry[0], stream)
            if best is not None:
                stream = best[1]
                message = stream.inbox.pop(stream.claimed)[1]
                stream.claimed += 1
                self._fill(receive, message)
                continue
            lost = next((r for r in receive.candidates if proc.views[r].state != "live"), None)
            if lost is not None:
                receive.lost = (lost, proc.views[lost].why)
                self.sim.complete(receive.done)
                continue
            proc.any_receives.append(receive)

    # -- connections closing ----------------------------------------------------------------------

    def crashed(self, rank: int) -> None:
        """The engine killed ``rank``'s process: what it had not sent yet stops, its peers learn of
        it when its FIN arrives."""
        proc = self.processes[rank]
        if proc.alive:
            self._close(proc, CRASHED, drain=False)

    def leave(self, proc: _Process) -> None:
        """``proc`` ended (shutdown): a goodbye to every peer, after what it is still sending."""
        if proc.alive:
            self._close(proc, LEFT, drain=True)

    def _close(self, proc: _Process, why: str, drain: bool) -> None:
        proc.alive, proc.closed_at, proc.close_why = False, self.sim.now, why
        proc.any_receives = []
        for peer, view in list(proc.views.items()):
            connection = view.connection
            if connection is None or proc.rank in connection.closed:
                continue
            connection.closed.add(proc.rank)
            stream = connection.streams[proc.rank]
            if drain and stream.unsent:
                stream.goodbye = why
                continue
            self._stop(stream.unsent.values())
            stream.unsent = {}
            self._send_fin(connection, proc.rank, why)

    def _stop(self, messages) -> None:
        """Stop these messages' flows (or keep them from starting)."""
        flows = set()
        for message in messages:
            message.cancelled = True
            if message.flow is not None:
                flows.add(message.flow)
        if flows:
            self.sim.network.cancel_flows(self.sim.now, lambda flow: flow.flow_id in flows)

    def _send_fin(self, connection: _Connection, src: int, why: str) -> None:
        """``src``'s end closed: the other end learns it behind the last data sent on it."""
        dst = next(r for r in connection.ends if r != src)
        stream = connection.streams[src]
        at = max(self.sim.now + self.delay(src, dst), stream.last_arrival)
        self.sim.at(at, lambda: self._fin_arrived(connection.ends[dst], src, connection, why))

    def _fin_arrived(self, proc: _Process, peer: int, connection: _Connection, why: str) -> None:
        """``peer``'s end of ``connection`` closed, and ``proc`` reads it (TcpComm's read loop)."""
        if not proc.alive:
            return
        if proc.rank not in connection.attached:
            self._attach(proc, peer, connection)
        view = self.view(proc, peer)
        if view.connection is connection and view.state != "gone":
            self._drop(proc, peer, why, tell_peer=False)

    def _drop(self, proc: _Process, peer: int, why: str, tell_peer: bool) -> None:
        """``proc`` marks ``peer`` gone and closes their connection (TcpComm's _drop): what waits on
        it fails; with ``tell_peer`` the peer learns it one one-way delay later."""
        view = self.view(proc, peer)
        view.state, view.why = "gone", why
        connection = view.connection
        if connection is not None and proc.rank not in connection.closed:
            connection.closed.add(proc.rank)
            self._fail(proc, peer, connection, why)
            if tell_peer:
                self._send_fin(connection, proc.rank, CRASHED)
        self._serve_any(proc)

    def _fail(self, proc: _Process, peer: int, connection: _Connection, why: str) -> None:
        """Receives on ``connection`` still waiting and sends not yet out raise PeerLost."""
        incoming = connection.streams[peer]
        for receive in incoming.waiting.values():
            receive.lost = (peer, why)
            self.sim.complete(receive.done)
        incoming.waiting = {}
        outgoing = connection.streams[proc.rank]
        for message in outgoing.unsent.values():
            message.lost = (peer, why)
            self.sim.complete(message.sent)
        self._stop(outgoing.unsent.values())
        outgoing.unsent = {}

    # -- a restarted process ----------------------------------------------------------------------

    def join(self, rank: int, generation: int) -> _Process:
        """In the restarted process's thread: connect as TcpComm does (see the module docstring);
        takes the virtual time the handshakes take. Returns the new process."""
        sim = self.sim
        proc = self.processes[rank] = _Process(rank, generation)
        sim.network.new_connections(rank)
        if self._connect(proc, COORDINATOR):
            sim.sleep(self.delay(rank, COORDINATOR) + self.delay(COORDINATOR, rank))  # hello, address table
            sim.settle()
        for peer in range(1, sim.world_size):
            if peer != rank:
                self._connect(proc, peer)
        return proc

    def _connect(self, proc: _Process, peer: int) -> bool:
        """One connect, a round trip; then the hello travels to the peer. False: refused."""
        sim = self.sim
        sim.sleep(self.delay(proc.rank, peer) + self.delay(peer, proc.rank))
        sim.settle()
        target = self.processes[peer]
        if not target.alive or not proc.alive:
            proc.views[peer] = _View(why=REFUSED)
            return False
        connection = _Connection.between(proc, target)
        connection.attached.add(proc.rank)
        proc.views[peer] = _View("live", "is connected", target.generation, connection=connection)
        sim.at(sim.now + self.delay(proc.rank, peer), lambda: self._attach(target, proc.rank, connection))
        return True

    def _attach(self, proc: _Process, peer: int, connection: _Connection) -> None:
        """The hello of ``peer``'s new process reached ``proc`` (TcpComm's _attach, accepting side):
        the new connection replaces the old one, the peer is joining until admitted."""
        if proc.rank in connection.attached:
            return
        connection.attached.add(proc.rank)
        if not proc.alive:  # it ended after the connect: its kernel closes the connection
            connection.closed.add(proc.rank)
            self._send_fin(connection, proc.rank, CRASHED)
            return
        view = self.view(proc, peer)
        old = view.connection
        if old is not None and old is not connection and proc.rank not in old.closed:
            old.closed.add(proc.rank)
            self._fail(proc, peer, old, "restarted (its old connection closed)")
        generation = connection.ends[peer].generation
        admitted = generation > 0 and view.admit == generation
        view.state = "joining" if generation > 0 and not admitted else "live"
        view.generation, view.ready, view.admit, view.why = generation, False, None, "is connected"
        view.connection = connection
        self._serve_any(proc)

    def ready(self, proc: _Process) -> None:
        """The restarted ``proc`` tells rank 0 it can train (a READY one way)."""
        view = self.view(proc, COORDINATOR)
        if view.state == "gone":
            return
        connection = view.connection

        def arrived():
            coordinator = connection.ends[COORDINATOR]
            if not coordinator.alive:
                return
            if COORDINATOR not in connection.attached:
                self._attach(coordinator, proc.rank, connection)
            theirs = self.view(coordinator, proc.rank)
            if theirs.connection is connection:
                theirs.ready = True

        self.sim.at(max(self.sim.now + self.delay(proc.rank, COORDINATOR),
                        connection.streams[proc.rank].last_arrival), arrived)

    def set_membership(self, proc: _Process, live: dict[int, int]) -> None:
        """TcpComm.set_membership on ``proc``'s views."""
        for rank in range(self.sim.world_size):
            if rank == proc.rank:
                continue
            state, generation = self.peek(proc, rank)
            if rank not in live:
                if rank in proc.views:
                    proc.views[rank].admit = None
                if state == "live":
                    self._drop(proc, rank, "was dropped from the membership", tell_peer=True)
            elif generation == live[rank] and state == "joining":
                self.view(proc, rank).state = "live"
            elif generation < live[rank]:
                self.view(proc, rank).admit = live[rank]


class ElasticSimComm(StarCollectives):
    """One process's elastic comm in a simulated job (see the module docstring).

    Args:
        sim: the simulator.
        rank: this rank.
        generation: restarts of this rank's process before this one (> 0: it rejoins).
    """

    def __init__(self, sim: Simulator, rank: int, generation: int = 0):
        super().__init__(rank, sim.world_size)
        if rank == COORDINATOR and generation > 0:
            raise RuntimeError("rank 0 is the coordinator (it hosts the rendezvous and admits restarted "
                               "ranks): it cannot rejoin; restart the whole job instead")
        self.sim = sim
        self.generation = generation
        if not hasattr(sim, "elastic_exchange"):
            sim.elastic_exchange = ElasticExchange(sim)
        self.exchange: ElasticExchange = sim.elastic_exchange
        self.process = self.exchange.join(rank, generation) if generation > 0 else self.exchange.first[rank]

    @property
    def transport(self) -> str:
        return "sim:tcp"

    def account(self, op: str, sent: int, recv: int, blocked_s: float, calls: int = 1) -> None:
        """The counters in the bytes charged on the network (``Simulator.wire_bytes``), as SimComm's."""
        super().account(op, round(self.sim.wire_bytes(sent)), round(self.sim.wire_bytes(recv)), blocked_s, calls)

    # -- membership -------------------------------------------------------------------------------

    def _peers(self):
        return (r for r in range(self.world_size) if r != self.rank)

    def live_ranks(self) -> list[int]:
        """Ranks this rank exchanges with, itself included, in order."""
        return sorted([self.rank] + [r for r in self._peers() if self.exchange.peek(self.process, r)[0] == "live"])

    def joining_ranks(self) -> list[int]:
        """Restarted ranks that connected to everyone and wait to be admitted."""
        return [r for r, view in sorted(self.process.views.items()) if view.state == "joining" and view.ready]

    def ready_to_join(self) -> None:
        self.sim.settle()
        self.exchange.ready(self.process)

    def generations(self) -> dict[int, int]:
        return {self.rank: self.generation, **{r: self.exchange.peek(self.process, r)[1] for r in self._peers()}}

    def is_live(self, rank: int) -> bool:
        return rank == self.rank or self.exchange.peek(self.process, rank)[0] == "live"

    def set_membership(self, live: dict[int, int]) -> None:
        self.sim.settle()
        self.exchange.set_membership(self.process, live)

    # -- point to point ---------------------------------------------------------------------------

    def send_admission(self, tensor: torch.Tensor, dst: int) -> None:
        """Send to a live or a *joining* peer (how the coordinator admits a restarted rank)."""
        self._run("send", tensor_nbytes(tensor), 0, False, lambda: self._isend(tensor, dst, allow_joining=True))

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size or rank == self.rank:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank} in a world of {self.world_size}")

    def _isend(self, tensor: torch.Tensor, dst: int, allow_joining: bool = False):
        self._check(dst)
        self.sim.settle()
        message = self.exchange.send(self.process, dst, tensor, allow_joining)
        return self._handle(message.sent, lambda: message.lost, lambda: None)

    def _irecv(self, tensor: torch.Tensor, src: int):
        self._check(src)
        self.sim.settle()
        receive = self.exchange.receive(self.process, src, tensor)
        return self._handle(receive.done, lambda: receive.lost, lambda: tensor)

    def _irecv_any(self, tensor: torch.Tensor, sources=None):
        self.sim.settle()
        receive = self.exchange.receive_any(self.process, tensor, sources)
        return self._handle(receive.done, lambda: receive.lost, lambda: receive.source)

    def _handle(self, done: Completion, lost, result):
        def wait_fn():
            self.sim.wait(done)
            if lost() is not None:
                raise PeerLost(*lost())
            return result()

        def poll_fn() -> bool:
            self.sim.settle()  # done by the time this rank has computed what it owes?
            return done.done

        return wait_fn, poll_fn

    # -- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Say goodbye to every peer (nothing, after a kill: the process is already gone)."""
        self.exchange.leave(self.process)
