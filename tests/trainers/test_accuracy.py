"""Every algorithm learns: 4 ranks, MLP on sklearn digits, held-out accuracy of the deployable model.

Measured (seed 3, this config, evaluating every 25 steps): accuracy first >= 0.88 at step 75
(local_sgd) or 100 (sync, ddp, dts, diloco); at step 150 all were 0.92-0.94. The test asks for
0.88 within 150 steps, and stops each run as soon as it is reached (target_accuracy).
"""

import pytest

from tests.trainers.conftest import records, run_sessions

pytestmark = pytest.mark.slow

TARGET_ACCURACY = 0.88
MAX_STEPS = 150
COMMON = {
    "steps": MAX_STEPS,
    "eval_every": 25,
    "batch_size": 16,
    "lr": 0.05,
    "optimizer": {"momentum": 0.9},
    "target_accuracy": TARGET_ACCURACY,
    "model": {"name": "mlp", "params": {"hidden_sizes": [64]}},
    "dataset": {"name": "digits", "shard": "iid"},
}
RUNS = {
    "sync": {**COMMON, "algorithm": {"name": "sync"}},
    "ddp": {**COMMON, "algorithm": {"name": "ddp"}},
    "local_sgd": {**COMMON, "algorithm": {"name": "local_sgd", "params": {"H": 8, "warmup_steps": 10}}},
    "dts": {**COMMON, "algorithm": {"name": "dts", "params": {"p": 4, "t": 2}}},
    # DiLoCo's inner optimizer is AdamW: a smaller inner learning rate.
    "diloco": {**COMMON, "lr": 0.003, "algorithm": {"name": "diloco", "params": {"H": 10}}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_ranks_module):
    return run_sessions(spawn_ranks_module, tmp_path_factory.mktemp("accuracy"), 4, RUNS, timeout_s=200)


@pytest.mark.parametrize("name", list(RUNS))
def test_reaches_target_accuracy_on_digits(runs, name):
    evals = records(runs[name], 0, "eval")
    best = max(r["accuracy"] for r in evals)
    assert best >= TARGET_ACCURACY, f"{name}: best held-out accuracy {best:.3f} in {MAX_STEPS} steps"
    for rank in range(4):
        status = records(runs[name], rank, "status")[-1]
        assert status["status"] == "ok" and status["stop_reason"] == "target_accuracy"
        # Every rank stopped at the same step (rank 0's decision is broadcast).
        assert status["steps"] == evals[-1]["step"] + 1


def test_communication_volume_matches_each_algorithm(runs):
    """Bytes per step follow from the algorithm: every step (sync, ddp), every H steps (local_sgd)."""
    n_params = 64 * 64 + 64 + 64 * 10 + 10
    ring_bytes = 2 * 3 * n_params * 4 // 4  # 2(n-1)/n of the float32 gradient, n = 4
    for name in ("sync", "ddp"):
        assert {r["bytes_sent"] for r in records(runs[name], 1, "step")} == {ring_bytes}
    local = records(runs["local_sgd"], 1, "step")
    assert all(r["bytes_sent"] == ring_bytes for r in local[:10])  # warm-up: synchronous
    after = [r["bytes_sent"] for r in local[10:]]
    assert after[7::8] == [ring_bytes] * len(after[7::8]) and sum(after) == ring_bytes * len(after[7::8])
    diloco = [r["bytes_sent"] for r in records(runs["diloco"], 1, "step")]
    assert sum(b > 0 for b in diloco) == len(diloco) // 10
