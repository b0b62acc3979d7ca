"""Fault events in the results: `load_run(...).faults`, report.md's Faults section, faults.csv and
the marks on the training curves, on synthetic run directories (test_report.write_run) with a
faults.jsonl as harness/faults.py writes it and membership/rejoin records as the trainers do.

Clocks of the synthetic `sync` job (FakeJob defaults: start record at time_s 0.5, 1 s per step):
every rank writer starts at wall clock WRITERS_UNIX; the harness started the processes 1 s
earlier (JOB_START_UNIX). Rank 0's training time 0 is time_s 0.5, so an event at `time_s` t (after
the job's start) is at training time t - 1.5; step k ends at training time k + 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from tests.harness.test_report import FakeJob, write_run

from harness import plots
from harness.report import load_results, write_report
from harness.results import FAULT_COLUMNS, injection_failed, load_run, summarize

WRITERS_UNIX = 1.7e9
JOB_START_UNIX = WRITERS_UNIX - 1.0
TO_TRAIN_S = -1.5

# (due_s, applied_s, what, effect, ok), as FaultTimeline.poll records them
HARNESS_ROWS = [
    (2.0, 2.0, "link east->west down", "down", True),
    (2.0, 2.0, "link west->east down", "down", True),
    (4.0, 4.25, "node_crash west-0", "rank 1 (pid 4242) killed", True),
    (6.0, 6.0, "link east->west up", "RuntimeError: no backend to change links on", False),
    (8.0, 8.0, "restart west-0", "rank 1 restarted as pid 4300", True),
]


def fault_record(due_s, applied_s, what, effect, ok) -> dict:
    return {"kind": "fault", "due_s": due_s, "applied_s": applied_s, "time_unix": JOB_START_UNIX + applied_s,
            "what": what, "effect": effect, "ok": ok}


def trainer_record(kind, rank, job_time_s, **fields) -> dict:
    """A record stamped as the first writer of `rank` stamps it, at `job_time_s` after the job's start."""
    time_unix = JOB_START_UNIX + job_time_s
    return {"kind": kind, "rank": rank, "time_unix": time_unix, "time_s": time_unix - WRITERS_UNIX, **fields}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def add_faults(job_dir: Path, rows=HARNESS_ROWS) -> None:
    write_jsonl(job_dir / "faults.jsonl", [fault_record(*row) for row in rows])


def add_membership(job_dir: Path) -> None:
    """Rank 0 sees rank 1 lost at step 3 and admitted back at step 9; rank 1's restarted process
    appends to its file after a torn line, on a clock that starts again at 0, and rejoins."""
    rank0 = read_jsonl(job_dir / "rank0.jsonl")
    rank0 += [trainer_record("membership", 0, 5.5, step=3, live=[0], joined=[], lost=[1]),
              trainer_record("membership", 0, 10.8, step=9, live=[0, 1], joined=[1], lost=[])]
    write_jsonl(job_dir / "rank0.jsonl", sorted(rank0, key=lambda r: r["time_s"]))
    # The crashed process wrote until job time 4.25 (time_s 3.25: steps 0 and 1), then a torn line.
    first = [r for r in read_jsonl(job_dir / "rank1.jsonl") if r["time_s"] <= 3.25]
    restart_unix = JOB_START_UNIX + 9.0  # the restarted writer's origin: its time_s 0
    restarted = [{"kind": "start", "rank": 1, "time_unix": restart_unix + 0.5, "time_s": 0.5, "restarts": 1},
                 {"kind": "rejoin", "rank": 1, "time_unix": restart_unix + 1.7, "time_s": 1.7, "step": 9,
                  "restarts": 1, "live": [0, 1]},
                 {"kind": "step", "rank": 1, "time_unix": restart_unix + 2.7, "time_s": 2.7, "step": 10,
                  "step_s": 1.0, "loss": 0.2, "bytes_sent_total": 100, "comm_blocked_s": 0.1}]
    text = "".join(json.dumps(r) + "\n" for r in first) + '{"kind": "step", "ra'  # SIGKILL mid-line
    text += "".join(json.dumps(r) + "\n" for r in restarted)
    (job_dir / "rank1.jsonl").write_text(text)


def job_dir_of(run_dir: Path, label: str) -> Path:
    (job_dir,) = [d for d in (run_dir / "jobs").iterdir() if d.name.endswith(f"-{label}-seed0")]
    return job_dir


@pytest.fixture
def faulty_run(tmp_path) -> Path:
    """One run: `sync` with every kind of record above, `dts` without any fault."""
    run_dir = write_run(tmp_path / "runs", [FakeJob("sync", evals={4: 0.5, 9: 0.92}),
                                            FakeJob("dts", step_time_s=0.5, evals={9: 0.93})])
    add_faults(job_dir_of(run_dir, "sync"))
    add_membership(job_dir_of(run_dir, "sync"))
    return run_dir


def test_faults_frame_has_every_event_on_both_clocks(faulty_run):
    faults = load_run(faulty_run).faults
    assert list(faults.columns) == FAULT_COLUMNS
    assert set(faults["label"]) == {"sync"}
    assert list(faults["source"]) == ["fault", "fault", "fault", "membership", "fault", "fault", "rejoin",
                                      "membership"]
    assert list(faults["what"]) == ["link east->west down", "link west->east down", "node_crash west-0",
                                    "rank 1 lost", "link east->west up", "restart west-0", "rank 1 rejoined",
                                    "rank 1 joined"]
    # faults: time_s is applied_s; trainer records: their time_unix against the harness's zero
    assert list(faults["time_s"]) == pytest.approx([2.0, 2.0, 4.25, 5.5, 6.0, 8.0, 10.7, 10.8])
    assert list(faults["train_time_s"]) == pytest.approx([t + TO_TRAIN_S for t in faults["time_s"]])
    # a fault's step: rank 0's last finished step (step k ends at training time k + 1)
    assert faults["step"].tolist() == [pd.NA, pd.NA, 1, 3, 3, 5, 9, 9]
    by_what = faults.set_index("what")
    assert injection_failed(by_what.loc["link east->west up", "ok"])
    assert not injection_failed(by_what.loc["restart west-0", "ok"]) and by_what.loc["restart west-0", "ok"]
    assert "no backend" in by_what.loc["link east->west up", "effect"]
    assert by_what.loc["node_crash west-0", "effect"] == "rank 1 (pid 4242) killed"
    assert by_what.loc["node_crash west-0", "due_s"] == 4.0
    assert by_what.loc["rank 1 lost", "effect"] == "live: 0"
    assert by_what.loc["rank 1 rejoined", "effect"] == "admitted after 1 restart(s); live: 0, 1"
    assert by_what.loc["rank 1 rejoined", "rank"] == 1 and pd.isna(by_what.loc["rank 1 rejoined", "ok"])


def test_membership_and_rejoin_records_are_not_steps_or_evals(faulty_run, tmp_path):
    frames = load_run(faulty_run)
    assert set(frames.steps["kind"]) == {"step"} and set(frames.evals["kind"]) == {"eval"}
    sync = frames.steps[frames.steps["label"] == "sync"]
    assert len(sync[sync["rank"] == 0]) == 10
    # rank 1: two steps before the crash, then (after the torn line) one by the restarted process
    assert sorted(sync[sync["rank"] == 1]["step"]) == [0, 1, 10]
    summary = summarize(load_run(faulty_run)).set_index("label")
    assert summary.loc["sync", "steps"] == 10 and summary.loc["sync", "final_accuracy"] == pytest.approx(0.92)


def test_a_restarted_rank_stays_on_its_first_clock(faulty_run):
    steps = load_run(faulty_run).steps
    rank1 = steps[(steps["label"] == "sync") & (steps["rank"] == 1)].set_index("step")
    # its first step began at time_s 0.5; the restarted writer's step 10 ended 11.7 s after the
    # job's start, 10.7 s after the first writer's origin: training time 10.7 - 0.5
    assert rank1.loc[0, "train_time_s"] == pytest.approx(1.0)
    assert rank1.loc[10, "train_time_s"] == pytest.approx(10.2)
    assert rank1.loc[10, "time_s"] == pytest.approx(2.7)  # the record's own time_s is kept


def test_without_faults_jsonl_the_zero_is_the_earliest_writer(tmp_path):
    run_dir = write_run(tmp_path, [FakeJob("sync", evals={9: 0.9})])
    job_dir = job_dir_of(run_dir, "sync")
    rank0 = read_jsonl(job_dir / "rank0.jsonl")
    rank0.append({"kind": "membership", "rank": 0, "time_unix": WRITERS_UNIX + 3.0, "time_s": 3.0, "step": 1,
                  "live": [0], "joined": [], "lost": [1]})
    write_jsonl(job_dir / "rank0.jsonl", sorted(rank0, key=lambda r: r["time_s"]))
    (row,) = load_run(run_dir).faults.to_dict("records")
    assert row["source"] == "membership" and row["time_s"] == pytest.approx(3.0)
    assert row["train_time_s"] == pytest.approx(2.5) and row["step"] == 1


def test_no_faults_gives_an_empty_frame_with_the_columns(tmp_path):
    faults = load_run(write_run(tmp_path, [FakeJob("sync")])).faults
    assert not len(faults) and list(faults.columns) == FAULT_COLUMNS


def test_results_concatenate_faults_with_the_run(faulty_run, tmp_path):
    other = write_run(tmp_path / "runs", [FakeJob("sync")], name="calm")
    results = load_results([faulty_run, other])
    assert set(results.faults["run"]) == {"synthetic/20250101-000000"}
    assert results.faults["run_complete"].all() and len(results.faults) == 8


def test_report_lists_faults_in_time_order_and_marks_the_failed_one(faulty_run, tmp_path):
    calm = write_run(tmp_path / "runs", [FakeJob("sync", evals={9: 0.9})], name="calm")
    outcome = write_report([faulty_run, calm], tmp_path / "out")
    markdown = outcome.markdown.read_text()
    section = markdown[markdown.index("## Faults"):markdown.index("## Comparison figures")]
    assert "### synthetic/20250101-000000" in section and "calm/" not in section  # only runs with events
    assert "#### `sync` seed 0 at delay1 (`delay1-sync-seed0`)" in section and "`dts`" not in section
    order = ["link east->west down", "link west->east down", "node_crash west-0", "rank 1 lost",
             "link east->west up", "restart west-0", "rank 1 rejoined", "rank 1 joined"]
    positions = [section.index(f"| {what} |") for what in order]
    assert positions == sorted(positions)
    failed_row = next(line for line in section.splitlines() if "| link east->west up |" in line)
    assert failed_row.endswith("| **FAILED** |") and "no backend" in failed_row
    assert "| 4.25 | 2.75 | 1 | fault | node_crash west-0 | rank 1 (pid 4242) killed | yes |" in section
    assert "| 5.50 | 4.00 | 3 | membership | rank 1 lost | live: 0 | - |" in section
    assert "**1 fault injection(s) FAILED**: link east->west up" in section
    assert "Dashed vertical lines mark fault events" in markdown

    csv = pd.read_csv(outcome.faults_csv)
    assert outcome.faults_csv == tmp_path / "out" / "faults.csv"
    assert len(csv) == 8 and list(csv["what"]) == order
    assert ["" if pd.isna(v) else str(v) for v in csv["ok"]] == ["True", "True", "True", "", "False", "True", "", ""]
    per_run = {p.parent.name: pd.read_csv(p) for p in outcome.run_faults_csvs}
    assert len(per_run["synthetic-20250101-000000"]) == 8 and not len(per_run["calm-20250101-000000"])


def test_a_run_without_faults_has_no_faults_section(tmp_path):
    outcome = write_report([write_run(tmp_path / "runs", [FakeJob("sync", evals={9: 0.9})])], tmp_path / "out")
    markdown = outcome.markdown.read_text()
    assert "## Faults" not in markdown and "Dashed vertical lines" not in markdown
    csv = pd.read_csv(outcome.faults_csv)  # written anyway: the header, so scripts can rely on it
    assert not len(csv) and "what" in csv.columns


def test_many_trace_rows_are_one_line_and_one_mark(tmp_path):
    run_dir = write_run(tmp_path / "runs", [FakeJob("sync", evals={4: 0.5, 9: 0.92})])
    rows = [(1.0 + t, 1.0 + t, f"trace {pair} t={t}s", "delay 40 ms, rate 100 Mbit/s, loss 0%", True)
            for t in range(6) for pair in ("east->west", "west->east")]
    rows.append((4.0, 4.0, "node_crash west-0", "rank 1 (pid 4242) killed", True))
    add_faults(job_dir_of(run_dir, "sync"), sorted(rows))
    results = load_results([run_dir])
    marks = plots.fault_marks(results.faults)
    assert list(marks["text"]) == ["trace ×6", "crash west-0"]
    assert list(marks["x"]) == pytest.approx([1.0 + TO_TRAIN_S, 4.0 + TO_TRAIN_S])
    markdown = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert "| trace east->west ×6 (t=0s..t=5s) |" in markdown and "| trace west->east ×6 (t=0s..t=5s) |" in markdown
    assert "t=3s |" not in markdown
    assert len(pd.read_csv(tmp_path / "out" / "faults.csv")) == 13  # every row stays in the CSV


def test_training_curves_mark_each_fault(faulty_run):
    results = load_results([faulty_run])
    steps, evals = results.steps, results.evals
    figure = plots.loss_accuracy_vs_time(steps, evals, title="t", faults=results.faults)
    plain = plots.loss_accuracy_vs_time(steps, evals, title="t")
    expected_x = [t + TO_TRAIN_S for t in (2.0, 4.25, 6.0, 8.0)]  # both link directions: one mark
    for ax, plain_ax in zip(figure.axes, plain.axes):
        lines = plots.fault_lines(ax)
        assert [line.get_xdata()[0] for line in lines] == pytest.approx(expected_x)
        assert all(line.get_linestyle() == "--" and line.get_linewidth() < 1 for line in lines)
        assert [line.get_color() for line in lines] == [plots.PALETTE["sync"], plots.PALETTE["sync"],
                                                         plots.FAILED_FAULT_COLOR, plots.PALETTE["sync"]]
        assert plots.fault_texts(ax) == ["link east-west down", "crash west-0", "link east-west up (failed)",
                                         "restart west-0"]
        assert len(plots.series_lines(ax)) == len(plots.series_lines(plain_ax))  # marks are not data
        assert not plots.fault_lines(plain_ax) and not plots.fault_texts(plain_ax)
    labels = [t for t in figure.axes[1].texts if t.get_gid() == plots.FAULT_GID]
    assert all(t.get_rotation() == 90 for t in labels)
    failed = next(t for t in labels if "failed" in t.get_text())
    assert failed.get_color() == plots.FAILED_FAULT_COLOR


def test_nearby_fault_marks_share_one_label(faulty_run):
    results = load_results([faulty_run])
    faults = results.faults[results.faults["source"] == "fault"].copy()
    crash = faults["what"] == "node_crash west-0"
    link_down_x = faults.loc[faults["what"] == "link east->west down", "train_time_s"].iloc[0]
    faults.loc[crash, "train_time_s"] = link_down_x + 0.05
    figure = plots.loss_accuracy_vs_time(results.steps, results.evals, faults=faults)
    assert plots.fault_texts(figure.axes[0])[0] == "link east-west down / crash west-0"
    assert len(plots.fault_lines(figure.axes[0])) == 4


def test_report_progress_figure_has_the_marks(faulty_run, tmp_path):
    results = load_results([faulty_run])
    from harness.report import _progress_figures

    (made,), _ = _progress_figures(results)
    run, network, title, figure = made
    assert network == "delay1" and len(plots.fault_lines(figure.axes[1])) == 4


@pytest.mark.parametrize("what, label", [
    ("node_crash b-0", "crash b-0"),
    ("restart b-0", "restart b-0"),
    ("link a->b down", "link a-b down"),
    ("link b->a up", "link a-b up"),
    ("link a->b change", "link a-b change"),
    ("loss burst a->b 30%", "loss 30%"),
    ("loss burst a->b ends", "loss ends"),
    ("trace a->b t=5s", "trace"),
    ("straggler b-0 x3", "straggler b-0 x3"),
    ("straggler b-0 ends", "straggler b-0 ends"),
    ("something new", "something new"),
])
def test_fault_label(what, label):
    assert plots.fault_label(what) == label
