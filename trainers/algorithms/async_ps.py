"""`async_ps`: asynchronous parameter server, Downpour-style (Dean et al., NIPS 2012).

Workers push their gradient to the server(s) every step without waiting for one another; each
server applies every gradient as it arrives to its range of the parameters with the configured
optimizer (SGD with the run's lr, momentum, weight decay; or AdamW), and every ``pull_every``
steps a worker waits for the server's current parameters and continues from them. Between pulls
a worker applies its own gradients to its replica with plain SGD (Downpour's client does the same),
so it does not keep computing on the same point.

Roles, messages and how a server takes part in each step: see ``ps_common``. Staleness recorded
per step: on a server, the largest staleness among the gradients it applied in that step; on a
worker, at pull steps, the staleness its own gradient had when applied (None otherwise).
Deployable model: the servers' parameters, gathered on rank 0. With one worker and
``pull_every: 1`` the run is exactly single-process SGD on that worker's batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from trainers.algorithms.base import AlgorithmContext, StepResult, flatten, grads_of, unflatten_into
from trainers.algorithms.ps_common import ParameterServerAlgorithm, check_server_ranks
from trainers.config import ConfigError, require_int


@dataclass
class AsyncPSParams:
    """Args: server_ranks: ranks acting as servers (parameters split in contiguous ranges over them,
    in this order); pull_every: steps between a worker's pulls of the current parameters;
    staleness_aware_lr: a server applies a gradient of staleness s with lr / max(1, s) (Zhang et
    al., "Staleness-aware Async-SGD", IJCAI 2016), so stale gradients move the model less."""

    server_ranks: list[int] = field(default_factory=lambda: [0])
    pull_every: int = 1
    staleness_aware_lr: bool = True

    def __post_init__(self) -> None:
        check_server_ranks(self.server_ranks)
        require_int("pull_every", self.pull_every, minimum=1)
        if not isinstance(self.staleness_aware_lr, bool):
            raise ConfigError("staleness_aware_lr", f"must be true or false, got {self.staleness_aware_lr!r}")


class AsyncPS(ParameterServerAlgorithm):
    """Asynchronous SGD: gradients pushed every step, parameters pulled every ``pull_every`` steps."""

    name = "async_ps"
    Params = AsyncPSParams
    tolerates_crash = True

    def __init__(self, params: AsyncPSParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.server_param: Optional[torch.nn.Parameter] = None
        self.server_optimizer: Optional[torch.optim.Optimizer] = None

    def setup(self) -> None:
        super().setup()
        if self.is_server:
            self.server_param = torch.nn.Parameter(self.shard, requires_grad=False)
            self.shard = self.server_param.data
            self.server_optimizer = self.make_optimizer([self.server_param])

    def set_lr(self, lr: float) -> None:
        super().set_lr(lr)
        if self.server_optimizer is not None:
            for group in self.server_optimizer.param_groups:
                group["lr"] = lr

    def messages_due(self, step: int) -> int:
        return step + 1

    def server_apply(self, payload: torch.Tensor, want_reply: bool, staleness: int) -> Optional[torch.Tensor]:
        self.server_param.grad = payload
        lr = self.lr / max(1, staleness) if self.params.staleness_aware_lr else self.lr
        for group in self.server_optimizer.param_groups:
            group["lr"] = lr
        self.server_optimizer.step()
        return self.shard.clone() if want_reply else None

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if self.is_server:
            return self.serve(step)
        loss = self.forward_backward(batch)
        gradient = flatten(grads_of(self.trainable))
        pull = (step + 1) % self.params.pull_every == 0
        reply = self.exchange(step, gradient, want_reply=pull, loss=loss)
        if reply is not None:
            parameters, staleness = reply
            unflatten_into(parameters, self.trainable)
            return StepResult(loss=loss, staleness=staleness)
        with torch.no_grad():
            for param, grad in zip(self.trainable, grads_of(self.trainable)):
                param.add_(grad, alpha=-self.lr)
        return StepResult(loss=loss)
