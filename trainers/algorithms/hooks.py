"""Gradient-exchange hooks: "average this flat gradient buffer over ranks".

A hook is ``hook(comm, flat) -> Work`` whose ``wait()`` returns the buffer holding the average
(``flat`` itself, updated in place, for the plain all-reduce). Synchronous strategies (``sync``,
``local_sgd`` warm-up, ``dts``) call ``self.exchange_hook`` for every buffer they exchange, so a
compression scheme composes by wrapping a hook instead of copying a strategy, as in
torch.distributed.algorithms.ddp_comm_hooks (``fp16_compress_wrapper(allreduce_hook)``)::

    class Fp16Sync(Sync):
        name = "fp16_sync"
        exchange_hook = staticmethod(fp16_compress_wrapper(allreduce_hook))
"""

from __future__ import annotations

from typing import Callable

import torch

from trainers.comm import Comm, Work

ExchangeHook = Callable[[Comm, torch.Tensor], Work]


def allreduce_hook(comm: Comm, flat: torch.Tensor) -> Work:
    """Average ``flat`` over all ranks in place with one non-blocking all-reduce, by the comm's
    configured algorithm (``comm.allreduce``: auto | ring | direct | recursive_doubling | gloo)."""
    return comm.allreduce_async(flat, op="avg")


def ring_allreduce_hook(comm: Comm, flat: torch.Tensor) -> Work:
    """Average ``flat`` in place with the ring of :meth:`Comm.allreduce_async` (isend/irecv on a
    background thread), whatever ``comm.allreduce`` says; overlaps with the caller's compute."""
    return comm.allreduce_async(flat, op="avg", algorithm="ring")


def fp16_compress_wrapper(hook: ExchangeHook) -> ExchangeHook:
    """Wrap ``hook`` so the exchanged payload is float16 (half the bytes); the result is written back.

    Args:
        hook: the exchange to run on the compressed buffer.
    """

    def compressed_hook(comm: Comm, flat: torch.Tensor) -> Work:
        half = flat.to(torch.float16)
        return hook(comm, half).then(lambda averaged: flat.copy_(averaged))

    return compressed_hook
