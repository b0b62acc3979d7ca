"""A calibration point held in CI: the same small scenario on tun and on sim agree (issue 13 §2).

The full table (six algorithms, 4 and 8 nodes) is bench/bench_sim_calibration.py's, in
docs/RESULTS.md section 10. Here: sync and SwarmSGD on aws-4region, 4 nodes, 40 steps; the sim
half charges the compute tun's own records measured (mean forward + backward and rest of a step),
as the bench does. Tolerance 25%: the bench's worst for these two algorithms was 16.4%.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path

import pytest

from harness import run as run_module
from harness.scenario import load_scenario
from tests.harness.test_sim_harness import _quiet
from trainers.records import read_complete_records

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIO = textwrap.dedent("""
    name: calibration-point
    topology: {topology}
    backend: {backend}
    workload:
      model: {{name: mlp, params: {{hidden_sizes: [64]}}}}
      dataset: {{name: digits}}
      batch_size: 32
      lr: 0.1
      optimizer: {{name: sgd, momentum: 0.9}}
      eval_every: 10
    stop: {{steps: 40}}
    algorithms: [{{name: sync}}, {{name: swarmsgd, params: {{H: 4}}}}]
    verify: {{enabled: false}}
    {sim}
""")


def compute_model(run_dir) -> tuple[float, float]:
    forward_backward, rest = [], []
    for path in run_dir.glob("jobs/*/rank*.jsonl"):
        for record in [r for r in read_complete_records(path) if r.get("kind") == "step"][2:]:
            forward_backward.append(record["compute_unpadded_s"])
            rest.append(max(0.0, record["compute_s"] - record["compute_unpadded_s"]))
    return statistics.fmean(forward_backward), statistics.fmean(rest)


def test_sim_agrees_with_tun_on_a_small_scenario(tmp_path, test_prefix):
    topology = Path(__file__).resolve().parents[2] / "topologies" / "aws-4region.yaml"
    tun_file = tmp_path / "tun.yaml"
    tun_file.write_text(SCENARIO.format(topology=topology, backend="tun", sim=""))
    tun = run_module.run_scenario(load_scenario(tun_file), "tun", tmp_path / "runs", console=_quiet())
    compute_s, overhead_s = compute_model(tun.run_dir)
    sim_file = tmp_path / "sim.yaml"
    sim_file.write_text(SCENARIO.format(topology=topology, backend="sim",
                                        sim=f"sim: {{compute_s: {compute_s}, overhead_s: {overhead_s}}}"))
    sim = run_module.run_scenario(load_scenario(sim_file), "sim", tmp_path / "runs", console=_quiet())
    a, b = tun.summary.set_index("label"), sim.summary.set_index("label")
    for label in ("sync", "swarmsgd"):
        assert a.loc[label, "status"] == b.loc[label, "status"] == "ok"
        ratio = b.loc[label, "steps_per_s"] / a.loc[label, "steps_per_s"]
        assert 0.75 < ratio < 1.25, f"{label}: sim {b.loc[label, 'steps_per_s']:.3f} steps/s, tun {a.loc[label, 'steps_per_s']:.3f}"
        assert b.loc[label, "bytes_per_step_per_node"] == pytest.approx(a.loc[label, "bytes_per_step_per_node"], rel=0.05)
