"""What the DiLoCo family (`diloco`, `streaming_diloco`, `sparseloco`, `hierarchical_diloco`)
shares: AdamW inside; the global model theta_g beside the replica with its outer SGD
(:class:`GlobalModelAlgorithm`, their base class); average a pseudo-gradient over the ranks at an
outer precision, then step the outer optimizer on the global parameters with it. Each algorithm's
file keeps what makes it different: its schedule and how its pseudo-gradient is averaged.

Outer precisions (``outer_precision``):

* ``fp32``: the pseudo-gradient itself, averaged by one all-reduce (float32 sums on the wire).
* ``bf16``, ``int8``, ``int4``: each rank encodes its pseudo-gradient
  (:mod:`trainers.compression`: ``bf16``; ``int8``/``int4`` uniform per-chunk codes), the
  payloads are all-gathered (``Comm.allgather_async``, on the exchange the all-reduce uses, as
  `quantized` does), and every rank decodes all of them in rank order and averages in float32.
  So the sum is never taken at low precision (bf16 is summable, but a bf16 all-reduce would add
  at bf16), and every rank gets the same average bit for bit. The wire carries (n-1) payloads
  per rank. Against a ring all-reduce (2 (n-1)/n float32 buffers per rank) that is 16/n x fewer
  bytes for int4, 8/n x for int8 and 4/n x for bf16 (at n = 4: 4x, 2x, 1x; at n = 8: 2x, 1x,
  0.5x); against the direct all-reduce (n-1 float32 buffers, what ``auto`` picks for a small
  vector) 8x, 4x and 2x.
* The same codes over a coded ring all-reduce (``outer_reduce: ring``; INTELLECT-1's int8 ring
  all-reduce; ``Comm.allreduce_coded_async``): the reduce-scatter re-encodes each partial sum at
  every hop and the all-gather passes each owner's encoded result, so a rank sends
  2 (n-1)/n payloads: the ring's bytes at the code's size (at n = 8 an int8 ring sends 1.76 bytes a
  parameter against 7.0 for float32: 3.97x fewer, whatever n). The price is n-1 roundings of each
  chunk's partial sum on the way, plus the result's, where the all-gather rounds once: for int8 at
  most (n+1) max|x| / 254 an element of the mean (the bound tests/trainers/test_allreduce.py
  asserts for n = 2-8).
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook
from trainers.algorithms.sync import GradientBucketer
from trainers.comm import Comm, Work
from trainers.compression import Compressor, build_compressor
from trainers.config import ConfigError, require_float, require_int
from trainers.snapshots import OutputState

OuterPrecision = Literal["fp32", "bf16", "int8", "int4"]
OUTER_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
OUTER_REDUCES: tuple[str, ...] = ("allgather", "ring")


def inner_adamw(model: torch.nn.Module, ctx: Any) -> torch.optim.AdamW:
    """DiLoCo's inner optimizer: AdamW whatever the config's optimizer.name says, at the job's lr
    with the config's betas and weight decay (``ctx``: the algorithm's AlgorithmContext)."""
    cfg = ctx.optimizer
    return torch.optim.AdamW(model.parameters(), lr=ctx.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def outer_compressor(precision: str) -> Optional[Compressor]:
    """The code for ``precision`` (None for fp32: the buffer goes as it is)."""
    return None if precision == "fp32" else build_compressor(precision)


def launch_average(comm: Comm, flat: torch.Tensor, compressor: Optional[Compressor],
                   collective: str = "allreduce", outer_reduce: str = "allgather") -> Work:
    """Start replacing ``flat`` by its mean over the ranks; ``wait()`` on the handle finishes it.

    Args:
        flat: 1-D float buffer (this rank's pseudo-gradient); overwritten with the mean.
        compressor: None: all-reduce ``flat`` itself; else its encoded payloads, by ``outer_reduce``.
        collective: allreduce (the comm's configured exchange) | ring (isend/irecv ring).
        outer_reduce: allgather (all-gather the payloads, average the decoded ones in float32) |
            ring (the coded ring all-reduce, ``Comm.allreduce_coded_async``).
    """
    algorithm = "ring" if collective == "ring" else None
    if compressor is None:
        return comm.allreduce_async(flat, op="avg", algorithm=algorithm)
    if outer_reduce == "ring":
        return comm.allreduce_coded_async(flat, compressor, op="avg")
    payload = compressor.encode(flat)
    gathered = [torch.empty_like(payload) for _ in range(comm.world_size)]
    work = comm.allgather_async(gathered, payload, algorithm=algorithm)

    def average(_: Any) -> torch.Tensor:
        total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        for received in gathered:  # rank order, own payload decoded too: equal on every rank
            total += compressor.decode(received, flat.numel(), torch.float32)
        return flat.copy_(total / comm.world_size)

    return work.then(average)


def outer_step(global_params: list[torch.nn.Parameter], averaged: torch.Tensor,
               outer_optimizer: torch.optim.Optimizer) -> None:
    """Take one outer step on ``global_params`` with the averaged pseudo-gradient ``averaged``
    (flat, in their order) as their gradient."""
    for param in global_params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    unflatten_into(averaged, [p.grad for p in global_params])
    outer_optimizer.step()


def check_outer_reduce(outer_reduce: str, outer_precision: str) -> None:
    """Check ``outer_reduce`` against ``outer_precision`` (raises ConfigError naming the field)."""
    if outer_reduce not in OUTER_REDUCES:
        raise ConfigError("outer_reduce", f"must be one of {OUTER_REDUCES}, got {outer_reduce!r}")
    if outer_reduce == "ring" and outer_precision == "fp32":
        raise ConfigError("outer_reduce", "ring is the coded ring of outer_precision bf16, int8 or int4; an fp32 "
                                          "pseudo-gradient is all-reduced as it is (collective: ring for a ring)")


def check_outer_sgd(outer_lr: float, outer_momentum: float, nesterov: bool) -> None:
    """Check the outer SGD's settings of a Params dataclass (raises ConfigError naming the field)."""
    require_float("outer_lr", outer_lr, minimum=0.0, min_exclusive=True)
    require_float("outer_momentum", outer_momentum, minimum=0.0, maximum=1.0)
    if nesterov and outer_momentum == 0.0:
        raise ConfigError("nesterov", "needs outer_momentum > 0")


def pseudo_gradient(global_params: list[torch.nn.Parameter], local_params: list[torch.nn.Parameter]) -> torch.Tensor:
    """theta_g - theta_local, flat (a new buffer): points away from where local training went, so
    an outer SGD step with it as the gradient moves theta_g towards the replica."""
    return flatten(global_params) - flatten(local_params)


def float_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The persistent floating-point buffers of ``model`` (BatchNorm statistics), which the family
    averages as they are. A non-persistent buffer is not the model's state but a constant it keeps
    at hand (the transformer's causal mask, 4 kB at 32 tokens): exchanging it would only add bytes."""
    persistent = model.state_dict(keep_vars=True).keys()
    return [b for name, b in model.named_buffers() if b.is_floating_point() and name in persistent]


class GlobalModelAlgorithm(Algorithm):
    """Base of the DiLoCo family: inner AdamW on the local replica (``self.model``) and the global
    model theta_g (``self.global_model``, a copy made at setup, identical on every rank) stepped by
    outer SGD (``outer_lr``, ``outer_momentum``, ``nesterov`` from the params).

    A subclass sets ``outer_groups`` to give index runs of the parameters their own outer SGD
    (`streaming_diloco`'s fragments); by default one SGD takes all of theta_g.

    Warm start, for a subclass whose params have ``warmup_steps`` (> 0), ``warmup_lr`` and
    ``bucket_cap_mb`` (`diloco`, `streaming_diloco`; see diloco.py's docstring): its train_step
    calls ``warmup_step`` for the first ``warmup_steps`` steps, data-parallel as `sync` (the
    gradient all-reduced in buckets during backward, the inner AdamW stepping on the average, so
    the replicas stay identical), ``Algorithm.peak_lr`` gives those steps ``warmup_lr``, and the last one
    calls ``end_warmup``: theta_g <- the replica, the hooks go, the inner AdamW state stays.
    ``bucketer`` is not None exactly while the warm-up lasts.
    """

    exchange_hook: ExchangeHook = staticmethod(allreduce_hook)

    def __init__(self, params: Any, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.optimizer = inner_adamw(self.model, ctx)  # AdamW whatever optimizer.name says
        self.global_model: nn.Module | None = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self.bucketer: Optional[GradientBucketer] = None
        if getattr(params, "warmup_steps", 0) > 0:
            self.bucketer = GradientBucketer(
                self.model.parameters(), self.comm, int(params.bucket_cap_mb * 2**20), self.exchange_hook
            )

    def warmup_step(self, step: int, batch: tuple) -> StepResult:
        """One data-parallel step (as `sync`); the warm-up's last one calls ``end_warmup``."""
        loss = self.forward_backward(batch)
        self.bucketer.wait_and_apply()
        self.note_sync()
        self.optimizer.step()
        if step + 1 >= self.params.warmup_steps:
            self.end_warmup()
        return StepResult(loss=loss)

    def end_warmup(self) -> None:
        """theta_g <- the replica (identical on every rank; float buffers averaged first); the
        warm-up's hooks go, the inner AdamW state stays, the outer SGD has not stepped yet. A
        subclass resets its round counters after calling this."""
        self.bucketer.remove_hooks()
        self.bucketer = None
        buffers = float_buffers(self.model)
        if buffers:
            self.average_tensors(buffers, getattr(self.params, "collective", "allreduce"))
        self.global_model.load_state_dict(self.model.state_dict())

    def outer_groups(self) -> list[range]:
        """Index runs of the parameters (in module order), each stepped by its own outer SGD."""
        return [range(len(list(self.model.parameters())))]

    def setup(self) -> None:
        super().setup()
        self.global_model = copy.deepcopy(self.model)
        global_params = list(self.global_model.parameters())
        self.outer_optimizers = [
            torch.optim.SGD(
                [global_params[i] for i in indices],
                lr=self.params.outer_lr,
                momentum=self.params.outer_momentum,
                nesterov=self.params.nesterov,
            )
            for indices in self.outer_groups()
        ]

    @property
    def outer_optimizer(self) -> torch.optim.Optimizer:
        """The outer SGD of a subclass with one group (all of theta_g)."""
        (only,) = self.outer_optimizers
        return only

    def global_buffers_from_replica(self) -> None:
        """theta_g takes the replica's buffers (averaged by the caller: no gradient trains them)."""
        with torch.no_grad():
            for target, source in zip(self.global_model.buffers(), self.model.buffers()):
                target.copy_(source)

    def restart_replica(self) -> None:
        """After an outer step: theta_g takes the replica's (averaged) buffers and the replica
        restarts from theta_g's parameters; the inner optimizer's state is kept."""
        self.global_buffers_from_replica()
        with torch.no_grad():
            for local, global_param in zip(self.model.parameters(), self.global_model.parameters()):
                local.copy_(global_param)

    def output_state(self) -> Optional[OutputState]:
        """The global model theta_g, written by rank 0 (every rank holds the same one)."""
        return OutputState("global", self.global_model.state_dict()) if self.comm.rank == 0 else None

    def deployable_model(self) -> nn.Module:
        """The global model theta_g as of the last outer step (identical on every rank, no communication)."""
        return self.global_model
