"""Records through the real command line (`python -m trainers`), and a failing rank's status."""

import json

import pytest

from tests.trainers.conftest import BASE_CONFIG, evaluations, merge, records, run_training
from tests.trainers.workers import failing_worker
from trainers.launch import launch_local
from trainers.records import RESOLVED_CONFIG_FILE

pytestmark = pytest.mark.slow

STEP_FIELDS = {
    "kind", "rank", "time_unix", "time_s", "step", "epoch", "loss", "lr", "step_s", "compute_s",
    "comm_blocked_s", "bytes_sent", "bytes_recv", "bytes_sent_total", "bytes_recv_total", "staleness", "syncs_applied",
}


def test_rank0_writes_the_resolved_config_beside_the_one_the_ranks_read(tmp_path):
    """As in a run directory: the ranks start from <output_dir>/config.json; rank 0 must not
    rewrite it (another rank may be reading it) but put the resolved form in its own file."""
    out = tmp_path / "out"
    out.mkdir()
    started_from = out / "config.json"
    text = json.dumps(merge(BASE_CONFIG, {"steps": 2, "eval_every": 2, "output_dir": str(out),
                                          "algorithm": {"name": "local_sgd", "params": {"H": 3}}}))
    started_from.write_text(text)
    exits = launch_local(started_from, 2, timeout_s=120)
    assert [e.returncode for e in exits] == [0, 0], [e.stderr_tail for e in exits]
    assert started_from.read_text() == text
    resolved = json.loads((out / RESOLVED_CONFIG_FILE).read_text())
    assert resolved["algorithm"]["params"]["H"] == 3 and "collective" in resolved["algorithm"]["params"]
    assert resolved["model"]["params"] == {"hidden_sizes": [32]} and resolved["dataset"]["params"] == {}
    names = {p.name for p in out.iterdir()}
    assert {"config.json", RESOLVED_CONFIG_FILE, "rank0.jsonl", "rank1.jsonl"} <= names
    assert not [name for name in names if name.startswith(".")]  # no temporary file left behind


def test_every_rank_writes_step_records_and_ok_status(tmp_path):
    out = run_training(tmp_path, 2, {
        "steps": 12, "eval_every": 5,
        "lr_schedule": {"name": "cosine", "warmup_steps": 2},
        "algorithm": {"name": "dts", "params": {"p": 2, "t": 1}},
    })
    saved = json.loads((out / RESOLVED_CONFIG_FILE).read_text())
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
        assert 50 < rows[-1]["max_rss_mib"] < 8192   # torch alone takes well over 50 MiB
        # Snapshots at steps 4 and 9 and after the last step; nothing evaluated in the job.
        snapshots = records(out, rank, "snapshot")
        assert [(r["eval_index"], r["step"], r["role"]) for r in snapshots] == [(0, 4, "replica"), (1, 9, "replica"), (2, 11, "replica")]
        assert rows[-1]["snapshot_s_total"] == pytest.approx(sum(r["snapshot_s"] for r in snapshots))
        assert records(out, rank, "eval") == []
    evals = evaluations(out)
    assert [(r["eval_index"], r["step"], r["step_min"], r["ranks"]) for r in evals] == [(0, 4, 4, [0, 1]), (1, 9, 9, [0, 1]), (2, 11, 11, [0, 1])]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["role"] == "replica" for r in evals)  # mean of the replicas


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
