"""`eawild`: asynchronous Elastic Averaging SGD with a lock-free centre ("EA-wild").

The asynchronous EASGD of Zhang, Choromanska and LeCun (2015, Algorithm 1) with Hogwild's
non-locking updates of the centre, as compared in Wongpanich, You and Demmel, "Rethinking the
Value of Asynchronous Solvers for Distributed Deep Learning" (HPC Asia 2020): the centre x~ lives
on the server rank(s); workers never wait for one another. At step t a worker computes its
gradient g at its replica x_i; if tau divides t it sends x_i to the server, which applies the
elastic move as soon as the message arrives, x~ <- x~ + alpha (x_i - x~), and replies with the
centre it saw; the worker then moves x_i <- x_i - alpha (x_i - x~_seen). Then the local optimizer
step with g. Each exchange is one message each way.

"Wild" (``server: concurrent``, the default): no lock orders the workers' exchanges and the
server is no serialization point. Each worker's connection has its own service (on gloo a thread
per worker), which applies that worker's exchange as soon as it has arrived, in place on the
shared centre, without a lock, while other services apply theirs: seen = x~ (a copy, the reply),
then x~ += alpha (x_i - seen), so an exchange that overlaps another may partly undo it (a lost
update, as in Hogwild). On the simulator the services are events: an apply takes no virtual time
(as nothing but compute does), so what overlaps there is the exchanges' messages, each on a
receive posted ahead for its connection. ``server: serial`` keeps the older server, one message
at a time in arrival order (no update lost, never read half-written, but every exchange waits for
those ahead of it): kept for the side-by-side benchmark (``bench/bench_eawild_server.py``). With
one worker both give the same numbers. See ``ps_common`` for both ways of serving.

alpha defaults to beta / p with beta = 0.9 and p the number of workers. Roles, messages, how a
server takes part in each step, and staleness (centre updates by others since this worker's last
exchange; on a concurrent server, those finished when this one's apply started): see
``ps_common``. Deployable model: the centre, gathered on rank 0 (as it is at that moment: a
service may be part-way through an exchange of a worker that is ahead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from trainers.algorithms.base import AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.algorithms.easgd import EASGDParams
from trainers.algorithms.ps_common import ParameterServerAlgorithm, check_server_mode, check_server_ranks


@dataclass
class EAWildParams(EASGDParams):
    """EASGD's parameters (tau, alpha, beta: the same checks and moving rate, with workers the
    ranks that are not servers) plus server_ranks: ranks holding the centre (split in contiguous
    ranges, in this order); server: concurrent (each worker's exchanges served on its own
    connection, applied without a lock: the paper's lock-free centre) | serial (one exchange at a
    time, in arrival order: the baseline of bench/bench_eawild_server.py)."""

    server_ranks: list[int] = field(default_factory=lambda: [0])
    server: str = "concurrent"

    def __post_init__(self) -> None:
        check_server_ranks(self.server_ranks)
        check_server_mode(self.server)
        super().__post_init__()


class EAWild(ParameterServerAlgorithm):
    """Asynchronous EASGD: each worker's elastic exchange with the server's centre, every tau steps."""

    name = "eawild"
    output_role = "centre"
    Params = EAWildParams

    def __init__(self, params: EAWildParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.alpha = params.moving_rate(len(self.workers))
        self.server_mode = params.server

    def messages_due(self, step: int) -> int:
        return step // self.params.tau + 1  # exchanges at steps 0, tau, 2 tau, ...

    def server_apply(self, payload: torch.Tensor, want_reply: bool, staleness: int) -> Optional[torch.Tensor]:
        # on a concurrent server other services may be writing the shard meanwhile: the reply is
        # the centre as read here, and the move is made from it
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
