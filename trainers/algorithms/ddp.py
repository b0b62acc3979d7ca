"""`ddp`: torch's DistributedDataParallel itself, the reference for `sync`.

DDP runs its own C++ reducer, so its traffic bypasses the comm layer's timers: bytes are
accounted from the same ring model (every trainable gradient once per step, plus the buffer
broadcast), and comm_blocked_s is recorded as null because it cannot be measured from outside.
"""

from __future__ import annotations

import inspect

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
        self._step_bytes_sent = 2 * (n - 1) * grad_bytes // n
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

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch, model=self.ddp_model)
        self.note_sync()  # the reducer averaged the gradients during backward
        self.optimizer.step()
        self.comm.account_external(self._step_bytes_sent, self._step_bytes_recv)
        return StepResult(loss=loss)
