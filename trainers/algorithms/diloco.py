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

from dataclasses import dataclass
from typing import Literal

from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.diloco_common import (
    OUTER_PRECISIONS, GlobalModelAlgorithm, OuterPrecision, check_outer_sgd, float_buffers, launch_average,
    outer_compressor, outer_step, pseudo_gradient,
)
from trainers.config import require_choice, require_int


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
        check_outer_sgd(self.outer_lr, self.outer_momentum, self.nesterov)
        require_choice("collective", self.collective, ("allreduce", "ring"))


@dataclass
class DiLoCoState:
    """inner_steps: inner steps in the current round; rounds: outer steps taken."""

    inner_steps: int = 0
    rounds: int = 0


class DiLoCo(GlobalModelAlgorithm):
    """Inner AdamW on the local replica, outer Nesterov SGD on the averaged pseudo-gradient."""

    name = "diloco"
    Params = DiLoCoParams
    tolerates_crash = True

    def __init__(self, params: DiLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = DiLoCoState()
        self.outer_code = outer_compressor(params.outer_precision)

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.inner_steps += 1
        if self.state.inner_steps == self.params.H:
            self._outer_step()
        return StepResult(loss=loss)

    def _outer_step(self) -> None:
        global_params = list(self.global_model.parameters())
        delta = pseudo_gradient(global_params, list(self.model.parameters()))
        launch_average(self.comm, delta, self.outer_code, self.params.collective).wait()
        outer_step(global_params, delta, self.outer_optimizer)
        # BatchNorm statistics are not trained by gradients: average them as they are.
        self.average_tensors(float_buffers(self.model), self.params.collective)
        self.restart_replica()
        self.state.inner_steps = 0
        self.state.rounds += 1
        self.note_sync()

    def rejoin_state(self, deployable: nn.Module) -> dict:
        return {"global": self.global_model.state_dict(), "outer": self.outer_optimizer.state_dict()}

    def load_rejoin_state(self, state: dict, step: int) -> None:
        self.global_model.load_state_dict(state["global"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.model.load_state_dict(state["global"])
        self.state = DiLoCoState(inner_steps=(step + 1) % self.params.H, rounds=(step + 1) // self.params.H)
