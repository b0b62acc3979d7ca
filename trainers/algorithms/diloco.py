"""`diloco`: DiLoCo (Douillard et al. 2023; OpenDiLoCo defaults), inner AdamW, outer Nesterov SGD.

Every rank keeps the global model theta_g (identical everywhere) and a local replica. Each round:
H inner AdamW steps on the replica (lr, betas and weight_decay from the config's optimizer
section, schedule from lr_schedule); then the pseudo-gradient delta_i = theta_g - theta_local
(pointing away from where local training went) is averaged with one all_reduce, and the outer
optimizer takes theta_g <- theta_g - outer_lr * nesterov(mean delta), i.e. moves towards the
replicas' mean. The replica restarts from the new theta_g; inner optimizer state persists.

``outer_precision`` (fp32 | bf16 | int8 | int4) sets how the pseudo-gradient crosses the
network: fp32 (default) is the all-reduce above; the others all-gather encoded payloads and
average the decoded ones in float32 (trainers/algorithms/diloco_common.py). The BatchNorm
buffers are averaged in float32 whatever the precision. Crash tolerance is tested at fp32 only
(tests/trainers/test_fault_tolerance.py); the all-gather of the other precisions through a crash
is not.

Crash tolerance (comm backend tcp): the average is over the replicas that reached the outer
step; a crashed rank is left out from then on. A restarted rank gets theta_g, the outer
momentum and the round counters from rank 0 at an evaluation point, and starts its replica from
theta_g (its inner AdamW state starts afresh).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten
from trainers.algorithms.diloco_common import (
    OUTER_PRECISIONS, OuterPrecision, inner_adamw, launch_average, outer_compressor, outer_step,
)
from trainers.config import ConfigError, require_choice, require_float, require_int
from trainers.snapshots import OutputState


@dataclass
class DiLoCoParams:
    """Args: H: inner steps per round; outer_lr: outer SGD learning rate; outer_momentum: its
    Nesterov momentum; nesterov: use Nesterov (else heavy-ball) momentum in the outer step;
    collective: how the pseudo-gradient is averaged, allreduce (gloo/nccl) or ring (isend/irecv
    ring, fewer WAN round trips); outer_precision: the pseudo-gradient on the wire, fp32
    (all-reduced) or bf16 | int8 | int4 (encoded, all-gathered, averaged in float32)."""

    H: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    collective: Literal["allreduce", "ring"] = "allreduce"
    outer_precision: OuterPrecision = "fp32"

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        require_choice("outer_precision", self.outer_precision, OUTER_PRECISIONS)
        require_float("outer_lr", self.outer_lr, minimum=0.0, min_exclusive=True)
        require_float("outer_momentum", self.outer_momentum, minimum=0.0, maximum=1.0)
        require_choice("collective", self.collective, ("allreduce", "ring"))
        if self.nesterov and self.outer_momentum == 0.0:
            raise ConfigError("nesterov", "needs outer_momentum > 0")


@dataclass
class DiLoCoState:
    """inner_steps: inner steps in the current round; rounds: outer steps taken."""

    inner_steps: int = 0
    rounds: int = 0


class DiLoCo(Algorithm):
    """Inner AdamW on the local replica, outer Nesterov SGD on the averaged pseudo-gradient."""

    name = "diloco"
    Params = DiLoCoParams
    tolerates_crash = True

    def __init__(self, params: DiLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.optimizer = inner_adamw(self.model, ctx)  # AdamW whatever optimizer.name says
        self.state = DiLoCoState()
        self.global_model: nn.Module | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self.outer_code = outer_compressor(params.outer_precision)

    def setup(self) -> None:
        super().setup()
        self.global_model = copy.deepcopy(self.model)
        self.outer_optimizer = torch.optim.SGD(
            self.global_model.parameters(),
            lr=self.params.outer_lr,
            momentum=self.params.outer_momentum,
            nesterov=self.params.nesterov,
        )

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.inner_steps += 1
        if self.state.inner_steps == self.params.H:
            self._outer_step()
        return StepResult(loss=loss)

    def _outer_step(self) -> None:
        global_params = list(self.global_model.parameters())
        local_params = list(self.model.parameters())
        pseudo_gradient = flatten(global_params) - flatten(local_params)
        launch_average(self.comm, pseudo_gradient, self.outer_code, self.params.collective).wait()
        outer_step(global_params, pseudo_gradient, self.outer_optimizer)
        # BatchNorm statistics are not trained by gradients: average them as they are.
        local_buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        self.average_tensors(local_buffers, self.params.collective)
        with torch.no_grad():
            for target, source in zip(self.global_model.buffers(), self.model.buffers()):
                target.copy_(source)
            for local, global_param in zip(local_params, global_params):
                local.copy_(global_param)
        self.state.inner_steps = 0
        self.state.rounds += 1
        self.note_sync()

    def output_state(self) -> Optional[OutputState]:
        """The global model theta_g, written by rank 0 (every rank holds the same one)."""
        return OutputState("global", self.global_model.state_dict()) if self.comm.rank == 0 else None

    def deployable_model(self) -> nn.Module:
        """The global model theta_g (identical on every rank, no communication)."""
        return self.global_model

    def rejoin_state(self, deployable: nn.Module) -> dict:
        return {"global": self.global_model.state_dict(), "outer": self.outer_optimizer.state_dict()}

    def load_rejoin_state(self, state: dict, step: int) -> None:
        self.global_model.load_state_dict(state["global"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.model.load_state_dict(state["global"])
        self.state = DiLoCoState(inner_steps=(step + 1) % self.params.H, rounds=(step + 1) // self.params.H)
