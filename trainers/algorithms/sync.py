"""`sync`: gradient all-reduce every step, bucketed and overlapped with the backward pass.

Parameters are grouped into buckets of about ``bucket_cap_mb`` in reverse registration order
(roughly the order backward produces their gradients, as DDP does). Gradients are views into
their bucket's flat buffer (DDP's gradient_as_bucket_view), so backward accumulates straight
into it. A post-accumulate-grad hook per parameter counts ready gradients; when a bucket is
complete, ``exchange_hook`` starts an asynchronous in-place all-reduce of its buffer while
backward keeps computing earlier layers. Before the optimizer step every bucket is waited on;
the averages are then already in ``.grad``. Buckets are launched strictly in index order, so
every rank issues the same sequence of collectives even if hooks fire in a different order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook
from trainers.comm import Comm, Work
from trainers.config import require_float


@dataclass
class SyncParams:
    """Args: bucket_cap_mb: bucket size (MiB, as DDP's bucket_cap_mb); broadcast_buffers: copy
    rank 0's buffers (BatchNorm statistics) to all ranks before each forward, as DDP does."""

    bucket_cap_mb: float = 25.0
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        require_float("bucket_cap_mb", self.bucket_cap_mb, minimum=0.0, min_exclusive=True)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0
    work: Optional[Work] = None


@dataclass
class BucketState:
    """Per-step state of the reducer: which buckets are launched, and how many so far."""

    next_to_launch: int = 0
    steps_reduced: int = 0


class GradientBucketer:
    """Averages gradients over ranks during backward, bucket by bucket (see module docstring).

    Args:
        parameters: model parameters (only those requiring grad are reduced).
        comm: communication layer.
        bucket_cap_bytes: target bucket size in bytes.
        exchange_hook: exchange of one flat buffer (``allreduce_hook`` or a wrapped one).
    """

    def __init__(self, parameters, comm: Comm, bucket_cap_bytes: int, exchange_hook: ExchangeHook):
        self.comm = comm
        self.exchange_hook = exchange_hook
        self.state = BucketState()
        trainable = [p for p in parameters if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        current_bytes = 0
        for param in reversed(trainable):
            size = param.numel() * param.element_size()
            # A new bucket when full or when the dtype/device changes (one flat buffer per bucket).
            if current and (current_bytes + size > bucket_cap_bytes or not _same_kind(current[0], param)):
                self._add_bucket(current)
                current, current_bytes = [], 0
            current.append(param)
            current_bytes += size
        if current:
            self._add_bucket(current)
        self._bucket_of = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in trainable]

    def _add_bucket(self, params: list[torch.nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for param in params:
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        # Gradients live in the bucket buffer (DDP's gradient_as_bucket_view): backward
        # accumulates straight into it, so launching and applying a bucket copies nothing.
        with torch.no_grad():
            for param, view in zip(params, views):
                if param.grad is not None:
                    view.copy_(param.grad)
                param.grad = view
        self.buckets.append(_Bucket(params, buffer, views))

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.ready += 1
        # Launch every complete bucket in index order; a complete bucket waits for earlier ones.
        while self.state.next_to_launch < len(self.buckets):
            candidate = self.buckets[self.state.next_to_launch]
            if candidate.ready < len(candidate.params):
                break
            self._launch(candidate)

    def _launch(self, bucket: _Bucket) -> None:
        for param, view in zip(bucket.params, bucket.views):
            if param.grad is None:
                view.zero_()
                param.grad = view
            elif param.grad.data_ptr() != view.data_ptr():
                # Someone replaced .grad (e.g. zero_grad(set_to_none=True)): copy, then rebind.
                view.copy_(param.grad)
                param.grad = view
        bucket.work = self.exchange_hook(self.comm, bucket.buffer)
        self.state.next_to_launch += 1

    def wait_and_apply(self) -> None:
        """Launch buckets whose parameters got no gradient, wait for all; .grad then holds the averages."""
        while self.state.next_to_launch < len(self.buckets):
            self._launch(self.buckets[self.state.next_to_launch])
        for bucket in self.buckets:
            averaged = bucket.work.wait()
            if averaged.data_ptr() != bucket.buffer.data_ptr():  # a hook that returns a new tensor
                bucket.buffer.copy_(averaged)
            bucket.ready = 0
            bucket.work = None
        self.state.next_to_launch = 0
        self.state.steps_reduced += 1

    def remove_hooks(self) -> None:
        """Detach from the parameters (the bucketer cannot be used afterwards)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.device == b.device


class Sync(Algorithm):
    """Fully synchronous data parallelism: every step uses the gradient averaged over all ranks."""

    name = "sync"
    Params = SyncParams
    exchange_hook: ExchangeHook = staticmethod(allreduce_hook)

    def __init__(self, params: SyncParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        # self.exchange_hook: a subclass or an instance attribute set before this runs may replace
        # the class's hook with a stateful one (compression with error feedback, see `quantized`).
        self.bucketer = GradientBucketer(
            self.model.parameters(), self.comm, int(params.bucket_cap_mb * 2**20), self.exchange_hook
        )
        self._buffers = list(self.model.buffers())

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if self.params.broadcast_buffers and self._buffers:
            self.broadcast_tensors(self._buffers, src=0)
        loss = self.forward_backward(batch)
        self.bucketer.wait_and_apply()
        self.note_sync()
        self.optimizer.step()
        return StepResult(loss=loss)
