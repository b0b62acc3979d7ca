"""Parameter-server machinery shared by `async_ps` and `eawild`: roles, shards, messages, serving.

Roles. The ranks in ``server_ranks`` hold the shared state, a flat vector of all trainable
parameters cut into contiguous ranges, one per server (in the order given); every other rank is a
worker. The harness maps ranks to regions in order, so choosing the server ranks chooses where the
servers are. The runner still hands servers a batch each step; they ignore it.

Messages (point to point, tag 0, as the serial server receives them; a concurrent server's are
the same header and payload in one buffer, on the stream driver's tag; messages between one pair
of ranks arrive in the order sent):

* worker -> server: a float64 header ``[step, base_version, want_reply, loss]``, then the payload
  (the worker's values for that server's range, in the parameters' dtype);
* server -> worker, only if ``want_reply``: a float64 header ``[version, staleness]``, then the
  server's range.

Two ways to serve (``server_mode``; ``eawild`` chooses with its ``server`` parameter,
``async_ps`` serves serially):

* ``serial``: a server receives headers from any source (``Comm.recv_any``) and handles messages
  in arrival order, one at a time, so its state is never read half-updated. The server is a
  serialization point: while it receives and applies one worker's message, every other worker's
  message waits for it (on gloo, even its bytes wait: a message moves once its receive is posted).
* ``concurrent``: one service per worker connection, no global order. The server keeps one
  receive posted per worker (the comm's stream driver, ``trainers.comm.streams``: on gloo a
  receiving thread per worker, on the simulator an event per message), and each message is
  applied on its connection's own thread as soon as it has arrived, without a lock, in place on
  the shared state (Hogwild: two applies may run at once, torch's in-place ops release the GIL,
  and an element written by both at once may lose one of the two writes); its reply is the state
  as that service read it. A small lock guards only the counters (version, messages handled)
  and the posting of messages, never the arithmetic. Each message is one message of the streams'
  tag (header and payload in one buffer), so its bytes move as soon as it is sent. A worker ends
  its connection with a last message (``GOODBYE``) in ``finish``. Needs a comm with tagged
  point-to-point messages on threads (gloo; not nccl, not the elastic tcp comm: no crash
  tolerance).

How a server takes part in the step loop. Every rank runs the same number of steps. In
``train_step(step)`` a server handles messages until every worker has sent all the messages it
sends in steps ``0..step`` (``messages_due(step)``, the same rule on both sides). Messages of
workers that are ahead are handled as they come, so fast workers never wait for slow ones: a
worker may run many steps ahead of the server's step count (only the runner's stop decision, a
broadcast made when a target accuracy or time budget is set, lines all ranks up at evaluations).
Every message a worker sends up to the step where all ranks stop is due by that step, so the
server has handled all of them when it stops, and no rank waits for a message that never comes.
The deployable model is sent to rank 0 after the server's step, so it reflects every message due
by then (and possibly some from workers that are ahead).

Versions and staleness. A server's version counts the messages it applied. A worker's message
carries the version of the server state it last received (``base_version``); staleness is the
server's version when the message is applied minus that base: 0 for a lone worker that pulls
every step, about (workers - 1) when every worker pushes once per step. On a concurrent server,
"when applied" is when its service starts applying it: the version counts the applies finished
by then, and a reply carries that count plus one (its own); an apply that overlaps this one is
counted in neither, though the state read may hold part of it. With one worker both ways of
serving give the same versions, staleness and numbers.

Crash tolerance (comm backend tcp, for algorithms that set ``tolerates_crash``): a server stops
waiting for a worker that is gone (its messages that arrived are still applied) and takes a
restarted worker back at the evaluation point it is admitted at, counting its messages from
there. A worker starts again from the servers' parameters. A server cannot be lost: its range of
the parameters exists nowhere else, so a server crash ends the job (the workers' exchanges fail).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from torch import nn

from trainers import clock
from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.comm import PeerLost, Work
from trainers.config import ConfigError
from trainers.snapshots import OutputState

HEADER_FIELDS = 4  # step, base_version, want_reply, loss
REPLY_FIELDS = 2  # version, staleness
SERVER_MODES = ("serial", "concurrent")
# want_reply of a worker's last message to a concurrent server: no more messages on this connection
GOODBYE = -1.0
HEADER_BYTES = HEADER_FIELDS * 8  # float64 fields ahead of the payload in a concurrent server's messages
REPLY_HEADER_BYTES = REPLY_FIELDS * 8


def check_server_ranks(server_ranks: list[int]) -> None:
    """Fail unless ``server_ranks`` is a non-empty list of distinct ranks >= 0 (``__post_init__`` helper)."""
    ok = isinstance(server_ranks, list) and len(server_ranks) > 0
    ok = ok and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in server_ranks)
    if not ok or len(set(server_ranks)) != len(server_ranks):
        raise ConfigError("server_ranks", f"must be a non-empty list of distinct ranks >= 0, got {server_ranks!r}")


def check_server_mode(server: str) -> None:
    """Fail unless ``server`` is one of :data:`SERVER_MODES` (``__post_init__`` helper)."""
    if server not in SERVER_MODES:
        raise ConfigError("server", f"must be one of {list(SERVER_MODES)}, got {server!r}")


def split_ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """Cut [0, numel) into ``parts`` contiguous ranges whose sizes differ by at most one element."""
    bounds = [numel * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class ServerState:
    """version: messages applied by this server; handled: per worker rank, messages handled."""

    version: int = 0
    handled: dict[int, int] = field(default_factory=dict)


@dataclass
class WorkerState:
    """base_version: per server rank, version of its range last received; exchanges: messages sent
    per server."""

    base_version: dict[int, int] = field(default_factory=dict)
    exchanges: int = 0


class ParameterServerAlgorithm(Algorithm):
    """Base of algorithms whose shared state lives on server ranks (see module docstring).

    Subclasses set ``name`` and ``Params`` (with a ``server_ranks`` list), and define
    :meth:`messages_due`, :meth:`server_apply` and the worker side of ``train_step`` (using
    :meth:`exchange`).
    """

    output_role: ClassVar[str] = "server"  # the role of the servers' snapshots
    server_mode: str = "serial"  # serial | concurrent (module docstring); a subclass may set it per instance

    def __init__(self, params, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        world = self.comm.world_size
        out_of_range = [r for r in params.server_ranks if r >= world]
        if out_of_range:
            raise ConfigError("server_ranks", f"ranks {out_of_range} do not exist in a world of {world}")
        if len(params.server_ranks) >= world:
            raise ConfigError("server_ranks", f"leave at least one worker: {len(params.server_ranks)} servers in a world of {world}")
        self.server_ranks: list[int] = list(params.server_ranks)
        self.workers = [r for r in range(world) if r not in self.server_ranks]
        self.is_server = self.comm.rank in self.server_ranks
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.trainable}
        if len(dtypes) != 1:
            raise ValueError(f"{self.name} needs one dtype for all trainable parameters, got {sorted(map(str, dtypes))}")
        self.numel = sum(p.numel() for p in self.trainable)
        self.ranges = dict(zip(self.server_ranks, split_ranges(self.numel, len(self.server_ranks))))
        self.server_state = ServerState(handled={w: 0 for w in self.workers})
        self.active = set(self.workers)  # workers a server waits for (all but those gone)
        self.worker_state = WorkerState(base_version={s: 0 for s in self.server_ranks})
        self.shard: Optional[torch.Tensor] = None  # this server's range of the shared state
        self._pending: list[tuple[Work, torch.Tensor]] = []  # sends in progress and their buffers
        self._connections: Optional[_Connections] = None  # the concurrent mode's messages

    # -- what subclasses define -----------------------------------------------------------------

    def messages_due(self, step: int) -> int:
        """Messages each worker has sent to each server by the end of step ``step`` (0-based)."""
        raise NotImplementedError

    def server_apply(self, payload: torch.Tensor, want_reply: bool, staleness: int) -> Optional[torch.Tensor]:
        """Apply one worker's payload to ``self.shard`` (``staleness``: server updates since the
        worker's base version); return the reply (a tensor nobody else modifies) if ``want_reply``."""
        raise NotImplementedError

    # -- the interface the runner calls ---------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        if self.is_server:
            start, stop = self.ranges[self.comm.rank]
            self.shard = flatten(self.trainable)[start:stop].clone()
        if self.server_mode == "concurrent":
            self._connections = _Connections(self)

    def output_state(self) -> Optional[OutputState]:
        """On a server: its range of the shared state, inside a copy of its model's state (the
        evaluator joins the servers' ranges; buffers come from the lowest server rank). Workers: None."""
        if not self.is_server:
            return None
        start, stop = self.ranges[self.comm.rank]
        flat = flatten(self.trainable)
        flat[start:stop] = self.shard
        values = [torch.empty_like(p) for p in self.trainable]
        unflatten_into(flat, values)
        replaced = {id(p): v for p, v in zip(self.trainable, values)}
        state = {name: replaced.get(id(t), t).detach() for name, t in self.model.state_dict(keep_vars=True).items()}
        return OutputState(self.output_role, state, (start, stop))

    def deployable_model(self) -> nn.Module:
        """On rank 0: a copy of the model holding the servers' state (each server sends its range
        to rank 0; buffers are rank 0's). Other ranks return their local model, not evaluated."""
        if self.comm.rank == 0:
            flat = torch.empty(self.numel, dtype=self.trainable[0].dtype, device=self.trainable[0].device)
            for server, (start, stop) in self.ranges.items():
                if server == 0:
                    flat[start:stop] = self.shard
                else:
                    part = torch.empty(stop - start, dtype=flat.dtype, device=flat.device)
                    self.comm.recv(part, server)
                    flat[start:stop] = part
            deployable = copy.deepcopy(self.model)
            unflatten_into(flat, [p for p in deployable.parameters() if p.requires_grad])
            return deployable
        if self.is_server:
            self.comm.send(self.shard.clone(), 0)  # a copy: a concurrent server's services may be writing it
        return self.model

    def finish(self) -> None:
        """Complete sends in progress (concurrent: a worker says goodbye to every server, a server
        waits for every worker's goodbye); a server writes its range into its own model (saved by
        the runner)."""
        if self._connections is not None:
            self._connections.close()
        self._prune(block=True)
        if self.is_server:
            flat = flatten(self.trainable)
            start, stop = self.ranges[self.comm.rank]
            flat[start:stop] = self.shard
            unflatten_into(flat, self.trainable)

    # -- server side ----------------------------------------------------------------------------

    def serve(self, step: int) -> StepResult:
        """A server's ``train_step``: handle messages until every worker sent those due by ``step``.

        Returns the mean loss the handled messages reported (NaN if none) and their largest staleness.
        """
        if self._connections is not None:
            return self._connections.serve(step)
        due = self.messages_due(step)
        start, stop = self.ranges[self.comm.rank]
        header = torch.zeros(HEADER_FIELDS, dtype=torch.float64)
        losses: list[float] = []
        staleness: list[int] = []
        while True:
            owing = [w for w in self.workers if w in self.active and self.server_state.handled[w] < due]
            if not owing:
                break
            try:
                source = self.comm.recv_any(header, sources=owing)
                if source not in self.server_state.handled:
                    raise RuntimeError(f"server {self.comm.rank}: unexpected message from rank {source} (not a worker)")
                _, base_version, want_reply, loss = header.tolist()
                payload = torch.empty(stop - start, dtype=self.shard.dtype, device=self.shard.device)
                self.comm.recv(payload, source)
            except PeerLost as lost:
                self._peer_lost(lost)  # a worker gone: stop waiting for it
                continue
            age = self.server_state.version - int(base_version)
            reply = self.server_apply(payload, bool(want_reply), age)
            self.note_sync()  # the servers' state is the output model
            self.server_state.version += 1
            self.server_state.handled[source] += 1
            if want_reply:
                reply_header = torch.tensor([self.server_state.version, age], dtype=torch.float64)
                self._send(reply_header, source)
                self._send(reply, source)
            losses.append(loss)
            staleness.append(age)
        self._prune()
        return StepResult(
            loss=sum(losses) / len(losses) if losses else math.nan, staleness=max(staleness) if staleness else None
        )

    # -- worker side ----------------------------------------------------------------------------

    def exchange(self, step: int, flat: torch.Tensor, want_reply: bool, loss: float) -> Optional[tuple[torch.Tensor, int]]:
        """Send each server its range of ``flat``; with ``want_reply`` wait for and return the
        servers' replies assembled into one flat tensor, and the largest staleness they reported."""
        if self._connections is not None:
            return self._connections.exchange(step, flat, want_reply, loss)
        for server, (start, stop) in self.ranges.items():
            header = torch.tensor(
                [step, self.worker_state.base_version[server], float(want_reply), loss], dtype=torch.float64
            )
            self._send(header, server)
            self._send(flat[start:stop].clone(), server)
        self.worker_state.exchanges += 1
        self._prune()
        if not want_reply:
            return None
        receives = []
        for server, (start, stop) in self.ranges.items():
            reply_header = torch.zeros(REPLY_FIELDS, dtype=torch.float64)
            part = torch.empty(stop - start, dtype=flat.dtype, device=flat.device)
            receives.append((server, start, stop, self.comm.irecv(reply_header, server), reply_header, self.comm.irecv(part, server), part))
        result = torch.empty_like(flat)
        ages = []
        for server, start, stop, header_work, reply_header, part_work, part in receives:
            header_work.wait()
            part_work.wait()
            version, age = reply_header.tolist()
            self.worker_state.base_version[server] = int(version)
            result[start:stop] = part
            ages.append(int(age))
        return result, max(ages)

    # -- helpers --------------------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        try:
            self._pending.append((self.comm.isend(tensor, dst), tensor))
        except PeerLost as lost:
            self._peer_lost(lost)

    def _prune(self, block: bool = False) -> None:
        """Drop finished sends (all of them, waiting, with ``block``); raises if one failed,
        unless it went to a worker that is gone."""
        still_running = []
        for work, tensor in self._pending:
            if block or work.is_completed():
                try:
                    work.wait()
                except PeerLost as lost:
                    self._peer_lost(lost)
            else:
                still_running.append((work, tensor))
        self._pending = still_running

    # -- crash tolerance ------------------------------------------------------------------------

    def _peer_lost(self, lost: PeerLost) -> None:
        """A worker that is gone is no longer waited for; a server cannot be done without."""
        if lost.rank in self.server_ranks:
            raise lost
        self.active.discard(lost.rank)

    def on_membership(self, step: int, live: list[int], joined: list[int], lost: list[int]) -> None:
        """A server waits for admitted workers from the next step on, and no longer for lost ones."""
        for rank in lost:
            self.active.discard(rank)
        for rank in joined:
            if rank in self.server_state.handled:
                self.active.add(rank)
                self.server_state.handled[rank] = self.messages_due(step)

    def rejoin_state(self, deployable: nn.Module) -> dict:
        state = super().rejoin_state(deployable)
        if self.is_server:  # rank 0 is a server: its version is the base of the state sent
            state["versions"] = {self.comm.rank: self.server_state.version}
        return state

    def load_rejoin_state(self, state: dict, step: int) -> None:
        super().load_rejoin_state(state, step)
        self.worker_state.base_version.update(state.get("versions", {}))
        self.worker_state.exchanges = self.messages_due(step)


class _Connections:
    """The concurrent mode's messages, on either side (module docstring, ``concurrent``).

    A server: one receive posted per worker at a time; each request is served on its connection
    (``_serve_one``: apply without a lock, reply, post the next receive), whichever arrives first,
    without a global order. A worker: each exchange posts its replies' receives, then sends one
    request per server, and waits for the replies.

    Args:
        algorithm: the parameter-server algorithm whose shard, counters and ``server_apply`` it uses.
    """

    def __init__(self, algorithm: ParameterServerAlgorithm):
        self.algorithm = algorithm
        comm = algorithm.comm
        try:
            self.driver = comm.stream_driver()
        except NotImplementedError as error:
            raise ConfigError("server", f"concurrent needs tagged messages on background threads: {error}; "
                                        "or use server: serial") from error
        self.lock = self.driver.lock
        self.dtype = algorithm.trainable[0].dtype
        self.element_size = torch.empty(0, dtype=self.dtype).element_size()
        self.sends_in_flight = 0
        self.goodbyes: set[int] = set()
        self.served_losses: list[float] = []
        self.served_staleness: list[int] = []
        if algorithm.is_server:
            start, stop = algorithm.ranges[comm.rank]
            self.request_bytes = HEADER_BYTES + (stop - start) * self.element_size
            self.driver.enter()
            with self.lock:
                for worker in algorithm.workers:
                    self._post_request(worker, torch.empty(self.request_bytes, dtype=torch.uint8))

    # -- server side ----------------------------------------------------------------------------

    def _post_request(self, worker: int, buffer: torch.Tensor) -> None:
        """Post the receive of ``worker``'s next request (call under the lock)."""
        self.driver.recv(buffer, worker, lambda: self._serve_one(worker, buffer), locked=False)

    def _serve_one(self, worker: int, buffer: torch.Tensor) -> None:
        """A request from ``worker`` arrived in ``buffer``: apply it (no lock), reply, post the next
        receive. On its connection's own thread (gloo), or as an event (the simulator)."""
        algorithm = self.algorithm
        _, base_version, want_reply, loss = buffer[:HEADER_BYTES].view(torch.float64).tolist()
        with self.lock:
            algorithm.comm.account("irecv", 0, self.request_bytes, 0.0)
            if want_reply == GOODBYE:
                self.goodbyes.add(worker)
                self.driver.notify()
                return
            applied_before = algorithm.server_state.version
        age = applied_before - int(base_version)
        payload = buffer[HEADER_BYTES:].view(self.dtype)
        centre = algorithm.server_apply(payload, bool(want_reply), age)  # Hogwild: no lock held
        reply = None
        if want_reply:
            reply = torch.empty(REPLY_HEADER_BYTES + centre.numel() * self.element_size, dtype=torch.uint8)
            reply[:REPLY_HEADER_BYTES].view(torch.float64).copy_(
                torch.tensor([applied_before + 1, age], dtype=torch.float64))
            reply[REPLY_HEADER_BYTES:].view(self.dtype).copy_(centre)
        with self.lock:
            algorithm.note_sync()  # the servers' state is the output model
            algorithm.server_state.version += 1
            algorithm.server_state.handled[worker] += 1
            self.served_losses.append(loss)
            self.served_staleness.append(age)
            if reply is not None:
                self._send(reply, worker)
            self._post_request(worker, buffer)  # the payload was read: the buffer is free again
            self.driver.notify()

    def serve(self, step: int) -> StepResult:
        """The server's step: wait until every worker's requests due by ``step`` were applied."""
        algorithm = self.algorithm
        due = algorithm.messages_due(step)
        handled = algorithm.server_state.handled
        self._wait(lambda: all(handled[w] >= due for w in algorithm.workers))
        with self.lock:
            losses, self.served_losses = self.served_losses, []
            staleness, self.served_staleness = self.served_staleness, []
        return StepResult(
            loss=sum(losses) / len(losses) if losses else math.nan, staleness=max(staleness) if staleness else None
        )

    # -- worker side ----------------------------------------------------------------------------

    def exchange(self, step: int, flat: torch.Tensor, want_reply: bool, loss: float) -> Optional[tuple[torch.Tensor, int]]:
        """:meth:`ParameterServerAlgorithm.exchange` over the connections."""
        algorithm = self.algorithm
        self.driver.enter()
        replies: dict[int, torch.Tensor] = {}
        arrived: set[int] = set()
        with self.lock:
            if want_reply:
                for server, (start, stop) in algorithm.ranges.items():
                    replies[server] = buffer = torch.empty(REPLY_HEADER_BYTES + (stop - start) * self.element_size,
                                                           dtype=torch.uint8)
                    self.driver.recv(buffer, server, lambda server=server: self._reply_arrived(server, arrived))
            for server, (start, stop) in algorithm.ranges.items():
                header = [step, algorithm.worker_state.base_version[server], float(want_reply), loss]
                self._send(self._request(header, flat[start:stop]), server)
        algorithm.worker_state.exchanges += 1
        if not want_reply:
            return None
        self._wait(lambda: len(arrived) == len(replies))
        result = torch.empty_like(flat)
        ages = []
        for server, (start, stop) in algorithm.ranges.items():
            version, age = replies[server][:REPLY_HEADER_BYTES].view(torch.float64).tolist()
            algorithm.worker_state.base_version[server] = int(version)
            result[start:stop] = replies[server][REPLY_HEADER_BYTES:].view(flat.dtype)
            ages.append(int(age))
        return result, max(ages)

    def _request(self, header: list[float], values: torch.Tensor) -> torch.Tensor:
        message = torch.empty(HEADER_BYTES + values.numel() * self.element_size, dtype=torch.uint8)
        message[:HEADER_BYTES].view(torch.float64).copy_(torch.tensor(header, dtype=torch.float64))
        message[HEADER_BYTES:].view(self.dtype).copy_(values.detach().reshape(-1))
        return message

    def _reply_arrived(self, server: int, arrived: set[int]) -> None:
        """Under the lock (a locked receive)."""
        arrived.add(server)
        start, stop = self.algorithm.ranges[server]
        self.algorithm.comm.account("irecv", 0, REPLY_HEADER_BYTES + (stop - start) * self.element_size, 0.0)
        self.driver.notify()

    # -- both sides -----------------------------------------------------------------------------

    def _send(self, message: torch.Tensor, dst: int) -> None:
        """Send ``message`` (call under the lock); counted until it is handed to the transport."""
        self.sends_in_flight += 1
        self.algorithm.comm.account("isend", message.numel(), 0, 0.0)
        self.driver.send(message, dst, self._sent)

    def _sent(self) -> None:
        self.sends_in_flight -= 1
        self.driver.notify()

    def _wait(self, predicate) -> None:
        """Block until ``predicate()`` (evaluated under the lock); accounted as blocked time."""
        self.driver.enter()
        started = clock.perf_counter()
        try:
            self.driver.wait(predicate)
        finally:
            self.algorithm.comm.account("irecv", 0, 0, clock.perf_counter() - started, calls=0)

    def close(self) -> None:
        """The end: a worker sends every server its goodbye; a server waits for every worker's.
        Then both wait until their messages are handed over and end the driver's threads."""
        algorithm = self.algorithm
        if algorithm.is_server:
            self._wait(lambda: self.goodbyes >= set(algorithm.workers))
        else:
            self.driver.enter()
            with self.lock:
                for server, (start, stop) in algorithm.ranges.items():
                    self._send(self._request([-1.0, 0.0, GOODBYE, math.nan], torch.zeros(stop - start, dtype=self.dtype)),
                               server)
        self._wait(lambda: self.sends_in_flight == 0)
        self.driver.close()
