"""A calibration point held in CI: the same small scenario on tun and on sim agree (issue 13 §2).

The full table (six algorithms, 4 and 8 nodes) is bench/bench_sim_calibration.py's, in
docs/RESULTS.md section 10. Here, with the bench's scenario and compute model: sync and SwarmSGD
on aws-4region, 4 nodes, 40 steps; the sim half charges the compute tun's own records measured.
Tolerance 25% on steps/s (the bench's worst for these two algorithms: 10.5%), 5% on bytes.

SwarmSGD here is the configuration that calibration measured: the round-based exchange without
quantization (`interaction: rounds, quantize: none`). The paper's asynchronous interaction (the
default since issue 23) is not calibrated yet: on this 40-step point it ran 1.40x faster on sim
than on tun with qsgd (the simulator charges no CPU for encoding and decoding the model, nor for
the responder's work beside the ranks on 2 cores), and without quantization within 25 % in
steps/s but one model exchange per node apart in bytes (a 40-step window holds 2-3 exchanges at
these round trips): 2026-11-26, see docs/RESULTS.md section 3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from harness import run as run_module
from harness.scenario import load_scenario
from tests.harness.test_sim_harness import _quiet

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from bench_sim_calibration import SCENARIO, compute_model  # noqa: E402  (the bench's own scenario and model)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ALGORITHMS = """
  - {name: sync}
  - {name: swarmsgd, params: {H: 4, interaction: rounds, quantize: none}}
"""


def test_sim_agrees_with_tun_on_a_small_scenario(tmp_path, test_prefix):
    common = dict(name="calibration-point", nodes=4, per_region=1, steps=40, target=0.8, seed=0,
                  topology=REPO / "topologies" / "aws-4region.yaml", algorithms=ALGORITHMS)
    tun_file = tmp_path / "tun.yaml"
    tun_file.write_text(SCENARIO.format(backend="tun", sim="", **common))
    tun = run_module.run_scenario(load_scenario(tun_file), "tun", tmp_path / "runs", console=_quiet())
    model = compute_model(tun.run_dir)
    sim_file = tmp_path / "sim.yaml"
    sim_file.write_text(SCENARIO.format(backend="sim", **common,
                                        sim=f"sim: {{compute_s: {model['compute_s']}, overhead_s: {model['overhead_s']}}}"))
    sim = run_module.run_scenario(load_scenario(sim_file), "sim", tmp_path / "runs", console=_quiet())
    a, b = tun.summary.set_index("label"), sim.summary.set_index("label")
    for label in ("sync", "swarmsgd"):
        assert a.loc[label, "status"] == b.loc[label, "status"] == "ok"
        ratio = b.loc[label, "steps_per_s"] / a.loc[label, "steps_per_s"]
        assert 0.75 < ratio < 1.25, f"{label}: sim {b.loc[label, 'steps_per_s']:.3f} steps/s, tun {a.loc[label, 'steps_per_s']:.3f}"
        assert b.loc[label, "bytes_per_step_per_node"] == pytest.approx(a.loc[label, "bytes_per_step_per_node"], rel=0.05)
