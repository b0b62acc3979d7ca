"""trainers/jsonl.py: the one reader of JSONL records (whole, by kind, from the end, from a
byte offset), on files cut mid-line as a killed writer leaves them."""

from __future__ import annotations

import json

import pytest

from trainers import jsonl
from trainers.stop import last_steps


def write(path, records, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def steps(n: int, rank: int = 0, start: int = 0) -> list[dict]:
    return [{"kind": "step", "rank": rank, "step": s, "time_s": 0.5 * s, "loss": 1.0} for s in range(start, start + n)]


def test_read_by_kind_skips_a_torn_line_and_a_cut_last_line(tmp_path):
    path = tmp_path / "rank0.jsonl"
    write(path, [{"kind": "start"}, *steps(2)], tail='{"kind": "step", "ra\n' + json.dumps(steps(1, start=2)[0])
          + '\n{"kind": "eval", "accu')
    assert [r["step"] for r in jsonl.read_complete_records(path, kinds=("step",))] == [0, 1, 2]
    assert [r["kind"] for r in jsonl.read_complete_records(path)] == ["start", "step", "step", "step"]
    assert jsonl.read_complete_records(tmp_path / "missing.jsonl") == []


@pytest.mark.parametrize("chunk", [64, 100, 16384])
def test_last_record_of_each_kind_across_read_chunks(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(jsonl, "TAIL_CHUNK_BYTES", chunk)
    path = tmp_path / "rank0.jsonl"
    records = [{"kind": "start", "world_size": 2}, *steps(40), {"kind": "eval", "step": 39, "accuracy": 0.9}, *steps(30, start=40)]
    write(path, records, tail='{"kind": "step", "step": 70, "ti')  # cut mid-write: not a record yet
    found = jsonl.last_records(path, ("step", "eval", "start", "status"))
    assert found["step"]["step"] == 69 and found["eval"]["accuracy"] == 0.9 and found["start"]["world_size"] == 2
    assert "status" not in found
    assert jsonl.last_records(tmp_path / "missing.jsonl", ("step",)) == {}


def test_the_first_record_of_a_kind_is_found_however_the_writer_spaced_it(tmp_path):
    path = tmp_path / "rank0.jsonl"
    # a warning that mentions a step is not a step; a compact writer's step is one
    path.write_text(json.dumps({"kind": "warning", "message": '"kind": "step" soon'}) + "\n"
                    + '{"kind":"step","step":0}\n')
    assert jsonl.first_record(path, "step") == {"kind": "step", "step": 0}
    write(path, [{"kind": "start"}, {"kind": "warning", "message": "step"}])
    assert jsonl.first_record(path, "step") is None
    assert jsonl.first_record(tmp_path / "missing.jsonl", "step") is None


def test_the_tail_leaves_out_the_line_its_start_cuts(tmp_path):
    path = tmp_path / "rank0.jsonl"
    write(path, steps(100))
    size = path.stat().st_size
    last_ten = sum(len(json.dumps(r) + "\n") for r in steps(100)[-10:])
    tail = jsonl.tail_records(path, last_ten + 5, kinds=("step",))  # 10 whole lines and part of one
    assert [r["step"] for r in tail] == list(range(90, 100))
    assert [r["step"] for r in jsonl.tail_records(path, size)] == list(range(100))  # from byte 0: every line


def test_rank_files_by_rank_number(tmp_path):
    for name in ("rank10.jsonl", "rank2.jsonl", "rank0.jsonl", "rank_x.jsonl", "rank1.log"):
        (tmp_path / name).write_text("")
    assert list(jsonl.rank_files(tmp_path)) == [0, 2, 10]


def test_stop_reads_each_ranks_recent_steps(tmp_path):
    write(tmp_path / "rank0.jsonl", [{"kind": "start"}, *steps(3)])
    write(tmp_path / "rank1.jsonl", [{"kind": "start"}, *steps(2, rank=1)], tail='{"kind": "step", "st')
    assert last_steps(tmp_path) == {0: [(0, 0.0), (1, 0.5), (2, 1.0)], 1: [(0, 0.0), (1, 0.5)]}


def test_written_bytes_grow_with_records(tmp_path):
    path = tmp_path / "rank0.jsonl"
    assert jsonl.written_bytes(path) == 0
    write(path, steps(1))
    before = jsonl.written_bytes(path)
    write(path, steps(2))
    assert 0 < before < jsonl.written_bytes(path)
