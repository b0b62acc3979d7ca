"""One definition of "equal budget" (harness/budget.py): the stop rule waits for what the report
says, the summary reads accuracy there, and a job that did not get there has no delta and a reason."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from emulator.plan import make_plan
from harness.budget import EqualBudget
from harness.jobs import StopDecider
from harness.jobspec import job_spec
from harness.report import write_report
from harness.results import load_run, summarize
from harness.scenario import load_scenario
from tests.harness.jobspec_golden import SCENARIO, TRACE
from tests.harness.test_report import FakeJob, write_run

TARGET = 0.9


def _evals():
    """An evaluation every 5 steps (0.5 s a step); the target is first reached after 20 steps."""
    for steps_done in range(5, 105, 5):
        yield {"kind": "eval", "step": steps_done - 1, "train_time_s": steps_done * 0.5,
               "accuracy": 0.5 if steps_done < 20 else 0.95}


@pytest.mark.parametrize("budgets, stops_after_steps", [
    ("", 20),                                      # no budget: stops at the target
    ("budget_steps: 40", 40),
    ("budget_time_s: 30", 60),                     # 30 s at 0.5 s a step
    ("budget_steps: 40, budget_time_s: 12", 40),   # both passed at 40 steps (20 s)
    ("budget_steps: 30, budget_time_s: 35", 70),
])
def test_the_stop_rule_waits_for_the_budget_the_report_states(tmp_path, budgets, stops_after_steps):
    """The stop rule is given the budget through the job spec (StopBudgets) as a run gives it; the
    report's sentence, for the run this job ended, names the budgets it waited for, and no budget
    where the scenario states none (then the point every job got to: here where it stopped)."""
    (tmp_path / "trace.csv").write_text(TRACE)
    stop = "{steps: 200, time_budget_s: 300, target_accuracy: 0.9" + (", " + budgets if budgets else "") + "}"
    (tmp_path / "s.yaml").write_text(SCENARIO.replace("backend: sim", "backend: tun").replace(
        "stop: {steps: 6, time_budget_s: 30}", "stop: " + stop))
    scenario = load_scenario(tmp_path / "s.yaml")
    plan = make_plan(scenario.topology_for(scenario.network_points()[0]))
    spec = job_spec(scenario, scenario.jobs[0], tmp_path / "job", plan, "tun")
    spec.job_dir.mkdir()
    decider = StopDecider(spec.job_dir, spec.stop.target_accuracy, spec.stop.budget)
    decision = None
    with open(spec.job_dir / "eval.jsonl", "a") as evals:
        for record in _evals():
            evals.write(json.dumps(record) + "\n")
            evals.flush()
            decision = decider.poll(0.0)
            if decision is not None:
                break
    assert decision is not None and decision["eval_step"] + 1 == stops_after_steps
    stated = EqualBudget.from_stop(scenario.spec.stop)
    assert stated == spec.stop.budget  # the stop rule's and the summary's budget are one
    budget = stated.resolved([(stops_after_steps, stops_after_steps * 0.5)])
    sentence = budget.sentence()
    if not budgets:
        assert "(no budget stated)" in sentence and "only after" not in sentence
        assert f"equal budgets of {stops_after_steps} steps and {stops_after_steps * 0.5:g} s of training" in sentence
    else:
        waited = [f"{budget.steps} steps"] * stated.steps_stated + [f"{budget.time_s:g} s of training"] * stated.time_stated
        assert " and ".join(waited) + " (stated; a job stops at the target only after" in sentence
        # what the stop rule waited for, and no further
        assert all(stops_after_steps >= value for value in [stated.steps or 0, 2 * (stated.time_s or 0)])
    assert sentence.endswith(f"accuracy_delta_vs_sync at {budget.describe_compared()}")
    assert budget.waits_for(stops_after_steps, stops_after_steps * 0.5)


def _short_job_hit_its_time_limit(run_dir, label):
    path = next((run_dir / "jobs").glob(f"*-{label}-seed0")) / "rank0.jsonl"
    path.write_text(path.read_text().replace('"stop_reason": "steps"', '"stop_reason": "time_budget"'))


def _jobs():
    return [FakeJob("sync", evals={4: 0.5, 9: 0.92, 19: 0.95}, steps=20),
            FakeJob("dts", evals={4: 0.91, 9: 0.93, 19: 0.96}, steps=20),
            FakeJob("qsgd", label="compressed", step_time_s=3.0, evals={4: 0.6, 7: 0.7}, steps=8),
            FakeJob("local_sgd", label="crashed", evals={2: 0.3}, steps=3, status="failed")]


def test_a_job_short_of_the_stated_budget_has_no_delta_and_the_report_says_why(tmp_path):
    """budget_steps 10: the compressed job ended at its time limit after 8 steps, the crashed one
    failed after 3: no delta for them (not one taken at the time budget or at their end), a reason
    each; the others' delta is taken at 10 steps."""
    run_dir = write_run(tmp_path, _jobs(), stop={"budget_steps": 10, "budget_time_s": 12.0})
    _short_job_hit_its_time_limit(run_dir, "compressed")
    table = summarize(load_run(run_dir)).set_index("label")
    assert table.loc["dts", "accuracy_delta_vs_sync"] == pytest.approx(0.93 - 0.92)
    assert pd.isna(table.loc["dts", "budget_not_reached"])
    for label in ("compressed", "crashed"):
        assert pd.isna(table.loc[label, "accuracy_delta_vs_sync"]), label
    assert table.loc["compressed", "budget_not_reached"] == (
        "ended at its time limit (time_budget_s) before the budget of 10 steps: last evaluation after 8 steps "
        "(24 s of training)")
    assert table.loc["crashed", "budget_not_reached"].startswith("job failed before the budget of 10 steps")
    markdown = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert ("- job `compressed` seed 0 at delay1: no accuracy_delta_vs_sync: ended at its time limit "
            "(time_budget_s) before the budget of 10 steps") in markdown
    assert "- job `crashed` seed 0 at delay1: no accuracy_delta_vs_sync: job failed" in markdown
    assert "equal budgets of 10 steps and 12 s of training (stated; a job stops at the target only after both)" in markdown


def test_without_a_budget_every_job_that_ended_ok_is_compared_where_all_got(tmp_path):
    """No budget stated: the default is the furthest every job that ended ok got (the compressed
    job's 8 steps; sync's and dts's 20 s); the failed job does not pull it down and has no delta, with its reason."""
    run_dir = write_run(tmp_path, _jobs())
    frames = load_run(run_dir)
    assert (frames.budget.steps, frames.budget.time_s) == (8, pytest.approx(20.0))
    assert not frames.budget.stated
    table = summarize(frames).set_index("label")
    # at 8 steps: sync's and dts's last evaluations within it are after 5 steps
    assert table.loc["dts", "accuracy_delta_vs_sync"] == pytest.approx(0.91 - 0.5)
    assert table.loc["compressed", "accuracy_delta_vs_sync"] == pytest.approx(0.7 - 0.5)
    assert pd.isna(table.loc["crashed", "accuracy_delta_vs_sync"])
    assert "job failed" in table.loc["crashed", "budget_not_reached"]
    markdown = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert "equal budgets of 8 steps and 20 s of training, the furthest every job that ended ok got" in markdown


def test_a_job_whose_sync_did_not_reach_the_budget_says_so(tmp_path):
    jobs = [FakeJob("sync", evals={4: 0.5}, steps=5, status="failed"), FakeJob("dts", evals={4: 0.9, 9: 0.93}, steps=10)]
    table = summarize(load_run(write_run(tmp_path, jobs, stop={"budget_steps": 10}))).set_index("label")
    assert pd.isna(table.loc["dts", "accuracy_delta_vs_sync"])
    assert table.loc["dts", "budget_not_reached"].startswith("its sync (sync): job failed before the budget of 10 steps")


def test_a_budget_before_the_first_evaluation_says_so(tmp_path):
    jobs = [FakeJob("sync", evals={4: 0.5, 9: 0.92}, steps=10), FakeJob("dts", evals={4: 0.91, 9: 0.93}, steps=10)]
    table = summarize(load_run(write_run(tmp_path, jobs, stop={"budget_steps": 3}))).set_index("label")
    assert pd.isna(table.loc["dts", "accuracy_delta_vs_sync"])
    assert table.loc["dts", "budget_not_reached"] == "its first evaluation came after the budget of 3 steps"


def test_only_a_time_budget_compares_on_time(tmp_path):
    """budget_time_s alone: the delta is read at that training time for every job, whatever their steps."""
    jobs = [FakeJob("sync", evals={4: 0.5, 9: 0.92}, steps=10),
            FakeJob("dts", step_time_s=0.5, evals={4: 0.91, 9: 0.93, 19: 0.96}, steps=20)]
    table = summarize(load_run(write_run(tmp_path, jobs, stop={"budget_time_s": 6.0}))).set_index("label")
    # within 6 s: sync's evaluation after 5 steps (5 s), dts's after 10 steps (5 s)
    assert table.loc["dts", "accuracy_delta_vs_sync"] == pytest.approx(0.93 - 0.5)


@pytest.mark.slow
def test_the_quickstart_on_sim_compares_every_job_at_one_budget_all_reached(tmp_path):
    """The README's scenario as committed, on sim: its report names one budget, every job got
    there, and every delta is taken there (no job left to its own end point)."""
    import io
    from pathlib import Path

    from rich.console import Console

    import harness.run as run_module

    scenario = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.yaml")
    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=Console(file=io.StringIO()))
    budget = completed.frames.budget
    table = completed.summary
    assert len(table) == 4 and (table["status"] == "ok").all()
    assert budget.compared_on == "steps" and budget.steps <= table["steps"].min()
    assert table["accuracy_at_step_budget"].notna().all() and table["accuracy_delta_vs_sync"].notna().all()
    assert table["budget_not_reached"].isna().all()
    markdown = write_report([completed.run_dir], tmp_path / "out").markdown.read_text()
    assert f"accuracy_delta_vs_sync at {budget.steps} steps" in markdown
    assert f"equal budgets of {budget.steps} steps" in markdown and "3000 steps" not in markdown
