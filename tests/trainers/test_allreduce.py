"""Comm.allreduce_async: every algorithm equals gloo's all_reduce, is bitwise equal on every rank,
accounts the bytes it sends, and progresses in the background while the caller computes."""

import json

import pytest
import torch

from tests.trainers.workers import allreduce_worker, overlap_worker
from trainers.comm import DIRECT_MAX_BYTES, allreduce_bytes


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_equals_gloo_and_is_bitwise_equal_on_every_rank(spawn_ranks, tmp_path, world_size):
    assert spawn_ranks(allreduce_worker, world_size, str(tmp_path), timeout_s=120) == [0] * world_size
    outputs = [json.loads((tmp_path / f"allreduce{rank}.json").read_text()) for rank in range(world_size)]
    rows = [output["rows"] for output in outputs]
    assert len(rows[0]) == 5 * 4 * 4
    for index, row in enumerate(rows[0]):
        case = f"{row['algorithm']} {row['op']} numel={row['numel']} world={world_size}"
        # float32 sums of world_size terms in another order: a few ulps of the largest term
        assert row["max_error"] <= 1e-6 * max(1.0, row["scale"]) * world_size, case
        if row["op"] in ("max", "min"):
            assert row["max_error"] == 0.0, case
        assert row["same_tensor"], case
        assert len({r[index]["digest"] for r in rows}) == 1, f"{case}: ranks differ bitwise"
        for rank in range(world_size):
            expected = allreduce_bytes(
                row["algorithm"] if row["algorithm"] != "auto" else
                ("direct" if (world_size - 1) * row["numel"] * 4 <= DIRECT_MAX_BYTES else "ring"),
                rank, world_size, torch.empty(row["numel"]))
            assert (rows[rank][index]["sent"], rows[rank][index]["recv"]) == expected, case
    assert outputs[0]["in_flight"] == [sum(range(world_size)) + k * world_size for k in range(3)]


def test_bytes_per_algorithm_follow_the_textbook_counts():
    flat = torch.empty(1200)  # 4800 bytes, divisible by 2, 3 and 4
    whole = 4800
    for n in (2, 3, 4, 5):
        for rank in range(n):
            assert allreduce_bytes("ring", rank, n, flat) == (2 * (n - 1) * whole // n,) * 2
            assert allreduce_bytes("direct", rank, n, flat) == ((n - 1) * whole,) * 2
    assert [allreduce_bytes("recursive_doubling", r, 4, flat)[0] for r in range(4)] == [2 * whole] * 4
    # 3 ranks: rank 2 folds into rank 0 and gets the result back; ranks 0 and 1 do one round.
    assert [allreduce_bytes("recursive_doubling", r, 3, flat)[0] for r in range(3)] == [2 * whole, whole, whole]


def test_unknown_algorithm_and_op_fail_at_once_and_one_rank_is_a_no_op():
    from trainers.comm import Comm

    world_of_one = type("WorldOfOne", (Comm,), {name: None for name in Comm.__abstractmethods__})
    with pytest.raises(ValueError, match="allreduce: 'fastest'"):
        world_of_one(0, 1, allreduce="fastest")
    comm = world_of_one(0, 1, allreduce="auto")
    x = torch.arange(3.0)
    with pytest.raises(ValueError, match="algorithm: 'fastest'"):
        comm.allreduce_async(x, algorithm="fastest")
    with pytest.raises(ValueError, match="op: 'prod'"):
        comm.allreduce_async(x, op="prod")
    assert comm.allreduce_async(x, op="avg").wait() is x and x.tolist() == [0.0, 1.0, 2.0]
    assert comm.transport == "ours:auto"


@pytest.mark.slow
def test_background_allreduce_overlaps_compute(spawn_ranks, tmp_path):
    """4 ranks, 100 ms added to every background message: launch, compute 1 s, then wait is
    (nearly) never blocked; launch-and-wait is blocked for the algorithm's rounds of delay."""
    one_way_delay_s, compute_s = 0.1, 1.0
    assert spawn_ranks(overlap_worker, 4, str(tmp_path), one_way_delay_s, compute_s, timeout_s=120) == [0] * 4
    for rank in range(4):
        results = json.loads((tmp_path / f"overlap{rank}.json").read_text())
        for algorithm, rounds in (("ring", 6), ("direct", 1), ("recursive_doubling", 2)):
            at_once, overlapped = results[f"{algorithm}/wait_at_once"], results[f"{algorithm}/compute_then_wait"]
            assert at_once["correct"] and overlapped["correct"]
            assert at_once["blocked_s"] >= rounds * one_way_delay_s * 0.9, (rank, algorithm, at_once)
            # had it progressed only inside wait(), the wait would take the same rounds of delay
            assert overlapped["blocked_s"] < 0.5 * rounds * one_way_delay_s, (rank, algorithm, overlapped)
            assert overlapped["wall_s"] >= compute_s
