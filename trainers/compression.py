"""Gradient / model compressors: encode a flat float buffer into the bytes that cross the network.

Each compressor turns a 1-D float tensor into a *payload* whose size depends only on the number of
elements (so every rank's payload has the same shape and one ``all_gather`` moves them all), and
decodes a payload back into floats. The payload is what the comm layer counts, so byte records show
the real wire size:

============  ==============================================  ===========================================
name          payload (d elements)                            decoded value
============  ==============================================  ===========================================
fp16, bf16    d half-precision floats (summable: all_reduce)  the rounded values
qsgd          per chunk a float32 2-norm, then d int8 levels  norm * sign * level / s, level stochastically
              (sign * level, |level| <= s)                    rounded so it is unbiased (Alistarh et al.)
terngrad      float32 max|x|, then 2-bit codes, 4 per byte    max|x| * sign * Bernoulli(|x| / max|x|)
                                                              (unbiased; Wen et al. 2017)
onebit        float32 mean |x|, then 1 sign bit per element   mean|x| * sign(x) (EF-signSGD, Karimireddy
                                                              et al. 2019; needs error feedback)
topk          k int32 indices, then k float32 values          x on the k largest |x|, 0 elsewhere (DGC-style;
                                                              needs error feedback)
chunked_topk  per chunk of chunk_size: k 2-byte indices, then   the kept values' sign * the mean magnitude of
              2-bit codes + 2 float32 (bits 2) or k float32   their half (above / not above the chunk's mean
              (bits 32) (SparseLoCo, Sarfi et al. 2025)       kept magnitude); 0 elsewhere; error feedback
int8          per chunk a float32 max|x|, then d int8 codes   max|x| * code / 127, code = round(127 x /
              in [-127, 127]                                  max|x|): round to nearest, deterministic
int4          per chunk a float32 max|x|, then 4-bit codes    max|x| * code / 7, code = round(7 x / max|x|)
              (code + 8, 2 per byte) in [-7, 7]               in [-7, 7]: round to nearest, deterministic
============  ==============================================  ===========================================

Biased codes (onebit, topk) set ``error_feedback``: :class:`ErrorFeedback` keeps the part the
code dropped (the residual) and adds it to the next buffer, so nothing is lost, only delayed.

:func:`compressed_exchange_hook` turns a compressor into an exchange hook for the synchronous
strategies (see ``trainers/algorithms/hooks.py``): summable codes wrap ``allreduce_hook`` as
``fp16_compress_wrapper`` does; the others all-gather every rank's payload
(:meth:`Comm.allgather_async <trainers.comm.base.Comm.allgather_async>`: on the exchange the
all-reduce uses, ``comm.allreduce``) and average the decoded buffers. The registry
:data:`COMPRESSORS` is checked when this module is imported.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional

import torch

from trainers.comm import Comm, Work
from trainers.config import ConfigError, require_float, require_int

HEADER_BYTES = 4  # one float32 scale


# ---------------------------------------------------------------------------------------------
# Byte packing helpers (torch ops only, so they run on whatever device the buffer lives on).


def float32_bytes(values: torch.Tensor) -> torch.Tensor:
    """The raw bytes (uint8) of ``values`` as float32."""
    return values.to(torch.float32).contiguous().reshape(-1).view(torch.uint8)


def bytes_float32(payload: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float32_bytes`."""
    return payload.contiguous().view(torch.float32)


def pack_bits(bits: torch.Tensor, bits_per_value: int) -> torch.Tensor:
    """Pack unsigned integer codes of ``bits_per_value`` bits (1, 2 or 4) into uint8, MSB first.

    The input is padded with zeros to a whole number of bytes.
    """
    per_byte = 8 // bits_per_value
    codes = bits.to(torch.uint8).reshape(-1)
    padding = (-codes.numel()) % per_byte
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding)])
    shifts = torch.arange(per_byte - 1, -1, -1, device=codes.device, dtype=torch.uint8) * bits_per_value
    return (codes.reshape(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits_per_value: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``count`` codes as uint8."""
    per_byte = 8 // bits_per_value
    shifts = torch.arange(per_byte - 1, -1, -1, device=packed.device, dtype=torch.uint8) * bits_per_value
    mask = (1 << bits_per_value) - 1
    return ((packed.reshape(-1, 1) >> shifts) & mask).reshape(-1)[:count]


# ---------------------------------------------------------------------------------------------
# Compressors.


@dataclass
class NoParams:
    """This compressor has no parameters."""


class Compressor(ABC):
    """Encode a 1-D float buffer into a fixed-size payload and back.

    Args:
        params: instance of the subclass's ``Params`` (already validated).
        generator: random source for stochastic rounding (the quantized algorithm passes the
            rank's own, ``Algorithm.rank_generator``; None: torch's default generator).
    """

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    # The payload is a float tensor that all_reduce may sum (no all_gather needed).
    summable: ClassVar[bool] = False
    # The code is biased; use it through ErrorFeedback.
    error_feedback: ClassVar[bool] = False

    def __init__(self, params: Any = None, generator: Optional[torch.Generator] = None):
        self.params = params if params is not None else self.Params()
        self.generator = generator

    @abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Size in bytes of the payload of a buffer of ``numel`` elements."""

    @abstractmethod
    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        """The payload for 1-D ``flat`` (uint8, or a half-precision float tensor if ``summable``)."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The float buffer (``numel`` elements of ``dtype``) that ``payload`` stands for."""

    def _uniform(self, like: torch.Tensor) -> torch.Tensor:
        return torch.rand(like.shape, generator=self.generator, device=like.device, dtype=torch.float32)


class Fp16(Compressor):
    """IEEE half precision (2 bytes per element); summable, so it all-reduces."""

    name = "fp16"
    summable = True
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


class Bf16(Fp16):
    """bfloat16 (2 bytes per element, float32's range, 8 bits of mantissa); summable."""

    name = "bf16"
    wire_dtype = torch.bfloat16


@dataclass
class QSGDParams:
    """Args: levels: quantization levels s (1..127, stored as int8 sign*level); chunk_size:
    elements sharing one float32 norm (QSGD's "bucket size"; smaller: less variance, more bytes)."""

    levels: int = 16
    chunk_size: int = 512

    def __post_init__(self) -> None:
        require_int("levels", self.levels, minimum=1, maximum=127)
        require_int("chunk_size", self.chunk_size, minimum=1)


class QSGD(Compressor):
    """QSGD (Alistarh et al. 2017): x_i -> ||x|| * sign(x_i) * l_i / s, l_i stochastic rounding of
    s |x_i| / ||x|| to a neighbouring integer, so E[decoded] = x. Norms per chunk of ``chunk_size``."""

    name = "qsgd"
    Params = QSGDParams

    def _chunks(self, numel: int) -> int:
        return math.ceil(numel / self.params.chunk_size)

    def payload_bytes(self, numel: int) -> int:
        return HEADER_BYTES * self._chunks(numel) + numel

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel, size, s = flat.numel(), self.params.chunk_size, self.params.levels
        values = flat.detach().to(torch.float32)
        padded = torch.cat([values, values.new_zeros(self._chunks(numel) * size - numel)]).reshape(-1, size)
        norms = padded.norm(dim=1)
        scaled = padded.abs() * (s / norms.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(1)
        lower = scaled.floor()
        levels = lower + (self._uniform(scaled) < (scaled - lower)).float()
        signed = (torch.sign(padded) * levels.clamp_max(s)).reshape(-1)[:numel].to(torch.int8)
        return torch.cat([float32_bytes(norms), signed.view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        chunks, size = self._chunks(numel), self.params.chunk_size
        norms = bytes_float32(payload[: HEADER_BYTES * chunks])
        levels = payload[HEADER_BYTES * chunks :].view(torch.int8).to(torch.float32)
        per_element = norms.repeat_interleave(size)[:numel]
        return (per_element * levels / self.params.levels).to(dtype)


class TernGrad(Compressor):
    """TernGrad (Wen et al. 2017): x_i -> max|x| * sign(x_i) * b_i, b_i ~ Bernoulli(|x_i| / max|x|),
    so E[decoded] = x. One float32 scale per buffer, 2-bit codes (0: 0, 1: +1, 2: -1), 4 per byte."""

    name = "terngrad"

    def payload_bytes(self, numel: int) -> int:
        return HEADER_BYTES + math.ceil(numel / 4)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to(torch.float32)
        scale = values.abs().max() if values.numel() else values.new_zeros(())
        probability = values.abs() / scale.clamp_min(torch.finfo(torch.float32).tiny)
        keep = self._uniform(values) < probability
        codes = torch.where(keep, torch.where(values >= 0, 1, 2), 0)
        return torch.cat([float32_bytes(scale.reshape(1)), pack_bits(codes, 2)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        scale = bytes_float32(payload[:HEADER_BYTES])
        codes = unpack_bits(payload[HEADER_BYTES:], 2, numel)
        signs = (codes == 1).float() - (codes == 2).float()
        return (signs * scale).to(dtype)


class OneBit(Compressor):
    """1-bit sign code with scale mean|x| (EF-signSGD, Karimireddy et al. 2019; 1-bit SGD, Seide et
    al. 2014): d/8 bytes plus one float32. Biased: use with error feedback."""

    name = "onebit"
    error_feedback = True

    def payload_bytes(self, numel: int) -> int:
        return HEADER_BYTES + math.ceil(numel / 8)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to(torch.float32)
        scale = values.abs().mean() if values.numel() else values.new_zeros(())
        return torch.cat([float32_bytes(scale.reshape(1)), pack_bits(values >= 0, 1)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        scale = bytes_float32(payload[:HEADER_BYTES])
        bits = unpack_bits(payload[HEADER_BYTES:], 1, numel)
        return ((bits.float() * 2.0 - 1.0) * scale).to(dtype)


@dataclass
class TopKParams:
    """Args: ratio: fraction of elements sent (k = ceil(ratio * d), at least 1)."""

    ratio: float = 0.01

    def __post_init__(self) -> None:
        require_float("ratio", self.ratio, minimum=0.0, maximum=1.0, min_exclusive=True)


class TopK(Compressor):
    """Top-k sparsification (DGC-style, Lin et al. 2018, without momentum correction): the k
    largest |x_i| as int32 indices then float32 values. Biased: use with error feedback."""

    name = "topk"
    Params = TopKParams
    error_feedback = True

    def k(self, numel: int) -> int:
        """Number of elements kept of a buffer of ``numel``."""
        return min(numel, max(1, math.ceil(self.params.ratio * numel)))

    def payload_bytes(self, numel: int) -> int:
        return 8 * self.k(numel)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        values = flat.detach().to(torch.float32)
        indices = values.abs().topk(self.k(values.numel()), sorted=False).indices
        return torch.cat([indices.to(torch.int32).view(torch.uint8), float32_bytes(values[indices])])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        k = self.k(numel)
        indices = payload[: 4 * k].contiguous().view(torch.int32).to(torch.int64)
        values = bytes_float32(payload[4 * k :])
        out = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        out[indices] = values
        return out.to(dtype)


@dataclass
class ChunkedTopKParams:
    """Args: chunk_size: elements per chunk (<= 65536: in-chunk indices are 2 bytes); ratio:
    fraction of each chunk kept (k = ceil(ratio * chunk_size), at least 1); bits: 2 (sign and
    one magnitude bit, two float32 magnitudes per chunk) or 32 (float32 values, no quantization)."""

    chunk_size: int = 4096
    ratio: float = 1 / 64
    bits: int = 2

    def __post_init__(self) -> None:
        require_int("chunk_size", self.chunk_size, minimum=1, maximum=65536)
        require_float("ratio", self.ratio, minimum=0.0, maximum=1.0, min_exclusive=True)
        if self.bits not in (2, 32):
            raise ConfigError("bits", f"must be 2 or 32, got {self.bits!r}")


class ChunkedTopK(Compressor):
    """SparseLoCo's code (Sarfi et al. 2025): the buffer, zero-padded to whole chunks of
    ``chunk_size``, keeps its k largest |x_i| per chunk; each kept value is sent as 2 bits (sign,
    and whether |x_i| is above the chunk's mean kept magnitude; decoded as the mean magnitude of
    its half, two float32 per chunk) or as float32 (bits 32). Payload, C chunks: C*k in-chunk
    indices (2 bytes each, big-endian), then the codes (C*k 2-bit codes packed 4 per byte, then
    2*C float32 magnitudes; or C*k float32 values). Biased: use with error feedback."""

    name = "chunked_topk"
    Params = ChunkedTopKParams
    error_feedback = True

    def k(self) -> int:
        """Elements kept per chunk."""
        return min(self.params.chunk_size, max(1, math.ceil(self.params.ratio * self.params.chunk_size)))

    def chunks(self, numel: int) -> int:
        return math.ceil(numel / self.params.chunk_size)

    def payload_bytes(self, numel: int) -> int:
        kept = self.chunks(numel) * self.k()
        if self.params.bits == 32:
            return 2 * kept + 4 * kept
        return 2 * kept + math.ceil(kept / 4) + 8 * self.chunks(numel)

    def _chunked(self, flat: torch.Tensor) -> torch.Tensor:
        size = self.params.chunk_size
        values = flat.detach().to(torch.float32).reshape(-1)
        padding = self.chunks(values.numel()) * size - values.numel()
        return torch.cat([values, values.new_zeros(padding)]).reshape(-1, size)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        chunked = self._chunked(flat)
        indices = chunked.abs().topk(self.k(), dim=1, sorted=False).indices  # (C, k)
        kept = chunked.gather(1, indices)
        index_bytes = torch.stack([indices >> 8, indices & 255], dim=-1).to(torch.uint8).reshape(-1)
        if self.params.bits == 32:
            return torch.cat([index_bytes, float32_bytes(kept)])
        magnitude = kept.abs()
        high = magnitude > magnitude.mean(dim=1, keepdim=True)
        high_count = high.sum(dim=1)
        low_count = high.shape[1] - high_count
        high_mean = (magnitude * high).sum(dim=1) / high_count.clamp_min(1)
        low_mean = (magnitude * ~high).sum(dim=1) / low_count.clamp_min(1)
        codes = (kept < 0).to(torch.uint8) * 2 + high.to(torch.uint8)
        scales = torch.stack([low_mean, high_mean], dim=1)
        return torch.cat([index_bytes, pack_bits(codes, 2), float32_bytes(scales)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        chunks, k, size = self.chunks(numel), self.k(), self.params.chunk_size
        kept = chunks * k
        pairs = payload[: 2 * kept].to(torch.int64).reshape(chunks, k, 2)
        indices = pairs[..., 0] * 256 + pairs[..., 1]
        rest = payload[2 * kept :]
        if self.params.bits == 32:
            values = bytes_float32(rest.clone()).reshape(chunks, k)  # clone: float32-aligned
        else:
            code_bytes = math.ceil(kept / 4)
            codes = unpack_bits(rest[:code_bytes], 2, kept).reshape(chunks, k).to(torch.int64)
            scales = bytes_float32(rest[code_bytes:].clone()).reshape(chunks, 2)
            magnitude = scales.gather(1, codes & 1)
            values = torch.where(codes >= 2, -magnitude, magnitude)
        out = torch.zeros(chunks, size, dtype=torch.float32, device=payload.device)
        out.scatter_(1, indices, values)
        return out.reshape(-1)[:numel].to(dtype)


@dataclass
class UniformParams:
    """Args: chunk_size: elements sharing one float32 scale (their max |x|; smaller: finer steps
    where the values are small, more bytes)."""

    chunk_size: int = 512

    def __post_init__(self) -> None:
        require_int("chunk_size", self.chunk_size, minimum=1)


class Int8(Compressor):
    """Uniform symmetric quantization, per chunk: scale = max|x| of the chunk (float32), code =
    round(levels * x / scale) in [-levels, levels], decoded as scale * code / levels.

    Round to nearest, not stochastic: the error of each element is at most scale / (2 levels),
    and the codes depend on the values alone (the same on every rank and every run). Made for
    DiLoCo's pseudo-gradient (``outer_precision``), which is averaged over the ranks and applied
    once per round through the outer momentum. Streaming DiLoCo (Douillard et al. 2025) casts
    its outer gradients to low precision deterministically too (a 4-bit float there, a uniform
    grid here). Stochastic rounding would be unbiased but doubles the worst error per element;
    this code is biased by at most half a step per element: do not read it as QSGD.
    """

    name = "int8"
    Params = UniformParams
    levels: ClassVar[int] = 127
    bits: ClassVar[int] = 8

    def _chunks(self, numel: int) -> int:
        return math.ceil(numel / self.params.chunk_size)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of ``numel`` elements (without the scales)."""
        return math.ceil(numel * self.bits / 8)

    def payload_bytes(self, numel: int) -> int:
        return HEADER_BYTES * self._chunks(numel) + self.code_bytes(numel)

    def encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel, size, levels = flat.numel(), self.params.chunk_size, self.levels
        values = flat.detach().to(torch.float32)
        padded = torch.cat([values, values.new_zeros(self._chunks(numel) * size - numel)]).reshape(-1, size)
        scales = padded.abs().amax(dim=1) if numel else padded.new_zeros(0)
        ratio = padded * (levels / scales.clamp_min(torch.finfo(torch.float32).tiny)).unsqueeze(1)
        codes = torch.round(ratio).clamp(-levels, levels).reshape(-1)[:numel]
        return torch.cat([float32_bytes(scales), self._pack(codes)])

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return codes.to(torch.int8).view(torch.uint8)

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return packed.view(torch.int8).to(torch.float32)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        chunks, size = self._chunks(numel), self.params.chunk_size
        scales = bytes_float32(payload[: HEADER_BYTES * chunks])
        codes = self._unpack(payload[HEADER_BYTES * chunks :], numel)
        per_element = scales.repeat_interleave(size)[:numel]
        return (per_element * codes / self.levels).to(dtype)


class Int4(Int8):
    """:class:`Int8`'s code with 7 levels each side: codes in [-7, 7] stored as code + 8 in 4 bits,
    two per byte (:func:`pack_bits`); error at most scale / 14 per element."""

    name = "int4"
    levels = 7
    bits = 4

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        return pack_bits((codes + 8).to(torch.uint8), 4)

    def _unpack(self, packed: torch.Tensor, numel: int) -> torch.Tensor:
        return unpack_bits(packed, 4, numel).to(torch.float32) - 8


COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls for cls in (Fp16, Bf16, QSGD, TernGrad, OneBit, TopK, ChunkedTopK, Int8, Int4)
}


def _check_registry() -> None:
    """Fail at import if an entry is inconsistent (hivemind checks its compression table the same way)."""
    for key, cls in COMPRESSORS.items():
        if key != cls.name:
            raise TypeError(f"compressor registered as {key!r} is named {cls.name!r}")
        if not dataclasses.is_dataclass(cls.Params):
            raise TypeError(f"compressor {key!r}: Params must be a dataclass")
        if cls.summable and cls.error_feedback:
            raise TypeError(f"compressor {key!r}: a summable code is all-reduced and cannot use error feedback")


_check_registry()


def compressor_fields(name: str) -> set[str]:
    """Names of the parameters compressor ``name`` takes."""
    return {f.name for f in dataclasses.fields(get_compressor(name).Params)}


def get_compressor(name: str) -> type[Compressor]:
    """Registry lookup; KeyError names the known compressors."""
    if name not in COMPRESSORS:
        raise KeyError(f"unknown compressor {name!r} (known: {sorted(COMPRESSORS)})")
    return COMPRESSORS[name]


def build_compressor(name: str, generator: Optional[torch.Generator] = None, **params: Any) -> Compressor:
    """An instance of compressor ``name`` with ``params`` (checked by its Params; errors name the field)."""
    try:
        cls = get_compressor(name)
    except KeyError as error:
        raise ConfigError("compressor", str(error.args[0])) from None
    return cls(cls.Params(**params), generator)


# ---------------------------------------------------------------------------------------------
# Error feedback and the exchange hook.


class ErrorFeedback:
    """Error feedback (Seide et al. 2014; Karimireddy et al. 2019) around a compressor.

    Keeps one residual per buffer key: ``encode(key, x)`` compresses ``p = x + residual`` and stores
    ``residual = p - decode(payload)``, so what the code drops is sent in later rounds.

    Args:
        compressor: the (usually biased) code.
    """

    def __init__(self, compressor: Compressor):
        self.compressor = compressor
        self.residuals: dict[Any, torch.Tensor] = {}

    def encode(self, key: Any, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, decoded payload) for ``flat`` plus the residual stored under ``key``."""
        residual = self.residuals.get(key)
        corrected = flat.detach().clone() if residual is None else flat.detach() + residual
        payload = self.compressor.encode(corrected)
        decoded = self.compressor.decode(payload, corrected.numel(), corrected.dtype)
        self.residuals[key] = corrected - decoded
        return payload, decoded


class CompressedExchange:
    """Exchange hook ``hook(comm, flat) -> Work`` that averages ``flat`` over ranks in compressed form.

    Summable codes (fp16, bf16) all-reduce the half-precision payload (``fp16_compress_wrapper``
    style). Other codes all-gather every rank's packed payload (``Comm.allgather_async``, on the
    all-reduce's transport), then each rank decodes all of them
    in rank order and writes the mean into ``flat`` (identical on every rank). Codes that need it
    run through :class:`ErrorFeedback`, with one residual per exchanged buffer, keyed by its storage
    (the strategies exchange persistent buffers: sync's buckets, local_sgd's delta buffer).

    Args:
        compressor: the code.
        reduce_hook: the all-reduce that averages summable payloads (default ``allreduce_hook``;
            ``ring_allreduce_hook`` for the isend/irecv ring).
    """

    def __init__(self, compressor: Compressor, reduce_hook: Optional[Callable[[Comm, torch.Tensor], Work]] = None):
        self.compressor = compressor
        self.reduce_hook = reduce_hook
        self.feedback = ErrorFeedback(compressor) if compressor.error_feedback else None

    def __call__(self, comm: Comm, flat: torch.Tensor) -> Work:
        code = self.compressor
        if code.summable:
            wire = code.encode(flat)
            work = self.reduce_hook(comm, wire) if self.reduce_hook else comm.allreduce_async(wire, op="avg")
            return work.then(lambda averaged: flat.copy_(code.decode(averaged, flat.numel(), flat.dtype)))
        if self.feedback is not None:
            payload, own = self.feedback.encode((flat.data_ptr(), flat.numel(), flat.dtype), flat)
        else:
            payload = code.encode(flat)
            own = None
        gathered = [torch.empty_like(payload) for _ in range(comm.world_size)]
        # on the all-reduce's transport (comm.allreduce: direct / ring / gloo), not always gloo's
        work = comm.allgather_async(gathered, payload)

        def average(_: Any) -> torch.Tensor:
            total = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
            for rank, received in enumerate(gathered):
                decoded = own if (rank == comm.rank and own is not None) else code.decode(received, flat.numel(), torch.float32)
                total += decoded.to(torch.float32)
            return flat.copy_(total / comm.world_size)

        return work.then(average)
