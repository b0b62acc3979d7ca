"""`eawild`: asynchronous Elastic Averaging SGD with a lock-free centre ("EA-wild").

The asynchronous EASGD of Zhang, Choromanska and LeCun (2015, Algorithm 1) as compared in Gupta
et al., "Rethinking the Value of Asynchronous Solvers for Distributed Deep Learning": the centre
x~ lives on the server rank(s); workers never wait for one another. At step t a worker computes
its gradient g at its replica x_i; if tau divides t it sends x_i to the server, which applies the
elastic move as soon as the message arrives, x~ <- x~ + alpha (x_i - x~), and replies with the
centre it saw; the worker then moves x_i <- x_i - alpha (x_i - x~_seen). Then the local optimizer
step with g. Each exchange is one message each way.

"Wild": no lock orders the workers' exchanges; the server applies them in arrival order, each on
whatever centre the previous ones left (a server handles one message at a time, so no update is
lost and the centre is never read half-written: the effect of Hogwild's lock-free writes without
their races on dense parameters).

alpha defaults to beta / p with beta = 0.9 and p the number of workers. Roles, messages, how a
server takes part in each step, and staleness (centre updates by others since this worker's last
exchange): see ``ps_common``. Deployable model: the centre, gathered on rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from trainers.algorithms.base import AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.algorithms.easgd import EASGDParams
from trainers.algorithms.ps_common import ParameterServerAlgorithm, check_server_ranks


@dataclass
class EAWildParams(EASGDParams):
    """EASGD's parameters (tau, alpha, beta: the same checks and moving rate, with workers the
    ranks that are not servers) plus server_ranks: ranks holding the centre (split in contiguous
    ranges, in this order)."""

    server_ranks: list[int] = field(default_factory=lambda: [0])

    def __post_init__(self) -> None:
        check_server_ranks(self.server_ranks)
        super().__post_init__()


class EAWild(ParameterServerAlgorithm):
    """Asynchronous EASGD: each worker's elastic exchange with the server's centre, every tau steps."""

    name = "eawild"
    output_role = "centre"
    Params = EAWildParams

    def __init__(self, params: EAWildParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.alpha = params.moving_rate(len(self.workers))

    def messages_due(self, step: int) -> int:
        return step // self.params.tau + 1  # exchanges at steps 0, tau, 2 tau, ...

    def server_apply(self, payload: torch.Tensor, want_reply: bool, staleness: int) -> Optional[torch.Tensor]:
        seen = self.shard.clone()
        self.shard.add_(payload - seen, alpha=self.alpha)
        return seen

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if self.is_server:
            return self.serve(step)
        loss = self.forward_backward(batch)  # gradient at x_i before the elastic move
        staleness = None
        if step % self.params.tau == 0:
            local = flatten(self.trainable)
            centre, staleness = self.exchange(step, local, want_reply=True, loss=loss)
            unflatten_into(local - self.alpha * (local - centre), self.trainable)
        self.optimizer.step()
        return StepResult(loss=loss, staleness=staleness)
