"""`easgd`: synchronous Elastic Averaging SGD (Zhang, Choromanska, LeCun, NIPS 2015).

Every rank is a worker with its own replica x_i and a copy of the centre x~ (identical on all
ranks). At step t, with the gradient g evaluated at the current x_i (the paper's Algorithm 1 and
its synchronous form, eq. 5-6):

* if tau divides t:  d_i = x_i - x~;  x_i <- x_i - alpha d_i;  x~ <- x~ + alpha sum_i d_i
  (one all_reduce of the elastic differences);
* then the local optimizer step with g (plain SGD: x_i <- x_i - lr g).

The moving rate alpha defaults to beta / p with beta = 0.9 and p the number of ranks, as the paper
suggests. Optimizer state (momentum) stays local. Deployable model: the centre (same on every rank,
no communication); its buffers (BatchNorm statistics) are the replicas' mean at the last exchange.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.config import ConfigError, require_float, require_int
from trainers.snapshots import OutputState

DEFAULT_BETA = 0.9


@dataclass
class EASGDParams:
    """Args: tau: steps between elastic exchanges (the communication period); alpha: moving rate
    (default beta / number of workers); beta: p * alpha, used only when alpha is not given
    (default 0.9). Give alpha or beta, not both."""

    tau: int = 4
    alpha: Optional[float] = None
    beta: Optional[float] = None

    def __post_init__(self) -> None:
        require_int("tau", self.tau, minimum=1)
        if self.alpha is not None and self.beta is not None:
            raise ConfigError("alpha", "give alpha or beta, not both (alpha = beta / workers)")
        if self.alpha is not None:
            require_float("alpha", self.alpha, minimum=0.0, maximum=1.0, min_exclusive=True)
        if self.beta is not None:
            require_float("beta", self.beta, minimum=0.0, maximum=1.0, min_exclusive=True)

    def moving_rate(self, workers: int) -> float:
        """alpha, or beta / workers."""
        if self.alpha is not None:
            return self.alpha
        return (self.beta if self.beta is not None else DEFAULT_BETA) / workers


@dataclass
class EASGDState:
    """centre: flat centre variable x~; exchanges: elastic exchanges done."""

    centre: Optional[torch.Tensor] = None
    exchanges: int = 0


class EASGD(Algorithm):
    """Synchronous EASGD: replicas tied to a shared centre by an elastic force every tau steps."""

    name = "easgd"
    Params = EASGDParams

    def __init__(self, params: EASGDParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.alpha = params.moving_rate(self.comm.world_size)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.state = EASGDState()
        self._centre_buffers: list[torch.Tensor] = []

    def setup(self) -> None:
        super().setup()
        self.state.centre = flatten(self.trainable).clone()
        self._centre_buffers = [b.detach().clone() for b in self.model.buffers()]

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)  # gradient at x_i before the elastic move
        if step % self.params.tau == 0:
            self._elastic_exchange()
        self.optimizer.step()
        return StepResult(loss=loss)

    def _elastic_exchange(self) -> None:
        local = flatten(self.trainable)
        difference = local - self.state.centre
        total = difference.clone()
        self.comm.allreduce_async(total, op="sum").wait()
        unflatten_into(local - self.alpha * difference, self.trainable)
        self.state.centre.add_(total, alpha=self.alpha)
        floating = [b for b in self.model.buffers() if b.is_floating_point()]
        if floating:
            averaged = [b.detach().clone() for b in floating]
            self.average_tensors(averaged)
            floating_targets = [b for b in self._centre_buffers if b.is_floating_point()]
            for target, value in zip(floating_targets, averaged):
                target.copy_(value)
        self.state.exchanges += 1
        self.note_sync()

    def output_state(self) -> Optional[OutputState]:
        """The centre x~, written by rank 0 (every rank holds the same one)."""
        return OutputState("centre", self.deployable_model().state_dict()) if self.comm.rank == 0 else None

    def deployable_model(self) -> nn.Module:
        """The centre x~ (identical on every rank; no communication)."""
        centre = copy.deepcopy(self.model)
        unflatten_into(self.state.centre, [p for p in centre.parameters() if p.requires_grad])
        with torch.no_grad():
            for target, value in zip(centre.buffers(), self._centre_buffers):
                target.copy_(value)
        return centre
