"""`quantized`: compressed sync / local_sgd on real gloo ranks (loopback), and its Params.

The multi-process tests start the ranks once per world size and train every variant in turn over
the same process group (process start-up dominates the cost on a shared 2-core machine).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from trainers.config import ConfigError

DIGITS_MODEL = {"hidden_sizes": [32]}


def train_on_digits(comm, algorithm_name: str, params: dict, steps: int, lr: float, seed: int = 0,
                    batch_size: int = 32, before_steps=None, after_step=None) -> dict:
    """Train ``algorithm_name`` on this rank's digits shard with ``comm``; evaluate the deployable model.

    Returns accuracy (of the deployable model, the same on every rank), bytes_sent per step and
    the final local parameters. ``before_steps(algorithm)`` and ``after_step(step, algorithm)``
    let a test perturb or observe the replicas.
    """
    from trainers.algorithms import AlgorithmContext, get_algorithm
    from trainers.config import DatasetConfig, OptimizerConfig, from_dict
    from trainers.datasets import BatchSampler, load_dataset, shard_indices
    from trainers.models import build_model
    from trainers.training import evaluate, loss_fn

    rank, world_size = comm.rank, comm.world_size
    torch.manual_seed(1000 * seed + rank)  # per-rank stochastic rounding, as the runner seeds it
    data = load_dataset(DatasetConfig(name="digits"), seed)
    shards = shard_indices(data.train_y, world_size, "iid", 0.5, seed)
    sampler = BatchSampler(shards[rank], batch_size, seed=seed * 1000 + rank)
    model = build_model("mlp", DIGITS_MODEL, data.input_shape, data.num_classes, seed)
    cls = get_algorithm(algorithm_name)
    context = AlgorithmContext(
        model=model, comm=comm, loss_fn=loss_fn, optimizer=OptimizerConfig(), lr=lr, device=torch.device("cpu")
    )
    algorithm = cls(from_dict(cls.Params, params, "algorithm.params"), context)
    algorithm.setup()
    if before_steps is not None:
        before_steps(algorithm)
    bytes_sent = []
    for step in range(steps):
        indices = sampler.next_indices()
        sent = comm.stats.bytes_sent
        algorithm.train_step(step, (data.train_x[indices], data.train_y[indices]))
        bytes_sent.append(comm.stats.bytes_sent - sent)
        if after_step is not None:
            after_step(step, algorithm)
    algorithm.finish()
    accuracy, _ = evaluate(algorithm.deployable_model(), data.test_x, data.test_y, torch.device("cpu"))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"accuracy": accuracy, "bytes_sent": bytes_sent, "params": flat.tolist(), "numel": flat.numel()}


def _start_rank(rank: int, world_size: int, port: int):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from trainers.comm import TorchComm

    return TorchComm("gloo", timeout_s=60)


def runs_worker(rank: int, world_size: int, port: int, out_dir: str, runs: dict) -> None:
    """Train each of ``runs`` ({label: [algorithm, params, steps, lr]}) in turn; rank 0 writes results."""
    comm = _start_rank(rank, world_size, port)
    results = {}
    for label, (name, params, steps, lr) in runs.items():
        start = time.perf_counter()
        results[label] = train_on_digits(comm, name, params, steps, lr)
        results[label]["seconds"] = time.perf_counter() - start
    comm.shutdown()
    Path(out_dir, f"runs{rank}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------
# Params


def test_params_fill_base_and_compressor_defaults():
    from trainers.algorithms.quantized import QuantizedParams

    params = QuantizedParams(base="local_sgd", compressor="qsgd")
    assert (params.H, params.warmup_steps, params.levels, params.chunk_size) == (4, 0, 16, 512)
    assert params.ratio is None and params.broadcast_buffers is None
    assert QuantizedParams(compressor="topk", ratio=0.1).ratio == 0.1


@pytest.mark.parametrize(
    "params, message",
    [
        ({"base": "dts"}, r"^base: must be one of"),
        ({"compressor": "zip"}, r"^compressor: must be one of"),
        ({"base": "sync", "H": 4}, r"^H: is not a parameter of base 'sync'"),
        ({"compressor": "onebit", "ratio": 0.1}, r"^ratio: is not a parameter of compressor 'onebit'"),
        ({"compressor": "qsgd", "levels": 0}, r"^levels: must be an integer in \[1, 127\]"),
        ({"compressor": "topk", "ratio": 0.0}, r"^ratio: must be a number > 0"),
        ({"base": "local_sgd", "H": 0}, r"^H: must be an integer >= 1"),
    ],
)
def test_params_errors_name_the_field(params, message):
    from trainers.algorithms.quantized import QuantizedParams

    with pytest.raises(ConfigError, match=message):
        QuantizedParams(**params)


def test_every_base_and_compressor_parameter_is_exposed():
    """A parameter added to a base's or a compressor's Params must get a QuantizedParams field too."""
    from trainers.algorithms.quantized import BASE_PARAMS, QuantizedParams
    from trainers.compression import COMPRESSORS

    exposed = {f.name for f in dataclasses.fields(QuantizedParams)}
    for owner in [*BASE_PARAMS.values(), *(c.Params for c in COMPRESSORS.values())]:
        missing = {f.name for f in dataclasses.fields(owner)} - exposed
        assert not missing, f"{owner.__name__}: {sorted(missing)} not in QuantizedParams"


def test_ring_collective_only_for_summable_codes():
    from trainers.algorithms.quantized import QuantizedParams

    assert QuantizedParams(base="local_sgd", compressor="fp16", collective="ring").collective == "ring"
    with pytest.raises(ConfigError, match=r"^collective: ring needs a summable compressor"):
        QuantizedParams(base="local_sgd", compressor="onebit", collective="ring")
    with pytest.raises(ConfigError, match=r"^collective: is not a parameter of base 'sync'"):
        QuantizedParams(base="sync", collective="ring")


def test_registered_and_resolved_through_the_config():
    from trainers.loading import load_config

    config = load_config({
        "output_dir": "/tmp/unused", "algorithm": {"name": "quantized", "params": {"base": "local_sgd", "compressor": "topk"}},
    })
    assert config.algorithm.params.H == 4 and config.algorithm.params.ratio == 0.01
    with pytest.raises(ConfigError, match=r"^algorithm.params.chunk_size: is not a parameter"):
        load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "quantized", "params": {"chunk_size": 8}}})


# ---------------------------------------------------------------------------------------------
# Multi-process: 4 gloo ranks, started once for the module.

# Accuracy of the deployable model on held-out digits (360 samples) after STEPS steps on 4 ranks,
# batch 32 per rank, MLP 64-32-10, plain SGD at lr 0.3. Measured (seed 0, torch 2.13 CPU): sync,
# fp16, bf16 0.922; qsgd 0.919; terngrad, topk, topk_local_sgd 0.916; onebit 0.914. The stated
# thresholds leave margin for other torch builds.
STEPS = 100
ACCURACY_RUNS = {
    "sync": (["sync", {}, STEPS, 0.3], 0.85),
    "fp16": (["quantized", {"compressor": "fp16"}, STEPS, 0.3], 0.85),
    "bf16": (["quantized", {"compressor": "bf16"}, STEPS, 0.3], 0.85),
    "qsgd": (["quantized", {"compressor": "qsgd", "levels": 16}, STEPS, 0.3], 0.85),
    "terngrad": (["quantized", {"compressor": "terngrad"}, STEPS, 0.3], 0.80),
    "onebit": (["quantized", {"compressor": "onebit"}, STEPS, 0.3], 0.85),
    "topk": (["quantized", {"compressor": "topk", "ratio": 0.05}, STEPS, 0.3], 0.80),
    "topk_local_sgd": (["quantized", {"base": "local_sgd", "H": 4, "compressor": "topk", "ratio": 0.1}, STEPS, 0.3], 0.80),
}
SHORT = 6
SHORT_RUNS = {
    "sync_short": ["sync", {}, SHORT, 0.3],
    "fp16_short": ["quantized", {"compressor": "fp16"}, SHORT, 0.3],
    "qsgd_local_short": ["quantized", {"base": "local_sgd", "compressor": "qsgd", "H": 2}, SHORT, 0.3],
    "fp16_local_ring_short": ["quantized", {"base": "local_sgd", "compressor": "fp16", "H": 2, "collective": "ring"}, SHORT, 0.3],
}


@pytest.fixture(scope="module")
def four_ranks(spawn_ranks_module, tmp_path_factory):
    runs = {**SHORT_RUNS, **{label: run for label, (run, _) in ACCURACY_RUNS.items()}}
    directory = tmp_path_factory.mktemp("quantized")
    exits = spawn_ranks_module(runs_worker, 4, str(directory), runs, timeout_s=300.0)
    assert exits == [0] * 4
    results = [json.loads((directory / f"runs{rank}.json").read_text()) for rank in range(4)]
    summary = {
        label: {"accuracy": round(results[0][label]["accuracy"], 3),
                "bytes_sent_per_step": sum(results[0][label]["bytes_sent"]) / STEPS,
                "seconds": round(results[0][label]["seconds"], 1)}
        for label in ACCURACY_RUNS
    }
    print(json.dumps(summary, indent=1))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("label", list(ACCURACY_RUNS))
def test_reaches_stated_accuracy_on_digits_with_4_ranks(four_ranks, label):
    accuracy, threshold = four_ranks[0][label]["accuracy"], ACCURACY_RUNS[label][1]
    assert accuracy >= threshold, f"{label}: held-out accuracy {accuracy:.3f} < {threshold}"


@pytest.mark.slow
def test_wire_bytes_are_the_compressed_payloads(four_ranks):
    n = 4
    results = four_ranks[0]
    d = results["sync"]["numel"]
    # Ring all-reduce of d float32: 2 (n-1)/n * 4d bytes sent per step.
    assert results["sync"]["bytes_sent"] == [2 * (n - 1) * 4 * d // n] * STEPS
    assert results["fp16"]["bytes_sent"] == [2 * (n - 1) * 2 * d // n] * STEPS
    # Non-summable codes: all_gather sends this rank's payload to the n-1 others.
    assert results["onebit"]["bytes_sent"] == [(n - 1) * (4 + math.ceil(d / 8))] * STEPS
    assert results["terngrad"]["bytes_sent"] == [(n - 1) * (4 + math.ceil(d / 4))] * STEPS
    assert results["qsgd"]["bytes_sent"] == [(n - 1) * (d + 4 * math.ceil(d / 512))] * STEPS
    assert results["topk"]["bytes_sent"] == [(n - 1) * 8 * math.ceil(0.05 * d)] * STEPS
    # local_sgd base: nothing on local steps, one compressed delta every H steps.
    assert results["qsgd_local_short"]["bytes_sent"] == [0, (n - 1) * (d + 4 * math.ceil(d / 512))] * (SHORT // 2)
    # collective: ring sends fp16 chunks over isend/irecv: 2 (n-1)/n * 2d bytes, up to chunk rounding.
    ring = results["fp16_local_ring_short"]["bytes_sent"]
    assert ring[0::2] == [0] * (SHORT // 2)
    assert all(abs(sent - 2 * (n - 1) * 2 * d / n) <= 2 * (n - 1) * 2 for sent in ring[1::2]), ring


@pytest.mark.slow
def test_fp16_stays_within_fp16_precision_of_sync(four_ranks):
    sync = torch.tensor(four_ranks[0]["sync_short"]["params"])
    fp16 = torch.tensor(four_ranks[0]["fp16_short"]["params"])
    difference = (sync - fp16).abs().max().item()
    assert 0 < difference < 2e-3, difference


@pytest.mark.slow
def test_replicas_stay_identical_with_every_code(four_ranks):
    # Every rank decodes the same payloads in the same order, so the replicas agree bit for bit.
    for label in four_ranks[0]:
        for rank in range(1, 4):
            assert four_ranks[rank][label]["params"] == four_ranks[0][label]["params"], (label, rank)


# ---------------------------------------------------------------------------------------------
# The transport: non-summable payloads all-gathered on the all-reduce's exchange (comm.allreduce)

TRANSPORT_RUNS = {
    "qsgd": {"compressor": "qsgd"},
    "onebit": {"compressor": "onebit"},
    "topk": {"compressor": "topk", "ratio": 0.05},
    "qsgd_local": {"base": "local_sgd", "compressor": "qsgd", "H": 2},
}


def transports_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Train each of TRANSPORT_RUNS for 6 steps under each all-gather transport; write the results."""
    comm = _start_rank(rank, world_size, port)
    results = {}
    for transport in ("gloo", "direct", "ring"):
        comm.allreduce_algorithm = transport
        for label, params in TRANSPORT_RUNS.items():
            calls = comm.stats.per_op["all_gather"].calls
            result = train_on_digits(comm, "quantized", params, 6, 0.3)
            result["all_gathers"] = comm.stats.per_op["all_gather"].calls - calls
            results[f"{transport}/{label}"] = result
    comm.shutdown()
    Path(out_dir, f"transports{rank}.json").write_text(json.dumps(results))


@pytest.mark.slow
def test_compressed_payloads_decode_the_same_on_every_transport(spawn_ranks, tmp_path):
    # The same payloads reach every rank whichever exchange carries them, and are decoded in
    # rank order: the parameters are equal bit for bit, and so are the bytes counted.
    assert spawn_ranks(transports_worker, 3, str(tmp_path), timeout_s=240) == [0] * 3
    results = [json.loads((tmp_path / f"transports{rank}.json").read_text()) for rank in range(3)]
    for label in TRANSPORT_RUNS:
        assert results[0][f"gloo/{label}"]["all_gathers"] > 0, label
        for transport in ("direct", "ring"):
            for rank in range(3):
                gloo, ours = results[rank][f"gloo/{label}"], results[rank][f"{transport}/{label}"]
                assert ours["params"] == gloo["params"], (label, transport, rank)
                assert ours["bytes_sent"] == gloo["bytes_sent"], (label, transport, rank)
                assert ours["all_gathers"] == gloo["all_gathers"], (label, transport, rank)
