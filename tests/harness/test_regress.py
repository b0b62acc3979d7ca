"""`wanbench regress`: the pure comparison against baselines, the tolerances file, and the command
end to end with the scenario runner replaced by a synthetic run directory."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml
from tests.harness.test_report import sync_and_dts, write_run

from harness import cli, regress
from harness.regress import Tolerance, compare, load_tolerances, parse_tolerances, regressed
from harness.results import load_run, summarize
from harness.run import CompletedRun
from emulator.schema import ConfigError

PROJECT_TOLERANCES = Path(__file__).resolve().parents[2] / "results" / "baselines" / "tolerances.yaml"


@pytest.fixture
def baseline(tmp_path) -> pd.DataFrame:
    return summarize(load_run(write_run(tmp_path, sync_and_dts())))


@pytest.fixture
def tolerances():
    return load_tolerances(PROJECT_TOLERANCES)


def failures(checks):
    return checks[checks["verdict"] == "FAIL"]


def test_project_tolerances_file_is_valid(tolerances):
    assert tolerances["final_accuracy"] == Tolerance("final_accuracy", "higher", absolute=0.05)
    assert tolerances["speedup_vs_sync"] == Tolerance("speedup_vs_sync", "higher", relative=0.40)


def test_identical_run_passes(baseline, tolerances):
    checks = compare(baseline, baseline.copy(), tolerances)
    assert not regressed(checks)
    assert set(checks["verdict"]) == {"pass"}
    # a status check per row, then one check per tolerated metric
    assert len(checks) == len(baseline) * (1 + len(tolerances))


def test_accuracy_drop_beyond_tolerance_fails(baseline, tolerances):
    current = baseline.copy()
    current.loc[current["label"] == "dts", "final_accuracy"] -= 0.2
    checks = compare(baseline, current, tolerances)
    assert regressed(checks)
    bad = failures(checks)
    assert list(bad["metric"]) == ["final_accuracy"] and list(bad["label"]) == ["dts"]
    assert bad.iloc[0]["allowed"] == ">= 0.88 (-0.05)"


def test_changes_within_tolerance_pass(baseline, tolerances):
    current = baseline.copy()
    current["final_accuracy"] -= 0.049
    current["speedup_vs_sync"] *= 0.61          # -39%: allowed down to -40%
    current["bytes_per_step_per_node"] *= 1.10  # exactly on the bound passes
    current["throughput_speedup_vs_sync"] *= 5  # better is always fine
    assert not regressed(compare(baseline, current, tolerances))


def test_relative_speedup_drop_fails(baseline, tolerances):
    current = baseline.copy()
    current.loc[current["label"] == "dts", "speedup_vs_sync"] *= 0.5
    bad = failures(compare(baseline, current, tolerances))
    assert list(bad["metric"]) == ["speedup_vs_sync"]
    allowed = 0.6 * baseline.loc[baseline["label"] == "dts", "speedup_vs_sync"].iloc[0]
    assert bad.iloc[0]["allowed"] == f">= {allowed:.4g} (-40%)"


def test_missing_algorithm_row_fails(baseline, tolerances):
    current = baseline[baseline["label"] != "dts"]
    bad = failures(compare(baseline, current, tolerances))
    assert list(bad["metric"]) == ["row"] and list(bad["label"]) == ["dts"]
    assert bad.iloc[0]["now"] == "missing"


def test_failed_job_and_lost_value_fail_new_row_does_not(baseline, tolerances):
    current = baseline.copy()
    current.loc[current["label"] == "sync", "status"] = "timeout"
    current.loc[current["label"] == "dts", "speedup_vs_sync"] = float("nan")  # target no longer reached
    extra = current.iloc[[0]].assign(label="local_sgd")
    checks = compare(baseline, pd.concat([current, extra]), tolerances)
    assert sorted(failures(checks)["metric"]) == ["speedup_vs_sync", "status"]
    assert list(checks[checks["verdict"] == "new"]["label"]) == ["local_sgd"]


def test_compare_survives_a_csv_round_trip(baseline, tolerances, tmp_path):
    baseline.to_csv(tmp_path / "b.csv", index=False)
    assert not regressed(compare(pd.read_csv(tmp_path / "b.csv"), baseline, tolerances))


@pytest.mark.parametrize("data, field", [
    ({"final_acc": {"better": "higher", "absolute": 0.05}}, "final_acc"),
    ({"final_accuracy": {"better": "up", "absolute": 0.05}}, "final_accuracy"),
    ({"final_accuracy": {"better": "higher"}}, "final_accuracy"),
    ({"final_accuracy": {"better": "higher", "absolute": 0.1, "relative": 0.1}}, "final_accuracy"),
    ({"final_accuracy": {"better": "higher", "absolute": -1}}, "final_accuracy"),
    ({"final_accuracy": {"better": "higher", "relative": 25}}, "final_accuracy"),
    ({"final_accuracy": {"better": "higher", "absolut": 0.1}}, "final_accuracy.absolut"),
    ({"final_accuracy": 0.05}, "final_accuracy"),
])
def test_bad_tolerances_name_the_field(data, field):
    with pytest.raises(ConfigError) as error:
        parse_tolerances(data, "tolerances.yaml")
    assert error.value.field == field


# --- the command ------------------------------------------------------------------------------------


@pytest.fixture
def ci_setup(tmp_path, monkeypatch):
    """A scenarios folder with one valid scenario, a baselines folder with the project's tolerances,
    and run_scenario replaced by a writer of synthetic runs (jobs chosen by the test)."""
    scenarios = tmp_path / "scenarios"
    scenarios.mkdir()
    (scenarios / "tiny.yaml").write_text(yaml.safe_dump({
        "name": "tiny", "topology": "lan.yaml", "workload": {"model": {"name": "mlp"}, "dataset": {"name": "digits"}},
        "stop": {"steps": 10, "target_accuracy": 0.9}, "algorithms": [{"name": "sync"}, {"name": "dts"}]}))
    baselines = tmp_path / "baselines"
    baselines.mkdir()
    (baselines / "tolerances.yaml").write_text(PROJECT_TOLERANCES.read_text())
    state = {"jobs": sync_and_dts(), "runs": 0}

    def fake_run(scenario, backend, runs_root):
        state["runs"] += 1
        run_dir = write_run(tmp_path / "runs", state["jobs"], name=scenario.name, run_id=f"run{state['runs']}")
        frames = load_run(run_dir)
        return CompletedRun(run_dir, frames, summarize(frames))

    monkeypatch.setattr(regress, "run_scenario", fake_run)
    return scenarios, baselines, state


def test_regress_without_scenarios_fails_clearly(tmp_path, capsys):
    empty = tmp_path / "ci"
    empty.mkdir()
    assert cli.main(["regress", "--scenarios", str(empty), "--baselines", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(empty) in err and "no scenarios" in err


def test_regress_without_baseline_says_how_to_record_one(ci_setup, capsys):
    scenarios, baselines, state = ci_setup
    assert cli.main(["regress", "--scenarios", str(scenarios), "--baselines", str(baselines)]) == 2
    assert "--update-baselines" in capsys.readouterr().err
    assert state["runs"] == 0  # refused before running anything


def test_regress_update_then_pass_then_regression(ci_setup, capsys):
    scenarios, baselines, state = ci_setup
    args = ["regress", "--scenarios", str(scenarios), "--baselines", str(baselines)]
    assert cli.main(args + ["--update-baselines"]) == 0
    assert len(pd.read_csv(baselines / "tiny.csv")) == 2
    assert cli.main(args) == 0
    assert "no regression" in capsys.readouterr().err
    state["jobs"] = sync_and_dts()
    state["jobs"][1].evals = {4: 0.71, 9: 0.73}  # dts's accuracy dropped by 0.2
    assert cli.main(args) == regress.EXIT_REGRESSION
    captured = capsys.readouterr()
    assert "REGRESSION" in captured.err and "final_accuracy" in captured.out and "FAIL" in captured.out
