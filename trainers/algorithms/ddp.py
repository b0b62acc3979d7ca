"""`ddp`: torch's DistributedDataParallel itself, the reference for `sync`.

Its buckets' all-reduce runs on the transport every other algorithm gets (``comm.allreduce``):
under our own all-reduce (auto, ring, direct, recursive_doubling) a DDP comm hook
(``register_comm_hook``) hands each bucket to :meth:`Comm.allreduce_async`, which counts its
bytes; under ``gloo`` (and nccl's auto) torch's reducer runs its own collective, and the bytes are
accounted from the ring model (every trainable gradient once per step). Either way the start
record's ``transport`` names it (``ours:<algorithm>``, or the backend's). The buffer broadcast is
DDP's own (accounted by the flat-root model). comm_blocked_s is recorded as null: the reducer
waits for the buckets inside backward and the optimizer step, out of the comm layer's sight.
"""

from __future__ import annotations

import inspect
import threading

import torch

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.sync import SyncParams
from trainers.comm import TorchComm


class DDP(Algorithm):
    """Wraps the local model in ``torch.nn.parallel.DistributedDataParallel`` (gloo or nccl)."""

    name = "ddp"
    Params = SyncParams
    measures_blocked_time = False

    def __init__(self, params: SyncParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        if not isinstance(self.comm, TorchComm):
            raise TypeError("algorithm ddp needs a torch.distributed process group (TorchComm)")
        self.ddp_model = None
        n = self.comm.world_size
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        # our all-reduce through the comm hook (it accounts its own bytes), or torch's reducer
        self.on_our_transport = self.comm.allreduce_algorithm != "gloo"
        self._step_bytes_sent = 0 if self.on_our_transport else 2 * (n - 1) * grad_bytes // n
        self._step_bytes_recv = self._step_bytes_sent
        if params.broadcast_buffers:
            buffer_bytes = sum(b.numel() * b.element_size() for b in self.model.buffers())
            root = self.comm.rank == 0
            self._step_bytes_sent += buffer_bytes * (n - 1) if root else 0
            self._step_bytes_recv += 0 if root else buffer_bytes

    def setup(self) -> None:
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # Newer torch renamed broadcast_buffers (and warns on the old name); same meaning here.
        accepted = inspect.signature(DistributedDataParallel.__init__).parameters
        buffers_key = "forward_sync_buffers" if "forward_sync_buffers" in accepted else "broadcast_buffers"
        # The constructor broadcasts rank 0's parameters and buffers, like Algorithm.setup.
        self.ddp_model = DistributedDataParallel(
            self.model,
            device_ids=device_ids,
            bucket_cap_mb=self.params.bucket_cap_mb,
            **{buffers_key: self.params.broadcast_buffers},
            process_group=self.comm.process_group,
        )
        if self.on_our_transport:
            self.ddp_model.register_comm_hook(self.comm, our_allreduce_hook)

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch, model=self.ddp_model)
        self.note_sync()  # the reducer averaged the gradients during backward
        self.optimizer.step()
        if self._step_bytes_sent or self._step_bytes_recv:
            self.comm.account_external(self._step_bytes_sent, self._step_bytes_recv)
        return StepResult(loss=loss)


def our_allreduce_hook(comm, bucket):  # no return annotation: DDP rejects the string one
    """DDP comm hook: average the bucket with ``comm.allreduce_async`` (the configured algorithm,
    in the background, within ``comm.max_in_flight``); the Future DDP waits on is completed by a
    helper thread when the all-reduce is done, so backward goes on meanwhile (returns it)."""
    future: torch.futures.Future = torch.futures.Future()
    work = comm.allreduce_async(bucket.buffer(), op="avg")

    def complete() -> None:
        try:
            future.set_result(work.wait())
        except Exception as error:  # DDP's wait raises it on the training thread
            future.set_exception(error)

    threading.Thread(target=complete, name="ddp-hook", daemon=True).start()
    return future
