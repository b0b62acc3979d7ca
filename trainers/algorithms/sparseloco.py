"""`sparseloco`: SparseLoCo (Sarfi, Therien, Lidin, Belilovsky 2025, arXiv 2508.15706): DiLoCo
whose pseudo-gradients cross the network as chunked top-k, 2-bit codes, with error feedback.

Why SparseLoCo and not DeMo (Peng et al. 2024, "Decoupled Momentum Optimization"): DeMo
communicates every step (the DCT top-k of each worker's fast momentum components), so each step
pays at least one WAN round trip (68-216 ms on aws-4region); SparseLoCo keeps DiLoCo's rare outer
step (every H inner steps) and compresses that exchange, so it fits both the WAN and the
existing `diloco` code, and its paper reports it beating DeMo and full-precision DiLoCo at equal
communication.

Each round, on every rank (theta_g, the global model, identical everywhere):

    H inner AdamW steps on the replica                       (as `diloco`)
    delta      = theta_g - theta_local                       the pseudo-gradient
    e          = error_decay * e + delta                     the rank's error-feedback buffer
    sent       = decode(encode(e))                           chunked top-k + 2 bits (ChunkedTopK)
    e          = e - sent                                    the residual stays on the rank
    mean_sent  = (1/R) sum_r sent_r                          all-gather of the payloads, decoded
                                                             and summed in rank order on every rank
    theta_g   <- theta_g - outer_lr * mean_sent              (outer SGD; momentum optional)

The paper replaces DiLoCo's outer Nesterov momentum by the decayed error-feedback buffer (its
observation: the accumulator approximates outer momentum) and applies the averaged sparse
update with a plain outer step; here that is ``outer_momentum: 0`` (the default), and
``outer_momentum > 0`` (with ``nesterov``) gives DiLoCo's outer optimizer as a control. With
``ratio: 1, bits: 32, error_decay: 0`` and DiLoCo's outer settings, the round is DiLoCo's (test).

Defaults: chunk 4096 with k = 64 (ratio 1/64, 1.6 % density), 2 bits, error_decay 0.95,
outer_lr 1, H 15: our reading of the paper's main setting, not checked against its code
(github tplr-ai/SparseLoCo was not available here). Approximated: the paper's 2-bit quantizer
is not reproduced exactly; ours sends per kept value its sign and whether its magnitude is above
the chunk's mean kept magnitude, decoded as the mean magnitude of that half (two float32 per
chunk). The paper's chunks are 2-D tiles of each weight matrix; ours are consecutive runs of the
flattened parameter vector (zero-padded at the end). Indices are 2 bytes each (the paper's
12-bit packing for 4096-element chunks would save a quarter of them).

Exchange: one ``Comm.allgather_async`` of every rank's payload (fixed size: C*k indices, codes,
scales; ``ChunkedTopK.payload_bytes``), on the all-reduce's transport, so the byte records are the
payload's. Every rank decodes all payloads in rank order, so all apply the same update and hold
bitwise the same theta_g. BatchNorm buffers are averaged in full precision as `diloco` does.
Not crash tolerant (the all-gather needs every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.diloco_common import (
    GlobalModelAlgorithm, check_outer_sgd, float_buffers, outer_step, pseudo_gradient,
)
from trainers.compression import ChunkedTopK, ChunkedTopKParams
from trainers.config import require_float, require_int


@dataclass
class SparseLoCoParams:
    """Args:
        H: inner AdamW steps per round.
        chunk_size: elements per top-k chunk (<= 65536).
        ratio: fraction of each chunk sent (k = ceil(ratio * chunk_size)); 1: every element.
        bits: 2 (SparseLoCo) or 32 (float32 values: the control without quantization).
        error_decay: beta, the error-feedback buffer's decay per round (0: no error feedback,
            the residual is dropped).
        outer_lr: outer step size (the paper applies the averaged sparse update: 1).
        outer_momentum, nesterov: the outer SGD's momentum (0: none, as the paper); > 0 gives
            DiLoCo's outer optimizer.
    """

    H: int = 15
    chunk_size: int = 4096
    ratio: float = 1 / 64
    bits: int = 2
    error_decay: float = 0.95
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        ChunkedTopKParams(chunk_size=self.chunk_size, ratio=self.ratio, bits=self.bits)
        require_float("error_decay", self.error_decay, minimum=0.0, maximum=1.0)
        check_outer_sgd(self.outer_lr, self.outer_momentum, self.nesterov)


@dataclass
class SparseLoCoState:
    """inner_steps: inner steps in the current round; rounds: outer steps taken; residual: the
    error-feedback buffer after the last round (None before the first)."""

    inner_steps: int = 0
    rounds: int = 0
    residual: Optional[torch.Tensor] = None


class SparseLoCo(GlobalModelAlgorithm):
    """DiLoCo's rounds with each pseudo-gradient sent as chunked top-k 2-bit codes, error feedback kept locally."""

    name = "sparseloco"
    Params = SparseLoCoParams

    def __init__(self, params: SparseLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.code = ChunkedTopK(ChunkedTopKParams(params.chunk_size, params.ratio, params.bits))
        self.state = SparseLoCoState()
        # The last round's values, for tests: the pseudo-gradient, what this rank sent (decoded)
        # and the mean applied.
        self.last_round: dict[str, torch.Tensor] = {}

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.inner_steps += 1
        if self.state.inner_steps == self.params.H:
            self._outer_step()
        return StepResult(loss=loss)

    def compress(self, pseudo_gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, decoded payload) for ``pseudo_gradient`` plus the decayed residual; keeps the new residual."""
        corrected = pseudo_gradient.clone()
        if self.state.residual is not None and self.params.error_decay > 0.0:
            corrected += self.params.error_decay * self.state.residual
        payload = self.code.encode(corrected)
        sent = self.code.decode(payload, corrected.numel(), torch.float32)
        self.state.residual = corrected - sent
        return payload, sent

    def _outer_step(self) -> None:
        global_params = list(self.global_model.parameters())
        delta = pseudo_gradient(global_params, list(self.model.parameters())).to(torch.float32)
        payload, sent = self.compress(delta)
        gathered = [torch.empty_like(payload) for _ in range(self.comm.world_size)]
        self.comm.allgather_async(gathered, payload).wait()
        total = torch.zeros_like(delta)
        for rank, received in enumerate(gathered):
            total += sent if rank == self.comm.rank else self.code.decode(received, total.numel(), torch.float32)
        mean = total / self.comm.world_size
        self.last_round = {"pseudo_gradient": delta, "sent": sent, "mean": mean}
        outer_step(global_params, mean, self.outer_optimizer)
        self.average_tensors(float_buffers(self.model))
        self.restart_replica()
        self.state.inner_steps = 0
        self.state.rounds += 1
        self.note_sync()

    def payload_bytes(self) -> int:
        """Bytes of one rank's payload per round."""
        return self.code.payload_bytes(sum(p.numel() for p in self.model.parameters()))
