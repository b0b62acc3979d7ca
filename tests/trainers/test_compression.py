"""Compressors (trainers/compression.py): codes, unbiasedness, error feedback, wire bytes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trainers import compression
from trainers.algorithms.base import AlgorithmContext
from trainers.algorithms.hooks import allreduce_hook
from trainers.comm import Comm
from trainers.compression import (
    COMPRESSORS, CompressedExchange, ErrorFeedback, build_compressor, pack_bits, unpack_bits,
)
from trainers.config import ConfigError, OptimizerConfig


class MirrorComm(Comm):
    """In-process Comm of ``world_size`` ranks that all hold this rank's tensors (no peers needed).

    Collectives return what real ranks with identical inputs would get, and the base class does the
    real byte accounting, so wire sizes can be checked without starting processes.
    """

    def __init__(self, world_size: int):
        super().__init__(0, world_size)

    def _done(self, result=None):
        return (lambda: result), (lambda: True)

    def _all_reduce(self, tensor, op):
        if op == "sum":
            tensor.mul_(self.world_size)
        return self._done(tensor)

    def _broadcast(self, tensor, src):
        return self._done(tensor)

    def _all_gather(self, outputs, tensor):
        for output in outputs:
            output.copy_(tensor)
        return self._done()

    def _isend(self, tensor, dst):
        return self._done()

    def _irecv(self, tensor, src):
        return self._done(tensor)

    def _barrier(self):
        return self._done()


def test_registry_is_checked_at_import(monkeypatch):
    assert set(COMPRESSORS) == {"fp16", "bf16", "qsgd", "terngrad", "onebit", "topk", "chunked_topk", "int8", "int4"}
    monkeypatch.setitem(COMPRESSORS, "wrong_name", compression.QSGD)
    with pytest.raises(TypeError, match="registered as 'wrong_name' is named 'qsgd'"):
        compression._check_registry()


def test_build_compressor_errors_name_the_field():
    with pytest.raises(ConfigError, match="^compressor: unknown compressor 'zip'"):
        build_compressor("zip")
    with pytest.raises(ConfigError, match=r"^levels: must be an integer in \[1, 127\]"):
        build_compressor("qsgd", levels=128)
    with pytest.raises(ConfigError, match="^ratio: must be a number > 0"):
        build_compressor("topk", ratio=0)


@pytest.mark.parametrize("bits", [1, 2, 4])
@pytest.mark.parametrize("count", [1, 7, 8, 13, 64])
def test_bit_packing_round_trips(bits, count):
    codes = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(count))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(count * bits / 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes.to(torch.uint8))


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@pytest.mark.parametrize("numel", [1, 5, 1000, 1037])
def test_payload_size_is_fixed_by_numel_and_decodes_to_shape(name, numel):
    code = build_compressor(name, generator=torch.Generator().manual_seed(0))
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    payload = code.encode(x)
    assert payload.numel() * payload.element_size() == code.payload_bytes(numel)
    decoded = code.decode(payload, numel, torch.float32)
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32 and torch.isfinite(decoded).all()


def test_deterministic_codes_decode_as_documented():
    x = torch.tensor([0.5, -2.0, 0.0, 3.0, -0.25, 1.0, 0.1, -0.1, 7.0])
    onebit = build_compressor("onebit")
    assert torch.allclose(onebit.decode(onebit.encode(x), 9, torch.float32), x.abs().mean() * torch.where(x >= 0, 1.0, -1.0))
    topk = build_compressor("topk", ratio=0.3)  # k = ceil(2.7) = 3
    expected = torch.zeros(9)
    expected[[1, 3, 8]] = x[[1, 3, 8]]
    assert torch.equal(topk.decode(topk.encode(x), 9, torch.float32), expected)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        code = build_compressor(name)
        assert code.encode(x).dtype == dtype
        assert torch.equal(code.decode(code.encode(x), 9, torch.float32), x.to(dtype).float())


def test_zero_buffer_stays_zero():
    for name in COMPRESSORS:
        code = build_compressor(name)
        assert torch.equal(code.decode(code.encode(torch.zeros(20)), 20, torch.float32), torch.zeros(20)), name


@pytest.mark.parametrize(
    "name, params",
    [("qsgd", {"levels": 2, "chunk_size": 16}), ("qsgd", {"levels": 16, "chunk_size": 512}), ("terngrad", {})],
)
def test_stochastic_codes_are_unbiased(name, params):
    """The mean of many decoded samples converges to the input: |mean - x| within 5 standard errors.

    The standard error per coordinate comes from the samples' own variance; 5 sigma over 48
    coordinates makes a false failure improbable (and the generator is seeded anyway).
    """
    samples = 3000
    code = build_compressor(name, generator=torch.Generator().manual_seed(1), **params)
    x = torch.randn(48, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.01, 3.0, 48)
    decoded = torch.stack([code.decode(code.encode(x), x.numel(), torch.float64) for _ in range(samples)])
    mean, std = decoded.mean(dim=0), decoded.std(dim=0)
    standard_error = std / math.sqrt(samples)
    assert ((mean - x.double()).abs() <= 5 * standard_error + 1e-6).all(), (mean - x.double()).abs().max()
    # Not trivially exact: the code really is random.
    assert std.max() > 0
    if name == "qsgd":
        # Variance bound of the paper (Lemma 3.1): E||Q(x) - x||^2 <= min(d/s^2, sqrt(d)/s) ||x||^2 per chunk.
        d, s = min(params["chunk_size"], x.numel()), params["levels"]
        mean_square_error = ((decoded - x.double()) ** 2).sum(dim=1).mean()
        chunks = x.double().split(params["chunk_size"])
        bound = sum(min(d / s**2, math.sqrt(d) / s) * (c**2).sum() for c in chunks)
        assert mean_square_error <= 1.1 * bound


def test_terngrad_values_are_ternary_times_max():
    code = build_compressor("terngrad", generator=torch.Generator().manual_seed(0))
    x = torch.randn(101, generator=torch.Generator().manual_seed(3))
    decoded = code.decode(code.encode(x), 101, torch.float32)
    scale = x.abs().max()
    assert set((decoded / scale).round().tolist()) <= {-1.0, 0.0, 1.0}
    assert (decoded * x >= 0).all()  # never the wrong sign


@pytest.mark.parametrize("name, params", [("onebit", {}), ("topk", {"ratio": 0.1})])
def test_error_feedback_keeps_the_residual(name, params):
    code = build_compressor(name, **params)
    feedback = ErrorFeedback(code)
    generator = torch.Generator().manual_seed(4)
    inputs = [torch.randn(50, generator=generator) for _ in range(6)]
    total_decoded = torch.zeros(50)
    old_residual = torch.zeros(50)
    for x in inputs:
        payload, decoded = feedback.encode("bucket0", x)
        assert torch.equal(decoded, code.decode(payload, 50, torch.float32))
        residual = feedback.residuals["bucket0"]
        assert torch.allclose(residual, x + old_residual - decoded, atol=1e-6)
        old_residual = residual.clone()
        total_decoded += decoded
    # Nothing is lost, only delayed: everything sent plus what is still held equals everything put in.
    assert torch.allclose(total_decoded + old_residual, torch.stack(inputs).sum(dim=0), atol=1e-5)
    # Residuals are kept per buffer key.
    feedback.encode("bucket1", inputs[0])
    assert set(feedback.residuals) == {"bucket0", "bucket1"}


def test_exchange_hook_moves_compressed_bytes_one_bit_is_a_32nd_of_allreduce():
    """Two ranks: ring all_reduce sends 2(n-1)/n * 4d = 4d bytes; onebit's all_gather d/8 + 4."""
    d = 10_000
    flat = torch.randn(d, generator=torch.Generator().manual_seed(5))
    plain = MirrorComm(2)
    allreduce_hook(plain, flat.clone()).wait()
    onebit = MirrorComm(2)
    averaged = CompressedExchange(build_compressor("onebit"))(onebit, buffer := flat.clone()).wait()
    assert averaged.data_ptr() == buffer.data_ptr()
    assert plain.stats.bytes_sent == 4 * d
    assert onebit.stats.bytes_sent == d // 8 + 4 and onebit.stats.per_op["all_gather"].calls == 1
    assert onebit.stats.bytes_sent / plain.stats.bytes_sent == pytest.approx(1 / 32, rel=0.01)
    # Identical inputs on both ranks: the mean of the decoded buffers is the decoded buffer.
    assert torch.allclose(averaged, flat.abs().mean() * torch.where(flat >= 0, 1.0, -1.0))
    half = MirrorComm(2)
    CompressedExchange(build_compressor("fp16"))(half, flat.clone()).wait()
    assert half.stats.bytes_sent == 2 * d and half.stats.per_op["all_reduce"].calls == 1


def _context(comm: Comm) -> AlgorithmContext:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 40), nn.ReLU(), nn.Linear(40, 10))
    return AlgorithmContext(model=model, comm=comm, loss_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                            optimizer=OptimizerConfig(), lr=0.1, device=torch.device("cpu"))


def test_quantized_onebit_step_sends_a_32nd_of_sync():
    """Through the algorithms: one training step of quantized(onebit) vs sync on 2 (mirrored) ranks."""
    from trainers.algorithms.quantized import Quantized, QuantizedParams
    from trainers.algorithms.sync import Sync, SyncParams

    batch = (torch.randn(16, 64, generator=torch.Generator().manual_seed(6)), torch.arange(16) % 10)
    sent = {}
    for label, build in (
        ("sync", lambda ctx: Sync(SyncParams(broadcast_buffers=False), ctx)),
        ("onebit", lambda ctx: Quantized(QuantizedParams(compressor="onebit"), ctx)),
    ):
        comm = MirrorComm(2)
        algorithm = build(_context(comm))
        algorithm.setup()
        before = comm.stats.bytes_sent
        algorithm.train_step(0, batch)
        sent[label] = comm.stats.bytes_sent - before
    d = 64 * 40 + 40 + 40 * 10 + 10
    assert sent == {"sync": 4 * d, "onebit": math.ceil(d / 8) + 4}
    assert sent["onebit"] / sent["sync"] == pytest.approx(1 / 32, rel=0.02)  # + 4-byte scale, padding


@pytest.mark.parametrize("name, levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("numel, chunk_size", [(1, 4), (7, 4), (1037, 64), (1000, 512)])
def test_uniform_codes_round_to_within_half_a_step_of_each_chunks_scale(name, levels, numel, chunk_size):
    code = build_compressor(name, chunk_size=chunk_size)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * torch.linspace(0.01, 10, numel)
    payload = code.encode(x)
    chunks = math.ceil(numel / chunk_size)
    bits = {"int8": 8, "int4": 4}[name]
    assert payload.dtype == torch.uint8 and payload.numel() == 4 * chunks + math.ceil(numel * bits / 8)
    decoded = code.decode(payload, numel, torch.float32)
    assert decoded.shape == (numel,)
    padded = torch.cat([x, x.new_zeros(chunks * chunk_size - numel)]).reshape(chunks, chunk_size)
    step = (padded.abs().amax(dim=1) / levels).repeat_interleave(chunk_size)[:numel]
    error = (decoded - x).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 1e-12).all(), (error / step).max()
    # each chunk's largest value is on the grid: decoded exactly (to float32 rounding)
    largest = padded.abs().argmax(dim=1) + torch.arange(chunks) * chunk_size
    largest = largest[largest < numel]
    assert torch.allclose(decoded[largest], x[largest], rtol=1e-6)
    # deterministic: the same codes every time
    assert torch.equal(code.encode(x), payload)


def test_int4_codes_are_two_per_byte_and_int8_one():
    x = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5])
    int4 = build_compressor("int4", chunk_size=8)
    # scale 1.0, codes round(7 * x) = 7, -7, 4 (3.5 rounds half to even), 0, -4; stored + 8
    assert int4.encode(x)[4:].tolist() == [(15 << 4) | 1, (12 << 4) | 8, 4 << 4]
    int8 = build_compressor("int8", chunk_size=8)
    assert int8.encode(x)[4:].view(torch.int8).tolist() == [127, -127, 64, 0, -64]
