"""Tuned baselines by one protocol (`tuning:`): the scenario block's checks, the two phases' jobs,
the pick rule, and a run on backend sim that tunes on one seed and reports on the others."""

import io
import json
import sys
import textwrap

import pandas as pd
import pytest

import harness.jobs as jobs_module
import harness.run as run_module
from emulator.schema import ConfigError
from harness.report import write_report
from harness.results import SUMMARY_COLUMNS
from harness.scenario import load_scenario
from harness.tuning import pick, rank_candidates
from tests.harness.test_sim_harness import FAKE_ENGINE

SCENARIO = textwrap.dedent("""
    topology:
      name: tunet
      address_pool: 10.236.0.0/24
      regions: {a: {nodes: 2}, b: {nodes: 2}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload: {model: {name: mlp, params: {hidden_sizes: [16]}}, dataset: {name: digits}, lr: 0.05, eval_every: 2}
    stop: {steps: 10, target_accuracy: 0.8}
    algorithms: [{name: sync}, {name: local_sgd, params: {H: 2}}]
    seeds: [0, 1, 2]
    tuning: {grid: {lr: [0.05, 0.1]}, seed: 0}
    sim: {compute_s: 0.002, overhead_s: 0.0005}
""")


def _load(write_yaml, text=SCENARIO, name="s.yaml"):
    return load_scenario(write_yaml(text, name))


# --- the scenario block ------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, field, message", [
    ("seed: 0}", "seed: 5}", "tuning.seed", "5 is not among seeds [0, 1, 2]"),
    ("seeds: [0, 1, 2]", "seeds: [0]", "seeds", "give at least one more seed"),
    ("grid: {lr: [0.05, 0.1]}", "grid: {lrr: [0.05, 0.1]}, linear_scaling: false", "tuning.grid.lrr", ""),
    ("grid: {lr: [0.05, 0.1]}", "grid: {lr: [0.05, -0.1]}", "tuning.grid.lr", ""),
    ("grid: {lr: [0.05, 0.1]}", "grid: {lr: []}", "tuning.grid", "give at least one value"),
    ("grid: {lr: [0.05, 0.1]}", "grid: {lr: [0.1, 0.1]}", "tuning.grid", "listed twice"),
    ("grid: {lr: [0.05, 0.1]}", "grid: {optimizer.momentum: [0.5, 0.9]}", "tuning",
     "linear_scaling scales lr, and the grid has no lr"),
    ("seed: 0}", "seed: 0, by: fastest}", "tuning.by", ""),
    ("seed: 0}", "seed: 0, pick: best}", "tuning.pick", ""),
    ("{name: local_sgd, params: {H: 2}}", "{name: local_sgd, params: {H: 2}, workload: {lr: 0.3}}",
     "algorithms[1].workload.lr", "tuning.grid.lr gives every algorithm the same values"),
    ("sim: {", "sweep: {workload: {sync: {lr: [0.1, 0.2]}}}\nsim: {", "sweep.workload.sync",
     "tuning.grid already tunes every algorithm"),
    ("stop: {steps: 10, target_accuracy: 0.8}", "stop: {steps: 10}", "tuning.by",
     "time_to_target needs stop.target_accuracy"),
])
def test_a_bad_tuning_block_names_the_file_and_field(write_yaml, old, new, field, message):
    assert old in SCENARIO
    path = write_yaml(SCENARIO.replace(old, new), "bad.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert caught.value.source == path and caught.value.field == field, str(caught.value)
    assert message in caught.value.message and "\n" not in str(caught.value)


def test_a_scenario_without_tuning_saves_its_jobs_as_before(write_yaml):
    plain = SCENARIO.replace("tuning: {grid: {lr: [0.05, 0.1]}, seed: 0}\n", "")
    scenario = _load(write_yaml, plain)
    assert scenario.tuning_groups == [] and "tuning" not in scenario.spec.model_dump()
    assert all("phase" not in job.record() and "tuning_group" not in job.record() for job in scenario.jobs)
    assert len(scenario.jobs) == 6


# --- the two phases' jobs ----------------------------------------------------------------------


def test_the_tuning_phase_runs_every_algorithm_at_every_grid_value_on_the_tuning_seed(write_yaml):
    scenario = _load(write_yaml)
    jobs = {job.job_id: job for job in scenario.jobs}
    # sync averages 4 workers' gradients: the linear-scaling value 0.05 x 4 = 0.2 is its third candidate
    assert sorted(jobs) == ["delay1-local_sgd-lr0.05-seed0", "delay1-local_sgd-lr0.1-seed0",
                            "delay1-sync-lr0.05-seed0", "delay1-sync-lr0.1-seed0", "delay1-sync-lr0.2-seed0"]
    for job in scenario.jobs:
        assert (job.phase, job.seed, job.tuning_group) == ("tuning", 0, job.base_label)
        assert job.trainer_config["lr"] == job.tuned["lr"] and job.trainer.lr == job.tuned["lr"]
    groups = {group.label: group for group in scenario.tuning_groups}
    assert groups["sync"].candidates == [{"lr": 0.05}, {"lr": 0.1}, {"lr": 0.2}]
    assert (groups["sync"].workers, groups["sync"].linear_scaled) == (4, {"lr": 0.2})
    assert (groups["local_sgd"].workers, groups["local_sgd"].linear_scaled) == (1, None)
    assert groups["local_sgd"].candidates == [{"lr": 0.05}, {"lr": 0.1}]


def test_an_integer_grid_key_reaches_the_trainer_as_an_integer(write_yaml):
    """A warm-up's length is a number of steps: the grid keeps 25 an int (a float 25.0 is refused by
    the trainer's config) and the lr a float, and the label states both."""
    text = SCENARIO.replace("grid: {lr: [0.05, 0.1]}, seed: 0}",
                            "grid: {lr: [0.1], lr_schedule.warmup_steps: [2, 4]}, seed: 0, linear_scaling: false}")
    scenario = _load(write_yaml, text)
    sync = sorted((job for job in scenario.jobs if job.algorithm == "sync"), key=lambda job: job.label)
    assert [job.label for job in sync] == ["sync-lr0.1-warmup_steps2", "sync-lr0.1-warmup_steps4"]
    assert [job.trainer.lr_schedule.warmup_steps for job in sync] == [2, 4]
    assert all(type(job.tuned["lr_schedule.warmup_steps"]) is int and job.trainer.lr == 0.1 for job in sync)


def test_the_reported_phase_runs_the_other_seeds_at_the_pick(write_yaml):
    group = next(g for g in _load(write_yaml).tuning_groups if g.label == "sync")
    reported = group.reported_jobs({"lr": 0.2})
    assert [(job.job_id, job.label, job.phase, job.seed) for job in reported] == [
        ("delay1-sync-seed1", "sync", "reported", 1), ("delay1-sync-seed2", "sync", "reported", 2)]
    assert all(job.trainer_config["lr"] == 0.2 and job.tuned == {"lr": 0.2} for job in reported)
    with pytest.raises(ValueError, match="not one of its candidates"):
        group.reported_jobs({"lr": 0.3})


def test_linear_scaling_is_not_added_twice_nor_where_switched_off(write_yaml):
    in_grid = _load(write_yaml, SCENARIO.replace("[0.05, 0.1]", "[0.05, 0.2]"))
    sync = next(g for g in in_grid.tuning_groups if g.label == "sync")
    assert sync.candidates == [{"lr": 0.05}, {"lr": 0.2}] and sync.linear_scaled == {"lr": 0.2}
    off = _load(write_yaml, SCENARIO.replace("seed: 0}", "seed: 0, linear_scaling: false}"))
    assert all(len(g.candidates) == 2 for g in off.tuning_groups)


def test_every_network_point_and_swept_variant_is_tuned_apart(write_yaml):
    swept = SCENARIO.replace("sim: {", "sweep: {delay_scale: [1, 4], params: {local_sgd: {H: [2, 8]}}}\nsim: {")
    groups = _load(write_yaml, swept).tuning_groups
    assert sorted((g.base_point.key, g.label) for g in groups) == [
        ("delay1", "local_sgd-H2"), ("delay1", "local_sgd-H8"), ("delay1", "sync"),
        ("delay4", "local_sgd-H2"), ("delay4", "local_sgd-H8"), ("delay4", "sync")]


def test_the_synchronous_parameter_server_averages_every_worker_and_the_async_one_does_not(write_yaml):
    ps = SCENARIO.replace("{name: sync}, {name: local_sgd, params: {H: 2}}", "{name: ps_sync}, {name: async_ps}")
    groups = {group.label: group for group in _load(write_yaml, ps.replace("backend: sim\n", "")).tuning_groups}
    assert (groups["ps_sync"].workers, groups["ps_sync"].linear_scaled) == (4, {"lr": 0.2})
    # async_ps: its server on an extra node; each worker's gradient is applied alone
    assert groups["async_ps"].network.extra_servers == 1
    assert (groups["async_ps"].workers, groups["async_ps"].linear_scaled) == (1, None)


# --- the pick rule -----------------------------------------------------------------------------


def _candidates(*rows):
    columns = ["status", "time_to_target_s", "accuracy_at_budget", "loss_at_budget"]
    return pd.DataFrame([dict(zip(columns, row)) for row in rows], index=[f"c{i}" for i in range(len(rows))])


def test_time_to_target_picks_the_fastest_and_ranks_one_that_never_got_there_last():
    table = _candidates(("ok", None, 0.99, 0.1),   # never reached the target, though the most accurate
                        ("ok", 3.0, 0.90, 0.5),
                        ("ok", 2.0, 0.85, 0.6))
    assert rank_candidates(table, "time_to_target") == ["c2", "c1", "c0"]
    assert pick(table, "time_to_target") == "c2"


def test_a_tie_goes_to_the_more_accurate_then_the_lower_loss_then_the_first_listed():
    assert pick(_candidates(("ok", 2.0, 0.85, 0.6), ("ok", 2.0, 0.90, 0.7)), "time_to_target") == "c1"
    assert pick(_candidates(("ok", 2.0, 0.90, 0.6), ("ok", 2.0, 0.90, 0.5)), "time_to_target") == "c1"
    assert pick(_candidates(("ok", 2.0, 0.90, 0.5), ("ok", 2.0, 0.90, 0.5)), "time_to_target") == "c0"
    # none reached the target: the most accurate at the budget
    assert pick(_candidates(("ok", None, 0.70, 0.5), ("ok", None, 0.75, 0.9)), "time_to_target") == "c1"


def test_the_other_rules_pick_by_accuracy_or_loss_at_the_budget():
    table = _candidates(("ok", 2.0, 0.85, 0.40), ("ok", 3.0, 0.90, 0.45), ("ok", None, 0.80, 0.30))
    assert pick(table, "accuracy_at_budget") == "c1"
    assert pick(table, "loss") == "c2"
    assert pick(_candidates(("ok", 3.0, 0.9, 0.4), ("ok", 2.0, 0.9, 0.4)), "accuracy_at_budget") == "c1"


def test_a_failed_candidate_is_never_picked():
    assert pick(_candidates(("failed", 1.0, 0.99, 0.1), ("ok", 5.0, 0.80, 0.9)), "time_to_target") == "c1"
    assert pick(_candidates(("failed", 1.0, 0.99, 0.1), ("timeout", None, None, None)), "time_to_target") is None


# --- a run -------------------------------------------------------------------------------------

# The stand-in engine of test_sim_harness, with accuracy that depends on the learning rate: at
# lr 0.1 (local SGD's best) and 0.2 (sync's: the linear-scaling value) it climbs fastest, at lr
# 0.05 slowest; and the seed shifts it a little, so the seeds' rows differ.
LR_ENGINE = FAKE_ENGINE.replace(
    'write("eval", t, step=step, accuracy=0.5 + 0.05 * step)',
    'best = 0.2 if config.algorithm.name == "sync" else 0.1\n'
    '                    slope = 0.06 if abs(config.lr - best) < 1e-9 else (0.04 if config.lr >= 0.1 else 0.02)\n'
    '                    write("eval", t, step=step, accuracy=min(1.0, 0.5 + slope * step + 0.001 * config.seed), '
    'loss=1.0 - slope * step)')


@pytest.fixture
def lr_engine(tmp_path, monkeypatch):
    script = tmp_path / "lr_engine.py"
    script.write_text(LR_ENGINE)
    assert script.read_text() != FAKE_ENGINE  # the accuracy line was found and replaced
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(script), str(job_dir)])


@pytest.mark.slow
def test_a_tuned_run_picks_on_the_tuning_seed_and_reports_on_the_others(lr_engine, write_yaml, tmp_path):
    from rich.console import Console

    console = io.StringIO()
    completed = run_module.run_scenario(_load(write_yaml), "sim", tmp_path / "runs",
                                        console=Console(file=console, width=300))
    run_dir = completed.run_dir
    assert (run_dir / "COMPLETE").exists()
    tuning = json.loads((run_dir / "tuning.json").read_text())
    assert (tuning["grid"], tuning["seed"], tuning["by"], tuning["reported_seeds"]) == ({"lr": [0.05, 0.1]}, 0,
                                                                                       "time_to_target", [1, 2])
    picks = {record["label"]: record for record in tuning["picks"]}
    assert picks["sync"]["pick"] == {"lr": 0.2} and picks["local_sgd"]["pick"] == {"lr": 0.1}
    scaled = [c for c in picks["sync"]["candidates"] if c.get("linear_scaling")]
    assert [c["values"] for c in scaled] == [{"lr": 0.2}]
    # every candidate's scores are there; at lr 0.05 sync never reaches the target in 10 steps
    times = {c["values"]["lr"]: c["time_to_target_s"] for c in picks["sync"]["candidates"]}
    assert times[0.2] < times[0.1] and times[0.05] is None
    assert all(c["accuracy_at_budget"] is not None for c in picks["sync"]["candidates"])
    assert "tuning: sync at delay1: pick {'lr': 0.2}" in console.getvalue()

    summary = pd.read_csv(run_dir / "summary.csv")
    assert list(summary.columns) == [*SUMMARY_COLUMNS[:SUMMARY_COLUMNS.index("seed") + 1], "phase",
                                     *SUMMARY_COLUMNS[SUMMARY_COLUMNS.index("seed") + 1:]]
    tuned = summary[summary["phase"] == "tuning"]
    reported = summary[summary["phase"] == "reported"].set_index(["label", "seed"])
    assert len(tuned) == 5 and set(tuned["seed"]) == {0}
    assert sorted(reported.index) == [("local_sgd", 1), ("local_sgd", 2), ("sync", 1), ("sync", 2)]
    assert reported.loc[("sync", 1), "tuned"] == "lr=0.2" and reported.loc[("local_sgd", 2), "tuned"] == "lr=0.1"
    # each reported job against the reported sync of its seed, at sync's pick: sync at lr 0.2
    # climbs 0.06 a step, local SGD at lr 0.1 as fast: the same time to target, speedup 1
    assert reported.loc[("sync", 1), "speedup_vs_sync"] == pytest.approx(1.0)
    assert reported.loc[("local_sgd", 1), "speedup_vs_sync"] == pytest.approx(
        reported.loc[("sync", 1), "time_to_target_s"] / reported.loc[("local_sgd", 1), "time_to_target_s"])
    scenario_json = json.loads((run_dir / "scenario.json").read_text())
    assert sorted(j["phase"] for j in scenario_json["jobs"]) == ["reported"] * 4 + ["tuning"] * 5
    assert scenario_json["spec"]["tuning"]["grid"] == {"lr": [0.05, 0.1]}

    markdown = write_report([run_dir], tmp_path / "report").markdown.read_text()
    assert "**tuned by one protocol**: every algorithm ran the same grid, lr in {0.05, 0.1}" in markdown
    assert "on the tuning seed 0" in markdown and "reported seeds (1, 2) only" in markdown
    assert "| delay1 | sync | lr=0.2 |" in markdown and "lr=0.2 (linear scaling):" in markdown
    assert "| delay1 | local_sgd | lr=0.1 |" in markdown
    table = markdown.split("| network | label | seed |")[1].split("\n\n")[0]
    assert "sync-lr" not in table and "| delay1 | sync | 1 |" in table  # the table: reported seeds only


# --- the summary and the report of a tuned run, from hand-made records -------------------------


def _tuned_run(tmp_path):
    """sync's tuning candidate on seed 0 reaches 0.9 at step 5 (quicker than its reported run,
    at step 7); dts's reported run at step 3. Ratios must use the reported sync."""
    from tests.harness.test_report import FakeJob, write_run

    jobs = [FakeJob("sync", label="sync-lr0.1", seed=0, evals={1: 0.5, 5: 0.95}),
            FakeJob("sync", label="sync", seed=1, evals={1: 0.5, 7: 0.95}),
            FakeJob("dts", label="dts", seed=1, evals={1: 0.5, 3: 0.95})]
    run_dir = write_run(tmp_path, jobs)
    phases = {"sync-lr0.1": ("tuning", {"lr": 0.1}), "sync": ("reported", {"lr": 0.1}),
              "dts": ("reported", {"lr": 0.3})}
    for job_dir in (run_dir / "jobs").iterdir():
        info = json.loads((job_dir / "job.json").read_text())
        phase, tuned = phases[info["label"]]
        base = info["label"].split("-lr")[0]
        (job_dir / "job.json").write_text(json.dumps({**info, "base_label": base, "tuned": tuned, "phase": phase,
                                                      "tuning_group": base}))
    return run_dir


def test_ratios_against_sync_are_taken_within_a_phase(tmp_path):
    from harness.results import load_run, summarize

    table = summarize(load_run(_tuned_run(tmp_path))).set_index("label")
    assert table["phase"].to_dict() == {"dts": "reported", "sync": "reported", "sync-lr0.1": "tuning"}
    assert table.loc["dts", "speedup_vs_sync"] == pytest.approx(
        table.loc["sync", "time_to_target_s"] / table.loc["dts", "time_to_target_s"])
    assert table.loc["dts", "speedup_vs_sync"] > 1.5  # against the reported sync (step 7), not the candidate (5)
    assert table.loc["sync-lr0.1", "speedup_vs_sync"] == pytest.approx(1.0)
    assert pd.isna(table.loc["sync-lr0.1", "sweep_best"])  # the pick lives in tuning.json


def test_the_report_states_the_protocol_and_leaves_the_tuning_jobs_out_of_its_table(tmp_path):
    run_dir = _tuned_run(tmp_path)
    candidate = {"status": "ok", "time_to_target_s": 5.5, "accuracy_at_budget": 0.95, "loss_at_budget": 0.2,
                 "final_accuracy": 0.95}
    (run_dir / "tuning.json").write_text(json.dumps({
        "grid": {"lr": [0.1, 0.3]}, "seed": 0, "by": "time_to_target", "tie_break": "the rule's words",
        "linear_scaling": True, "reported_seeds": [1],
        "picks": [{"network": "delay1", "label": "sync", "pick": {"lr": 0.1}, "pick_job_id": "delay1-sync-lr0.1-seed0",
                   "candidates": [{**candidate, "values": {"lr": 0.1}, "job_id": "delay1-sync-lr0.1-seed0"},
                                  {**candidate, "values": {"lr": 0.4}, "job_id": "x", "linear_scaling": True,
                                   "status": "failed"}]},
                  {"network": "delay1", "label": "dts", "pick": None, "pick_job_id": None, "candidates": [],
                   "why_no_pick": "no candidate ended ok"}]}))
    outcome = write_report([run_dir], tmp_path / "report")
    markdown = outcome.markdown.read_text()
    assert "every algorithm ran the same grid, lr in {0.1, 0.3}" in markdown
    assert "on the tuning seed 0" in markdown and "by **time_to_target**: the rule's words" in markdown
    assert "reported seeds (1) only" in markdown and "the 1 tuning job(s) are in summary.csv" in markdown
    assert "| delay1 | sync | lr=0.1 | 5.5 | lr=0.1: 5.5 / 0.95 / 0.2; lr=0.4 (linear scaling): job failed |" in markdown
    assert "| delay1 | dts | none (no candidate ended ok) | - |  |" in markdown
    table = markdown.split("| network | label | seed |")[1].split("\n\n")[0]
    assert "sync-lr0.1" not in table and "| delay1 | sync | 1 |" in table and "| delay1 | dts | 1 |" in table
    # the CSV keeps every job, with its phase; the figures only the reported seeds
    summary = pd.read_csv(outcome.combined_csv)
    assert sorted(summary["phase"]) == ["reported", "reported", "tuning"]
    assert "sync-lr0.1" not in set(outcome.results.comparable()["label"])
    assert "sync-lr0.1" not in set(outcome.results.steps["label"])


def test_a_failed_tuning_candidate_is_said_but_only_a_reported_job_fails_the_run():
    from harness.cli import EXIT_JOB_FAILED, run_exit_code

    rows = [
        {"network": "delay1", "label": "sync", "seed": 0, "phase": "tuning", "tuned": "lr=0.3", "status": "failed"},
        {"network": "delay1", "label": "sync", "seed": 0, "phase": "tuning", "tuned": "lr=0.1", "status": "ok"},
        {"network": "delay1", "label": "sync", "seed": 1, "phase": "reported", "tuned": "lr=0.1", "status": "ok"},
    ]
    code, lines = run_exit_code(pd.DataFrame(rows))
    assert code == 0 and lines == ["wanbench: 1 tuning candidate(s) did not end ok (never picked): "
                                   "sync (lr=0.3) at delay1 (failed)"]
    rows[2]["status"] = "timeout"
    code, lines = run_exit_code(pd.DataFrame(rows))
    assert code == EXIT_JOB_FAILED and lines[-1] == "wanbench: 1 of 3 jobs did not end ok: sync seed 1 at delay1 (timeout)"
    # a run without a tuning protocol: any job that did not end ok fails it, as before
    code, lines = run_exit_code(pd.DataFrame([{k: v for k, v in r.items() if k != "phase"} for r in rows]))
    assert code == EXIT_JOB_FAILED and lines == ["wanbench: 2 of 3 jobs did not end ok: sync seed 0 at delay1 (failed), "
                                                 "sync seed 1 at delay1 (timeout)"]


def test_each_reported_job_is_compared_with_sync_of_its_own_workload_at_syncs_pick():
    """Two workloads (light and heavy compute), each with a sync; the picks differ (sync-heavy took
    its linear-scaling lr 0.2, eawild-heavy 0.1): eawild-heavy is compared with sync-heavy, not with
    whichever sync shares its lr. The workload key leaves the tuned keys out."""
    from harness.results import sync_reference, workload_key

    light, heavy = {"lr": 0.1, "min_compute_s": None}, {"lr": 0.1, "min_compute_s": 0.05}
    key = {name: workload_key({**config, "lr": lr}, tuned=["lr"])
           for name, config, lr in (("light", light, 0.1), ("heavy", heavy, 0.2))}
    assert key["light"] != key["heavy"]
    assert workload_key({**heavy, "lr": 0.2}, tuned=["lr"]) == workload_key({**heavy, "lr": 0.1}, tuned=["lr"])
    assert workload_key({**heavy, "lr": 0.2}) != workload_key({**heavy, "lr": 0.1})
    nested = {"optimizer": {"momentum": 0.9, "name": "sgd"}, "lr": 0.1}
    assert workload_key(nested, tuned=["optimizer.momentum"]) == workload_key(
        {**nested, "optimizer": {"momentum": 0.5, "name": "sgd"}}, tuned=["optimizer.momentum"])
    rows = pd.DataFrame([
        {"algorithm": "sync", "label": "sync-light", "network": "d1", "seed": 1, "phase": "reported",
         "workload": workload_key({**light, "lr": 0.1}, tuned=["lr"])},
        {"algorithm": "sync", "label": "sync-heavy", "network": "d1", "seed": 1, "phase": "reported",
         "workload": workload_key({**heavy, "lr": 0.2}, tuned=["lr"])},
        {"algorithm": "eawild", "label": "eawild-heavy", "network": "d1", "seed": 1, "phase": "reported",
         "workload": workload_key({**heavy, "lr": 0.1}, tuned=["lr"])},
    ])
    assert sync_reference(rows, rows.iloc[2])["label"] == "sync-heavy"


def test_a_job_at_its_own_written_lr_is_compared_with_sync_of_its_workload():
    """Picks written into each label's workload (no tuning phase in this run: nothing is marked
    tuned): eawild-c20 at lr 0.1 shares no exact workload with a sync (lr 0.05); its reference is
    sync-c20 (the same compute pad), found by the workload without its lr settings, not the first
    sync (sync-c5). With a sync of the exact workload present, that one wins."""
    from harness.results import LR_KEYS, sync_reference, workload_key

    def config(ms, lr, momentum=0.9):
        return {"lr": lr, "min_compute_s": ms / 1000, "optimizer": {"name": "sgd", "momentum": momentum}}

    def row(algorithm, label, cfg):
        return {"algorithm": algorithm, "label": label, "network": "d1", "seed": 1,
                "workload": workload_key(cfg), "workload_without_lr": workload_key(cfg, tuned=LR_KEYS)}

    rows = pd.DataFrame([row("sync", "sync-c5", config(5, 0.05)), row("sync", "sync-c20", config(20, 0.05)),
                         row("eawild", "eawild-c20", config(20, 0.1, momentum=0.5))])
    assert sync_reference(rows, rows.iloc[2])["label"] == "sync-c20"
    exact = pd.concat([rows, pd.DataFrame([row("sync", "sync-c20-lr0.1", config(20, 0.1, momentum=0.5))])],
                      ignore_index=True)
    assert sync_reference(exact, exact.iloc[2])["label"] == "sync-c20-lr0.1"
    legacy = rows.drop(columns=["workload_without_lr"])  # a summary from before the column: the first sync
    assert sync_reference(legacy, legacy.iloc[2])["label"] == "sync-c5"
