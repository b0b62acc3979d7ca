"""`quantized`: `sync` or `local_sgd` with every exchanged buffer compressed (trainers/compression.py).

Compression wraps the base strategy instead of copying it: the base runs unchanged with its
exchange hook replaced by a :class:`~trainers.compression.CompressedExchange` (one per run, so
error-feedback residuals persist across steps). Non-summable payloads are all-gathered with
``Comm.allgather_async``, on the exchange every all-reduce uses (``comm.allreduce``: direct or
ring; ``gloo``: gloo's own all_gather), so compression is compared on the transport sync gets.

* ``base: sync``: each gradient bucket is compressed; the bucketer's overlap with backward stays.
* ``base: local_sgd``: the model average exchanges the change since the last average,
  ``delta = x - x_last_average`` (Qsparse-local-SGD, Basu et al. 2019), not the weights
  themselves: the change is small, so a code's relative error costs little, and all ranks still
  agree on ``x_last_average + mean(decoded deltas)``. Warm-up steps compress gradients as `sync`.

The parameters are the base's own (e.g. ``H``) and the compressor's (e.g. ``ratio``), flat;
those left out take their owner's defaults and the resolved config shows them. A parameter that
the chosen base or compressor does not take is an error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult, flatten, group_by_dtype, unflatten_into
from trainers.algorithms.hooks import ExchangeHook, allreduce_hook, ring_allreduce_hook
from trainers.algorithms.local_sgd import LocalSGD, LocalSGDParams
from trainers.algorithms.sync import Sync, SyncParams
from trainers.compression import COMPRESSORS, CompressedExchange, build_compressor, get_compressor
from trainers.config import ConfigError, require_choice
from trainers.snapshots import OutputState

BASE_PARAMS = {"sync": SyncParams, "local_sgd": LocalSGDParams}
_BASE_FIELDS = ("bucket_cap_mb", "broadcast_buffers", "H", "warmup_steps", "warmup_lr", "collective")
_COMPRESSOR_FIELDS = ("levels", "chunk_size", "ratio", "bits")


@dataclass
class QuantizedParams:
    """Args:
        base: the strategy whose exchanges are compressed (sync | local_sgd).
        compressor: fp16 | bf16 | qsgd | terngrad | onebit | topk | chunked_topk | int8 | int4.
        levels, chunk_size: qsgd's levels s (1..127) and elements per float32 norm (chunk_size also
            int8's and int4's elements per float32 scale).
        ratio: topk's fraction of elements sent (chunked_topk's: of each chunk).
        bits: chunked_topk's bits per kept value (2, or 32: float32).
        bucket_cap_mb, broadcast_buffers: sync's (bucket_cap_mb also local_sgd's warm-up buckets).
        H, warmup_steps, warmup_lr: local_sgd's local steps per average, synchronous warm-up steps and
            their peak lr.
        collective: local_sgd's allreduce | ring; here it picks the all-reduce of summable codes
            (fp16, bf16); the other codes are all-gathered, so they take only allreduce.
    Left as None: the owner's default (filled in when the config is resolved).
    """

    base: Literal["sync", "local_sgd"] = "sync"
    compressor: str = "fp16"
    levels: Optional[int] = None
    chunk_size: Optional[int] = None
    ratio: Optional[float] = None
    bits: Optional[int] = None
    bucket_cap_mb: Optional[float] = None
    broadcast_buffers: Optional[bool] = None
    H: Optional[int] = None
    warmup_steps: Optional[int] = None
    warmup_lr: Optional[float] = None
    collective: Optional[str] = None

    def __post_init__(self) -> None:
        require_choice("base", self.base, BASE_PARAMS)
        require_choice("compressor", self.compressor, sorted(COMPRESSORS))
        self._fill(BASE_PARAMS[self.base], _BASE_FIELDS, f"base {self.base!r}")
        self._fill(get_compressor(self.compressor).Params, _COMPRESSOR_FIELDS, f"compressor {self.compressor!r}")
        if self.collective == "ring" and not get_compressor(self.compressor).summable:
            raise ConfigError(
                "collective", f"ring needs a summable compressor (fp16, bf16); {self.compressor} payloads are all-gathered"
            )

    def _fill(self, owner: type, candidates: tuple[str, ...], label: str) -> None:
        """Check the fields ``owner`` takes with its own Params, fill its defaults, reject the rest."""
        # A base parameter this class does not expose (yet) keeps the base's default.
        own = [f.name for f in dataclasses.fields(owner) if hasattr(self, f.name)]
        for name in candidates:
            if name not in own and getattr(self, name) is not None:
                raise ConfigError(name, f"is not a parameter of {label} (it takes: {own or 'nothing'})")
        built = owner(**{name: getattr(self, name) for name in own if getattr(self, name) is not None})
        for name in own:
            setattr(self, name, getattr(built, name))

    def base_params(self) -> Any:
        """The base strategy's Params."""
        owner = BASE_PARAMS[self.base]
        return owner(**{f.name: getattr(self, f.name) for f in dataclasses.fields(owner) if hasattr(self, f.name)})

    def compressor_params(self) -> dict:
        """Keyword arguments of the compressor's Params."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(get_compressor(self.compressor).Params)}


class _CompressedSync(Sync):
    """`sync` whose buckets go through ``hook`` (an instance attribute, so it may hold state)."""

    def __init__(self, params: SyncParams, ctx: AlgorithmContext, hook: ExchangeHook):
        self.exchange_hook = hook
        super().__init__(params, ctx)


class _CompressedLocalSGD(LocalSGD):
    """`local_sgd` that averages the compressed change since the last average (see module docstring)."""

    def __init__(self, params: LocalSGDParams, ctx: AlgorithmContext, hook: ExchangeHook):
        self.exchange_hook = hook
        super().__init__(params, ctx)
        self._groups = [g for g in group_by_dtype(self.model.parameters()) if g[0].is_floating_point()]
        self._anchors: list[torch.Tensor] = []
        self._deltas: list[torch.Tensor] = []

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if step == self.params.warmup_steps:
            # Replicas are identical here (after setup's broadcast, or after synchronous warm-up).
            self._anchors = [flatten(group) for group in self._groups]
            self._deltas = [torch.empty_like(anchor) for anchor in self._anchors]
        return super().train_step(step, batch)

    def average_model(self) -> None:
        for group, anchor, delta in zip(self._groups, self._anchors, self._deltas):
            # Persistent delta buffer: error feedback keys its residual by the buffer's storage.
            torch.sub(flatten(group), anchor, out=delta)
            averaged = self.exchange_hook(self.comm, delta).wait()
            anchor.add_(averaged)
            unflatten_into(anchor, group)


_COMPRESSED_BASES = {"sync": _CompressedSync, "local_sgd": _CompressedLocalSGD}


class Quantized(Algorithm):
    """The base strategy, unchanged, exchanging compressed buffers (the payload bytes are counted)."""

    name = "quantized"
    Params = QuantizedParams

    def __init__(self, params: QuantizedParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        reduce_hook = ring_allreduce_hook if params.collective == "ring" else allreduce_hook
        # stochastic rounding (QSGD, TernGrad) draws from the rank's own generator: the same codes
        # whatever order simulated ranks run in, and so on every transport
        compressor = build_compressor(params.compressor, self.rank_generator(stream=1), **params.compressor_params())
        self.exchange = CompressedExchange(compressor, reduce_hook)
        self.inner: Algorithm = _COMPRESSED_BASES[params.base](params.base_params(), ctx, self.exchange)
        self.optimizer = self.inner.optimizer

    @property
    def syncs_applied(self) -> int:
        """The base strategy's count (it applies the exchanges)."""
        return self.inner.syncs_applied

    def setup(self) -> None:
        self.inner.setup()

    def train_step(self, step: int, batch: tuple) -> StepResult:
        return self.inner.train_step(step, batch)

    def set_lr(self, lr: float) -> None:
        self.lr = lr
        self.inner.set_lr(lr)

    def output_state(self) -> Optional[OutputState]:
        """As the base: every replica over local_sgd, rank 0's over sync (replicas identical)."""
        return self.inner.output_state()

    def deployable_model(self) -> nn.Module:
        return self.inner.deployable_model()

    def finish(self) -> None:
        self.inner.finish()
