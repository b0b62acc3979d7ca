"""`dts`: Delayed and Temporally Sparse update (Zhu et al., "Distributed Training Across the World").

Temporally sparse: ranks synchronise every ``p`` steps. Delayed: the average from a
synchronisation launched at step s is applied at step s + ``t`` while local steps continue
(asynchronous all_reduce, waited on at s + t).

What is exchanged: each rank accumulates its learning-rate-weighted local gradients since the
last launch, U_i = sum_k lr_k g_i(k) (p terms). At launch, U_i is all-reduced to its mean U.
When that mean arrives (t steps later) the local contribution already applied is replaced by the
global one: the correction (U - U_i) / lr_now is added to the gradient of the current step, so
with plain SGD the parameters move by exactly -(U - U_i), i.e. w <- w - [lr g_mean(s) - lr g_local(s)]
per synchronised step, the paper's compensation. Replicas therefore differ only by the local
updates whose global replacement has not arrived yet.

With t = 0 and p = 1 the correction arrives in the same step, the step's gradient becomes the
mean gradient, and the algorithm is `sync` (to rounding). With momentum, corrections pass
through the momentum buffer like any gradient, so the total gradient fed to it is the global one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten, grads_of, unflatten_into
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook
from trainers.comm import Work
from trainers.config import require_int
from trainers.snapshots import OutputState


@dataclass
class DTSParams:
    """Args: p: steps between synchronisations (>= 1); t: steps between launching a
    synchronisation and applying its result (>= 0; t >= p keeps several in flight)."""

    p: int = 1
    t: int = 0

    def __post_init__(self) -> None:
        require_int("p", self.p, minimum=1)
        require_int("t", self.t, minimum=0)


@dataclass
class PendingSync:
    """A launched synchronisation: when, its handle, and the local contribution it will replace."""

    launch_step: int
    work: Work
    local_update: torch.Tensor


@dataclass
class DTSState:
    """accumulated: lr-weighted local gradient sum since the last launch (flat); pending: in flight."""

    accumulated: torch.Tensor
    steps_accumulated: int = 0
    pending: deque = field(default_factory=deque)


class DTS(Algorithm):
    """Delayed, temporally sparse gradient averaging with compensation of the local contribution."""

    name = "dts"
    Params = DTSParams
    exchange_hook: ExchangeHook = staticmethod(allreduce_hook)

    def __init__(self, params: DTSParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self._trainable)
        self.state = DTSState(accumulated=torch.zeros(total, dtype=self._trainable[0].dtype, device=ctx.device))

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        grads = grads_of(self._trainable)
        flat_grad = flatten(grads)
        state = self.state
        state.accumulated.add_(flat_grad, alpha=self.lr)
        state.steps_accumulated += 1
        if state.steps_accumulated == self.params.p:
            local_update = state.accumulated.clone()
            # The exchange runs on its own buffer (averaged in place) while local steps go on.
            work = self.exchange_hook(self.comm, state.accumulated.clone())
            state.pending.append(PendingSync(step, work, local_update))
            state.accumulated.zero_()
            state.steps_accumulated = 0
        correction, staleness = self._collect_due(step)
        if correction is not None and self.lr > 0:
            flat_grad.add_(correction, alpha=1.0 / self.lr)
            unflatten_into(flat_grad, grads)
        elif correction is not None:
            # lr 0 (a cosine schedule's last step): nothing passes through the gradient, so the
            # global update replaces the local one on the parameters, as finish() does
            self._apply_directly(correction)
        self.optimizer.step()
        return StepResult(loss=loss, staleness=staleness)

    def _collect_due(self, step: int, all_pending: bool = False) -> tuple[Optional[torch.Tensor], Optional[int]]:
        """Sum of (global - local) updates of the synchronisations due at ``step`` (all if all_pending)."""
        correction, staleness = None, None
        while self.state.pending and (all_pending or self.state.pending[0].launch_step + self.params.t <= step):
            sync = self.state.pending.popleft()
            delta = sync.work.wait() - sync.local_update
            correction = delta if correction is None else correction + delta
            staleness = step - sync.launch_step
            self.note_sync()  # applied now: this step's gradient, or finish()'s direct update
        return correction, staleness

    def finish(self) -> None:
        """Apply every synchronisation still in flight directly to the parameters (SGD-style)."""
        correction, _ = self._collect_due(step=-1, all_pending=True)
        if correction is not None:
            self._apply_directly(correction)

    def _apply_directly(self, correction: torch.Tensor) -> None:
        """w <- w - (U - U_i): the plain-SGD effect of a correction, without the optimizer."""
        with torch.no_grad():
            current = flatten(self._trainable)
            unflatten_into(current - correction, self._trainable)

    def output_state(self) -> OutputState:
        """Every rank's replica (no communication); their mean is the output model."""
        return self.replica_state()

    def deployable_model(self) -> nn.Module:
        """The mean of the replicas now (one all_reduce)."""
        return self.averaged_copy()
