"""Evaluation off the wire and off the training clock: snapshots, the STOP file, the evaluator.

Unit tests of the pieces (schedule, STOP file, combining snapshots), then real multi-process gloo
jobs on loopback: eval points add no communication at all, snapshot time is not on the training
clock, the evaluator's numbers equal evaluating the models directly, and the STOP file ends every
rank at the same step.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.trainers.conftest import BASE_CONFIG, evaluations, merge, records, run_sessions
from tests.trainers.workers import replica_mean_worker, slow_snapshot_worker
from trainers.evaluate import combine_snapshots, run_evaluator
from trainers.launch import launch_local, stop_processes
from trainers.records import RESOLVED_CONFIG_FILE
from trainers.snapshots import OutputState, SnapshotSchedule, list_snapshots, load_snapshot, write_snapshot
from trainers.stop import StopWatcher, read_stop, stop_step_from_records, write_stop
from trainers.training import evaluate

# ---------------------------------------------------------------------------------------------
# The pieces.


def test_step_schedule_is_the_same_on_every_rank_and_ends_with_the_last_step():
    schedule = SnapshotSchedule(eval_every=5)
    points = [(step, schedule.index_at(step, clock_s=0.0, last=step == 11)) for step in range(12)]
    assert [p for p in points if p[1] is not None] == [(4, 0), (9, 1), (11, 2)]
    resumed = SnapshotSchedule(eval_every=5)  # a restarted rank going on at step 10
    assert resumed.index_at(14, 0.0, last=False) == 2


def test_time_schedule_indexes_slots_of_the_training_clock():
    schedule = SnapshotSchedule(eval_every=1000, eval_every_s=0.5)
    clocks = [0.2, 0.49, 0.5, 0.7, 1.6, 1.7, 1.8]  # one step spans the slots 2 and 3
    indices = [schedule.index_at(step, clock, last=step == 6) for step, clock in enumerate(clocks)]
    assert indices == [None, None, 0, None, 2, None, 3]


def test_stop_file_first_writer_wins_and_is_read_once(tmp_path):
    watcher = StopWatcher(tmp_path)
    assert watcher.poll() is None and read_stop(tmp_path) is None
    assert write_stop(tmp_path, 40, "target_accuracy").stop_step == 40
    assert write_stop(tmp_path, 7, "time_budget").stop_step == 40  # already there: it stays
    assert json.loads((tmp_path / "STOP").read_text()) == {"stop_step": 40, "reason": "target_accuracy"}
    assert watcher.poll().stop_step == 40
    assert [p.name for p in tmp_path.iterdir()] == ["STOP"]  # no temporary file left
    with pytest.raises(ValueError, match="stop_step"):
        write_stop(tmp_path, 0, "x")
    (tmp_path / "STOP").write_text('{"stop_step": "soon"}')
    with pytest.raises(ValueError, match=r"STOP: stop_step: must be an integer >= 1, got 'soon'"):
        read_stop(tmp_path)


def test_stop_step_from_records_leaves_room_for_the_fastest_rank(tmp_path):
    for rank, (last, rate) in enumerate([(100, 50.0), (130, 200.0)]):  # steps/s
        rows = [{"kind": "step", "step": s, "time_s": s / rate} for s in range(last - 9, last + 1)]
        (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert stop_step_from_records(tmp_path, margin_s=1.0) == 130 + 200 + 1


def _snap(rank, role, state, param_range=None):
    return {"rank": rank, "role": role, "state": state, "param_range": param_range}


def test_combining_replicas_averages_floats_and_keeps_counters():
    states = [{"w": torch.full((2, 2), float(r)), "n": torch.tensor(r + 5)} for r in range(4)]
    combined = combine_snapshots("replica", {r: _snap(r, "replica", s) for r, s in enumerate(states)}, ["w"])
    assert torch.equal(combined["w"], torch.full((2, 2), 1.5)) and int(combined["n"]) == 5


def test_combining_server_ranges_joins_them_and_refuses_a_gap():
    trainable = ["a", "b"]  # flattened: a (3 values) then b (2)
    server2 = {"a": torch.tensor([1.0, 2.0, 3.0]), "b": torch.tensor([0.0, 0.0])}  # holds [0, 3)
    server0 = {"a": torch.tensor([0.0, 0.0, 0.0]), "b": torch.tensor([4.0, 5.0])}  # holds [3, 5)
    combined = combine_snapshots("server", {2: _snap(2, "server", server2, [0, 3]), 0: _snap(0, "server", server0, [3, 5])}, trainable)
    assert combined["a"].tolist() == [1.0, 2.0, 3.0] and combined["b"].tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="cover 3 of 5"):
        combine_snapshots("server", {2: _snap(2, "server", server2, [0, 3])}, trainable)


def test_a_snapshot_is_written_atomically_and_listed(tmp_path):
    size = write_snapshot(tmp_path, 3, 12, step=99, time_s=4.5, train_time_s=2.0,
                          output=OutputState("replica", {"w": torch.ones(3)}))
    (tmp_path / "snapshots" / "rank3" / ".000013.pt.123.tmp").write_bytes(b"half")  # a writer mid-way
    listed = list_snapshots(tmp_path)
    assert list(listed) == [3] and list(listed[3]) == [12] and listed[3][12].stat().st_size == size
    snap = load_snapshot(listed[3][12])
    assert {k: snap[k] for k in ("step", "time_s", "train_time_s", "rank", "eval_index", "role", "param_range")} == {
        "step": 99, "time_s": 4.5, "train_time_s": 2.0, "rank": 3, "eval_index": 12, "role": "replica", "param_range": None}


# ---------------------------------------------------------------------------------------------
# Real jobs (4 gloo ranks on loopback).

NO_COMM_ALGORITHMS = {
    "local_sgd": {"name": "local_sgd", "params": {"H": 4}},
    # the round-based exchange: the asynchronous one's bytes per step follow the replies' arrival
    # times, which differ between any two runs (eval points or not), so per-step equality cannot hold
    "swarmsgd": {"name": "swarmsgd", "params": {"H": 2, "interaction": "rounds"}},
    "async_ps": {"name": "async_ps"},
    "diloco": {"name": "diloco", "params": {"H": 5}},
    "sync": {"name": "sync"},
}


@pytest.mark.slow
def test_eval_points_send_no_byte_and_make_no_call(tmp_path, spawn_ranks):
    """The same job with an eval point after every step and with one at the end only: identical
    bytes per step on every rank (async PS: per worker), and identical totals of the comm layer (every call and byte,
    setup and drain included). Every snapshot is there: 20 per contributing rank, or 1."""
    runs = {}
    for name, algorithm in NO_COMM_ALGORITHMS.items():
        for eval_every in (1, 1000):
            runs[f"{name}_{eval_every}"] = {"algorithm": algorithm, "steps": 20, "eval_every": eval_every}
    outputs = run_sessions(spawn_ranks, tmp_path, 4, runs, timeout_s=400)
    for name in NO_COMM_ALGORITHMS:
        dense, sparse = outputs[f"{name}_1"], outputs[f"{name}_1000"]
        for rank in range(4):
            per_step = {out: [(r["bytes_sent"], r["bytes_recv"]) for r in records(out, rank, "step")] for out in (dense, sparse)}
            if name != "async_ps" or rank != 0:  # the server handles messages as they come: its per-step split varies
                assert per_step[dense] == per_step[sparse], f"{name} rank {rank}"
            status = {out: records(out, rank, "status")[-1] for out in (dense, sparse)}
            for field in ("comm_bytes_sent", "comm_bytes_recv", "comm_calls"):
                assert status[dense][field] == status[sparse][field], f"{name} rank {rank}: {field}"
        snapshots = list_snapshots(dense)
        assert all(len(snapshots[r]) == 20 for r in snapshots) and len(list_snapshots(sparse)[min(snapshots)]) == 1
        expected = {"local_sgd": [0, 1, 2, 3], "swarmsgd": [0, 1, 2, 3], "async_ps": [0], "diloco": [0], "sync": [0]}[name]
        assert sorted(snapshots) == expected, name


@pytest.mark.slow
def test_snapshot_time_is_off_the_training_clock(tmp_path, spawn_ranks):
    """Snapshot writing made 0.3 s slower: the wall clock sees it, the training clock (time_s of
    the records, and the snapshots' train_time_s) does not, and snapshot_s says how much was taken off."""
    delay_s = 0.3
    config = merge(BASE_CONFIG, {"output_dir": str(tmp_path / "out"), "steps": 12, "eval_every": 4,
                                 "algorithm": {"name": "local_sgd", "params": {"H": 2}}})
    assert spawn_ranks(slow_snapshot_worker, 2, config, delay_s, timeout_s=120) == [0, 0]
    out = tmp_path / "out"
    for rank in range(2):
        steps = {r["step"]: r for r in records(out, rank, "step")}
        snapshots = records(out, rank, "snapshot")
        assert [r["step"] for r in snapshots] == [3, 7, 11]
        assert all(r["snapshot_s"] >= delay_s for r in snapshots)
        for snap in snapshots[:2]:
            before, after = steps[snap["step"]], steps[snap["step"] + 1]
            assert after["time_unix"] - before["time_unix"] >= delay_s  # the wall clock paid for it
            assert after["time_s"] - before["time_s"] < delay_s / 2  # the training clock did not
        status = records(out, rank, "status")[-1]
        assert status["snapshot_s_total"] == pytest.approx(sum(r["snapshot_s"] for r in snapshots))
        saved = load_snapshot(out / "snapshots" / f"rank{rank}" / "000001.pt")
        assert saved["time_s"] == pytest.approx(steps[7]["time_s"], abs=0.1)  # the clock at the eval point
        first_step_start = steps[0]["time_s"] - steps[0]["step_s"]
        assert saved["train_time_s"] == pytest.approx(saved["time_s"] - first_step_start, abs=0.05)


@pytest.mark.slow
def test_evaluator_on_sync_equals_rank0_final_model(tmp_path, spawn_ranks):
    """sync (and async PS with its range split over servers [2, 0]): the evaluator's last record
    equals evaluating the final model directly; eval.jsonl holds the records in eval_index order."""
    outputs = run_sessions(spawn_ranks, tmp_path, 4, {
        "sync": {"steps": 30, "eval_every": 10, "save_final_model": True},
        "async_ps": {"steps": 30, "eval_every": 10, "save_final_model": True,
                     "algorithm": {"name": "async_ps", "params": {"server_ranks": [2, 0]}}},
    }, timeout_s=300)
    from trainers.evaluate import JobEvaluator

    for name, out in outputs.items():
        rows = run_evaluator(out)
        assert [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()] == rows
        assert [(r["eval_index"], r["step"]) for r in rows] == [(0, 9), (1, 19), (2, 29)]
        evaluator = JobEvaluator(out)
        final = {k: v for k, v in torch.load(out / "rank0_final.pt").items()}
        if name == "async_ps":  # servers write their ranges into their models in finish()
            server2 = torch.load(out / "rank2_final.pt")
            final = combine_snapshots("server", {2: _snap(2, "server", server2, list(_range(evaluator, 0))),
                                                 0: _snap(0, "server", final, list(_range(evaluator, 1)))},
                                      evaluator.trainable)
        evaluator.model.load_state_dict(final)
        accuracy, loss = evaluate(evaluator.model, evaluator.data.test_x, evaluator.data.test_y, torch.device("cpu"))
        assert rows[-1]["accuracy"] == accuracy and rows[-1]["loss"] == pytest.approx(loss, rel=1e-6), name
        assert rows[-1]["role"] == {"sync": "rank0", "async_ps": "server"}[name]
        assert rows[-1]["ranks"] == {"sync": [0], "async_ps": [0, 2]}[name]
        assert run_evaluator(out) == []  # already evaluated: resumed after the last eval_index


def _range(evaluator, part: int) -> tuple[int, int]:
    numel = sum(p.numel() for p in evaluator.model.parameters() if p.requires_grad)
    bounds = [0, numel // 2, numel]
    return bounds[part], bounds[part + 1]


@pytest.mark.slow
def test_local_sgd_mean_of_replicas_equals_the_allreduce_average(tmp_path, spawn_ranks):
    """After 10 steps with H = 4 the replicas differ (last average at step 8); the evaluator's mean
    of the snapshots equals averaged_copy() (the all-reduce it replaces), and writing the snapshot
    sent nothing."""
    assert spawn_ranks(replica_mean_worker, 4, str(tmp_path), 10, 4, timeout_s=120) == [0] * 4
    replicas = [torch.load(tmp_path / f"replica_{r}.pt") for r in range(4)]
    assert not torch.equal(replicas[0]["1.weight"], replicas[1]["1.weight"])
    snaps = {r: load_snapshot(tmp_path / "snapshots" / f"rank{r}" / "000000.pt") for r in range(4)}
    mean = combine_snapshots("replica", snaps, [k for k in replicas[0]])
    for rank in range(4):
        average = torch.load(tmp_path / f"allreduce_average_{rank}.pt")
        for name in average:
            torch.testing.assert_close(mean[name], average[name], rtol=1e-6, atol=1e-7)
        assert json.loads((tmp_path / f"snapshot_bytes_{rank}.json").read_text()) == 0


STOP_CASES = {
    "sync_stop_file": ({"name": "sync"}, {}),
    "async_ps_stop_file": ({"name": "async_ps"}, {}),
    "swarmsgd_stop_file": ({"name": "swarmsgd", "params": {"H": 2}}, {}),
    "sync_time_budget": ({"name": "sync"}, {"time_budget_s": 2.0}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stop_file_ends_every_rank_at_stop_step(tmp_path, case):
    """A 4-rank job with a step budget it would not reach in minutes. The STOP file (written here
    as the harness would, once rank 0 passed step 30; or by rank 0 for its time budget) ends every
    rank after step stop_step - 1, with status ok, the reason, and a final snapshot."""
    algorithm, changes = STOP_CASES[case]
    out = tmp_path / "out"
    config = merge(BASE_CONFIG, {"output_dir": str(out), "steps": 1_000_000, "eval_every": 25, "algorithm": algorithm,
                                 "comm": {"timeout_s": 60}, **changes})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = {}
    job = threading.Thread(target=lambda: result.setdefault("exits", launch_local(path, 4, timeout_s=240)))
    job.start()
    try:
        if "time_budget_s" not in changes:
            deadline = time.monotonic() + 180
            while _last_step(out / "rank0.jsonl") < 30:
                assert time.monotonic() < deadline and job.is_alive(), "rank 0 never got to step 30"
                time.sleep(0.05)
            write_stop(out, stop_step_from_records(out), "target_accuracy")
    finally:
        job.join()
    assert [e.returncode for e in result["exits"]] == [0] * 4, [e.stderr_tail for e in result["exits"]]
    request = read_stop(out)
    reason = "time_budget" if "time_budget_s" in changes else "target_accuracy"
    assert request.reason == reason
    for rank in range(4):
        status = records(out, rank, "status")[-1]
        assert status == {**status, "status": "ok", "steps": request.stop_step, "stop_reason": reason,
                          "stop_step_passed": False}
        assert records(out, rank, "step")[-1]["step"] == request.stop_step - 1
    rows = evaluations(out)
    assert rows[-1]["step"] == rows[-1]["step_min"] == request.stop_step - 1


def _last_step(path: Path) -> int:
    try:
        steps = [json.loads(line) for line in path.read_text().splitlines() if '"kind": "step"' in line]
    except (FileNotFoundError, json.JSONDecodeError):
        return -1
    return steps[-1]["step"] if steps else -1


@pytest.mark.slow
def test_follow_evaluates_as_snapshots_appear_and_stops_at_target(tmp_path):
    """Without the harness: a 4-rank local SGD job with snapshots every 0.5 s of training clock and
    no step budget to speak of, beside ``python -m trainers.evaluate --follow --stop-at-target``.
    The evaluator writes STOP once the target is reached, every rank ends at stop_step, and the
    evaluator ends by itself with the eval records in order, the same as evaluating afterwards."""
    out = tmp_path / "out"
    config = merge(BASE_CONFIG, {"output_dir": str(out), "steps": 1_000_000, "eval_every": 50, "eval_every_s": 0.5,
                                 "target_accuracy": 0.8, "algorithm": {"name": "local_sgd", "params": {"H": 4}}})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    result = {}
    job = threading.Thread(target=lambda: result.setdefault("exits", launch_local(path, 4, timeout_s=300)))
    job.start()
    evaluator = None
    try:
        deadline = time.monotonic() + 120
        while not (out / RESOLVED_CONFIG_FILE).exists():
            assert time.monotonic() < deadline and job.is_alive(), f"the job never wrote {RESOLVED_CONFIG_FILE}"
            time.sleep(0.1)
        evaluator = subprocess.Popen([sys.executable, "-m", "trainers.evaluate", str(out), "--follow", "--stop-at-target",
                                      "--poll-s", "0.2"], stderr=subprocess.PIPE, text=True)
        _, stderr = evaluator.communicate(timeout=300)
        assert evaluator.returncode == 0, stderr
    finally:
        job.join()
        if evaluator is not None:
            stop_processes([evaluator])
    assert [e.returncode for e in result["exits"]] == [0] * 4, [e.stderr_tail for e in result["exits"]]
    request = read_stop(out)
    assert request.reason == "target_accuracy"
    assert {records(out, rank, "status")[-1]["steps"] for rank in range(4)} == {request.stop_step}
    followed = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    indices = [r["eval_index"] for r in followed]
    assert indices == sorted(indices) and len(indices) >= 2
    assert any(r["accuracy"] >= 0.8 for r in followed) and followed[-1]["step"] == request.stop_step - 1
    assert [(r["eval_index"], r["accuracy"]) for r in followed] == [(r["eval_index"], r["accuracy"]) for r in evaluations(out)]
