"""``TorchComm``: the comm layer over a torch.distributed process group (gloo or nccl)."""

from __future__ import annotations

import datetime
import os
from typing import Callable, Optional

import torch

from .allreduce import MAX_IN_FLIGHT, AllReduceAlgorithm
from .base import Comm, require_torchrun_env
from .streams import ThreadedStreamDriver

_TORCH_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN"}
BACKGROUND_TAG_BASE = 0x57420000  # "WB": torch.distributed message tags of the background all-reduces


def import_dynamo_first() -> None:
    """Import ``torch._dynamo`` before the process group exists.

    Its first import (which torch.optim's first optimizer, DDP or torch.compile trigger) keeps
    references to the objects it finds in torch.distributed: imported after
    ``init_process_group`` it holds the default group, so ``destroy_process_group`` cannot free
    it. Gloo's threads then outlive the group and are still running when the interpreter
    exits, where C++ ends them with ``terminate called without an active exception`` (SIGABRT):
    measured 7 exits in 40 two-rank runs of the `sync` reference test, 0 in 40 with this import
    first (tests/trainers/test_comm.py checks the threads are gone after shutdown). See
    pytorch/pytorch#109478 and #190489.
    """
    import torch._dynamo  # noqa: F401


class TorchComm(Comm):
    """Comm over a torch.distributed process group (gloo or nccl).

    With gloo and CUDA tensors the payload is staged through a CPU copy and copied back on
    ``wait()``, so algorithms can keep their tensors on the GPU for either backend.

    Args:
        backend: gloo | nccl.
        timeout_s: how long a collective may wait for peers before failing (s).
        device: torch device of the model's tensors.
    """

    def __init__(self, backend: str = "gloo", timeout_s: float = 300.0, device: torch.device | str = "cpu",
                 allreduce: AllReduceAlgorithm = "gloo", max_in_flight: int = MAX_IN_FLIGHT):
        import torch.distributed as dist

        self._dist = dist
        self.backend = backend
        self.device = torch.device(device)
        if not dist.is_initialized():
            require_torchrun_env(os.environ)
            import_dynamo_first()
            kwargs = {}
            if backend == "nccl":
                kwargs["device_id"] = self.device
            dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        # NCCL's own all-reduce is already bandwidth-optimal on GPUs, and its point-to-point calls
        # are not safe from a second thread: "auto" means NCCL's collective there.
        if backend == "nccl" and allreduce == "auto":
            allreduce = "gloo"
        super().__init__(dist.get_rank(), dist.get_world_size(), allreduce, max_in_flight)

    @property
    def transport(self) -> str:
        return self.backend if self.allreduce_algorithm == "gloo" else super().transport

    @property
    def process_group(self):
        """The underlying torch.distributed group (only for the `ddp` reference algorithm)."""
        return self._dist.group.WORLD

    def shutdown(self) -> None:
        self._stop_background()
        if self._dist.is_initialized():
            self._dist.destroy_process_group()

    def _staged(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """CPU copy for gloo when the tensor lives on a GPU, and the copy-back to run on completion."""
        if self.backend == "gloo" and tensor.is_cuda:
            host = tensor.detach().to("cpu")
            return host, lambda: tensor.copy_(host)
        return tensor, lambda: None

    def _finish(self, work, copy_back: Callable[[], None], result: Optional[torch.Tensor], post=None):
        def wait_fn():
            if work is not None:
                work.wait()
            if post is not None:
                post()
            copy_back()
            return result

        return wait_fn, (lambda: work is None or work.is_completed())

    def _all_reduce(self, tensor, op):
        payload, copy_back = self._staged(tensor)
        work = self._dist.all_reduce(payload, op=getattr(self._dist.ReduceOp, _TORCH_OPS[op]), async_op=True)
        # gloo has no AVG: sum, then divide once the sum has arrived.
        post = (lambda: payload.div_(self.world_size)) if op == "avg" else None
        return self._finish(work, copy_back, tensor, post)

    def _broadcast(self, tensor, src):
        payload, copy_back = self._staged(tensor)
        work = self._dist.broadcast(payload, src=src, async_op=True)
        return self._finish(work, copy_back, tensor)

    def _all_gather(self, outputs, tensor):
        payload, _ = self._staged(tensor)
        staged = [self._staged(o) for o in outputs]
        work = self._dist.all_gather([s[0] for s in staged], payload, async_op=True)

        def copy_back():
            for _, back in staged:
                back()

        return self._finish(work, copy_back, None)

    def _isend(self, tensor, dst, tag: int = 0):
        payload, _ = self._staged(tensor)
        work = self._dist.isend(payload, dst=dst, tag=tag)
        return self._finish(work, lambda: None, None)

    def _irecv(self, tensor, src, tag: int = 0):
        payload, copy_back = self._staged(tensor)
        work = self._dist.irecv(payload, src=src, tag=tag)
        return self._finish(work, copy_back, tensor)

    # Tags above the caller's (0) keep each background all-reduce's messages apart.
    def tagged_isend(self, tensor, dst, tag):
        return self._isend(tensor, dst, tag=BACKGROUND_TAG_BASE + tag)

    def tagged_irecv(self, tensor, src, tag):
        return self._irecv(tensor, src, tag=BACKGROUND_TAG_BASE + tag)

    def stream_driver(self) -> ThreadedStreamDriver:
        if self.backend == "nccl":  # its point-to-point calls are not safe from a second thread
            raise NotImplementedError("message streams (p3, ps_sync) send from background threads, which NCCL "
                                      "does not allow: use comm backend gloo (CUDA tensors are staged through the CPU)")
        return super().stream_driver()

    def tagged_irecv_any(self, tensor, src_tag):
        return self._irecv_any(tensor, tag=BACKGROUND_TAG_BASE + src_tag)

    def _irecv_any(self, tensor, sources=None, tag: int = 0):
        payload, copy_back = self._staged(tensor)
        work = self._dist.irecv(payload, src=None, tag=tag)  # src None: any source (gloo; nccl cannot)

        def wait_fn() -> int:
            work.wait()
            copy_back()
            return work._source_rank()  # what torch.distributed.recv itself returns for src=None

        return wait_fn, work.is_completed

    def _barrier(self):
        work = self._dist.barrier(async_op=True)
        return self._finish(work, lambda: None, None)

