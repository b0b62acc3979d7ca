"""bench_sim_calibration's compute model: a padded job's pad is not per-step overhead (issue 21)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from bench_sim_calibration import compute_model  # noqa: E402


def _job(root: Path, name: str, min_compute_s, steps: list[tuple[float, float]]) -> None:
    job = root / "jobs" / name
    job.mkdir(parents=True)
    (job / "config.json").write_text(json.dumps({"min_compute_s": min_compute_s}))
    lines = [json.dumps({"kind": "step", "step": i, "compute_s": c, "compute_unpadded_s": u})
             for i, (c, u) in enumerate([(0.5, 0.5), (0.5, 0.5)] + steps)]  # two warm-up steps, left out
    (job / "rank0.jsonl").write_text("\n".join(lines) + "\n")


def test_padding_is_not_counted_as_overhead(tmp_path):
    _job(tmp_path, "plain", None, [(0.004, 0.002)] * 4)        # 2 ms of overhead a step
    _job(tmp_path, "padded", 0.1, [(0.1015, 0.002)] * 4)       # padded to 0.1 s, then 1.5 ms of overhead
    model = compute_model(tmp_path)
    assert abs(model["compute_s"] - 0.002) < 1e-12
    assert abs(model["overhead_s"] - 0.00175) < 1e-9            # not (0.002 + 0.0995) / 2
