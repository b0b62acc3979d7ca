"""`hierarchical_diloco`: against `diloco` with one region, against a single-process reference with
2 regions x 2 ranks on 4 gloo ranks (loopback), where its bytes go, its Params, the harness's
region_sizes, and a run on the simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import BASE_CONFIG, merge, records
from tests.trainers.test_quantized import _start_rank, train_on_digits
from tests.trainers.test_sparseloco import Replicas
from trainers.config import ConfigError

WORLD = 4
STEPS = 12
LR = 0.01
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}
TWO_REGIONS = {"H_inner": 2, "H_outer": 6, "region_sizes": [2, 2], **OUTER}
RUNS = {
    "diloco": ["diloco", {"H": 6, **OUTER}],
    "one_region": ["hierarchical_diloco", {"H_inner": 6, "H_outer": 6, **OUTER}],
    "two_regions": ["hierarchical_diloco", TWO_REGIONS],
}


def hierarchical_worker(rank: int, world_size: int, port: int, out_dir: str, runs: dict) -> None:
    """Train each run; record per step every point-to-point send as (destination, bytes)."""
    comm = _start_rank(rank, world_size, port)
    sends: list = []
    original_isend = comm.isend

    def logged_isend(tensor, dst):
        sends.append([dst, tensor.numel() * tensor.element_size()])
        return original_isend(tensor, dst)

    comm.isend = logged_isend
    results = {}
    for label, (name, params) in runs.items():
        per_step: list = []

        def after_step(step, algorithm):
            per_step.append(list(sends))
            sends.clear()

        results[label] = train_on_digits(comm, name, params, STEPS, LR, after_step=after_step)
        results[label]["sends"] = per_step
    comm.shutdown()
    Path(out_dir, f"runs{rank}.json").write_text(json.dumps(results))


def reference_two_regions(params: dict, steps: int, lr: float) -> torch.Tensor:
    """theta_g after ``steps`` of hierarchical DiLoCo, 2 regions x 2 ranks, in one process."""
    torch.set_num_threads(1)
    replicas = Replicas(WORLD, lr)
    outer = torch.optim.SGD(replicas.global_model.parameters(), lr=params["outer_lr"],
                            momentum=params["outer_momentum"], nesterov=params["nesterov"])
    regions = [[0, 1], [2, 3]]
    for step in range(1, steps + 1):
        replicas.inner_step()
        if step % params["H_outer"] == 0:
            theta = replicas.flat(replicas.global_model)
            sums = []
            for region in regions:
                deltas = [theta - replicas.flat(replicas.models[r]) for r in region]
                sums.append(deltas[0] + deltas[1])
            replicas.outer_step(outer, (sums[0] + sums[1]) / WORLD)
        elif step % params["H_inner"] == 0:
            for region in regions:
                mean = (replicas.flat(replicas.models[region[0]]) + replicas.flat(replicas.models[region[1]])) / 2
                for r in region:
                    replicas.set_flat(replicas.models[r], mean)
    return replicas.flat(replicas.global_model)


# ---------------------------------------------------------------------------------------------
# Params (no ranks)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"H_inner": 0}, r"^H_inner: must be an integer >= 1"),
        ({"H_inner": 4, "H_outer": 6}, r"^H_outer: must be a multiple of H_inner \(4\), got 6"),
        ({"region_sizes": []}, r"^region_sizes: expected a non-empty list"),
        ({"region_sizes": [2, 0]}, r"^region_sizes: expected integers >= 1"),
        ({"outer_lr": -1.0}, r"^outer_lr: must be a number > 0"),
        ({"outer_momentum": 0.0}, r"^nesterov: needs outer_momentum > 0"),
    ],
)
def test_params_errors_name_the_field(changes, message):
    from trainers.algorithms.hierarchical_diloco import HierarchicalDiLoCoParams

    with pytest.raises(ConfigError, match=message):
        HierarchicalDiLoCoParams(**changes)


def test_region_sizes_must_sum_to_the_world_size():
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.hierarchical_diloco import HierarchicalDiLoCo, HierarchicalDiLoCoParams
    from trainers.config import OptimizerConfig

    class FourRanks:
        rank, world_size = 1, 4

    ctx = AlgorithmContext(model=torch.nn.Linear(2, 2), comm=FourRanks(), loss_fn=None, optimizer=OptimizerConfig(),
                           lr=0.1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^region_sizes: \[2, 1\] sums to 3 ranks, the job has 4"):
        HierarchicalDiLoCo(HierarchicalDiLoCoParams(region_sizes=[2, 1]), ctx)
    algorithm = HierarchicalDiLoCo(HierarchicalDiLoCoParams(region_sizes=[1, 3]), ctx)
    assert (algorithm.leaders, algorithm.region, algorithm.members) == ([0, 1], 1, [1, 2, 3])


def test_the_harness_fills_region_sizes_from_the_nodes_per_region(write_yaml):
    from harness.scenario import load_scenario

    scenario = load_scenario(write_yaml(
        "name: hier\ntopology: aws-4region.yaml\nbackend: sim\nnodes: {london: 2, tokyo: 2, oregon: 1, ohio: 2}\n"
        "workload: {model: {name: mlp}, dataset: {name: digits}}\nstop: {steps: 4}\n"
        "algorithms:\n  - {name: hierarchical_diloco, params: {H_inner: 2, H_outer: 4}}\n"
        "  - {name: hierarchical_diloco, label: own, params: {H_inner: 2, H_outer: 4, region_sizes: [7]}}\n", "hier.yaml"))
    sizes = {job.label: job.trainer_config["algorithm"]["params"]["region_sizes"] for job in scenario.jobs}
    assert sizes == {"hierarchical_diloco": [2, 2, 1, 2], "own": [7]}


# ---------------------------------------------------------------------------------------------
# 4 gloo ranks


@pytest.fixture(scope="module")
def four_ranks(spawn_ranks_module, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hierarchical")
    exits = spawn_ranks_module(hierarchical_worker, WORLD, str(directory), RUNS, timeout_s=240.0)
    assert exits == [0] * WORLD
    return [json.loads((directory / f"runs{rank}.json").read_text()) for rank in range(WORLD)]


def test_every_rank_holds_the_same_global_model(four_ranks):
    for label in RUNS:
        assert all(four_ranks[r][label]["params"] == four_ranks[0][label]["params"] for r in range(WORLD)), label


def test_one_region_with_equal_periods_equals_diloco(four_ranks):
    diloco = torch.tensor(four_ranks[0]["diloco"]["params"])
    one = torch.tensor(four_ranks[0]["one_region"]["params"])
    two = torch.tensor(four_ranks[0]["two_regions"]["params"])
    assert (two - diloco).abs().max() > 1e-4  # region averaging changes the result
    assert torch.allclose(one, diloco, atol=1e-5, rtol=0)


def test_two_regions_match_the_single_process_reference(four_ranks):
    reference = reference_two_regions(TWO_REGIONS, STEPS, LR)
    assert torch.allclose(torch.tensor(four_ranks[0]["two_regions"]["params"]), reference, atol=1e-5, rtol=0)


def test_cross_region_bytes_only_at_outer_steps_and_only_between_leaders(four_ranks):
    """Regions {0, 1} and {2, 3}, leaders 0 and 2. Inner averages (steps 2, 4, 8, 10): members send
    their replica to the leader, the leader the mean back, inside the region. Outer steps (6, 12):
    the same inside the region, plus one message from each leader to the other."""
    numel = four_ranks[0]["two_regions"]["numel"]
    whole = 4 * numel
    region = {0: 0, 1: 0, 2: 1, 3: 1}
    for rank in range(WORLD):
        for step, sends in enumerate(four_ranks[rank]["two_regions"]["sends"], start=1):
            cross = [s for s in sends if region[s[0]] != region[rank]]
            inside = [s for s in sends if region[s[0]] == region[rank]]
            if step % 6 == 0:
                assert cross == ([[2 - rank, whole]] if rank in (0, 2) else []), (rank, step)
            else:
                assert cross == [], (rank, step)
            if step % 2 == 0:
                partner = rank + 1 if rank in (0, 2) else rank - 1
                assert inside == [[partner, whole]], (rank, step)
            else:
                assert inside == [], (rank, step)
    # comm counters agree: per step, bytes sent are exactly the logged sends
    for rank in range(WORLD):
        result = four_ranks[rank]["two_regions"]
        assert result["bytes_sent"] == [sum(b for _, b in sends) for sends in result["sends"]]


# ---------------------------------------------------------------------------------------------
# The simulator


def test_runs_on_the_simulator_with_two_regions(tmp_path):
    from tests.trainers.test_sim import network
    from trainers.loading import load_config
    from trainers.sim import ComputeModel, run_simulated

    changes = {"steps": 12, "eval_every": 6, "lr": 0.01,
               "algorithm": {"name": "hierarchical_diloco", "params": {"H_inner": 2, "H_outer": 6, "region_sizes": [2, 2]}}}
    config = load_config(merge(BASE_CONFIG, {**changes, "output_dir": str(tmp_path)}))
    run_simulated(config, 4, network(4, 0.02, 125e6), ComputeModel(0.005, 0.001))
    for rank in range(4):
        steps = records(tmp_path, rank, "step")
        assert [r["syncs_applied"] for r in steps] == [0, 1] * 6
        assert all(math.isfinite(r["loss"]) for r in steps)
