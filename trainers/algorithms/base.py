"""Base class every distributed algorithm derives from, and the context it is built with.

An algorithm owns one training step: it computes gradients on its local batch, communicates
through ``self.comm`` (never torch.distributed directly), and updates ``self.model``. The runner
owns everything else (data, learning-rate schedule, records, evaluation, stopping).

To add an algorithm: one file in this package with a subclass that sets ``name``, a ``Params``
dataclass (checked in ``__post_init__``) and an explicit state object, then one line in
``trainers/algorithms/__init__.py``.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional

import torch
from torch import nn

from trainers import clock
from trainers.comm import Comm
from trainers.config import OptimizerConfig
from trainers.snapshots import OutputState


@dataclass
class NoParams:
    """This algorithm has no hyperparameters."""


@dataclass
class AlgorithmContext:
    """What an algorithm is built with.

    Args:
        model: the local replica, already on ``device`` and identically initialised on all ranks.
        comm: the communication layer.
        loss_fn: (model, batch) -> scalar loss tensor.
        optimizer: local optimizer settings.
        lr: initial learning rate (the runner calls ``set_lr`` every step).
        device: compute device.
        min_compute_s: pad forward + backward to at least this many seconds (a compute profile;
            None: no padding). See :meth:`Algorithm.pad_compute`.
        seed: the job's seed, for an algorithm's own random draws (:meth:`Algorithm.rank_generator`).
    """

    model: nn.Module
    comm: Comm
    loss_fn: Callable[[nn.Module, tuple], torch.Tensor]
    optimizer: OptimizerConfig
    lr: float
    device: torch.device
    min_compute_s: Optional[float] = None
    seed: int = 0


@dataclass
class StepResult:
    """What one step reports to the runner.

    Args:
        loss: local training loss of this step's batch.
        staleness: age in steps of the remote information applied this step (None: not applicable).
    """

    loss: float
    staleness: Optional[int] = None


class Algorithm(ABC):
    """One distributed training algorithm running on one rank.

    Args:
        params: instance of the subclass's ``Params`` dataclass (already validated).
        ctx: the model, comm layer, loss and optimizer settings.
    """

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    # False where communication happens inside a library we cannot time (torch DDP); the runner
    # then records comm_blocked_s as null rather than a misleading 0.
    measures_blocked_time: ClassVar[bool] = True
    # True where the algorithm goes on without a crashed peer and takes a restarted one back, on an
    # elastic comm (comm backend tcp). Such an algorithm treats ``PeerLost`` from an exchange as
    # "that peer is gone" and implements the rejoin hooks below where the defaults do not fit.
    tolerates_crash: ClassVar[bool] = False
    # Synchronisations this rank has applied so far (note_sync): the evidence that the mechanism
    # acted. The runner puts each step's count in its step record (syncs_applied).
    syncs_applied: int = 0

    def __init__(self, params, ctx: AlgorithmContext):
        self.params = params
        self.ctx = ctx
        self.model = ctx.model
        self.comm = ctx.comm
        self.lr = ctx.lr
        self.optimizer = self.make_optimizer(self.model.parameters())
        # Set by the runner on a restarted rank: setup() then skips the start-up broadcast (the
        # others are long past it) and load_rejoin_state() brings the state instead.
        self.rejoining = False
        # Seconds the last forward + backward took before padding (None: not measured this step).
        self.compute_unpadded_s: Optional[float] = None

    # -- the interface the runner calls -------------------------------------------------------

    def setup(self) -> None:
        """Make every rank start from rank 0's model (one broadcast). Called once before step 0."""
        if not self.rejoining:
            self.broadcast_tensors(list(self.model.parameters()) + list(self.model.buffers()), src=0)

    @abstractmethod
    def train_step(self, step: int, batch: tuple) -> StepResult:
        """Run step ``step`` (0-based) on this rank's ``batch``; return the local loss."""

    def peak_lr(self, step: int, lr: float) -> float:
        """The peak learning rate the job's schedule scales at 0-based ``step``: the job's ``lr``
        unless a phase of the algorithm has its own. Here: ``warmup_lr`` during the first
        ``params.warmup_steps`` steps, for params that set one (the data-parallel warm start of
        `diloco`, `streaming_diloco` and `local_sgd`)."""
        warmup_lr = getattr(self.params, "warmup_lr", None)
        if warmup_lr is not None and step < self.params.warmup_steps:
            return warmup_lr
        return lr

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of the local optimizer for the coming step."""
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def deployable_model(self) -> nn.Module:
        """The model this algorithm would deploy now (the average / centre / server copy).

        Called on every rank at the same step, so it may communicate (collectively). The default
        is the local replica, right for algorithms that keep replicas identical.
        """
        return self.model

    def output_state(self) -> Optional[OutputState]:
        """This rank's part of the model the algorithm outputs, for a snapshot; None: no part.

        Called at eval points on every rank, each on its own: it must not communicate and must not
        wait for an exchange in flight. The default (replicas kept identical: sync, DDP, P3) is
        rank 0's replica. Roles and how the evaluator combines them: ``trainers/snapshots.py``.
        """
        return OutputState("rank0", self.model.state_dict()) if self.comm.rank == 0 else None

    def finish(self) -> None:
        """Complete outstanding communication after the last step (called on every rank)."""

    # -- crash tolerance (used only on an elastic comm, by algorithms with tolerates_crash) -------

    def rejoin_state(self, deployable: nn.Module) -> dict:
        """On rank 0, at an evaluation point: what a restarted rank needs to go on (tensors and
        numbers, saved with torch.save). Default: the deployable model's state."""
        return {"model": deployable.state_dict()}

    def load_rejoin_state(self, state: dict, step: int) -> None:
        """On the restarted rank, after ``setup()``: take ``state`` (from :meth:`rejoin_state`);
        training goes on at step ``step + 1``."""
        self.model.load_state_dict(state["model"])

    def on_membership(self, step: int, live: list[int], joined: list[int], lost: list[int]) -> None:
        """Every live rank, at the evaluation point of ``step``: the ranks now live, admitted, dropped."""

    # -- helpers for subclasses -------------------------------------------------------------------

    def note_sync(self, count: int = 1) -> None:
        """Count ``count`` synchronisations applied on this rank now: communicated information
        that changed the model this rank holds towards the output (an average, a correction, an
        elastic move, a server's update). Call it where the result is applied, not where it is
        launched; a plain counter, so it costs nothing per step."""
        self.syncs_applied += count

    def rank_generator(self, stream: int) -> torch.Generator:
        """A random generator of this rank's own, on the compute device, seeded from the job's
        seed, the rank and ``stream`` (a number per use). Not torch's default generator: on the
        simulator every rank runs in one process and shares that one, so its draws would follow
        the order the ranks happen to run in."""
        generator = torch.Generator(device=self.ctx.device)
        return generator.manual_seed((self.ctx.seed * 1000 + self.ctx.comm.rank) * 7919 + stream)

    def make_optimizer(self, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The configured local optimizer (sgd with momentum/nesterov, or adamw) over ``parameters``."""
        cfg = self.ctx.optimizer
        if cfg.name == "sgd":
            return torch.optim.SGD(
                parameters, lr=self.ctx.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
            )
        return torch.optim.AdamW(parameters, lr=self.ctx.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

    def forward_backward(self, batch: tuple, model: Optional[nn.Module] = None) -> float:
        """Zero gradients, compute the loss on ``batch`` and back-propagate (padded to the compute
        profile, :meth:`pad_compute`); returns the loss."""
        started = clock.perf_counter()
        model = model or self.model
        self.optimizer.zero_grad(set_to_none=False)
        loss = self.ctx.loss_fn(model, batch)
        loss.backward()
        self.pad_compute(started)
        return loss.item()

    def pad_compute(self, started: float) -> None:
        """Record the compute time since ``started`` (``compute_unpadded_s``) and, with a compute
        profile (``min_compute_s``), sleep until that much time has passed: the step then takes
        the profiled accelerator's time, communication in flight overlapping it as it would."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.compute_unpadded_s = clock.compute_done(started)
        if self.ctx.min_compute_s:
            left = self.ctx.min_compute_s - self.compute_unpadded_s
            if left > 0:
                clock.sleep(left)

    def broadcast_tensors(self, tensors: list[torch.Tensor], src: int) -> None:
        """Overwrite ``tensors`` on every rank with rank ``src``'s values, in one message per dtype."""
        for group in group_by_dtype(tensors):
            flat = flatten(group)
            self.comm.broadcast(flat, src=src)
            unflatten_into(flat, group)

    def average_tensors(self, tensors: list[torch.Tensor], collective: str = "allreduce") -> None:
        """Replace ``tensors`` on every rank by their mean over ranks, one exchange per dtype.

        Args:
            tensors: floating-point tensors (others are skipped), same shapes on every rank.
            collective: allreduce (backend all_reduce) | ring (Comm.ring_all_reduce over
                isend/irecv: fewer round trips on a WAN).
        """
        for group in group_by_dtype(t for t in tensors if t.is_floating_point()):
            flat = flatten(group)
            if collective == "ring":
                self.comm.ring_all_reduce(flat, op="avg")
            else:  # the configured all-reduce (comm.allreduce)
                self.comm.allreduce_async(flat, op="avg").wait()
            unflatten_into(flat, group)

    def replica_state(self) -> OutputState:
        """This rank's replica as a ``replica`` output (the evaluator averages the replicas)."""
        return OutputState("replica", self.model.state_dict())

    def averaged_copy(self) -> nn.Module:
        """A copy of the local model whose parameters and float buffers are the mean over ranks (collective).

        Buffers (BatchNorm running statistics) are averaged too, so every rank holds the same model.
        """
        average = copy.deepcopy(self.model)
        with torch.no_grad():
            self.average_tensors(list(average.parameters()) + list(average.buffers()))
        return average


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``tensors`` (same dtype and device) into one new 1-D buffer."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors`` (inverse of :func:`flatten`)."""
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(flat[offset : offset + count].view_as(tensor))
            offset += count


def grads_of(parameters: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Gradient tensors of trainable parameters, allocating zeros where a gradient is missing."""
    grads = []
    for param in parameters:
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grads.append(param.grad)
    return grads


def group_by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one dtype each (in order of first appearance), so that each group
    can be flattened into one buffer."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return list(groups.values())
