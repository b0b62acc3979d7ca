"""Records through the real command line (`python -m trainers`), and a failing rank's status."""

import json

import pytest

from tests.trainers.conftest import records, run_training
from tests.trainers.workers import failing_worker

pytestmark = pytest.mark.slow

STEP_FIELDS = {
    "kind", "rank", "time_unix", "time_s", "step", "epoch", "loss", "lr", "step_s", "compute_s",
    "comm_blocked_s", "bytes_sent", "bytes_recv", "bytes_sent_total", "bytes_recv_total", "staleness",
}


def test_every_rank_writes_step_records_and_ok_status(tmp_path):
    out = run_training(tmp_path, 2, {
        "steps": 12, "eval_every": 5,
        "lr_schedule": {"name": "cosine", "warmup_steps": 2},
        "algorithm": {"name": "dts", "params": {"p": 2, "t": 1}},
    })
    saved = json.loads((out / "config.json").read_text())
    assert saved["algorithm"] == {"name": "dts", "params": {"p": 2, "t": 1}}
    assert saved["output_dir"] == str(out)
    for rank in range(2):
        rows = records(out, rank)
        assert rows[0]["kind"] == "start" and rows[0]["world_size"] == 2
        steps = [r for r in rows if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(12))
        for row in steps:
            assert STEP_FIELDS <= row.keys(), STEP_FIELDS - row.keys()
            assert row["rank"] == rank and row["loss"] > 0
            assert row["compute_s"] + row["comm_blocked_s"] == pytest.approx(row["step_s"])
        assert steps[0]["lr"] == pytest.approx(0.05) and steps[1]["lr"] == pytest.approx(0.1)
        assert steps[-1]["lr"] < steps[2]["lr"]  # cosine decay after warm-up
        sent = [r["bytes_sent"] for r in steps]
        assert [r["bytes_sent_total"] for r in steps] == [sum(sent[: i + 1]) for i in range(12)]
        assert [r["staleness"] for r in steps][:4] == [None, None, 1, None]
        assert rows[-1] == {**rows[-1], "kind": "status", "status": "ok", "steps": 12, "stop_reason": "steps"}
    evals = records(out, 0, "eval")
    assert [r["step"] for r in evals] == [4, 9, 11]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["eval_bytes_sent"] > 0 for r in evals)  # average of replicas
    assert records(out, 1, "eval") == []


def test_a_failing_rank_records_why(spawn_ranks, tmp_path):
    exits = spawn_ranks(failing_worker, 2, str(tmp_path), 1, 5, timeout_s=120)
    assert exits == [1, 1]
    failed = records(tmp_path, 1, "status")[-1]
    assert failed["status"] == "failed"
    assert failed["reason"] == "RuntimeError: injected fault at step 5"
    assert "injected fault" in failed["traceback"]
    assert [r["step"] for r in records(tmp_path, 1, "step")] == list(range(5))
    # The healthy rank does not hang: its collective fails once the peer is gone, and says so.
    other = records(tmp_path, 0, "status")[-1]
    assert other["status"] == "failed" and other["reason"]
