"""The evaluator follows a job by reading only what the ranks appended since its last look.

Unit tests, no processes: rank files written with the ranks' own RecordWriter and grown by hand
(in pieces cut anywhere, a record cut mid-write included), replaced, truncated; the states after
every piece equal those of reading the files whole; every line is decoded once however many
looks there are; ``run_evaluator --follow`` reads the records once per look and writes the same
eval records as evaluating afterwards.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from tests.trainers.conftest import BASE_CONFIG, merge
import trainers.evaluate as evaluate_module
from trainers.config import to_dict
from trainers.evaluate import JobEvaluator, RankRecords, RankStates, evaluate_job, run_evaluator
from trainers.loading import load_config
from trainers.records import RESOLVED_CONFIG_FILE, RecordTail, RecordWriter, read_records, write_json_atomic
from trainers.snapshots import OutputState, SnapshotLister, list_snapshots, write_snapshot


def _states_read_whole(job_dir: Path) -> RankStates:
    """The reference: what a reader that has never looked before makes of the files now."""
    return RankRecords(job_dir).read()


def _rank_lines(rank: int, steps: int, world_size: int = 4, eval_every: int = 5, end: bool = True,
                restart_at: int | None = None) -> bytes:
    """A rank's records as JSONL bytes (the kinds and fields the evaluator reads): start, output,
    steps, snapshots (rank 3 writes none), membership (rank 0), and a status record unless not
    ``end``; with ``restart_at``, a failed status there and the restarted rank's start."""
    rows = [{"kind": "start", "world_size": world_size, "restarts": 0},
            {"kind": "output", "role": "replica" if rank != 3 else None}]
    for step in range(steps):
        rows.append({"kind": "step", "step": step, "loss": 2.0 / (step + 1), "step_s": 0.01, "bytes_sent": 123 * step})
        if rank != 3 and (step + 1) % eval_every == 0:
            rows.append({"kind": "snapshot", "eval_index": (step + 1) // eval_every - 1, "step": step, "bytes": 999})
        if rank == 0 and (step + 1) % (2 * eval_every) == 0:
            rows.append({"kind": "membership", "step": step, "live": [0, 1, 2, 3][: 2 + step % 3], "joined": [], "lost": []})
        if restart_at is not None and step == restart_at:
            rows += [{"kind": "status", "status": "failed", "reason": "killed"},
                     {"kind": "start", "world_size": world_size, "restarts": 1}]
    if end:
        rows.append({"kind": "status", "status": "ok", "steps": steps})
    return "".join(json.dumps({**row, "rank": rank, "time_s": 0.5}) + "\n" for row in rows).encode()


def _write_job(job_dir: Path, contents: dict[int, bytes]) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    for rank, data in contents.items():
        (job_dir / f"rank{rank}.jsonl").write_bytes(data)


# ---------------------------------------------------------------------------------------------
# RecordTail: one file.


def test_a_file_appended_in_pieces_gives_the_records_of_reading_it_whole(tmp_path):
    data = _rank_lines(0, 60)
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(b"")
    tail = RecordTail(path)
    cuts = sorted(random.Random(5).sample(range(1, len(data)), 40)) + [len(data) - 3, len(data) - 1]  # mid-line too
    rows, written = [], 0
    for cut in sorted(set(cuts)) + [len(data)]:
        with open(path, "ab") as handle:
            handle.write(data[written:cut])
        written = cut
        rows += tail.read_new()
        assert tail.offset <= written and (tail.offset == 0 or data[tail.offset - 1:tail.offset] in (b"\n", b"}"))
    assert rows == read_records(path)
    assert tail.bad_lines == 0 and not tail.restarted


def test_a_last_line_cut_mid_write_waits_and_a_whole_one_without_newline_is_taken(tmp_path):
    path = tmp_path / "rank0.jsonl"
    record = json.dumps({"kind": "step", "step": 7}).encode()
    path.write_bytes(b'{"kind": "start"}\n' + record[:-4])
    tail = RecordTail(path)
    assert tail.read_new() == [{"kind": "start"}] and tail.offset == len(b'{"kind": "start"}\n')
    assert tail.read_new() == []  # still cut
    with open(path, "ab") as handle:
        handle.write(record[-4:])  # the record is whole, its newline not there yet
    assert tail.read_new() == [{"kind": "step", "step": 7}]
    with open(path, "ab") as handle:
        handle.write(b'\n{"kind": "status"}\n')
    assert tail.read_new() == [{"kind": "status"}]  # the late newline makes a blank line, skipped
    assert tail.bad_lines == 0


def test_a_cut_line_followed_by_a_restarted_writers_record_is_skipped_not_the_end(tmp_path):
    path = tmp_path / "rank1.jsonl"
    path.write_bytes(b'{"kind": "start"}\n{"kind": "st')  # the writer was killed mid-write
    tail = RecordTail(path)
    assert tail.read_new() == [{"kind": "start"}]
    with open(path, "ab") as handle:  # its restart appends whole lines after the cut one
        handle.write(b'{"kind": "start", "restarts": 1}\n{"kind": "status"}\n')
    assert tail.read_new() == [{"kind": "status"}] and tail.bad_lines == 1


def test_a_replaced_shrunk_or_refilled_file_is_read_again_from_the_start(tmp_path):
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(_rank_lines(0, 30))
    tail = RecordTail(path)
    assert len(tail.read_new()) > 30
    shorter = _rank_lines(0, 3, end=False).replace(b'"restarts": 0', b'"restarts": 7')
    replacement = tmp_path / "new.jsonl"
    replacement.write_bytes(shorter)
    os.replace(replacement, path)  # another inode
    assert tail.read_new() == read_records(path) and tail.restarted
    assert tail.read_new() == [] and not tail.restarted
    with open(path, "wb") as handle:  # truncated in place (same inode) and refilled past the offset
        handle.write(shorter.replace(b'"restarts": 7', b'"restarts": 8') + _rank_lines(0, 30))
    assert tail.read_new() == read_records(path) and tail.restarted
    path.write_bytes(shorter)  # truncated in place, shorter than what was read
    assert tail.read_new() == read_records(path) and tail.restarted


# ---------------------------------------------------------------------------------------------
# RankRecords: a job's files.


def test_rank_states_from_pieces_equal_reading_the_files_whole_at_every_look(tmp_path):
    whole = {0: _rank_lines(0, 80), 1: _rank_lines(1, 75, restart_at=40), 2: _rank_lines(2, 70, end=False),
             3: _rank_lines(3, 80)}
    job = tmp_path / "job"
    _write_job(job, {rank: b"" for rank in whole})
    followed = RankRecords(job)
    generator = random.Random(11)
    written = dict.fromkeys(whole, 0)
    looks = 0
    while any(written[rank] < len(whole[rank]) for rank in whole):
        for rank, data in whole.items():  # each rank appends 0..400 bytes: lines cut anywhere
            more = min(len(data), written[rank] + generator.randrange(0, 400))
            with open(job / f"rank{rank}.jsonl", "ab") as handle:
                handle.write(data[written[rank]:more])
            written[rank] = more
        looks += 1
        assert followed.read() == _states_read_whole(job), f"look {looks}"
    final = followed.states
    assert final.world_size == 4 and final.ended == {0, 1, 3}  # rank 1 restarted and ended; rank 2 runs on
    assert final.roles == {0: "replica", 1: "replica", 2: "replica", 3: None}
    assert final.snapshot_steps[0] == {i: 5 * i + 4 for i in range(16)} and 3 not in final.snapshot_steps
    assert [step for step, _ in final.membership] == list(range(9, 80, 10))
    assert looks > 20


def test_looks_at_a_growing_job_decode_each_line_once(tmp_path):
    """N looks at files growing by a few records between looks: the lines decoded are the lines
    written (each once), not N times the files (the cost of re-reading them at every look)."""
    job = tmp_path / "job"
    _write_job(job, {rank: b"" for rank in range(4)})
    whole = {rank: _rank_lines(rank, 400).splitlines(keepends=True) for rank in range(4)}
    followed = RankRecords(job)
    looks, reread_cost = 0, 0
    for start in range(0, max(len(lines) for lines in whole.values()), 7):
        for rank, lines in whole.items():
            with open(job / f"rank{rank}.jsonl", "ab") as handle:
                handle.writelines(lines[start:start + 7])
        followed.read()
        followed.read()  # a second look with nothing new decodes nothing
        looks += 1
        reread_cost += sum(min(len(lines), start + 7) for lines in whole.values())
    total = sum(len(lines) for lines in whole.values())
    assert followed.lines_parsed == total
    assert reread_cost > 25 * total  # what reading every file whole at each look would have decoded


def test_a_rank_file_replaced_by_a_shorter_one_or_removed_is_forgotten(tmp_path):
    job = tmp_path / "job"
    _write_job(job, {rank: _rank_lines(rank, 50) for rank in range(4)})
    followed = RankRecords(job)
    assert followed.read().ended == {0, 1, 2, 3}
    replacement = job / "new.tmp"
    replacement.write_bytes(_rank_lines(1, 12, end=False))
    os.replace(replacement, job / "rank1.jsonl")
    states = followed.read()
    assert states == _states_read_whole(job)
    assert states.ended == {0, 2, 3} and max(states.snapshot_steps[1]) == 1
    (job / "rank2.jsonl").unlink()
    states = followed.read()
    assert states == _states_read_whole(job) and 2 not in states.roles and 2 not in states.snapshot_steps


def test_the_snapshot_lister_lists_what_list_snapshots_lists(tmp_path):
    lister = SnapshotLister(tmp_path)
    assert lister.list() == {} == list_snapshots(tmp_path)
    output = OutputState("replica", {"w": torch.zeros(2)})
    for index in range(3):
        for rank in (0, 2):
            write_snapshot(tmp_path, rank, index, step=index, time_s=0.0, train_time_s=0.0, output=output)
        (tmp_path / "snapshots" / "rank0" / f".{index + 1:06d}.pt.9.tmp").write_bytes(b"half")  # a writer mid-way
        (tmp_path / "snapshots" / "rank0" / f".{index:06d}.pt.9.tmp").unlink(missing_ok=True)  # ... renamed
        assert lister.list() == list_snapshots(tmp_path)
    (tmp_path / "snapshots" / "rank5").mkdir()  # a folder with no snapshot yet is not listed
    (tmp_path / "snapshots" / "rank2" / "000001.pt").unlink()
    assert lister.list() == list_snapshots(tmp_path) and sorted(lister.list()[2]) == [0, 2]
    listed = lister.list()
    listed[0].clear()  # a caller's copy
    assert lister.list() == list_snapshots(tmp_path)


# ---------------------------------------------------------------------------------------------
# The evaluator on a job grown by hand (no processes): real config, snapshots of the real model.


def _make_job(job_dir: Path, eval_every: int = 5) -> JobEvaluator:
    """A job folder with a resolved config (local SGD, MLP on digits); its evaluator."""
    job_dir.mkdir(parents=True, exist_ok=True)
    config = load_config(merge(BASE_CONFIG, {"output_dir": str(job_dir), "eval_every": eval_every,
                                             "algorithm": {"name": "local_sgd", "params": {"H": 4}}}))
    write_json_atomic(job_dir / RESOLVED_CONFIG_FILE, to_dict(config))
    return JobEvaluator(job_dir)


class _GrowingJob:
    """A job's ranks as RecordWriters: ``advance`` runs every rank some steps (a snapshot of a
    slightly changed model at every eval point), ``end`` writes the status records."""

    def __init__(self, job_dir: Path, world_size: int, model: torch.nn.Module, eval_every: int = 5):
        self.job_dir, self.eval_every, self.step = job_dir, eval_every, 0
        self.state = {k: v.clone() for k, v in model.state_dict().items()}
        self.writers = [RecordWriter(job_dir, rank) for rank in range(world_size)]
        for writer in self.writers:
            writer.write("start", world_size=world_size, restarts=0)
            writer.write("output", role="replica")

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            for rank, writer in enumerate(self.writers):
                writer.write("step", step=self.step, loss=1.0, step_s=0.01)
                if (self.step + 1) % self.eval_every == 0:
                    index = (self.step + 1) // self.eval_every - 1
                    state = {k: v + 0.01 * (rank + index) if v.is_floating_point() else v for k, v in self.state.items()}
                    write_snapshot(self.job_dir, rank, index, self.step, writer.clock(), writer.clock(),
                                   OutputState("replica", state))
                    writer.write("snapshot", eval_index=index, step=self.step, role="replica")
            self.step += 1

    def end(self) -> None:
        for writer in self.writers:
            writer.write("status", status="ok", steps=self.step)
            writer.close()


def test_follow_reads_the_records_once_per_look_and_matches_evaluating_afterwards(tmp_path, monkeypatch):
    """run_evaluator --follow on a job that grows by 3 steps between looks (the sleep between
    looks runs the job): one read of the records per look, every line decoded once, and the same
    eval records as evaluating the finished job."""
    job_dir = tmp_path / "job"
    job = _GrowingJob(job_dir, 4, _make_job(job_dir).model)
    reads = []
    original_read = RankRecords.read

    def counting_read(self):
        reads.append(self)
        return original_read(self)

    looks = []

    def run_the_job_instead_of_sleeping(seconds):
        looks.append(seconds)
        job.advance(3)
        if job.step >= 60:
            job.end()

    monkeypatch.setattr(RankRecords, "read", counting_read)
    monkeypatch.setattr(evaluate_module.time, "sleep", run_the_job_instead_of_sleeping)
    rows = run_evaluator(job_dir, follow=True, poll_s=0.5)
    assert len(looks) == 20 and len(reads) == len(looks) + 1  # the last look sees the status records
    lines = sum(len((job_dir / f"rank{rank}.jsonl").read_text().splitlines()) for rank in range(4))
    assert reads[0].lines_parsed == lines
    assert [r["eval_index"] for r in rows] == list(range(12))
    assert [json.loads(line) for line in (job_dir / "eval.jsonl").read_text().splitlines()] == rows
    monkeypatch.undo()
    assert [(r["eval_index"], r["step"], r["accuracy"], r["loss"]) for r in rows] == [
        (r["eval_index"], r["step"], r["accuracy"], r["loss"]) for r in evaluate_job(job_dir)]


def test_a_rank_seen_ended_has_its_last_snapshot_in_the_listing(tmp_path):
    """The records are read before the snapshots are listed: a rank that writes its last snapshot
    and its status record just as the evaluator looks is either not yet ended (then the index
    waits) or has that snapshot listed; never ended with its last snapshot missing (which would
    evaluate the index with its previous replica)."""
    job_dir = tmp_path / "job"
    evaluator = _make_job(job_dir)
    job = _GrowingJob(job_dir, 2, evaluator.model)
    job.advance(9)  # eval_index 0 (step 4) on both ranks
    job.writers[0].write("step", step=9, loss=1.0, step_s=0.01)  # rank 0 writes its last snapshot and ends
    write_snapshot(job_dir, 0, 1, 9, 1.0, 1.0, OutputState("replica", job.state))
    job.writers[0].write("snapshot", eval_index=1, step=9, role="replica")
    job.writers[0].write("status", status="ok", steps=10)
    original_read = evaluator.records.read

    def rank1_ends_as_the_records_are_read():
        # Rank 1 ends late, with its last snapshot under eval_index 1 at step 12.
        write_snapshot(job_dir, 1, 1, 12, 1.0, 1.0, OutputState("replica", job.state))
        job.writers[1].write("snapshot", eval_index=1, step=12, role="replica")
        job.writers[1].write("status", status="ok", steps=13)
        evaluator.records.read = original_read
        return original_read()

    evaluator.records.read = rank1_ends_as_the_records_are_read
    rows = evaluator.poll()
    assert [(r["eval_index"], r["step_min"], r["step"]) for r in rows] == [(0, 4, 4), (1, 9, 12)]
    assert evaluator.finished(refresh=False)
