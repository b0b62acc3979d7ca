"""bench_sim_calibration's steady-state steps/s: each rank's steps after its first STEADY_FROM,
median over ranks (tun's ranks start apart; the whole-run figure counts a lone rank's head start)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from bench_sim_calibration import STEADY_FROM, steady_steps_per_s  # noqa: E402


def write_steps(path: Path, times: list[float]) -> None:
    path.write_text("".join(json.dumps({"kind": "step", "step": i, "time_s": t}) + "\n" for i, t in enumerate(times)))


def test_steady_rate_leaves_out_a_ranks_head_start(tmp_path):
    # rank 0 runs alone at 10 ms a step for its first 15 steps, then at 0.7 s like the others
    head = [0.01 * i for i in range(15)]
    write_steps(tmp_path / "rank0.jsonl", head + [head[-1] + 0.7 * (i + 1) for i in range(45)])
    for rank in (1, 2):
        write_steps(tmp_path / f"rank{rank}.jsonl", [1.0 + 1.05 * i for i in range(60)])
    rank0 = (59 - STEADY_FROM) / ((head[-1] + 0.7 * 45) - head[STEADY_FROM])
    assert steady_steps_per_s(tmp_path) == pytest.approx(1 / 1.05)  # the median of (rank0, 1/1.05, 1/1.05)
    assert rank0 > 1 / 1.05  # rank 0's own figure still carries 5 head-start steps past STEADY_FROM


def test_steady_rate_needs_steps_past_the_warm_up(tmp_path):
    write_steps(tmp_path / "rank0.jsonl", [0.1 * i for i in range(STEADY_FROM + 1)])
    assert steady_steps_per_s(tmp_path) is None
