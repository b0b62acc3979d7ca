"""`sparseloco`: SparseLoCo against DiLoCo and a single-process reference on 4 gloo ranks
(loopback), its error feedback, its wire bytes, its Params, and a run on the simulator.

The ranks start once for the module and train every variant in turn (start-up dominates on a
shared 2-core machine); train_on_digits is test_quantized's (digits, MLP 64-32-10).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import BASE_CONFIG, merge, records
from tests.trainers.test_quantized import DIGITS_MODEL, runs_worker
from trainers.config import ConfigError

WORLD = 4
H = 3
STEPS = 12  # 4 rounds; a multiple of H, so each replica ends equal to theta_g
LR = 0.01
DILOCO = {"H": H, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
SPARSE = {"H": H, "chunk_size": 256, "ratio": 0.05, "bits": 2, "error_decay": 0.9, "outer_lr": 1.0}
RUNS = {
    "diloco": ["diloco", DILOCO, STEPS, LR],
    "dense_control": ["sparseloco", {**DILOCO, "ratio": 1.0, "bits": 32, "error_decay": 0.0, "chunk_size": 256},
                      STEPS, LR],
    "sparse": ["sparseloco", SPARSE, STEPS, LR],
}


# ---------------------------------------------------------------------------------------------
# A single-process reference: every rank's replica in one process, trained as train_on_digits does.


class Replicas:
    """``world`` replicas of the digits MLP with train_on_digits's data, model and inner AdamW."""

    def __init__(self, world: int, lr: float, seed: int = 0, batch_size: int = 32):
        from trainers.config import DatasetConfig, OptimizerConfig
        from trainers.datasets import BatchSampler, load_dataset, shard_indices
        from trainers.models import build_model

        self.data = load_dataset(DatasetConfig(name="digits"), seed)
        shards = shard_indices(self.data.train_y, world, "iid", 0.5, seed)
        self.samplers = [BatchSampler(shards[r], batch_size, seed=seed * 1000 + r) for r in range(world)]
        base = build_model("mlp", DIGITS_MODEL, self.data.input_shape, self.data.num_classes, seed)
        self.models = [build_model("mlp", DIGITS_MODEL, self.data.input_shape, self.data.num_classes, seed)
                       for _ in range(world)]
        for model in self.models:
            model.load_state_dict(base.state_dict())
        cfg = OptimizerConfig()
        self.optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, betas=tuple(cfg.betas),
                                             weight_decay=cfg.weight_decay) for m in self.models]
        self.global_model = build_model("mlp", DIGITS_MODEL, self.data.input_shape, self.data.num_classes, seed)
        self.global_model.load_state_dict(base.state_dict())

    def inner_step(self) -> None:
        from trainers.training import loss_fn

        for model, optimizer, sampler in zip(self.models, self.optimizers, self.samplers):
            indices = sampler.next_indices()
            optimizer.zero_grad(set_to_none=False)
            loss_fn(model, (self.data.train_x[indices], self.data.train_y[indices])).backward()
            optimizer.step()

    def flat(self, model) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def set_flat(self, model, flat: torch.Tensor) -> None:
        from trainers.algorithms.base import unflatten_into

        unflatten_into(flat, list(model.parameters()))

    def outer_step(self, outer: torch.optim.Optimizer, mean_pseudo_gradient: torch.Tensor) -> None:
        """theta_g moved by ``outer`` along the mean pseudo-gradient; every replica restarts from it."""
        from trainers.algorithms.base import unflatten_into

        params = list(self.global_model.parameters())
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        unflatten_into(mean_pseudo_gradient, [p.grad for p in params])
        outer.step()
        for model in self.models:
            self.set_flat(model, self.flat(self.global_model))


def reference_sparseloco(params: dict, world: int, steps: int, lr: float) -> torch.Tensor:
    """theta_g after ``steps`` of SparseLoCo, computed in one process (the code: ChunkedTopK)."""
    from trainers.compression import ChunkedTopK, ChunkedTopKParams

    torch.set_num_threads(1)
    replicas = Replicas(world, lr)
    code = ChunkedTopK(ChunkedTopKParams(params["chunk_size"], params["ratio"], params["bits"]))
    outer = torch.optim.SGD(replicas.global_model.parameters(), lr=params["outer_lr"])
    residuals = [None] * world
    for step in range(steps):
        replicas.inner_step()
        if (step + 1) % params["H"]:
            continue
        total = None
        for rank, model in enumerate(replicas.models):
            error = replicas.flat(replicas.global_model) - replicas.flat(model)
            if residuals[rank] is not None:
                error = error + params["error_decay"] * residuals[rank]
            sent = code.decode(code.encode(error), error.numel(), torch.float32)
            residuals[rank] = error - sent
            total = sent.clone() if total is None else total + sent
        replicas.outer_step(outer, total / world)
    return replicas.flat(replicas.global_model)


# ---------------------------------------------------------------------------------------------
# Params and the code (no ranks)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"H": 0}, r"^H: must be an integer >= 1"),
        ({"ratio": 0.0}, r"^ratio: must be a number > 0"),
        ({"ratio": 1.5}, r"^ratio: must be a number"),
        ({"bits": 4}, r"^bits: must be 2 or 32"),
        ({"chunk_size": 70000}, r"^chunk_size: must be an integer in \[1, 65536\]"),
        ({"error_decay": 1.5}, r"^error_decay: must be a number"),
        ({"outer_lr": 0.0}, r"^outer_lr: must be a number > 0"),
        ({"nesterov": True}, r"^nesterov: needs outer_momentum > 0"),
    ],
)
def test_params_errors_name_the_field(changes, message):
    from trainers.algorithms.sparseloco import SparseLoCoParams

    with pytest.raises(ConfigError, match=message):
        SparseLoCoParams(**changes)


def test_registered_and_resolved_through_the_config():
    from trainers.loading import load_config

    config = load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "sparseloco", "params": {"H": 5}}})
    assert (config.algorithm.params.H, config.algorithm.params.bits, config.algorithm.params.chunk_size) == (5, 2, 4096)
    with pytest.raises(ConfigError, match=r"^algorithm.params.bits: must be 2 or 32"):
        load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "sparseloco", "params": {"bits": 8}}})


def expected_payload_bytes(numel: int, chunk_size: int, ratio: float, bits: int) -> int:
    """The payload by its definition: per chunk k 2-byte indices, then 2-bit codes (4 a byte,
    packed over all chunks) and two float32 magnitudes per chunk, or k float32 values."""
    chunks = math.ceil(numel / chunk_size)
    k = min(chunk_size, max(1, math.ceil(ratio * chunk_size)))
    if bits == 32:
        return chunks * k * (2 + 4)
    return chunks * k * 2 + math.ceil(chunks * k / 4) + chunks * 2 * 4


@pytest.mark.parametrize("bits", [2, 32])
def test_code_keeps_the_top_k_of_each_chunk(bits):
    from trainers.compression import build_compressor

    code = build_compressor("chunked_topk", chunk_size=10, ratio=0.3, bits=bits)  # k = 3
    x = torch.randn(25, generator=torch.Generator().manual_seed(1))
    payload = code.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == expected_payload_bytes(25, 10, 0.3, bits)
    decoded = code.decode(payload, 25, torch.float32)
    for start in range(0, 25, 10):
        chunk, out = x[start:start + 10], decoded[start:start + 10]
        kept = chunk.abs().topk(min(3, chunk.numel())).indices
        assert set(out.nonzero().reshape(-1).tolist()) == set(kept.tolist())
        assert torch.equal(torch.sign(out[kept]), torch.sign(chunk[kept]))
        if bits == 32:
            assert torch.equal(out[kept], chunk[kept])
        else:  # two magnitudes: the mean of those above the chunk's mean kept magnitude, and of the rest
            magnitude = chunk[kept].abs()
            high = magnitude > magnitude.mean()
            expected = torch.where(high, magnitude[high].mean() if high.any() else 0.0, magnitude[~high].mean())
            assert torch.allclose(out[kept].abs(), expected, atol=1e-7)


def _algorithm(changes: dict):
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.sparseloco import SparseLoCo, SparseLoCoParams
    from trainers.config import OptimizerConfig

    model = torch.nn.Linear(4, 3)
    ctx = AlgorithmContext(model=model, comm=None, loss_fn=None, optimizer=OptimizerConfig(), lr=0.1,
                           device=torch.device("cpu"))
    return SparseLoCo(SparseLoCoParams(**changes), ctx)


@pytest.mark.parametrize("bits", [2, 32])
def test_error_feedback_residual_plus_sent_is_the_pseudo_gradient_plus_decayed_residual(bits):
    algorithm = _algorithm({"chunk_size": 5, "ratio": 0.4, "bits": bits, "error_decay": 0.5})
    generator = torch.Generator().manual_seed(2)
    previous = None
    for _ in range(3):
        pseudo_gradient = torch.randn(15, generator=generator)
        _, sent = algorithm.compress(pseudo_gradient)
        corrected = pseudo_gradient if previous is None else pseudo_gradient + 0.5 * previous
        residual = algorithm.state.residual
        assert torch.count_nonzero(sent) == 3 * 2  # 3 chunks, k = 2
        if bits == 32:  # disjoint supports: exact
            assert torch.equal(residual + sent, corrected)
            assert torch.equal(residual[sent != 0], torch.zeros(6))
        else:
            assert torch.allclose(residual + sent, corrected, atol=1e-6, rtol=0)
        previous = residual.clone()


def test_without_error_feedback_the_residual_is_dropped():
    algorithm = _algorithm({"chunk_size": 5, "ratio": 0.4, "bits": 32, "error_decay": 0.0})
    first, second = torch.randn(15), torch.randn(15)
    algorithm.compress(first)
    _, sent = algorithm.compress(second)
    assert torch.equal(sent + algorithm.state.residual, second)


# ---------------------------------------------------------------------------------------------
# 4 gloo ranks


@pytest.fixture(scope="module")
def four_ranks(spawn_ranks_module, tmp_path_factory):
    directory = tmp_path_factory.mktemp("sparseloco")
    exits = spawn_ranks_module(runs_worker, WORLD, str(directory), RUNS, timeout_s=240.0)
    assert exits == [0] * WORLD
    return [json.loads((directory / f"runs{rank}.json").read_text()) for rank in range(WORLD)]


def test_every_rank_holds_the_same_global_model(four_ranks):
    for label in RUNS:
        assert all(four_ranks[rank][label]["params"] == four_ranks[0][label]["params"] for rank in range(WORLD)), label


def test_all_entries_32_bits_no_error_feedback_equals_diloco(four_ranks):
    diloco = torch.tensor(four_ranks[0]["diloco"]["params"])
    dense = torch.tensor(four_ranks[0]["dense_control"]["params"])
    start = torch.tensor(four_ranks[0]["sparse"]["params"])
    assert (diloco - start).abs().max() > 1e-3  # the runs differ where they should
    assert torch.allclose(dense, diloco, atol=1e-5, rtol=0)


def test_sparse_run_matches_the_single_process_reference(four_ranks):
    reference = reference_sparseloco(SPARSE, WORLD, STEPS, LR)
    ranks = torch.tensor(four_ranks[0]["sparse"]["params"])
    assert torch.allclose(ranks, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("label, params", [("sparse", SPARSE), ("dense_control", RUNS["dense_control"][1])])
def test_bytes_per_round_are_the_payloads(four_ranks, label, params):
    """Each outer step all-gathers one payload to the 3 other ranks (the MLP has no buffers);
    inner steps send nothing."""
    for rank in range(WORLD):
        result = four_ranks[rank][label]
        payload = expected_payload_bytes(result["numel"], params["chunk_size"], params["ratio"], params["bits"])
        expected = [(WORLD - 1) * payload if (step + 1) % H == 0 else 0 for step in range(STEPS)]
        assert result["bytes_sent"] == expected
    # diloco's float32 all-reduce of the same rounds, for scale: the 2-bit code sends < 1/10 of it
    assert sum(four_ranks[0]["sparse"]["bytes_sent"]) < sum(four_ranks[0]["diloco"]["bytes_sent"]) / 10


# ---------------------------------------------------------------------------------------------
# The simulator


def test_runs_on_the_simulator(tmp_path):
    from tests.trainers.test_sim import network
    from trainers.loading import load_config
    from trainers.sim import ComputeModel, run_simulated

    changes = {"steps": 12, "eval_every": 6, "optimizer": {"name": "adamw"}, "lr": 0.01,
               "algorithm": {"name": "sparseloco", "params": {"H": 3, "chunk_size": 256, "ratio": 0.05}}}
    config = load_config(merge(BASE_CONFIG, {**changes, "output_dir": str(tmp_path)}))
    run_simulated(config, 4, network(4, 0.02, 125e6), ComputeModel(0.005, 0.001))
    steps = records(tmp_path, 1, "step")
    assert [r["syncs_applied"] for r in steps] == [0, 0, 1] * 4
    assert all(math.isfinite(r["loss"]) for r in steps)
