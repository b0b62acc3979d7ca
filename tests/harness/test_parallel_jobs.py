"""`wanbench run --jobs N` (harness/run.py `_run_sim_jobs_at_once`): sim jobs at once, each its own
process, with the results of a run one job at a time.

The first test runs the real simulator (trainers on a virtual clock); the others the light
stand-in engine of tests/harness/test_resume.py, wrapped to stamp when each job's process ran.
"""

import io
import json
import os
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

import harness.jobs as jobs_module
import harness.run as run_module
from emulator import helpers
from harness import cli
from harness.scenario import load_scenario
from tests.harness.test_resume import LIGHT_ENGINE, SCENARIO, STUB_EVALUATOR, TUNED, WALL_CLOCK_COLUMNS

# The stand-in engine, stamping its start and end (wall clock) into its job folder.
STAMPED_ENGINE = (
    "import sys, time\nfrom pathlib import Path\n"
    "Path(sys.argv[1], 'ran').write_text(f'{time.time()}')\n"
    + LIGHT_ENGINE
    + "Path(sys.argv[1], 'ran').write_text(Path(sys.argv[1], 'ran').read_text() + f' {time.time()}')\n"
)


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def _summary(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "summary.csv").drop(columns=WALL_CLOCK_COLUMNS)


@pytest.fixture
def stamped(tmp_path, monkeypatch):
    engine, evaluator = tmp_path / "engine.py", tmp_path / "evaluator.py"
    engine.write_text(STAMPED_ENGINE)
    evaluator.write_text(STUB_EVALUATOR)
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(engine), str(job_dir)])
    monkeypatch.setattr(jobs_module.Evaluator, "_argv", lambda self: [sys.executable, str(evaluator), str(self.job_dir)])
    monkeypatch.setattr("emulator.backends.base.STATE_ROOT", tmp_path / "state")
    monkeypatch.setenv("WANBENCH_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("WANBENCH_PREFIX", "par" + str(os.getpid() % 1000))
    monkeypatch.setenv("ENGINE_PAUSE_S", "0.4")


def _intervals(run_dir: Path) -> list[tuple[float, float]]:
    return [tuple(map(float, (job / "ran").read_text().split())) for job in sorted((run_dir / "jobs").glob("*"))]


def _most_at_once(intervals) -> int:
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


@pytest.mark.slow
def test_two_at_once_on_the_real_simulator_give_the_summary_of_one_at_a_time(write_yaml, tmp_path):
    path = write_yaml(SCENARIO, "s.yaml")  # 2 algorithms x 2 seeds, 6 steps, 2 nodes
    runs = {jobs: run_module.run_scenario(load_scenario(path), "sim", tmp_path / f"jobs{jobs}", console=_quiet(),
                                          jobs=jobs) for jobs in (1, 2)}
    one, two = (_summary(runs[jobs].run_dir) for jobs in (1, 2))
    assert len(one) == 4 and set(one["status"]) == {"ok"}
    pd.testing.assert_frame_equal(one, two)
    for job in (runs[1].run_dir / "jobs").glob("*"):  # every rank's steps, record by record
        for records in sorted(job.glob("rank*.jsonl")):
            steps = [(r["step"], r["loss"], r["time_s"]) for r in map(json.loads, records.read_text().splitlines())
                     if r["kind"] == "step"]
            other = runs[2].run_dir / "jobs" / job.name / records.name
            assert steps == [(r["step"], r["loss"], r["time_s"]) for r in map(json.loads, other.read_text().splitlines())
                             if r["kind"] == "step"]


def test_jobs_of_every_point_overlap_at_most_n_and_the_tuned_run_equals_one_at_a_time(stamped, write_yaml, tmp_path):
    # tuning: 2 lr x 2 algorithms on seed 0, then 2 x 2 reported seeds, at each of two network points
    path = write_yaml(TUNED + "sweep: {delay_scale: [1.0, 2.0]}\n", "s.yaml")
    runs = {jobs: run_module.run_scenario(load_scenario(path), "sim", tmp_path / f"jobs{jobs}", console=_quiet(),
                                          jobs=jobs) for jobs in (1, 3)}
    pd.testing.assert_frame_equal(_summary(runs[1].run_dir), _summary(runs[3].run_dir))
    assert len(_summary(runs[1].run_dir)) == 16
    assert (runs[1].run_dir / "tuning.json").read_text() == (runs[3].run_dir / "tuning.json").read_text()
    assert _most_at_once(_intervals(runs[1].run_dir)) == 1
    assert _most_at_once(_intervals(runs[3].run_dir)) == 3
    ran = dict(zip(sorted(p.name for p in (runs[3].run_dir / "jobs").glob("*")), _intervals(runs[3].run_dir)))
    # the points do not take turns: a job of one ran while a job of the other did
    assert any(a[0] < b[1] and b[0] < a[1] for name_a, a in ran.items() for name_b, b in ran.items()
               if name_a.startswith("delay1-") and name_b.startswith("delay2-"))
    # the picks need every tuning job's result: no reported job starts before the last one ended
    tuning = [name for name in ran if "-lr" in name]  # delay1-sync-lr0.05-seed0; reported: delay1-sync-seed1
    assert len(tuning) == 8
    assert max(ran[j][1] for j in tuning) <= min(ran[j][0] for j in ran if j not in tuning)

def test_an_interrupted_parallel_run_stops_its_running_jobs_and_resumes_to_the_same_summary(stamped, write_yaml,
                                                                                            tmp_path, monkeypatch):
    path = write_yaml(SCENARIO, "s.yaml")
    reference = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "reference", console=_quiet())
    printed = []
    original = run_module._print_job_line

    def interrupt_after_first(console, spec, outcome, state):
        original(console, spec, outcome, state)
        printed.append(spec.job.job_id)
        raise KeyboardInterrupt  # as Ctrl-C lands in the main thread while the other job runs

    monkeypatch.setattr(run_module, "_print_job_line", interrupt_after_first)
    # Only the first job to start ends on its own: the other is still running when its line
    # interrupts, the third has just started, the fourth never does (were all quick, the second
    # could end with the first and both others start before the interrupt).
    (tmp_path / "gate").mkdir()
    monkeypatch.setenv("ENGINE_FIRST_ALONE_FAST", str(tmp_path / "gate"))
    monkeypatch.setenv("ENGINE_SLOW_S", "60")
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_module.run_scenario(load_scenario(path), "sim", tmp_path / "killed", console=_quiet(), jobs=2)
    assert time.monotonic() - started < 30
    assert helpers.leftover_helpers(os.environ["WANBENCH_PREFIX"]) == []  # the running job's processes ended
    run_dir = next((tmp_path / "killed").glob("*/*"))
    assert (run_dir / "INTERRUPTED").exists() and not (run_dir / "COMPLETE").exists()
    statuses = {job.name: json.loads((job / "job.json").read_text())["status"]
                for job in (run_dir / "jobs").glob("*") if (job / "job.json").exists()}
    assert statuses[printed[0]] == "ok" and "interrupted" in statuses.values(), statuses
    # the first ok, the running two interrupted, the fourth (not started) without a job.json
    assert sorted(statuses.values()) == ["interrupted", "interrupted", "ok"], statuses
    monkeypatch.setattr(run_module, "_print_job_line", original)
    monkeypatch.delenv("ENGINE_FIRST_ALONE_FAST")
    resumed = run_module.resume_run(run_dir, console=_quiet(), jobs=2)
    pd.testing.assert_frame_equal(_summary(reference.run_dir), _summary(resumed.run_dir))


def test_jobs_below_one_is_refused_naming_the_option(write_yaml, capsys):
    path = write_yaml(SCENARIO, "s.yaml")
    assert cli.main(["run", path, "--jobs", "0"]) == cli.EXIT_BAD_INPUT
    assert "--jobs" in capsys.readouterr().err
