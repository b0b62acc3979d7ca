"""`swarmsgd`: SwarmSGD (Nadiradze et al., "Decentralized SGD with Asynchronous, Local and Quantized
Updates"): H local steps, then a pairwise average with a partner drawn at random, no global rounds.

The paper's interaction (``interaction: async``, the default where the comm has tagged messages):
after its H local steps a node (the *initiator*) draws a partner uniformly at random among its
neighbours (``neighbours``: every other node by default; ring or torus), from a generator of its
own seeded by the job's seed, its rank and ``seed``. It sends its model to the partner, encoded
(``quantize``: qsgd by default, as in the paper; fp16 or none), and goes on with local steps.
On the partner, a *responder* (the comm's receive path: a background thread on a real comm, an
event on the simulator) answers at once, whatever step the partner is at: it replies with the
partner's *current* model (encoded) and queues the pairwise average for itself; the partner's
own thread applies it at its next step boundary. The initiator applies its half when the reply
has arrived, looking between steps, never waiting for it. Both halves keep the local progress
made since the snapshots they were computed from:

    x_i <- x_i + (decode(x_p snapshot) - decode(x_i snapshot)) / 2

What is the paper's and what is approximated here:

* The paper's: random partner per interaction (no matching, no rounds), H local steps between a
  node's interactions, quantized models on the wire, the partner answering without being at any
  particular step.
* Approximation: the paper's analysis treats an interaction as atomic. Here the two models are
  snapshots taken at the request and at the answer, and each half is applied later, on top of
  the local steps taken since (the paper's non-blocking variant has the same staleness). A node
  answering a request while its own request is out computes the two averages from the same
  snapshot, so both are applied on top of each other (a + (b - a)/2 + (c - a)/2); answers a
  node gives one after another are exact (each answer's snapshot includes the averages queued
  before it).
* Two nodes that pick each other at once (a crossing: each receives the other's request while
  waiting for the other's reply) would swap their models if both requests were answered: the
  lower rank answers the higher one's request ``crossed`` (neither side applies anything for it)
  and the higher rank answers the lower one's as usual, so the pair averages once. Each side
  applies its half exactly when a ``reply`` (not ``crossed``) was sent, so the two always agree.
* A node has at most ``max_outstanding`` requests out (default 1); with that many out, it keeps
  taking local steps and starts its next interaction at the first step boundary after a reply.
  A partner that is itself busy (its own request out, or computing) answers at once all the same;
  two initiators that pick the same partner are answered in the order their requests arrive,
  the second with a model that includes the first's average.

Mean preservation: each interaction adds (b - a)/2 to one model and (a - b)/2 to the other, with
the same two decoded snapshots on both sides, so it leaves the sum of all models unchanged (up to
float rounding), with quantization as without, and with local progress too (the local steps
themselves move the mean, as in any SGD). Without quantization and without local progress, an
interaction that overlaps no other yields exactly (x_i + x_p) / 2 on both.

Ending: at ``finish`` (the last step, on every rank) a node starts no more interactions, waits for
its own replies (still answering others), meets the others in one barrier (then no request is
in flight anywhere), and the ranks pass one ``stop`` message around a ring to retire each
responder's posted receive.

``interaction: rounds`` is the earlier, round-based exchange kept as a control: every H steps a
random perfect matching drawn from ``seed`` and the round pairs all ranks; each exchanges
snapshots with its round partner in the background and applies the average (the formula above)
once it has arrived, at the latest when its next round starts (then it waits for that partner).
It needs only isend/irecv, so it runs on every comm; the async interaction needs the comm's
tagged point-to-point messages (gloo, and the simulator's comm), which the elastic tcp comm
(crash faults) does not have: ``interaction: auto`` (the default) is async where it can run
and rounds on such a comm, with a warning that says so; ``async`` there is refused.
QSGD is applied to the whole model, its norms per ``chunk_size`` elements, levels 127 by default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.gossip_common import GossipAlgorithm, random_matching, ring_graph, torus_graph
from trainers.comm import STREAM_TAG, Work
from trainers.compression import Compressor, build_compressor
from trainers.config import require_choice, require_int

log = logging.getLogger(__name__)

# Message tags of the async interaction (the two after the message streams' own): requests
# (received from any source) and replies (from the partner asked).
REQUEST_TAG = STREAM_TAG + 1
REPLY_TAG = STREAM_TAG + 2
HEADER_BYTES = 8  # every message starts with its kind, one int64
REQUEST, STOP, REPLY, CROSSED = 1, 2, 3, 4
# The random stream of the partner draws (Algorithm.rank_generator's ``stream``), and of qsgd's rounding.
PARTNER_STREAM, ROUNDING_STREAM = 23, 24


@dataclass
class SwarmSGDParams:
    """Args: H: local steps between a node's interactions; interaction: auto | async | rounds (see
    the module docstring); quantize: none | fp16 | qsgd (code of the sent model); levels,
    chunk_size: qsgd's levels (1..127) and elements per float32 norm; neighbours: all | ring |
    torus (whom a node may pick, async); max_outstanding: requests a node may have out at once
    (async); seed: seed of the partner draws (with the job's seed and the rank, async) or of the
    matchings (rounds)."""

    H: int = 4
    interaction: Literal["auto", "async", "rounds"] = "auto"
    quantize: Literal["none", "fp16", "qsgd"] = "qsgd"
    levels: int = 127
    chunk_size: int = 64
    neighbours: Literal["all", "ring", "torus"] = "all"
    max_outstanding: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        require_choice("interaction", self.interaction, ("auto", "async", "rounds"))
        require_choice("quantize", self.quantize, ("none", "fp16", "qsgd"))
        require_int("levels", self.levels, minimum=1, maximum=127)
        require_int("chunk_size", self.chunk_size, minimum=1)
        require_choice("neighbours", self.neighbours, ("all", "ring", "torus"))
        require_int("max_outstanding", self.max_outstanding, minimum=1, maximum=64)
        require_int("seed", self.seed, minimum=0)


@dataclass
class PendingAverage:
    """A round's exchange in flight: partner, own decoded snapshot, receive buffer by peer, handles, start step."""

    partner: int
    own_decoded: torch.Tensor
    received: dict[int, torch.Tensor]
    works: list[Work]
    started_step: int


@dataclass
class SwarmState:
    """Rounds: local_steps: steps since the last round started; rounds: rounds started; pending:
    exchange in flight."""

    local_steps: int = 0
    rounds: int = 0
    pending: Optional[PendingAverage] = None


@dataclass
class Request:
    """An interaction this node started: partner, own decoded snapshot, reply buffer, start step."""

    partner: int
    own_decoded: torch.Tensor
    reply: torch.Tensor
    started_step: int


@dataclass
class AsyncState:
    """The async interaction's state on one node.

    local_steps: steps since this node's last interaction started; outstanding: its requests out;
    queued: the sum of the averages that arrived and are not applied yet (None: none), and their
    count; queued_age: age in steps of the oldest own reply among them; partners: the partner of
    every interaction started, in order; answered: the requester of every request answered, in
    order; crossed: requests answered ``crossed`` (cancelled crossings); stopped: the ring's stop arrived.
    """

    local_steps: int = 0
    outstanding: list[Request] = field(default_factory=list)
    queued: Optional[torch.Tensor] = None
    queued_count: int = 0
    queued_age: Optional[int] = None
    step: int = 0
    partners: list[int] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)
    crossed: int = 0
    stopped: bool = False
    finished: bool = False


class SwarmSGD(GossipAlgorithm):
    """Local steps with pairwise averaging with random partners (see module docstring)."""

    name = "swarmsgd"
    Params = SwarmSGDParams

    def __init__(self, params: SwarmSGDParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = SwarmState()
        self.code: Optional[Compressor] = None
        if params.quantize == "fp16":
            self.code = build_compressor("fp16")
        elif params.quantize == "qsgd":
            self.code = build_compressor("qsgd", self.rank_generator(ROUNDING_STREAM), levels=params.levels,
                                         chunk_size=params.chunk_size)
        self.interaction = self._resolve_interaction(params.interaction)
        self.swarm: Optional[AsyncState] = None
        if self.interaction == "async":
            self.swarm = AsyncState()
            self.driver = self.comm.stream_driver()
            self.lock = self.driver.lock
            self.partner_generator = torch.Generator().manual_seed(
                (ctx.seed * 1000 + self.comm.rank) * 7919 + PARTNER_STREAM + 100 * params.seed)
            self.neighbours = self._neighbours()
            self.numel = self.flat_parameters().numel()
            self.payload_bytes = self.numel * 4 if self.code is None else self.code.payload_bytes(self.numel)
            self.message_bytes = HEADER_BYTES + self.payload_bytes

    def _resolve_interaction(self, asked: str) -> str:
        """``auto``: async where the comm carries tagged messages, else rounds (with a warning)."""
        if asked == "rounds":
            return "rounds"
        try:
            self.comm.stream_driver()
            return "async"
        except NotImplementedError as error:
            if asked == "async":
                raise ValueError(f"interaction: async needs the comm's tagged point-to-point messages ({error}); "
                                 "use interaction rounds on this comm") from None
            log.warning("swarmsgd: interaction auto runs the round-based exchange on %s (no tagged messages "
                        "for the asynchronous one)", type(self.comm).__name__)
            return "rounds"

    def _neighbours(self) -> list[int]:
        n, rank = self.comm.world_size, self.comm.rank
        if self.params.neighbours == "ring":
            return sorted(ring_graph(n)[rank])
        if self.params.neighbours == "torus":
            return sorted(torus_graph(n)[rank])
        return [r for r in range(n) if r != rank]

    def setup(self) -> None:
        super().setup()
        if self.swarm is not None and self.comm.world_size > 1:
            self.driver.enter()
            with self.lock:
                self._post_request_receive()

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if self.swarm is None:
            return self._round_step(step, batch)
        loss = self.forward_backward(batch)
        self.driver.enter()  # a simulated rank: pay the compute first, so answers until now saw the model before this step
        with self.lock:
            self.optimizer.step()
            self.swarm.step = step
            self.swarm.local_steps += 1
            staleness = self._apply_queued()
            if self._due():
                self._start_interaction(step)
                self.swarm.local_steps = 0
        return StepResult(loss=loss, staleness=staleness)

    # -- the async interaction: everything under self.lock ---------------------------------------

    def _due(self) -> bool:
        """Whether this node starts an interaction now: H local steps done and a request free."""
        return (bool(self.neighbours) and self.swarm.local_steps >= self.params.H
                and len(self.swarm.outstanding) < self.params.max_outstanding)

    def _virtual_flat(self) -> torch.Tensor:
        """The model with the averages queued for it: what an answer given now must show."""
        flat = self.flat_parameters()
        return flat if self.swarm.queued is None else flat.add_(self.swarm.queued)

    def _encode(self, flat: torch.Tensor, kind: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The message for ``flat`` (header ``kind``, then the encoded model) and the decoded model
        both ends will use."""
        message = torch.empty(self.message_bytes, dtype=torch.uint8)
        message[:HEADER_BYTES].view(torch.int64)[0] = kind
        if self.code is None:
            payload, decoded = flat.detach().to(torch.float32).cpu().view(torch.uint8), flat
        else:
            payload = self.code.encode(flat)
            decoded = self.code.decode(payload, self.numel, flat.dtype)
            payload = payload.cpu().reshape(-1).view(torch.uint8)
        message[HEADER_BYTES:].copy_(payload)
        return message, decoded

    def _decode(self, message: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        payload = message[HEADER_BYTES:]
        if self.code is None:
            return payload.view(torch.float32).to(device=like.device, dtype=like.dtype, copy=True)
        if self.params.quantize == "fp16":
            payload = payload.view(torch.float16)
        return self.code.decode(payload.to(like.device), self.numel, like.dtype)

    def _queue(self, delta: torch.Tensor) -> None:
        state = self.swarm
        state.queued = delta if state.queued is None else state.queued.add_(delta)
        state.queued_count += 1

    def _apply_queued(self) -> Optional[int]:
        """Apply the averages that arrived (on this rank's thread, between steps); returns the age
        of the oldest own reply among them (None: none)."""
        state = self.swarm
        if state.queued is None:
            return None
        self.load_flat_parameters(self.flat_parameters().add_(state.queued))
        self.note_sync(state.queued_count)
        age = state.queued_age
        state.queued, state.queued_count, state.queued_age = None, 0, None
        return age

    def _start_interaction(self, step: int) -> None:
        state = self.swarm
        partner = self.neighbours[int(torch.randint(len(self.neighbours), (1,), generator=self.partner_generator))]
        if not self.comm.is_live(partner):
            return
        message, own_decoded = self._encode(self.flat_parameters(), REQUEST)
        request = Request(partner, own_decoded, torch.empty(self.message_bytes, dtype=torch.uint8), step)
        state.outstanding.append(request)
        state.partners.append(partner)
        self.comm.account("irecv", 0, self.message_bytes, 0.0)
        self.comm.account("isend", self.message_bytes, 0, 0.0)
        self.driver.recv(request.reply, partner, lambda: self._replied(request), tag=REPLY_TAG)
        self.driver.send(message, partner, lambda: None, tag=REQUEST_TAG)

    def _replied(self, request: Request) -> None:
        """The partner's answer to ``request`` arrived (the comm's receive path)."""
        state = self.swarm
        state.outstanding.remove(request)
        if int(request.reply[:HEADER_BYTES].view(torch.int64)[0]) == REPLY:
            theirs = self._decode(request.reply, request.own_decoded)
            self._queue(theirs.sub_(request.own_decoded).mul_(0.5))
            age = state.step - request.started_step
            state.queued_age = age if state.queued_age is None else max(state.queued_age, age)
        self.driver.notify()

    def _post_request_receive(self) -> None:
        buffer = torch.empty(self.message_bytes, dtype=torch.uint8)
        self.driver.recv_any(buffer, REQUEST_TAG, lambda src: self._requested(src, buffer))

    def _requested(self, src: int, message: torch.Tensor) -> None:
        """A request (or the ring's stop) from ``src`` arrived: answer at once (the comm's receive path)."""
        state = self.swarm
        if int(message[:HEADER_BYTES].view(torch.int64)[0]) == STOP:
            state.stopped = True
            self.driver.notify()
            return
        self._post_request_receive()
        # a crossing (this node waits for src's reply to its own request): only the higher rank answers
        crossing = self.comm.rank < src and any(request.partner == src for request in state.outstanding)
        mine = self._virtual_flat()
        reply, own_decoded = self._encode(mine, CROSSED if crossing else REPLY)
        self.comm.account("irecv", 0, self.message_bytes, 0.0)
        self.comm.account("isend", self.message_bytes, 0, 0.0)
        self.driver.send(reply, src, lambda: None, tag=REPLY_TAG)
        if crossing:
            state.crossed += 1
        else:
            state.answered.append(src)
            self._queue(self._decode(message, mine).sub_(own_decoded).mul_(0.5))
        self.driver.notify()

    def _finish_async(self) -> None:
        state = self.swarm
        if state.finished:
            return
        state.finished = True
        n = self.comm.world_size
        if n > 1:
            self.driver.wait(lambda: not state.outstanding)
            self.comm.barrier()  # every rank has its replies: no request is in flight any more
            self.driver.enter()
            with self.lock:
                stop = torch.zeros(self.message_bytes, dtype=torch.uint8)
                stop[:HEADER_BYTES].view(torch.int64)[0] = STOP
                self.driver.send(stop, (self.comm.rank + 1) % n, lambda: None, tag=REQUEST_TAG)
            self.driver.wait(lambda: state.stopped)
            self.driver.close()
        with self.lock:
            self._apply_queued()

    # -- the round-based exchange (interaction: rounds) -------------------------------------------

    def _round_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.local_steps += 1
        staleness = None
        pending = self.state.pending
        if pending is not None and all(work.is_completed() for work in pending.works):
            staleness = self._apply_pending(step)
        if self.state.local_steps >= self.params.H:
            if self.state.pending is not None:
                staleness = self._apply_pending(step)
            self._start_round(step)
            self.state.local_steps = 0
        return StepResult(loss=loss, staleness=staleness)

    def _start_round(self, step: int) -> None:
        partner = random_matching(self.comm.world_size, self.params.seed, self.state.rounds)[self.comm.rank]
        self.state.rounds += 1
        if partner is None:
            return
        snapshot = self.flat_parameters()
        if self.code is None:
            payload, own_decoded = snapshot, snapshot
        else:
            payload = self.code.encode(snapshot)
            own_decoded = self.code.decode(payload, snapshot.numel(), snapshot.dtype)
        received, works = self.start_exchange([partner], payload)
        if partner in received:  # else the partner is gone: no average this round
            self.state.pending = PendingAverage(partner, own_decoded, received, works, step)

    def _apply_pending(self, step: int) -> Optional[int]:
        """Wait for the exchange in flight and apply it; returns its age in steps (None: the partner
        was lost, nothing applied)."""
        pending = self.state.pending
        self.state.pending = None
        arrived = self.wait_exchange(pending.received, pending.works)
        if pending.partner not in arrived:
            return None
        theirs = arrived[pending.partner]
        if self.code is not None:
            theirs = self.code.decode(theirs, pending.own_decoded.numel(), pending.own_decoded.dtype)
        self.load_flat_parameters(self.flat_parameters().add_((theirs - pending.own_decoded).mul_(0.5)))
        self.note_sync()
        return step - pending.started_step

    # -- the runner's interface ----------------------------------------------------------------

    def deployable_model(self) -> nn.Module:
        """The averages that arrived applied first (rounds: the exchange in flight completed), then
        the mean of all replicas (one all_reduce)."""
        if self.swarm is not None:
            self.driver.enter()
            with self.lock:
                self._apply_queued()
        elif self.state.pending is not None:
            self._apply_pending(self.state.pending.started_step)
        return super().deployable_model()

    def finish(self) -> None:
        if self.swarm is not None:
            self._finish_async()
        elif self.state.pending is not None:
            self._apply_pending(self.state.pending.started_step)

    def load_rejoin_state(self, state: dict, step: int) -> None:
        """The mean model, and the round counters every rank has after ``step`` (rounds start every H steps)."""
        super().load_rejoin_state(state, step)
        self.state = SwarmState(local_steps=(step + 1) % self.params.H, rounds=(step + 1) // self.params.H)
