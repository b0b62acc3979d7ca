"""The inner optimizer and outer step shared by the DiLoCo family (`diloco`, `streaming_diloco`,
`sparseloco`, `hierarchical_diloco`): AdamW inside; average a pseudo-gradient over the
ranks at an outer precision, then step the outer optimizer on the global parameters with it.

Outer precisions (``outer_precision``):

* ``fp32``: the pseudo-gradient itself, averaged by one all-reduce (float32 sums on the wire).
* ``bf16``, ``int8``, ``int4``: each rank encodes its pseudo-gradient
  (:mod:`trainers.compression`: ``bf16``; ``int8``/``int4`` uniform per-chunk codes), the
  payloads are all-gathered (``Comm.allgather_async``, on the exchange the all-reduce uses, as
  `quantized` does), and every rank decodes all of them in rank order and averages in float32.
  So the sum is never taken at low precision (bf16 is summable, but a bf16 all-reduce would add
  at bf16), and every rank gets the same average bit for bit. The wire carries (n-1) payloads
  per rank where the all-reduce carries 2 (n-1)/n float32 buffers: int8 is about 2x, int4 about
  4x fewer bytes than fp32, bf16 about equal (its win would need a summing exchange).
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch

from trainers.algorithms.base import unflatten_into
from trainers.comm import Comm, Work
from trainers.compression import Compressor, build_compressor

OuterPrecision = Literal["fp32", "bf16", "int8", "int4"]
OUTER_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")


def inner_adamw(model: torch.nn.Module, ctx: Any) -> torch.optim.AdamW:
    """DiLoCo's inner optimizer: AdamW whatever the config's optimizer.name says, at the job's lr
    with the config's betas and weight decay (``ctx``: the algorithm's AlgorithmContext)."""
    cfg = ctx.optimizer
    return torch.optim.AdamW(model.parameters(), lr=ctx.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)


def outer_compressor(precision: str) -> Optional[Compressor]:
    """The code for ``precision`` (None for fp32: the buffer goes as it is)."""
    return None if precision == "fp32" else build_compressor(precision)


def launch_average(comm: Comm, flat: torch.Tensor, compressor: Optional[Compressor],
                   collective: str = "allreduce") -> Work:
    """Start replacing ``flat`` by its mean over the ranks; ``wait()`` on the handle finishes it.

    Args:
        flat: 1-D float buffer (this rank's pseudo-gradient); overwritten with the mean.
        compressor: None: all-reduce ``flat`` itself; else all-gather its encoded payloads.
        collective: allreduce (the comm's configured exchange) | ring (isend/irecv ring).
    """
    algorithm = "ring" if collective == "ring" else None
    if compressor is None:
        return comm.allreduce_async(flat, op="avg", algorithm=algorithm)
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
