"""Gossip algorithms dpsgd, adpsgd, swarmsgd: graphs and schedules, a D-PSGD reference, consensus,
accuracy and wire bytes on 4 real gloo ranks (loopback; started once for the module)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from tests.trainers.test_quantized import _start_rank, train_on_digits
from trainers.algorithms.gossip_common import (
    bipartite_matching, metropolis_weights, random_graph, random_matching, ring_graph, torus_graph, torus_shape,
)
from trainers.config import ConfigError, to_dict

# ---------------------------------------------------------------------------------------------
# Pure parts: graphs, mixing weights, schedules, Params.


def test_ring_and_torus_graphs():
    assert ring_graph(4) == [{1, 3}, {0, 2}, {1, 3}, {0, 2}]
    assert ring_graph(2) == [{1}, {0}] and ring_graph(1) == [set()]
    assert torus_shape(4) == (2, 2) and torus_shape(12) == (3, 4) and torus_shape(7) == (1, 7)
    torus = torus_graph(12)
    assert all(len(neighbours) == 4 for neighbours in torus)
    assert torus[0] == {1, 3, 4, 8}  # right, left (wrap), down, up (wrap) in a 3 x 4 grid
    assert torus_graph(7) == ring_graph(7)


@pytest.mark.parametrize("graph", [ring_graph(5), torus_graph(12), random_graph(9, 0.4, seed=1, step=3)])
def test_metropolis_weights_are_symmetric_and_doubly_stochastic(graph):
    for i, neighbours in enumerate(graph):
        assert all(i in graph[j] for j in neighbours)
    weights = metropolis_weights(graph)
    assert torch.allclose(weights, weights.T)
    assert torch.allclose(weights.sum(dim=0), torch.ones(len(graph), dtype=torch.float64))
    assert (weights >= 0).all()
    assert ((weights > 0) == (torch.eye(len(graph), dtype=torch.bool) | _adjacency(graph))).all()


def _adjacency(graph) -> torch.Tensor:
    adjacency = torch.zeros(len(graph), len(graph), dtype=torch.bool)
    for i, neighbours in enumerate(graph):
        adjacency[i, list(neighbours)] = True
    return adjacency


def test_random_graph_is_the_same_for_a_seed_and_step_and_changes_with_the_step():
    assert random_graph(8, 0.5, seed=3, step=10) == random_graph(8, 0.5, seed=3, step=10)
    graphs = {str(random_graph(8, 0.5, seed=3, step=s)) for s in range(10)}
    assert len(graphs) > 5
    assert random_graph(6, 0.0, 0, 0) == [set()] * 6 and random_graph(4, 1.0, 0, 0) == [{1, 2, 3}, {0, 2, 3}, {0, 1, 3}, {0, 1, 2}]


@pytest.mark.parametrize("world_size", [2, 4, 5, 8])
def test_matchings_pair_ranks_both_ways(world_size):
    for index in range(20):
        for partners in (random_matching(world_size, 0, index), bipartite_matching(world_size, 0, index)):
            for rank, partner in enumerate(partners):
                assert partner is None or (partner != rank and partners[partner] == rank)
            assert partners.count(None) == world_size % 2 or world_size % 2 == 0 and partners.count(None) == 0
        for rank, partner in enumerate(bipartite_matching(world_size, 0, index)):
            assert partner is None or (rank % 2) != (partner % 2)  # active (even) with passive (odd)
    assert len({str(random_matching(8, 0, i)) for i in range(10)}) > 5


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("dpsgd", {"topology": "star"}, r"^topology: must be one of"),
        ("dpsgd", {"edge_probability": 1.5}, r"^edge_probability: must be a number in \[0.0, 1.0\]"),
        ("adpsgd", {"seed": -1}, r"^seed: must be an integer >= 0"),
        ("swarmsgd", {"H": 0}, r"^H: must be an integer >= 1"),
        ("swarmsgd", {"quantize": "onebit"}, r"^quantize: must be one of"),
        ("swarmsgd", {"levels": 200}, r"^levels: must be an integer in \[1, 127\]"),
        ("swarmsgd", {"interaction": "matching"}, r"^interaction: must be one of"),
        ("swarmsgd", {"neighbours": "star"}, r"^neighbours: must be one of"),
        ("swarmsgd", {"max_outstanding": 0}, r"^max_outstanding: must be an integer in \[1, 64\]"),
    ],
)
def test_params_errors_name_the_field(name, params, message):
    from trainers.algorithms import get_algorithm

    with pytest.raises(ConfigError, match=message):
        get_algorithm(name).Params(**params)


def test_registered_and_resolved_through_the_config():
    from trainers.loading import load_config

    config = load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "swarmsgd", "params": {"quantize": "qsgd"}}})
    assert to_dict(config)["algorithm"]["params"] == {"H": 4, "interaction": "auto", "quantize": "qsgd", "levels": 127,
                                                      "chunk_size": 64, "neighbours": "all", "max_outstanding": 1,
                                                      "seed": 0}
    with pytest.raises(ConfigError, match=r"^algorithm.params.topology: must be one of"):
        load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "dpsgd", "params": {"topology": "mesh"}}})


# ---------------------------------------------------------------------------------------------
# Multi-process runs.

LR = 0.3
STEPS = 100
REFERENCE_STEPS = 3
# label: (algorithm, params, stated accuracy of the averaged model after STEPS steps). Measured
# (seed 0, torch 2.13 CPU): dpsgd ring and torus 0.914, random 0.925, adpsgd 0.919, swarmsgd
# (rounds) 0.919 with every quantize option; sync reaches 0.922 in the same setting (test_quantized.py).
# swarmsgd's asynchronous interaction (the default) on loopback: see the printed summary.
ACCURACY_RUNS = {
    "dpsgd_ring": ("dpsgd", {"topology": "ring"}, 0.85),
    "dpsgd_torus": ("dpsgd", {"topology": "torus"}, 0.85),
    "dpsgd_random": ("dpsgd", {"topology": "random", "edge_probability": 0.5, "seed": 1}, 0.85),
    "adpsgd": ("adpsgd", {}, 0.85),
    "swarmsgd": ("swarmsgd", {"H": 4, "quantize": "none"}, 0.85),
    "swarmsgd_fp16": ("swarmsgd", {"H": 4, "quantize": "fp16"}, 0.85),
    "swarmsgd_qsgd": ("swarmsgd", {"H": 4, "quantize": "qsgd"}, 0.80),
    "swarmsgd_rounds": ("swarmsgd", {"H": 4, "quantize": "none", "interaction": "rounds"}, 0.85),
}
CONSENSUS_STEPS = 30
CONSENSUS_SNAPSHOTS = (0, 9, 29)
CONSENSUS_RUNS = {
    "dpsgd_ring": ("dpsgd", {"topology": "ring"}),
    "dpsgd_random": ("dpsgd", {"topology": "random", "edge_probability": 0.3}),
    "adpsgd": ("adpsgd", {}),
    "swarmsgd": ("swarmsgd", {"H": 2, "quantize": "none"}),
    "swarmsgd_qsgd": ("swarmsgd", {"H": 2, "quantize": "qsgd"}),
}


def _flat(model) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def gossip_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Reference, consensus and accuracy runs in turn over one process group; each rank writes JSON."""
    comm = _start_rank(rank, world_size, port)
    results: dict = {"reference": train_on_digits(comm, "dpsgd", {"topology": "ring"}, REFERENCE_STEPS, LR)}
    for label, (name, params) in CONSENSUS_RUNS.items():
        snapshots: dict = {}

        def spread_and_freeze(algorithm):
            # Different replicas (rank-seeded offsets), then lr = 0: only the averaging moves them.
            generator = torch.Generator().manual_seed(100 + rank)
            with torch.no_grad():
                for param in algorithm.model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator))
            algorithm.set_lr(0.0)
            snapshots["initial"] = _flat(algorithm.model)

        def snapshot(step, algorithm):
            if getattr(algorithm, "swarm", None) is not None:
                # Swarm's asynchronous interaction: how many replies arrive within 30 steps follows the
                # machine's load (CI saw 5 % of the disagreement left). Waiting for this node's own
                # replies after each step fixes the count (one interaction every H steps per node);
                # the averaging itself (snapshots, queued halves, crossings) is the protocol's.
                algorithm.driver.wait(lambda: not algorithm.swarm.outstanding)
            if step in CONSENSUS_SNAPSHOTS:
                snapshots[step] = _flat(algorithm.model)

        run = train_on_digits(comm, name, params, CONSENSUS_STEPS, LR, before_steps=spread_and_freeze, after_step=snapshot)
        results[f"consensus_{label}"] = {**run, "snapshots": snapshots}
    for label, (name, params, _) in ACCURACY_RUNS.items():
        start = time.perf_counter()
        results[label] = train_on_digits(comm, name, params, STEPS, LR)
        results[label]["seconds"] = time.perf_counter() - start
    comm.shutdown()
    Path(out_dir, f"gossip{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def four_ranks(spawn_ranks_module, tmp_path_factory):
    directory = tmp_path_factory.mktemp("gossip")
    exits = spawn_ranks_module(gossip_worker, 4, str(directory), timeout_s=300.0)
    assert exits == [0] * 4
    results = [json.loads((directory / f"gossip{rank}.json").read_text()) for rank in range(4)]
    summary = {
        label: {"accuracy": round(results[0][label]["accuracy"], 3),
                "bytes_sent_per_step": sum(results[0][label]["bytes_sent"]) / STEPS,
                "seconds": round(results[0][label]["seconds"], 1)}
        for label in ACCURACY_RUNS
    }
    print(json.dumps(summary, indent=1))
    return results


def _reference_dpsgd_ring(world_size: int, steps: int, lr: float) -> list[torch.Tensor]:
    """Single-process D-PSGD on a ring: x_i <- sum_j W_ij x_j - lr * grad_i(x_i), W = 1/3 on i, i+-1.

    Data, shards, batches and initial model are built as ``train_on_digits`` builds them per rank.
    """
    from trainers.config import DatasetConfig
    from trainers.datasets import BatchSampler, load_dataset, shard_indices
    from trainers.models import build_model
    from trainers.training import loss_fn

    from tests.trainers.test_quantized import DIGITS_MODEL

    seed = 0
    data = load_dataset(DatasetConfig(name="digits"), seed)
    shards = shard_indices(data.train_y, world_size, "iid", 0.5, seed)
    samplers = [BatchSampler(shards[r], 32, seed=seed * 1000 + r) for r in range(world_size)]
    model = build_model("mlp", DIGITS_MODEL, data.input_shape, data.num_classes, seed)
    params = list(model.parameters())
    x = [torch.cat([p.detach().reshape(-1) for p in params]) for _ in range(world_size)]
    mixing = torch.zeros(world_size, world_size, dtype=torch.float64)
    for i in range(world_size):
        for j in (i - 1, i, i + 1):
            mixing[i, j % world_size] = 1 / 3
    for _ in range(steps):
        gradients = []
        for rank in range(world_size):
            offset = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(x[rank][offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
            model.zero_grad()
            indices = samplers[rank].next_indices()
            loss_fn(model, (data.train_x[indices], data.train_y[indices])).backward()
            gradients.append(torch.cat([p.grad.reshape(-1) for p in params]))
        stacked = torch.stack(x).double()
        x = [(mixing[i] @ stacked).float() - lr * gradients[i] for i in range(world_size)]
    return x


@pytest.mark.slow
def test_dpsgd_ring_matches_single_process_reference(four_ranks):
    reference = _reference_dpsgd_ring(4, REFERENCE_STEPS, LR)
    for rank in range(4):
        trained = torch.tensor(four_ranks[rank]["reference"]["params"])
        assert (trained - reference[rank]).abs().max().item() < 1e-5, rank
    # The replicas really differ (each rank used its own batches), so the check is not vacuous.
    assert not torch.allclose(reference[0], reference[1])


def _disagreement(replicas: list[list[float]]) -> float:
    stacked = torch.tensor(replicas, dtype=torch.float64)
    return ((stacked - stacked.mean(dim=0)) ** 2).sum().item()


@pytest.mark.slow
@pytest.mark.parametrize("label", list(CONSENSUS_RUNS))
def test_replicas_reach_consensus_with_lr_zero_and_keep_their_mean(four_ranks, label):
    runs = [four_ranks[rank][f"consensus_{label}"] for rank in range(4)]
    initial = _disagreement([run["snapshots"]["initial"] for run in runs])
    middle = _disagreement([run["snapshots"][str(CONSENSUS_SNAPSHOTS[1])] for run in runs])
    final = _disagreement([run["params"] for run in runs])
    assert initial > 1000  # rank-seeded N(0, 1) offsets on ~2400 parameters
    assert middle < 0.5 * initial and final < 0.01 * initial, (initial, middle, final)
    # Doubly stochastic mixing (and Swarm's symmetric update, even quantized) keeps the mean model.
    initial_mean = torch.tensor([run["snapshots"]["initial"] for run in runs]).mean(dim=0)
    final_mean = torch.tensor([run["params"] for run in runs]).mean(dim=0)
    assert (initial_mean - final_mean).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("label", list(ACCURACY_RUNS))
def test_reaches_stated_accuracy_on_digits_with_4_ranks(four_ranks, label):
    accuracy, threshold = four_ranks[0][label]["accuracy"], ACCURACY_RUNS[label][2]
    assert accuracy >= threshold, f"{label}: accuracy of the averaged model {accuracy:.3f} < {threshold}"
    # The deployable model is the mean of all replicas: every rank evaluates the same one.
    assert all(four_ranks[rank][label]["accuracy"] == accuracy for rank in range(4))


@pytest.mark.slow
def test_wire_bytes_are_point_to_point_models(four_ranks):
    results = four_ranks[0]
    d = results["dpsgd_ring"]["numel"]
    assert results["dpsgd_ring"]["bytes_sent"] == [2 * 4 * d] * STEPS  # two neighbours
    assert results["dpsgd_torus"]["bytes_sent"] == [2 * 4 * d] * STEPS  # 2 x 2 torus: also two
    assert results["adpsgd"]["bytes_sent"] == [4 * d] * STEPS  # one partner (4 ranks: always one)
    assert set(results["dpsgd_random"]["bytes_sent"]) <= {k * 4 * d for k in range(4)}
    # Swarm's rounds: one model to one partner every H = 4 steps, nothing in between.
    assert results["swarmsgd_rounds"]["bytes_sent"] == [0, 0, 0, 4 * d] * (STEPS // 4)
    # Swarm's async interaction: whole messages (an 8-byte kind, then the encoded model), a request
    # at most every H = 4 steps plus the answers to others' requests, which come at any step.
    for label, size in (("swarmsgd", 4 * d), ("swarmsgd_fp16", 2 * d), ("swarmsgd_qsgd", d + 4 * math.ceil(d / 64))):
        sent = results[label]["bytes_sent"]
        assert all(b % (8 + size) == 0 for b in sent), label
        # its own requests (at most STEPS / H) and answers to the three others' (at most theirs)
        assert 0 < sum(sent) // (8 + size) <= 4 * (STEPS // 4), label
