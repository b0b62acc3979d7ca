"""`local_sgd`: H local optimizer steps, then model averaging (one all_reduce of all parameters).

Optional post-local warm-up (Lin et al. 2020, "Don't use large mini-batches, use local SGD"):
the first ``warmup_steps`` steps are fully synchronous (bucketed gradient all-reduce, as `sync`),
at ``warmup_lr`` when set (the peak lr of the schedule for those steps; the job's lr after them), so
that with the same seed, batch and schedule the warm-up is a `sync` run's own first steps: the
shared warm start of DiLoCo's paper, as `diloco` takes it (the controls of its comparison).
Optimizer state (momentum) stays local, as torch's PeriodicModelAverager leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook
from trainers.algorithms.sync import GradientBucketer
from trainers.config import check_warmup, require_choice, require_int
from trainers.snapshots import OutputState


@dataclass
class LocalSGDParams:
    """Args: H: local steps between averages; warmup_steps: initial fully synchronous steps;
    warmup_lr: the peak lr of those steps (None: the job's lr); bucket_cap_mb: bucket size of the warm-up gradient all-reduce (MiB); collective: how the
    parameters are averaged, allreduce (gloo/nccl) or ring (isend/irecv ring, fewer WAN round trips)."""

    H: int = 4
    warmup_steps: int = 0
    warmup_lr: Optional[float] = None
    bucket_cap_mb: float = 25.0
    collective: Literal["allreduce", "ring"] = "allreduce"

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        check_warmup(self.warmup_steps, self.warmup_lr, self.bucket_cap_mb)
        require_choice("collective", self.collective, ("allreduce", "ring"))


@dataclass
class LocalSGDState:
    """local_steps: local steps since the last average; averages: averages done so far."""

    local_steps: int = 0
    averages: int = 0


class LocalSGD(Algorithm):
    """Periodic model averaging; replicas drift apart for up to H steps."""

    name = "local_sgd"
    Params = LocalSGDParams
    exchange_hook: ExchangeHook = staticmethod(allreduce_hook)

    def __init__(self, params: LocalSGDParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = LocalSGDState()
        self.bucketer: Optional[GradientBucketer] = None
        if params.warmup_steps > 0:
            self.bucketer = GradientBucketer(
                self.model.parameters(), self.comm, int(params.bucket_cap_mb * 2**20), self.exchange_hook
            )

    def train_step(self, step: int, batch: tuple) -> StepResult:
        warming_up = step < self.params.warmup_steps
        if self.bucketer is not None and not warming_up:
            # Warm-up is over for good: drop the hooks so local steps pay nothing for them.
            self.bucketer.remove_hooks()
            self.bucketer = None
        loss = self.forward_backward(batch)
        if warming_up:
            self.bucketer.wait_and_apply()
            self.note_sync()
            self.optimizer.step()
            return StepResult(loss=loss)
        self.optimizer.step()
        self.state.local_steps += 1
        if self.state.local_steps == self.params.H:
            self.average_model()
            self.note_sync()
            self.state.local_steps = 0
            self.state.averages += 1
        return StepResult(loss=loss)

    def average_model(self) -> None:
        """Replace the parameters by their mean over ranks (subclasses may exchange differently)."""
        self.average_tensors(list(self.model.parameters()), self.params.collective)

    def output_state(self) -> OutputState:
        """Every rank's replica (no communication); their mean is the output model."""
        return self.replica_state()

    def deployable_model(self) -> nn.Module:
        """The mean of the replicas now (one all_reduce; replicas are equal right after averaging)."""
        return self.averaged_copy()
