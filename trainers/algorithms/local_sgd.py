"""`local_sgd`: H local optimizer steps, then model averaging (one all_reduce of all parameters).

Optional post-local warm-up (Lin et al. 2020, "Don't use large mini-batches, use local SGD"):
the first ``warmup_steps`` steps are fully synchronous (bucketed gradient all-reduce, as `sync`).
Optimizer state (momentum) stays local, as torch's PeriodicModelAverager leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook
from trainers.algorithms.sync import GradientBucketer
from trainers.config import require_choice, require_float, require_int
from trainers.snapshots import OutputState


@dataclass
class LocalSGDParams:
    """Args: H: local steps between averages; warmup_steps: initial fully synchronous steps;
    bucket_cap_mb: bucket size of the warm-up gradient all-reduce (MiB); collective: how the
    parameters are averaged, allreduce (gloo/nccl) or ring (isend/irecv ring, fewer WAN round trips)."""

    H: int = 4
    warmup_steps: int = 0
    bucket_cap_mb: float = 25.0
    collective: Literal["allreduce", "ring"] = "allreduce"

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        require_int("warmup_steps", self.warmup_steps, minimum=0)
        require_float("bucket_cap_mb", self.bucket_cap_mb, minimum=0.0, min_exclusive=True)
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
