"""`swarmsgd`: SwarmSGD (Nadiradze et al., "Decentralized SGD with Asynchronous, Local and Quantized
Updates"): H local steps, then a non-blocking pairwise average with a random partner.

Round r starts after every H local steps: the ranks are paired by a random matching drawn from
``seed`` and r (identical on every rank, so partners agree without coordination). Each rank
snapshots its parameters, encodes them (``quantize``: none, fp16, or qsgd from
trainers/compression.py), and starts isend/irecv with its partner; local steps go on meanwhile.
As soon as the partner's model has arrived (polled after each step, waited for at the latest
when the next round starts, at evaluation and at the end), the average is applied keeping the
local progress made since the snapshot:

    x_i <- x_i + (decode(x_p snapshot) - decode(x_i snapshot)) / 2

Both partners use the same two decoded snapshots, so the mean of all models is preserved even
with quantization, and without local progress this is exactly (x_i + x_p) / 2. QSGD is applied
to the whole model, so its norms are per ``chunk_size`` elements and its levels default to 127.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.gossip_common import GossipAlgorithm, random_matching
from trainers.comm import Work
from trainers.compression import Compressor, build_compressor
from trainers.config import require_choice, require_int


@dataclass
class SwarmSGDParams:
    """Args: H: local steps between averaging rounds; quantize: none | fp16 | qsgd (code of the sent
    model); levels, chunk_size: qsgd's levels (1..127) and elements per float32 norm; seed: seed of
    the partner schedule (the same on every rank)."""

    H: int = 4
    quantize: Literal["none", "fp16", "qsgd"] = "none"
    levels: int = 127
    chunk_size: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        require_choice("quantize", self.quantize, ("none", "fp16", "qsgd"))
        require_int("levels", self.levels, minimum=1, maximum=127)
        require_int("chunk_size", self.chunk_size, minimum=1)
        require_int("seed", self.seed, minimum=0)


@dataclass
class PendingAverage:
    """An exchange in flight: partner, own decoded snapshot, receive buffer by peer, handles, start step."""

    partner: int
    own_decoded: torch.Tensor
    received: dict[int, torch.Tensor]
    works: list[Work]
    started_step: int


@dataclass
class SwarmState:
    """local_steps: steps since the last round started; rounds: rounds started; pending: exchange in flight."""

    local_steps: int = 0
    rounds: int = 0
    pending: Optional[PendingAverage] = None


class SwarmSGD(GossipAlgorithm):
    """Local steps with background pairwise averaging (see module docstring)."""

    name = "swarmsgd"
    Params = SwarmSGDParams

    def __init__(self, params: SwarmSGDParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = SwarmState()
        self.code: Optional[Compressor] = None
        if params.quantize == "fp16":
            self.code = build_compressor("fp16")
        elif params.quantize == "qsgd":
            self.code = build_compressor("qsgd", levels=params.levels, chunk_size=params.chunk_size)

    def train_step(self, step: int, batch: tuple) -> StepResult:
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

    def deployable_model(self) -> nn.Module:
        """Completes the exchange in flight first, then the mean of all replicas (one all_reduce)."""
        self.finish()
        return super().deployable_model()

    def finish(self) -> None:
        if self.state.pending is not None:
            self._apply_pending(self.state.pending.started_step)

    def load_rejoin_state(self, state: dict, step: int) -> None:
        """The mean model, and the round counters every rank has after ``step`` (rounds start every H steps)."""
        super().load_rejoin_state(state, step)
        self.state = SwarmState(local_steps=(step + 1) % self.params.H, rounds=(step + 1) // self.params.H)
