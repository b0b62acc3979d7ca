"""`ps_sync`: synchronous data parallelism on P3's transport without P3's priorities (the baseline).

The same sharded parameter server, slices and message streams as `p3` (``p3.py``), with the
schedule of a DDP-style synchronous step instead of P3's:

* Slices are grouped into buckets of about ``bucket_cap_mb`` in the order backward produces their
  gradients (reverse of the forward order, as `sync` groups parameters in reverse registration
  order); a bucket's slices are pushed together once all of its gradients are ready, buckets in
  index order (as DDP launches them).
* Messages leave each rank in the order they were queued (FIFO): nothing overtakes.
* Every layer's update is applied before the next forward pass begins.

So `p3` against `ps_sync` isolates what prioritisation (and the per-layer wait that it enables)
buys on one transport; `sync` against `ps_sync` compares the all-reduce with the parameter server.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.algorithms.p3 import P3, P3Params
from trainers.config import require_float


@dataclass
class PSSyncParams(P3Params):
    """Args: P3's (slice_elements, broadcast_buffers), and bucket_cap_mb: bucket size (MiB, as
    DDP's and `sync`'s bucket_cap_mb)."""

    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_float("bucket_cap_mb", self.bucket_cap_mb, minimum=0.0, min_exclusive=True)


class PSSync(P3):
    """Synchronous data parallelism through the sharded parameter server, FIFO and bucketed."""

    name = "ps_sync"
    Params = PSSyncParams
    order = "fifo"
    per_layer = False

    def _open(self) -> None:
        super()._open()
        slice_bytes = self.params.slice_elements * self.trainable[0].element_size()
        per_bucket = max(1, int(self.params.bucket_cap_mb * 2**20) // slice_bytes)
        backward_order = list(reversed(range(len(self.slices))))
        self.buckets = [backward_order[i : i + per_bucket] for i in range(0, len(backward_order), per_bucket)]
        self.bucket_of = {k: b for b, bucket in enumerate(self.buckets) for k in bucket}

    def _begin_round(self) -> None:
        super()._begin_round()
        self.bucket_left = [len(bucket) for bucket in self.buckets]
        self.next_bucket = 0

    def _slice_ready(self, k: int) -> None:
        self.bucket_left[self.bucket_of[k]] -= 1
        # Push every complete bucket in index order; a complete bucket waits for earlier ones.
        while self.next_bucket < len(self.buckets) and self.bucket_left[self.next_bucket] == 0:
            for slice_id in self.buckets[self.next_bucket]:
                self._push(slice_id)
            self.next_bucket += 1
