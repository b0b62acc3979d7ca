"""Every algorithm learns: 4 ranks, MLP on sklearn digits, held-out accuracy of the deployable model.

Measured (seed 3, this config, evaluating every 25 steps): accuracy first >= 0.88 at step 75
(local_sgd) or 100 (sync, ddp, dts, diloco); at step 150 all were 0.92-0.94. The test asks for
0.88 within 150 steps. The ranks only write snapshots (the target is the harness's business: it
writes the STOP file), so every run takes its 150 steps and the evaluator reads the snapshots.
"""

import pytest

from tests.trainers.conftest import evaluations, records, run_sessions

pytestmark = pytest.mark.slow

TARGET_ACCURACY = 0.88
MAX_STEPS = 150
COMMON = {
    "steps": MAX_STEPS,
    "eval_every": 25,
    "batch_size": 16,
    "lr": 0.05,
    "optimizer": {"momentum": 0.9},
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
    evals = evaluations(runs[name])
    best = max(r["accuracy"] for r in evals)
    assert best >= TARGET_ACCURACY, f"{name}: best held-out accuracy {best:.3f} in {MAX_STEPS} steps"
    assert [r["step"] for r in evals] == [24, 49, 74, 99, 124, 149]
    for rank in range(4):
        status = records(runs[name], rank, "status")[-1]
        assert status["status"] == "ok" and status["stop_reason"] == "steps" and status["steps"] == MAX_STEPS


def _allreduce_bytes(run, rank: int, n_params: int) -> int:
    """Bytes one all-reduce of the float32 gradient puts on the transport the run recorded: gloo's
    (and DDP's own reducer, under comm.allreduce gloo) count the ring's 2(n-1)/n; ours:auto picks the
    direct exchange at this size
    ((n-1) whole tensors)."""
    import torch

    from trainers.comm import DIRECT_MAX_BYTES, allreduce_bytes

    transport = records(run, rank, "start")[0]["transport"]
    n, whole = 4, n_params * 4
    if not transport.startswith("ours:"):
        return 2 * (n - 1) * whole // n
    algorithm = transport.split(":", 1)[1]
    if algorithm == "auto":
        algorithm = "direct" if (n - 1) * whole <= DIRECT_MAX_BYTES else "ring"
    return allreduce_bytes(algorithm, rank, n, torch.zeros(n_params))[0]


def test_communication_volume_matches_each_algorithm(runs):
    """Bytes per step follow from the algorithm and its transport: every step (sync, ddp), every H
    steps (local_sgd)."""
    n_params = 64 * 64 + 64 + 64 * 10 + 10
    assert _allreduce_bytes(runs["ddp"], 1, n_params) == 3 * n_params * 4  # ours:auto through DDP's comm hook
    assert _allreduce_bytes(runs["sync"], 1, n_params) == 3 * n_params * 4  # ours:auto -> direct
    for name in ("sync", "ddp"):
        assert {r["bytes_sent"] for r in records(runs[name], 1, "step")} == {_allreduce_bytes(runs[name], 1, n_params)}
    one = _allreduce_bytes(runs["local_sgd"], 1, n_params)
    local = records(runs["local_sgd"], 1, "step")
    assert all(r["bytes_sent"] == one for r in local[:10])  # warm-up: synchronous
    after = [r["bytes_sent"] for r in local[10:]]
    assert after[7::8] == [one] * len(after[7::8]) and sum(after) == one * len(after[7::8])
    diloco = [r["bytes_sent"] for r in records(runs["diloco"], 1, "step")]
    assert sum(b > 0 for b in diloco) == len(diloco) // 10
