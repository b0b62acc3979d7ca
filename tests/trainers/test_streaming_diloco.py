"""`streaming_diloco` and DiLoCo's ``outer_precision``: Params, the fragment split, 4 gloo ranks
on loopback against DiLoCo and against a single-process reference of the streaming schedule,
bytes per round by precision, and the overlap hiding communication on the simulator.

The multi-process runs start the ranks once for the module and train every variant in turn
(process start-up dominates on a shared 2-core machine).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import BASE_CONFIG, merge, records
from tests.trainers.test_quantized import DIGITS_MODEL, _start_rank, train_on_digits
from trainers.config import ConfigError

WORLD = 4
LR = 0.003  # AdamW inner steps (test_accuracy's diloco value)


# ---------------------------------------------------------------------------------------------
# Params and the fragment split


@pytest.mark.parametrize(
    "params, message",
    [
        ({"H": 0}, r"^H: must be an integer >= 1"),
        ({"H": 10, "fragments": 0}, r"^fragments: must be an integer >= 1"),
        ({"H": 10, "fragments": 3}, r"^fragments: must divide H \(10\); got 3"),
        ({"H": 10, "fragments": 2, "overlap": 10}, r"^overlap: must be an integer in \[0, 9\]"),
        ({"overlap": -1}, r"^overlap: must be an integer in \[0, 49\]"),
        ({"alpha": 1.5}, r"^alpha: must be a number in \[0.0, 1.0\]"),
        ({"outer_lr": 0}, r"^outer_lr: must be a number > 0"),
        ({"outer_precision": "int2"}, r"^outer_precision: must be one of \['fp32', 'bf16', 'int8', 'int4'\]"),
        ({"outer_momentum": 0.0}, r"^nesterov: needs outer_momentum > 0"),
    ],
)
def test_params_errors_name_the_field(params, message):
    from trainers.algorithms.streaming_diloco import StreamingDiLoCoParams

    with pytest.raises(ConfigError, match=message):
        StreamingDiLoCoParams(**params)


def test_diloco_outer_precision_is_checked_and_defaults_to_fp32():
    from trainers.algorithms.diloco import DiLoCoParams

    assert DiLoCoParams().outer_precision == "fp32"
    assert DiLoCoParams(outer_precision="int4").outer_precision == "int4"
    with pytest.raises(ConfigError, match=r"^outer_precision: must be one of"):
        DiLoCoParams(outer_precision="fp8")


@pytest.mark.parametrize("name", ["diloco", "streaming_diloco"])
def test_outer_reduce_is_checked_against_the_precision(name):
    from trainers.algorithms import ALGORITHMS

    Params = ALGORITHMS[name].Params
    assert Params().outer_reduce == "allgather"
    assert Params(outer_precision="int8", outer_reduce="ring").outer_reduce == "ring"
    with pytest.raises(ConfigError, match=r"^outer_reduce: ring is the coded ring of outer_precision bf16"):
        Params(outer_reduce="ring")
    with pytest.raises(ConfigError, match=r"^outer_reduce: must be one of \('allgather', 'ring'\)"):
        Params(outer_precision="int8", outer_reduce="tree")


def test_registered_and_checked_through_the_config():
    from trainers.loading import load_config

    config = load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "streaming_diloco", "params": {"H": 8, "fragments": 4}}})
    assert (config.algorithm.params.H, config.algorithm.params.fragments, config.algorithm.params.alpha) == (8, 4, 0.5)
    with pytest.raises(ConfigError, match=r"^algorithm.params.fragments: must divide H"):
        load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "streaming_diloco", "params": {"H": 8, "fragments": 3}}})
    with pytest.raises(ConfigError, match=r"^algorithm.params.outer_precision: must be one of"):
        load_config({"output_dir": "/tmp/unused", "algorithm": {"name": "diloco", "params": {"outer_precision": "fp64"}}})


@pytest.mark.parametrize(
    "sizes, count, expected",
    [
        ([10] * 8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
        ([2048, 32, 320, 10], 2, [[0], [1, 2, 3]]),       # the digits MLP: never splits a tensor
        ([1, 1, 1, 100], 3, [[0, 1], [2], [3]]),           # each later fragment keeps a tensor
        ([100, 1, 1, 1], 2, [[0], [1, 2, 3]]),
        ([5, 5, 5], 1, [[0, 1, 2]]),
    ],
)
def test_fragments_are_contiguous_runs_of_about_equal_size(sizes, count, expected):
    from trainers.algorithms.streaming_diloco import split_fragments

    assert [list(r) for r in split_fragments(sizes, count)] == expected


def test_more_fragments_than_parameter_tensors_is_refused():
    from trainers.algorithms.streaming_diloco import split_fragments

    with pytest.raises(ConfigError, match=r"^fragments: the model has 4 parameter tensors; got 5"):
        split_fragments([1, 2, 3, 4], 5)


# ---------------------------------------------------------------------------------------------
# A single-process reference of the streaming schedule: WORLD replicas in one process, written
# from the paper's description (its own event list, its own Nesterov), not from the module.


def reference_streaming(H, fragments, overlap, alpha, steps, outer_lr=0.7, momentum=0.9, seed=0, batch_size=32):
    """The global model's and replica 0's parameters (flat) after ``steps`` and the final drain."""
    from trainers.config import DatasetConfig, OptimizerConfig
    from trainers.datasets import BatchSampler, load_dataset, shard_indices
    from trainers.models import build_model
    from trainers.training import loss_fn

    data = load_dataset(DatasetConfig(name="digits"), seed)
    shards = shard_indices(data.train_y, WORLD, "iid", 0.5, seed)
    samplers = [BatchSampler(shards[r], batch_size, seed=seed * 1000 + r) for r in range(WORLD)]
    start = build_model("mlp", DIGITS_MODEL, data.input_shape, data.num_classes, seed)
    replicas = [copy.deepcopy(start) for _ in range(WORLD)]
    cfg = OptimizerConfig()
    inner = [torch.optim.AdamW(m.parameters(), lr=LR, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay) for m in replicas]
    global_params = [p.detach().clone() for p in start.parameters()]
    momentum_buffers = [torch.zeros_like(p) for p in global_params]
    # the MLP's four tensors: fragments of 1 and 2 as split_fragments cuts them (checked above)
    members = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]]}[fragments]
    period = H // fragments
    events = []  # (launch step, apply step, fragment)
    for p in range(fragments):
        for apply_at in range((p + 1) * period, steps + H + 1, H):
            if 1 <= apply_at - overlap <= steps:
                events.append((apply_at - overlap, apply_at, p))
    in_flight = {}

    def apply(p):
        mean_delta = in_flight.pop(p)
        for i, delta in zip(members[p], mean_delta):
            buf = momentum_buffers[i].mul_(momentum).add_(delta)
            global_params[i] -= outer_lr * (delta + momentum * buf)  # Nesterov
            for m in replicas:
                local = list(m.parameters())[i]
                with torch.no_grad():
                    local.copy_(alpha * local + (1 - alpha) * global_params[i])

    for step in range(1, steps + 1):
        for m, opt, sampler in zip(replicas, inner, samplers):
            idx = sampler.next_indices()
            opt.zero_grad()
            loss_fn(m, (data.train_x[idx], data.train_y[idx])).backward()
            opt.step()
        for launch_at, _, p in events:
            if launch_at == step:
                in_flight[p] = [
                    torch.stack([global_params[i] - list(m.parameters())[i].detach() for m in replicas]).mean(dim=0)
                    for i in members[p]
                ]
        for _, apply_at, p in events:
            if apply_at == step:
                apply(p)
    for p in sorted(in_flight):  # finish(): syncs still in flight are applied
        apply(p)
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts])
    return flat(global_params), flat(replicas[0].parameters())


# ---------------------------------------------------------------------------------------------
# Multi-process: 4 gloo ranks, started once for the module.

BYTES_STEPS = 12
RUNS = {
    # (a) reduces to DiLoCo
    "diloco": ["diloco", {"H": 5}, 20],
    "streaming_as_diloco": ["streaming_diloco", {"H": 5, "fragments": 1, "overlap": 0, "alpha": 0.0}, 20],
    # ... with the same data-parallel warm start (6 steps, then rounds of 5; train_on_digits keeps
    # one lr, so warmup_lr is checked in test_diloco_warmup.py, not here)
    "diloco_warm": ["diloco", {"H": 5, "warmup_steps": 6}, 20],
    "streaming_as_diloco_warm": ["streaming_diloco", {"H": 5, "fragments": 1, "overlap": 0, "alpha": 0.0,
                                                      "warmup_steps": 6}, 20],
    "f2_t1_warm": ["streaming_diloco", {"H": 4, "fragments": 2, "overlap": 1, "alpha": 0.5, "warmup_steps": 5}, 13],
    # (b) against the reference; 13 steps leaves a sync in flight for finish()
    "f2_t1": ["streaming_diloco", {"H": 4, "fragments": 2, "overlap": 1, "alpha": 0.5}, 13],
    "f2_t3": ["streaming_diloco", {"H": 4, "fragments": 2, "overlap": 3, "alpha": 0.25}, 13],
    # (c) bytes by precision
    **{f"bytes_{precision}": ["streaming_diloco", {"H": 4, "fragments": 2, "overlap": 1, "outer_precision": precision}, BYTES_STEPS]
       for precision in ("fp32", "bf16", "int8", "int4")},
    "bytes_int8_ring": ["streaming_diloco", {"H": 4, "fragments": 2, "overlap": 1, "outer_precision": "int8",
                                             "outer_reduce": "ring"}, BYTES_STEPS],
    "diloco_int8": ["diloco", {"H": 5, "outer_precision": "int8"}, 20],
    "diloco_int4": ["diloco", {"H": 5, "outer_precision": "int4"}, 20],
    "diloco_int8_ring": ["diloco", {"H": 5, "outer_precision": "int8", "outer_reduce": "ring"}, 20],
    # learning at all
    "learn": ["streaming_diloco", {"H": 10, "fragments": 2, "overlap": 2, "outer_precision": "int4"}, 100],
}


def streaming_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    comm = _start_rank(rank, world_size, port)
    results = {}
    for label, (name, params, steps) in RUNS.items():
        held = []
        result = train_on_digits(comm, name, params, steps, LR, before_steps=held.append)
        algorithm = held[0]
        result["global"] = torch.cat([p.detach().reshape(-1) for p in algorithm.global_model.parameters()]).tolist()
        result["syncs_applied"] = algorithm.syncs_applied
        if name == "streaming_diloco":
            result["fragment_numel"] = [sum(p.numel() for p in algorithm.fragment_params(algorithm.model, f))
                                        for f in range(params["fragments"])]
        results[label] = result
    comm.shutdown()
    Path(out_dir, f"streaming{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def four_ranks(spawn_ranks_module, tmp_path_factory):
    directory = tmp_path_factory.mktemp("streaming")
    exits = spawn_ranks_module(streaming_worker, WORLD, str(directory), timeout_s=300.0)
    assert exits == [0] * WORLD
    results = [json.loads((directory / f"streaming{rank}.json").read_text()) for rank in range(WORLD)]
    print(json.dumps({label: {"accuracy": round(r["accuracy"], 3), "bytes_sent": sum(r["bytes_sent"])}
                      for label, r in results[0].items()}, indent=1))
    return results


def assert_same_run(four_ranks, diloco_label: str, streaming_label: str, syncs: int) -> None:
    """On every rank the two runs end with the same replica and global model (to 1e-6), applied
    ``syncs`` syncs each and sent the same bytes at every step."""
    for rank in range(WORLD):
        diloco, streaming = four_ranks[rank][diloco_label], four_ranks[rank][streaming_label]
        for key in ("params", "global"):
            difference = (torch.tensor(diloco[key]) - torch.tensor(streaming[key])).abs().max().item()
            assert difference <= 1e-6, (rank, key, difference)
        assert streaming["syncs_applied"] == diloco["syncs_applied"] == syncs
        assert streaming["bytes_sent"] == diloco["bytes_sent"]


@pytest.mark.slow
def test_one_fragment_no_overlap_no_merge_is_diloco(four_ranks):
    assert_same_run(four_ranks, "diloco", "streaming_as_diloco", 4)
    # and the run moved: the global model is not where it started
    assert four_ranks[0]["diloco"]["global"] != four_ranks[0]["f2_t1"]["global"]


@pytest.mark.slow
def test_the_warm_start_is_diloco_s_and_the_fragments_count_from_its_end(four_ranks):
    # 6 warm-up steps (a gradient average each), then outer steps after steps 10 and 15
    assert_same_run(four_ranks, "diloco_warm", "streaming_as_diloco_warm", 6 + 2)
    for rank in range(WORLD):
        assert four_ranks[rank]["diloco_warm"]["global"] != four_ranks[rank]["diloco"]["global"]
    # H 4, F 2, tau 1 after a 5-step warm-up: fragments applied after inner steps 2, 4, 6, 8 (steps
    # 6, 8, 10, 12); before any of them every rank holds the same replica, after them only theta_g agrees
    warm = [four_ranks[rank]["f2_t1_warm"] for rank in range(WORLD)]
    assert [r["syncs_applied"] for r in warm] == [5 + 4] * WORLD
    # bytes cross in the 5 warm-up steps (0-4) and at each launch, one step before its application:
    # inner steps 1, 3, 5, 7 = steps 5, 7, 9, 11
    assert [b > 0 for b in warm[0]["bytes_sent"]] == [True] * 5 + [True, False] * 4
    assert all(r["global"] == warm[0]["global"] for r in warm)
    assert warm[1]["params"] != warm[0]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("label", ["f2_t1", "f2_t3"])
def test_streaming_schedule_matches_the_single_process_reference(four_ranks, label):
    _, params, steps = RUNS[label]
    expected_global, expected_replica0 = reference_streaming(params["H"], params["fragments"], params["overlap"],
                                                             params["alpha"], steps)
    for rank in range(WORLD):
        assert four_ranks[rank][label]["global"] == four_ranks[0][label]["global"]
    ours = four_ranks[0][label]
    global_gap = (torch.tensor(ours["global"]) - expected_global).abs().max().item()
    replica_gap = (torch.tensor(ours["params"]) - expected_replica0).abs().max().item()
    print(label, "max |4 ranks - reference|: global", global_gap, "replica 0", replica_gap)
    assert global_gap <= 1e-5 and replica_gap <= 1e-5
    # the merge kept part of each replica's own steps: replicas differ, the global models do not
    assert four_ranks[1][label]["params"] != ours["params"]


@pytest.mark.slow
def test_each_fragment_crosses_once_per_H_steps_sized_by_the_precision(four_ranks):
    n = WORLD
    results = four_ranks[0]
    d0, d1 = results["bytes_fp32"]["fragment_numel"]
    assert d0 + d1 == results["bytes_fp32"]["numel"]
    # H 4, F 2, overlap 1: fragment 0 launched after steps 1, 5, 9 (applied 2, 6, 10), fragment 1
    # after 3, 7, 11 (applied 4, 8, 12); nothing crosses on the other steps
    launches = {0: d0, 2: d1, 4: d0, 6: d1, 8: d0, 10: d1}
    sizes = {
        "fp32": lambda d: 2 * (n - 1) * 4 * d // n,                       # gloo all-reduce of float32
        "bf16": lambda d: (n - 1) * 2 * d,                                # all-gathered payloads
        "int8": lambda d: (n - 1) * (4 * math.ceil(d / 512) + d),
        "int4": lambda d: (n - 1) * (4 * math.ceil(d / 512) + math.ceil(d / 2)),
    }
    for precision, size in sizes.items():
        sent = results[f"bytes_{precision}"]["bytes_sent"]
        assert sent == [size(launches[i]) if i in launches else 0 for i in range(BYTES_STEPS)], precision
    total = {p: sum(results[f"bytes_{p}"]["bytes_sent"]) for p in sizes}
    # on 4 ranks an all-gather of (n-1) payloads against a ring's 2 (n-1)/n float32: 2x, 4x
    assert total["fp32"] / total["int8"] == pytest.approx(2.0, rel=0.02)
    assert total["fp32"] / total["int4"] == pytest.approx(4.0, rel=0.03)
    # DiLoCo's outer_precision: one all-gathered int8 / int4 pseudo-gradient every H steps
    d = results["diloco"]["numel"]
    assert results["diloco_int8"]["bytes_sent"] == ([0] * 4 + [(n - 1) * (4 * math.ceil(d / 512) + d)]) * 4
    assert results["diloco_int4"]["bytes_sent"] == ([0] * 4 + [(n - 1) * (4 * math.ceil(d / 512) + math.ceil(d / 2))]) * 4
    # outer_reduce ring: the coded ring, 2 (n-1) chunk payloads a rank (half the all-gather's at n = 4)
    from trainers.comm.allreduce import ring_coded_bytes
    from trainers.compression import build_compressor
    ring = ring_coded_bytes(0, n, torch.empty(d), build_compressor("int8"))[0]
    assert results["diloco_int8_ring"]["bytes_sent"] == ([0] * 4 + [ring]) * 4
    # Streaming DiLoCo's fragments over the coded ring: each launch the ring's bytes at the fragment's size
    def ring_of(numel):
        return ring_coded_bytes(0, n, torch.empty(numel), build_compressor("int8"))[0]
    assert results["bytes_int8_ring"]["bytes_sent"] == [ring_of(launches[i]) if i in launches else 0
                                                       for i in range(BYTES_STEPS)]
    assert ring / ((n - 1) * (4 * math.ceil(d / 512) + d)) == pytest.approx(2 * (n - 1) / n / (n - 1), rel=0.01)


@pytest.mark.slow
def test_low_precision_outer_gradients_stay_close_to_fp32_and_agree_on_every_rank(four_ranks):
    fp32 = torch.tensor(four_ranks[0]["diloco"]["global"])
    moved = (fp32 - torch.tensor(four_ranks[0]["streaming_as_diloco"]["global"])).abs().max().item()
    assert moved <= 1e-6
    for label in ("diloco_int8", "diloco_int4", "diloco_int8_ring", "bytes_int8", "bytes_int4", "bytes_bf16",
                  "bytes_int8_ring"):
        for rank in range(1, WORLD):
            assert four_ranks[rank][label]["global"] == four_ranks[0][label]["global"], (label, rank)
    gap8 = (torch.tensor(four_ranks[0]["diloco_int8"]["global"]) - fp32).abs().max().item()
    gap4 = (torch.tensor(four_ranks[0]["diloco_int4"]["global"]) - fp32).abs().max().item()
    assert 0 < gap8 < gap4, (gap8, gap4)
    # the coded ring rounds each partial sum on the way (n-1 times): further from fp32 than the
    # all-gather's one rounding, nearer than int4's coarser code
    gap8_ring = (torch.tensor(four_ranks[0]["diloco_int8_ring"]["global"]) - fp32).abs().max().item()
    assert gap8 <= gap8_ring < gap4, (gap8, gap8_ring, gap4)
    # the same for Streaming DiLoCo's fragments: the coded ring stays nearer its fp32 run than int4's all-gather
    streaming_fp32 = torch.tensor(four_ranks[0]["bytes_fp32"]["global"])
    gaps = {label: (torch.tensor(four_ranks[0][label]["global"]) - streaming_fp32).abs().max().item()
            for label in ("bytes_int8", "bytes_int8_ring", "bytes_int4")}
    assert 0 < gaps["bytes_int8_ring"] < gaps["bytes_int4"], gaps


@pytest.mark.slow
def test_streaming_with_int4_outer_gradients_learns_digits(four_ranks):
    # 100 steps, H 10, F 2, overlap 2, int4; the held-out accuracy of the global model. Measured
    # 0.900 (seed 0, torch 2.x CPU; diloco at H 5 has 0.602 after only 20 steps); wide margin.
    assert four_ranks[0]["learn"]["accuracy"] >= 0.80, four_ranks[0]["learn"]["accuracy"]


# ---------------------------------------------------------------------------------------------
# The simulator: the same code on a virtual clock, the overlap hiding the exchange


def sim_blocked_s(tmp_path, name, overlap, compute_s=0.05, latency_s=0.05):
    """Mean comm_blocked_s per sync (over ranks) of a 16-step run with H 8, F 2 on 4 sim ranks."""
    from tests.trainers.test_sim import network
    from trainers.loading import load_config
    from trainers.sim import ComputeModel, run_simulated

    changes = {"steps": 16, "eval_every": 16, "lr": LR, "output_dir": str(tmp_path / name),
               "algorithm": {"name": "streaming_diloco", "params": {"H": 8, "fragments": 2, "overlap": overlap}}}
    run_simulated(load_config(merge(BASE_CONFIG, changes)), WORLD, network(WORLD, latency_s), ComputeModel(compute_s))
    blocked = [sum(r["comm_blocked_s"] for r in records(tmp_path / name, rank, "step")) for rank in range(WORLD)]
    syncs = sum(r["syncs_applied"] for r in records(tmp_path / name, 0, "step"))
    return sum(blocked) / WORLD / syncs, syncs


def test_overlap_hides_the_exchange_on_the_simulator(tmp_path):
    # each sync's exchange takes at least a round trip (0.1 s) on this link; 3 steps of 0.05 s
    # of compute run while it is in flight
    blocking, syncs_blocking = sim_blocked_s(tmp_path, "overlap0", 0)
    overlapped, syncs_overlapped = sim_blocked_s(tmp_path, "overlap3", 3)
    assert syncs_blocking == syncs_overlapped == 4  # each fragment twice in 16 steps
    print("blocked per sync: overlap 0", blocking, "overlap 3", overlapped)
    assert blocking >= 0.09, blocking
    assert overlapped < 0.25 * blocking, (overlapped, blocking)
