"""`ps_sync`: synchronous data parallelism on P3's transport without P3's priorities (the baseline).

The same sharded parameter server, message streams and per-slice messages as `p3` (``p3.py``),
with the schedule of a synchronous step without priorities. Two layouts (``layout``):

* ``buckets`` (the default): DDP-style. P3's slices are grouped into buckets of about
  ``bucket_cap_mb`` in the order backward produces their gradients (reverse of the forward
  order, as `sync` groups parameters in reverse registration order); a bucket's slices are
  pushed together once all of its gradients are ready, buckets in index order (as DDP launches
  them).
* ``mxnet_keys``: the baseline of the P3 paper, MXNet's KVStore (``kv-store dist_device_sync``)
  with wait-free backpropagation. Every parameter array is one key (MXNet's keys are the
  model's parameter arrays, numbered in forward order), pushed as soon as backward has produced
  its gradient, in that order. A key of fewer than ``bigarray_bound`` elements goes whole to
  server ``(key * 9973) mod n``; a bigger one is cut into n equal parts, part i to server i
  (MXNet 1.x ``src/kvstore/kvstore_dist.h`` ``EncodeDefaultKey``, bound
  ``MXNET_KVSTORE_BIGARRAY_BOUND``, default 1,000,000 elements; the P3 artifact's baseline,
  github.com/anandj91/p3, keeps that code). A key or part travels as consecutive messages of
  ``slice_elements`` (this transport's messages have one size; MXNet sends each as one
  message), the last one padded: pick ``slice_elements`` small against the model's arrays to
  keep the padding small (the step records' ``bytes_sent`` count it).

In both, messages leave each rank in the order they were queued (FIFO: nothing overtakes), and
every layer's update is applied before the next forward pass begins.

So `p3` against `ps_sync` isolates what prioritisation (and the per-layer wait that it enables)
buys on one transport; `sync` against `ps_sync` compares the all-reduce with the parameter server.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.algorithms.p3 import P3, P3Params, Slice
from trainers.config import ConfigError, require_float, require_int

LAYOUTS = ("buckets", "mxnet_keys")
MXNET_BIGARRAY_BOUND = 1_000_000  # MXNET_KVSTORE_BIGARRAY_BOUND's default (kvstore_dist.h)
MXNET_KEY_HASH = 9973  # kvstore_dist.h: server = (key * 9973) % num_servers


@dataclass
class PSSyncParams(P3Params):
    """Args: P3's (slice_elements, broadcast_buffers), and layout: ``buckets`` or ``mxnet_keys``
    (module docstring); bucket_cap_mb: bucket size (MiB, as DDP's and `sync`'s bucket_cap_mb;
    ``buckets`` only); bigarray_bound: elements from which a key is split over all servers
    (``mxnet_keys`` only; MXNet's default 1,000,000)."""

    layout: str = "buckets"
    bucket_cap_mb: float = 25.0
    bigarray_bound: int = MXNET_BIGARRAY_BOUND

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.layout not in LAYOUTS:
            raise ConfigError("layout", f"must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        require_float("bucket_cap_mb", self.bucket_cap_mb, minimum=0.0, min_exclusive=True)
        require_int("bigarray_bound", self.bigarray_bound, minimum=1)


def mxnet_key_parts(numel: int, key: int, servers: int, bigarray_bound: int) -> list[tuple[int, int, int]]:
    """Where MXNet's KVStore sends key ``key`` of ``numel`` elements: (first, end, server) per part."""
    if numel < bigarray_bound:
        return [(0, numel, (key * MXNET_KEY_HASH) % servers)]
    # C's round(): halves away from zero (the sizes are positive)
    bounds = [int(numel / servers * i + 0.5) for i in range(servers + 1)]
    return [(bounds[i], bounds[i + 1], i) for i in range(servers)]


class PSSync(P3):
    """Synchronous data parallelism through the sharded parameter server, FIFO: DDP-style buckets
    or MXNet's per-key pushes."""

    name = "ps_sync"
    Params = PSSyncParams
    order = "fifo"
    per_layer = False

    def _cut_slices(self, params_in_order: list[int]) -> list[Slice]:
        if self.params.layout != "mxnet_keys":
            return super()._cut_slices(params_in_order)
        size, slices, offset = self.params.slice_elements, [], 0
        for key, i in enumerate(params_in_order):
            numel = self.trainable[i].numel()
            for first, end, server in mxnet_key_parts(numel, key, self.comm.world_size, self.params.bigarray_bound):
                for start in range(first, end, size):
                    stop = min(start + size, end)
                    slices.append(Slice(offset + start, stop - start, owner=server, segments=[(i, start, stop, 0)]))
            offset += numel
        return slices

    def _open(self) -> None:
        super()._open()
        if self.params.layout == "mxnet_keys":
            self.buckets, self.bucket_of = [], {}
            return
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
        if self.params.layout == "mxnet_keys":
            self._push(k)  # wait-free backpropagation: each key's messages as soon as its gradient is ready
            return
        self.bucket_left[self.bucket_of[k]] -= 1
        # Push every complete bucket in index order; a complete bucket waits for earlier ones.
        while self.next_bucket < len(self.buckets) and self.bucket_left[self.next_bucket] == 0:
            for slice_id in self.buckets[self.next_bucket]:
                self._push(slice_id)
            self.next_bucket += 1
