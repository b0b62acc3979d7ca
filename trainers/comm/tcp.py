"""`TcpComm`: the communication layer over plain TCP, one connection per pair of ranks, that
survives a peer's crash and lets a restarted peer rejoin.

Why not torch.distributed here: a gloo or NCCL group is fixed at start-up. When one rank dies,
every later collective fails, and a restarted process cannot join the old group. Crash-tolerant
algorithms (async PS, gossip, SwarmSGD, DiLoCo) need three things: point-to-point messages to
each peer; an error naming a dead peer instead of a hang; and a way back in for a restarted rank.
A connection per pair gives all three. A crashed process's sockets are closed by its kernel, so
its peers read end-of-file: the crash is detected as soon as the FIN crosses the (emulated) WAN.

Membership. Every peer is ``live``, ``joining`` or ``gone``:

* At start-up every rank says hello to rank 0, which listens at MASTER_ADDR:MASTER_PORT, with the
  address it listens at; rank 0 hands out the table, and every rank connects to every lower rank.
  Everyone is ``live`` once all connections are up. (Not torch's TCPStore: measured, its server
  in a training rank stopped answering new clients, so a restarted rank could not rejoin.)
* A connection that ends without a goodbye marks that peer ``gone`` (crashed). Sends to it and
  receives from it raise :class:`PeerLost` (messages that arrived before the crash are still
  delivered, in order).
* A restarted rank (TORCHELASTIC_RESTART_COUNT > 0, as torchrun sets it) says hello to rank 0,
  gets the table, connects to every reachable peer with its new generation number, and tells
  rank 0 when it is ready to train (:meth:`ready_to_join`). Its peers see it as ``joining`` and ignore it until the coordinator (rank 0)
  admits it: :meth:`set_membership`, called on every rank at the same step (the runner does it at
  evaluation points) with each live rank's generation, so a peer whose new connection is still
  on its way is admitted when it arrives, and a crash rank 0 has not noticed yet is not undone.
  Rank 0 is the coordinator and cannot be lost; every rank's job ends if it is.

Collectives run as a star through rank 0 over the live ranks: ``all_reduce`` sends each tensor to
rank 0, which combines those that arrived (a rank lost meanwhile is left out and ``avg`` divides by
the ranks that took part) and sends the result back. On 4 ranks the star moves as many bytes per
non-coordinator rank as a ring (1 tensor each way vs 2(n-1)/n = 1.5). Accounting: every
collective is made of the sends and receives it is accounted as.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .allreduce import COMBINE, ReduceOp, tensor_nbytes
from .base import Comm, PeerLost, Work, require_torchrun_env

MAGIC = b"WBT1"
# magic, frame kind, generation (HELLO) or 0, payload bytes
FRAME = struct.Struct("!4sBIQ")
HELLO, DATA, BYE, ADDRESSES, READY = 1, 2, 3, 4, 5
COORDINATOR = 0
CONNECT_TIMEOUT_S = 5.0


@dataclass
class _Connection:
    """One live TCP connection to a peer, with its sender thread's queue."""

    sock: socket.socket
    outbox: "queue.Queue" = field(default_factory=queue.Queue)
    closed: bool = False
    threads: list = field(default_factory=list)  # its reader and sender, joined by shutdown


@dataclass
class _Peer:
    """What this rank knows about one other rank."""

    rank: int
    state: str = "gone"  # live | joining | gone
    why: str = "is not connected"
    generation: int = 0  # restarts of the process on the current connection
    ready: bool = False  # a joining rank connected to everyone (what rank 0 waits for to admit it)
    admit: Optional[int] = None  # generation admitted before its connection arrived
    connection: Optional[_Connection] = None
    epoch: int = 0  # bumps whenever the message stream restarts (new connection)
    arrived: dict = field(default_factory=dict)  # message index -> (arrival seq, bytes)
    arrived_count: int = 0
    posted: int = 0  # receives posted (each claims the next message index)


class StarCollectives(Comm):
    """Collectives as a star through rank 0 (the coordinator) over the live ranks, made of this
    comm's point-to-point messages, so that they survive a lost rank: the elastic comms' (TcpComm
    here, and the simulator's, trainers/sim/elastic.py). A subclass gives ``_isend``/``_irecv``
    (raising :class:`PeerLost`) and ``live_ranks``."""

    elastic = True

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum", async_op: bool = False) -> Optional[Work]:
        """Reduce over the live ranks through rank 0; a rank lost meanwhile is left out (avg divides
        by the ranks that took part). Runs at once; with ``async_op`` returns a completed handle."""
        if self.rank == COORDINATOR:
            parts = {rank: torch.empty_like(tensor) for rank in self.live_ranks()[1:]}
            arrived = self._each(parts, lambda rank: self.irecv(parts[rank], rank))
            for rank in arrived:  # in rank order: the same sum whatever the arrival order
                COMBINE[op](tensor, parts[rank])
            if op == "avg":
                tensor.div_(len(arrived) + 1)
            self._each(arrived, lambda rank: self.isend(tensor, rank))
        else:
            self.send(tensor, COORDINATOR)
            self.recv(tensor, COORDINATOR)
        return _done(self) if async_op else None

    def ring_all_reduce(self, tensor: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """A ring cannot lose a member mid-way: the star :meth:`all_reduce` stands in for it."""
        self.all_reduce(tensor, op)
        return tensor

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp = "sum", algorithm=None) -> Work:
        """Every algorithm is the star :meth:`all_reduce` here (it survives a lost rank); runs at once."""
        return self.all_reduce(tensor, op, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Optional[Work]:
        """Send ``src``'s tensor to every live rank (lost ones are skipped)."""
        if self.rank == src:
            self._each([r for r in self.live_ranks() if r != src], lambda rank: self.isend(tensor, rank))
        else:
            self.recv(tensor, src)
        return _done(self) if async_op else None

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1), "sum")

    def all_gather(self, outputs, tensor, async_op: bool = False):
        raise NotImplementedError(f"{type(self).__name__} has no all_gather: no crash-tolerant algorithm needs one")

    # The base class's collective hooks are replaced by the public methods above.
    def _all_reduce(self, tensor, op):  # pragma: no cover - not reachable
        raise AssertionError("unused")

    _broadcast = _all_gather = _barrier = _all_reduce

    @staticmethod
    def _each(ranks, start: Callable[[int], Work]) -> list[int]:
        """Start a transfer with every rank, then wait for all (so they overlap on the WAN); returns
        the ranks whose transfer completed, in order (a peer lost meanwhile is left out)."""
        works = {}
        for rank in sorted(ranks):
            try:
                works[rank] = start(rank)
            except PeerLost:
                pass
        done = []
        for rank, work in works.items():
            try:
                work.wait()
                done.append(rank)
            except PeerLost:
                pass
        return done


class TcpComm(StarCollectives):
    """Point-to-point TCP transport with crash detection and rejoin (see module docstring).

    Args:
        timeout_s: how long a receive waits for a live peer's message before failing (s).
        device: torch device of the model's tensors (CUDA tensors are staged through the CPU).
        env: the torchrun variables (default os.environ).
    """

    def __init__(self, timeout_s: float = 300.0, device: torch.device | str = "cpu", env=None):
        env = os.environ if env is None else env
        require_torchrun_env(env)
        super().__init__(int(env["RANK"]), int(env["WORLD_SIZE"]))
        self.backend = "tcp"
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.generation = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.rank == COORDINATOR and self.generation > 0:
            raise RuntimeError("rank 0 is the coordinator (it hosts the rendezvous and admits restarted "
                               "ranks): it cannot rejoin; restart the whole job instead")
        self._lock = threading.Condition()
        self._peers = {r: _Peer(r) for r in range(self.world_size) if r != self.rank}
        self._arrivals = itertools.count()
        self._closing = False
        self._addresses: dict[int, list] = {}  # rank -> ["host:port" it listens at, generation] (from rank 0)
        master_addr, master_port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        self._address = _route_to(master_addr, master_port)
        # Rank 0 listens at MASTER_ADDR:MASTER_PORT and is the rendezvous: every rank says hello
        # there with the address it listens at, and rank 0 hands out the table (as torchrun's store).
        port = master_port if self.rank == COORDINATOR else 0
        self._listener = socket.create_server((self._address, port))
        self._listener.settimeout(0.5)
        self._addresses[self.rank] = [f"{self._address}:{self._listener.getsockname()[1]}", self.generation]
        threading.Thread(target=self._accept_loop, name="tcpcomm-accept", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        if self.rank == COORDINATOR:
            self._wait_for(lambda: all(p.state == "live" for p in self._peers.values()), "not every rank said hello")
            for peer in self._peers.values():
                self._send_addresses(peer)
            return
        self._connect(COORDINATOR, retry_until=deadline, address=(master_addr, master_port))
        self._wait_for(lambda: len(self._addresses) == self.world_size, "rank 0 sent no address table")
        if self.generation == 0:
            for peer in range(1, self.rank):
                self._connect(peer, retry_until=deadline)
            self._wait_for(lambda: all(p.state == "live" for p in self._peers.values()), "not every rank connected")
        else:
            for peer in range(1, self.world_size):
                if peer != self.rank:
                    try:
                        self._connect(peer, retry_until=time.monotonic())
                    except OSError as error:
                        self._peers[peer].why = f"is unreachable ({error})"

    # -- membership ------------------------------------------------------------------------------

    def live_ranks(self) -> list[int]:
        """Ranks this rank exchanges with, itself included, in order."""
        with self._lock:
            return sorted([self.rank] + [r for r, p in self._peers.items() if p.state == "live"])

    def joining_ranks(self) -> list[int]:
        """Restarted ranks that connected to everyone and wait to be admitted."""
        with self._lock:
            return sorted(r for r, p in self._peers.items() if p.state == "joining" and p.ready)

    def ready_to_join(self) -> None:
        """On a restarted rank, once it can train (data loaded, model built): ask rank 0 to admit it.

        Every peer has this rank's new connection by now (or is unreachable), so whatever rank 0
        decides, the peers can exchange with it at once.
        """
        self._peers[COORDINATOR].connection.outbox.put((FRAME.pack(MAGIC, READY, 0, 0), None, None, None))

    def generations(self) -> dict[int, int]:
        """The generation (restart count) of every rank's current process, as this rank knows it."""
        with self._lock:
            return {self.rank: self.generation, **{r: p.generation for r, p in self._peers.items()}}

    def is_live(self, rank: int) -> bool:
        return rank == self.rank or self._peers[rank].state == "live"

    def set_membership(self, live: dict[int, int]) -> None:
        """Agree with rank 0: ``live`` maps each live rank to the generation of its process.

        A joining peer of that generation is admitted; one whose new connection has not arrived
        yet is admitted when it does; a live peer missing from ``live`` is dropped (a joining one
        keeps waiting); a peer this rank saw crash stays gone (rank 0 will notice too).
        """
        with self._lock:
            for rank, peer in self._peers.items():
                if rank not in live:
                    peer.admit = None
                    if peer.state == "live":  # a joining one waits for its admission
                        self._drop(peer, "was dropped from the membership")
                elif peer.generation == live[rank] and peer.state == "joining":
                    peer.state = "live"
                elif peer.generation < live[rank]:
                    peer.admit = live[rank]
            self._lock.notify_all()

    # -- point to point --------------------------------------------------------------------------

    def send_admission(self, tensor: torch.Tensor, dst: int) -> None:
        """Send to a live or a *joining* peer (how the coordinator admits a restarted rank)."""
        self._run("send", tensor_nbytes(tensor), 0, False, lambda: self._isend(tensor, dst, allow_joining=True))

    def _isend(self, tensor: torch.Tensor, dst: int, allow_joining: bool = False):
        peer = self._peer_for(dst)
        payload = _bytes_of(tensor)
        done = threading.Event()
        outcome: list = []
        with self._lock:
            if peer.state == "gone" or (peer.state == "joining" and not allow_joining):
                raise PeerLost(dst, peer.why if peer.state == "gone" else "is joining (not admitted yet)")
            connection = peer.connection
        connection.outbox.put((FRAME.pack(MAGIC, DATA, 0, payload.numel()), payload, done, outcome))

        def wait_fn():
            while not done.wait(1.0):
                if connection.closed and not done.is_set():
                    raise PeerLost(dst, peer.why)
            if outcome:
                raise PeerLost(dst, outcome[0])
            return None

        return wait_fn, done.is_set

    def _irecv(self, tensor: torch.Tensor, src: int):
        peer = self._peer_for(src)
        with self._lock:
            if peer.state != "live" and not self._pending(peer):
                raise PeerLost(src, peer.why)
            ticket, epoch = peer.posted, peer.epoch
            peer.posted += 1

        def ready() -> bool:
            return ticket in peer.arrived or peer.epoch != epoch or peer.state != "live"

        def wait_fn():
            with self._lock:
                self._wait_locked(ready, f"rank {src} sent nothing")
                if peer.epoch != epoch or ticket not in peer.arrived:
                    raise PeerLost(src, peer.why)
                _, data = peer.arrived.pop(ticket)
            _fill(tensor, data)
            return tensor

        return wait_fn, ready  # done, or would raise at once

    def _irecv_any(self, tensor: torch.Tensor, sources=None):
        candidates = [r for r in (self._peers if sources is None else sources) if r != self.rank]

        def unclaimed():
            best = None
            for rank in candidates:
                peer = self._peers[rank]
                if peer.posted in peer.arrived:
                    seq = peer.arrived[peer.posted][0]
                    if best is None or seq < best[0]:
                        best = (seq, peer)
            return best

        def ready() -> bool:
            return unclaimed() is not None or any(
                self._peers[r].state != "live" and not self._pending(self._peers[r]) for r in candidates)

        def wait_fn() -> int:
            with self._lock:
                self._wait_locked(ready, f"none of ranks {candidates} sent anything")
                best = unclaimed()
                if best is None:
                    lost = next(r for r in candidates if self._peers[r].state != "live")
                    raise PeerLost(lost, self._peers[lost].why)
                peer = best[1]
                _, data = peer.arrived.pop(peer.posted)
                peer.posted += 1
            _fill(tensor, data)
            return peer.rank

        return wait_fn, ready  # done, or would raise at once

    @property
    def transport(self) -> str:
        return "tcp"

    # -- life cycle ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Say goodbye to every peer, let the senders drain (bounded), close everything."""
        if self._closing:
            return
        self._closing = True
        with self._lock:
            connections = [p.connection for p in self._peers.values() if p.connection is not None]
        for connection in connections:
            connection.outbox.put((FRAME.pack(MAGIC, BYE, 0, 0), None, None, None))
        deadline = time.monotonic() + 10.0
        for connection in connections:
            while not connection.closed and not connection.outbox.empty() and time.monotonic() < deadline:
                time.sleep(0.01)
        for connection in connections:
            _close(connection)
        self._listener.close()
        # Their threads end on the closed sockets; joined (bounded) so that none is still inside
        # torch when the interpreter exits (a daemon thread in C++ code at exit can abort it).
        deadline = time.monotonic() + 5.0
        for connection in connections:
            for thread in connection.threads:
                if thread is not threading.current_thread():
                    thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # -- internals -------------------------------------------------------------------------------

    def _peer_for(self, rank: int) -> _Peer:
        if rank not in self._peers:
            raise ValueError(f"rank {rank} is not a peer of rank {self.rank} in a world of {self.world_size}")
        return self._peers[rank]

    @staticmethod
    def _pending(peer: _Peer) -> bool:
        return peer.posted in peer.arrived

    def _wait_locked(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: {what} for {self.timeout_s:g} s")
            self._lock.wait(min(left, 1.0))

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        with self._lock:
            self._wait_locked(ready, what)

    def _hello(self) -> bytes:
        address = self._addresses[self.rank][0].encode()
        return FRAME.pack(MAGIC, HELLO, self.generation, 4 + len(address)) + struct.pack("!I", self.rank) + address

    def _send_addresses(self, peer: _Peer) -> None:
        """Rank 0: hand ``peer`` the table of listening addresses."""
        table = json.dumps(self._addresses).encode()
        peer.connection.outbox.put((FRAME.pack(MAGIC, ADDRESSES, 0, len(table)),
                                    torch.frombuffer(bytearray(table), dtype=torch.uint8), None, None))

    def _connect(self, rank: int, retry_until: float, address: Optional[tuple[str, int]] = None) -> None:
        address = address or _split(self._addresses[rank][0])
        while True:
            try:
                sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S, source_address=(self._address, 0))
                break
            except OSError:
                if time.monotonic() >= retry_until:
                    raise
                time.sleep(0.1)
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(self._hello())
        self._attach(rank, sock, generation=self._addresses.get(rank, [None, 0])[1], joining=False)

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            try:
                sock.settimeout(CONNECT_TIMEOUT_S)
                magic, kind, generation, size = FRAME.unpack(_read_exact(sock, FRAME.size))
                if magic != MAGIC or kind != HELLO or not 4 < size < 300:
                    raise ValueError("not a wanbench hello")
                hello = _read_exact(sock, size)
                (rank,) = struct.unpack("!I", hello[:4])
                if rank not in self._peers:
                    raise ValueError(f"hello from unknown rank {rank}")
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, EOFError, ValueError, struct.error):
                sock.close()
                continue
            with self._lock:
                self._addresses[rank] = [hello[4:].decode(), generation]
            peer = self._attach(rank, sock, generation, joining=generation > 0)
            if generation > 0 and self.rank == COORDINATOR:
                self._send_addresses(peer)  # a restarted rank learns where the others are

    def _attach(self, rank: int, sock: socket.socket, generation: int, joining: bool) -> _Peer:
        connection = _Connection(sock)
        with self._lock:
            peer = self._peers[rank]
            if peer.connection is not None:
                _close(peer.connection)
            peer.connection = connection
            peer.epoch += 1
            peer.arrived, peer.arrived_count, peer.posted = {}, 0, 0
            admitted = joining and peer.admit == generation
            peer.state = "joining" if joining and not admitted else "live"
            peer.generation, peer.ready, peer.admit = generation, False, None
            peer.why = "is connected"
            self._lock.notify_all()
        connection.threads = [
            threading.Thread(target=self._read_loop, args=(peer, connection), name=f"tcpcomm-read-{rank}", daemon=True),
            threading.Thread(target=self._send_loop, args=(peer, connection), name=f"tcpcomm-send-{rank}", daemon=True)]
        for thread in connection.threads:
            thread.start()
        return peer

    def _read_loop(self, peer: _Peer, connection: _Connection) -> None:
        why = "crashed (its connection closed without a goodbye)"
        try:
            while True:
                magic, kind, _, size = FRAME.unpack(_read_exact(connection.sock, FRAME.size))
                if magic != MAGIC:
                    raise ValueError("corrupt frame")
                if kind == BYE:
                    why = "left (finished)"
                    break
                if kind == READY:
                    with self._lock:
                        peer.ready = True
                    continue
                data = bytearray(size)
                _read_exact_into(connection.sock, data)
                if kind == ADDRESSES:
                    with self._lock:
                        self._addresses.update({int(r): entry for r, entry in json.loads(data).items()})
                        self._lock.notify_all()
                    continue
                with self._lock:
                    if peer.connection is not connection:
                        return
                    peer.arrived[peer.arrived_count] = (next(self._arrivals), data)
                    peer.arrived_count += 1
                    self._lock.notify_all()
        except (OSError, EOFError, ValueError, struct.error) as error:
            if not isinstance(error, EOFError):
                why = f"crashed ({type(error).__name__}: {error})" if str(error) else why
        with self._lock:
            if peer.connection is connection and peer.state != "gone":
                self._drop(peer, why)
            self._lock.notify_all()

    def _send_loop(self, peer: _Peer, connection: _Connection) -> None:
        while True:
            header, payload, done, outcome = connection.outbox.get()
            try:
                connection.sock.sendall(header)
                if payload is not None:
                    connection.sock.sendall(memoryview(payload.numpy()))
            except OSError as error:
                with self._lock:
                    if peer.connection is connection and peer.state != "gone":
                        self._drop(peer, f"crashed (send failed: {error})")
                    self._lock.notify_all()
                if outcome is not None:
                    outcome.append(peer.why)
                    done.set()
                self._fail_queued(connection, peer)
                return
            if header[4] == BYE:  # the frame kind byte, after the magic
                connection.closed = True
                return
            if done is not None:
                done.set()

    def _fail_queued(self, connection: _Connection, peer: _Peer) -> None:
        while True:
            try:
                _, _, done, outcome = connection.outbox.get_nowait()
            except queue.Empty:
                return
            if outcome is not None:
                outcome.append(peer.why)
                done.set()

    def _drop(self, peer: _Peer, why: str) -> None:
        """Mark ``peer`` gone (lock held); queued messages that arrived stay deliverable."""
        peer.state, peer.why = "gone", why
        if peer.connection is not None:
            _close(peer.connection)


def _done(comm: Comm) -> Work:
    return Work(comm, "barrier", lambda: None, lambda: True, accounted=False)


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _route_to(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers can reach us at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # UDP connect sends nothing; it only picks the route
        return probe.getsockname()[0]


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU uint8 view (or copy) of ``tensor``'s bytes, safe to send later."""
    flat = tensor.detach()
    if flat.is_cuda:
        flat = flat.to("cpu")
    return flat.contiguous().reshape(-1).view(torch.uint8)


def _fill(tensor: torch.Tensor, data: bytearray) -> None:
    expected = tensor_nbytes(tensor)
    if len(data) != expected:
        raise RuntimeError(f"message of {len(data)} bytes for a tensor of {expected} bytes: ranks disagree "
                           "on what they exchange")
    source = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        if tensor.is_contiguous() and not tensor.is_cuda:
            tensor.view(-1).view(torch.uint8).copy_(source)
        else:
            tensor.copy_(source.view(tensor.dtype).view(tensor.shape))


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    _read_exact_into(sock, data)
    return bytes(data)


def _read_exact_into(sock: socket.socket, buffer: bytearray) -> None:
    view, got = memoryview(buffer), 0
    while got < len(buffer):
        count = sock.recv_into(view[got:])
        if count == 0:
            raise EOFError("connection closed")
        got += count


def _close(connection: _Connection) -> None:
    connection.closed = True
    try:
        connection.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    connection.sock.close()
