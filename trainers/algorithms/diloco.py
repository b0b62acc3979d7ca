"""`diloco`: DiLoCo (Douillard et al. 2023; OpenDiLoCo defaults), inner AdamW, outer Nesterov SGD.

Every rank keeps the global model theta_g (identical everywhere) and a local replica. Each round:
H inner AdamW steps on the replica (lr, betas and weight_decay from the config's optimizer
section, schedule from lr_schedule); then the pseudo-gradient delta_i = theta_g - theta_local
(pointing away from where local training went) is averaged with one all_reduce, and the outer
optimizer takes theta_g <- theta_g - outer_lr * nesterov(mean delta), i.e. moves towards the
replicas' mean. The replica restarts from the new theta_g; inner optimizer state persists.

``outer_precision`` (fp32 | bf16 | int8 | int4) sets how the pseudo-gradient crosses the
network: fp32 (default) is the all-reduce above; the others all-gather encoded payloads and
average the decoded ones in float32 (trainers/algorithms/diloco_common.py), or, with
``outer_reduce: ring``, run a ring all-reduce whose every message is encoded (INTELLECT-1's int8
ring all-reduce: the ring's bytes at the code's size, partial sums rounded at every hop). The BatchNorm
buffers are averaged in float32 whatever the precision. Crash tolerance is tested at fp32 only
(tests/trainers/test_fault_tolerance.py); the all-gather of the other precisions through a crash
is not.

Crash tolerance (comm backend tcp): the average is over the replicas that reached the outer
step; a crashed rank is left out from then on. A restarted rank gets theta_g, the outer
momentum and the round counters from rank 0 at an evaluation point, and starts its replica from
theta_g (its inner AdamW state starts afresh).

Warm start (``warmup_steps``, default 0). The DiLoCo paper (Douillard et al. 2023, arXiv
2311.08105, Section 3) does not start from random weights: "by default all training experiments
start from a transformer language model pretrained for 24,000 steps on the same training set"
(then H = 500 inner steps per round; its Section 3.1 ablation "Number of Pretraining Steps" also
runs DiLoCo from scratch and reports little loss). Here the first ``warmup_steps`` steps are
data-parallel, as `sync`: every rank's gradient is averaged each step (bucketed all-reduce
during backward, ``bucket_cap_mb``, on the comm's configured all-reduce whatever
``collective`` says) and the inner AdamW steps on the average, so the replicas stay
identical and no outer step is taken. At the end of step ``warmup_steps - 1`` theta_g is set to
the replica (its float buffers averaged first), and the rounds of H inner steps count from there:
the first outer step ends step ``warmup_steps + H - 1``. What carries over: the inner AdamW state
(moments and step count) is kept, as DiLoCo keeps it across rounds; the outer optimizer starts
fresh (no momentum) at the first round; the lr schedule is the job's, by global step (the paper
warms the inner lr up again when DiLoCo begins; this does not). ``warmup_lr`` gives the warm-up
its own peak lr under that schedule: set to the tuned `sync`'s lr (same seed, schedule and batch),
the warm-up is that sync run's first ``warmup_steps`` steps, the paper's "pretrained by
data-parallel training" checkpoint shared with the baseline, and DiLoCo's own (tuned) lr applies
from the first round on. Differences from the paper: its
pretraining is one model at one worker's batch size, ours the data-parallel average over all
ranks (a k-times larger batch); and the paper's warm-up is a separate run, ours the same job.
A rank that rejoins during the warm-up gets rank 0's replica and inner AdamW state, so the
replicas stay identical (crash tolerance within the warm-up is not tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.diloco_common import (
    OUTER_PRECISIONS, GlobalModelAlgorithm, OuterPrecision, check_outer_reduce, check_outer_sgd,
    float_buffers, launch_average, outer_compressor, outer_step, pseudo_gradient,
)
from trainers.config import check_warmup, require_choice, require_int
from trainers.snapshots import OutputState


@dataclass
class DiLoCoParams:
    """Args: H: inner steps per round; outer_lr: outer SGD learning rate; outer_momentum: its
    Nesterov momentum; nesterov: use Nesterov (else heavy-ball) momentum in the outer step;
    collective: how the pseudo-gradient is averaged, allreduce (gloo/nccl) or ring (isend/irecv
    ring, fewer WAN round trips); outer_precision: the pseudo-gradient on the wire, fp32
    (all-reduced) or bf16 | int8 | int4 (encoded); outer_reduce: how encoded pseudo-gradients
    are averaged, allgather (every payload to every rank, averaged in float32) or ring (the coded
    ring all-reduce: 2 (n-1)/n payloads a rank, re-encoded at every hop); warmup_steps: initial
    data-parallel steps (gradient all-reduce every step, as `sync`) before
    the first round; warmup_lr: the peak lr the job's schedule scales during those steps (None:
    the job's lr), so the warm start can be the tuned data-parallel run's own first steps;
    bucket_cap_mb: bucket size of that warm-up all-reduce (MiB)."""

    H: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    collective: Literal["allreduce", "ring"] = "allreduce"
    outer_precision: OuterPrecision = "fp32"
    outer_reduce: Literal["allgather", "ring"] = "allgather"
    warmup_steps: int = 0
    warmup_lr: Optional[float] = None
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        check_warmup(self.warmup_steps, self.warmup_lr, self.bucket_cap_mb)
        require_choice("outer_precision", self.outer_precision, OUTER_PRECISIONS)
        check_outer_reduce(self.outer_reduce, self.outer_precision)
        check_outer_sgd(self.outer_lr, self.outer_momentum, self.nesterov)
        require_choice("collective", self.collective, ("allreduce", "ring"))


@dataclass
class DiLoCoState:
    """inner_steps: inner steps in the current round; rounds: outer steps taken; warm: the
    warm-up is over (always True without one)."""

    inner_steps: int = 0
    rounds: int = 0
    warm: bool = True


class DiLoCo(GlobalModelAlgorithm):
    """Inner AdamW on the local replica, outer Nesterov SGD on the averaged pseudo-gradient."""

    name = "diloco"
    Params = DiLoCoParams
    tolerates_crash = True

    def __init__(self, params: DiLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = DiLoCoState(warm=params.warmup_steps == 0)
        self.outer_code = outer_compressor(params.outer_precision)

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if not self.state.warm:
            return self.warmup_step(step, batch)
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.inner_steps += 1
        if self.state.inner_steps == self.params.H:
            self._outer_step()
        return StepResult(loss=loss)

    def end_warmup(self) -> None:
        super().end_warmup()
        self.state = DiLoCoState()

    def _outer_step(self) -> None:
        global_params = list(self.global_model.parameters())
        delta = pseudo_gradient(global_params, list(self.model.parameters()))
        launch_average(self.comm, delta, self.outer_code, self.params.collective, self.params.outer_reduce).wait()
        outer_step(global_params, delta, self.outer_optimizer)
        # BatchNorm statistics are not trained by gradients: average them as they are.
        self.average_tensors(float_buffers(self.model), self.params.collective)
        self.restart_replica()
        self.state.inner_steps = 0
        self.state.rounds += 1
        self.note_sync()

    def deployable_model(self) -> nn.Module:
        """theta_g; during the warm-up the replica (identical on every rank), theta_g's start."""
        return self.global_model if self.state.warm else self.model

    def output_state(self) -> Optional[OutputState]:
        return OutputState("global", self.deployable_model().state_dict()) if self.comm.rank == 0 else None

    def rejoin_state(self, deployable: nn.Module) -> dict:
        state = {"global": self.deployable_model().state_dict(), "outer": self.outer_optimizer.state_dict()}
        if not self.state.warm:  # the rejoiner's replica must step as the others do
            state["inner"] = self.optimizer.state_dict()
        return state

    def load_rejoin_state(self, state: dict, step: int) -> None:
        """Go on at step ``step + 1``: still in the warm-up (with rank 0's inner AdamW state), or
        in the round that step falls in, rounds counted from the warm-up's end."""
        self.global_model.load_state_dict(state["global"])
        self.outer_optimizer.load_state_dict(state["outer"])
        self.model.load_state_dict(state["global"])
        done = step + 1 - self.params.warmup_steps  # steps since the warm-up ended
        if done < 0:
            self.optimizer.load_state_dict(state["inner"])
            self.state = DiLoCoState(warm=False)
            return
        if self.bucketer is not None:  # the warm-up is over: no gradient all-reduce
            self.bucketer.remove_hooks()
            self.bucketer = None
        self.state = DiLoCoState(inner_steps=done % self.params.H, rounds=done // self.params.H)
