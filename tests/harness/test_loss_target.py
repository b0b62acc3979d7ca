"""stop.target_loss: a language model's target is a held-out loss at or below a value; the stop
rule ends a job there and the summary's time_to_target_s is the time to reach it."""

import json
import textwrap

import pandas as pd
import pytest

from emulator.schema import ConfigError
from harness import cli
from harness.jobs import StopDecider
from harness.results import time_to_loss_target
from harness.scenario import load_scenario

SCENARIO = textwrap.dedent("""
    topology:
      name: losst
      address_pool: 10.237.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload:
      model: {name: transformer, params: {d_model: 16, n_heads: 2, n_layers: 1}}
      dataset: {name: text_corpus, test_fraction: 0.2, max_test_samples: 200, params: {seq_len: 16, max_files: 6}}
      batch_size: 16
      lr: 0.01
      optimizer: {name: adamw}
      eval_every: 10
    stop: {steps: 60, target_loss: 4.0}
    algorithms: [{name: sync}]
    sim: {compute_s: 0.002, overhead_s: 0.0005}
""")


def test_the_stop_rule_takes_a_loss_target_and_passes_it_to_the_trainers(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO, "s.yaml"))
    assert scenario.spec.stop.target_loss == 4.0
    assert scenario.jobs[0].trainer_config["target_loss"] == 4.0
    assert "target_accuracy" not in scenario.jobs[0].trainer_config
    # scenario.json of a run without a loss target is as before the field
    plain = load_scenario(write_yaml(SCENARIO.replace(", target_loss: 4.0", ""), "p.yaml"))
    assert "target_loss" not in plain.spec.model_dump()["stop"]
    assert scenario.spec.model_dump()["stop"]["target_loss"] == 4.0


@pytest.mark.parametrize("stop, message", [
    ("{steps: 60, target_loss: 4.0, target_accuracy: 0.5}", "give one target"),
    ("{steps: 60, target_loss: -1}", "target_loss"),
])
def test_bad_loss_targets_name_the_field(write_yaml, stop, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_scenario(write_yaml(SCENARIO.replace("{steps: 60, target_loss: 4.0}", stop), "s.yaml"))
    assert "stop" in str(error.value)


def test_the_stop_decider_stops_at_a_loss_at_or_below_the_target(tmp_path):
    (tmp_path / "rank0.jsonl").write_text(json.dumps({"kind": "step", "step": 40, "rank": 0, "time_s": 4.0}) + "\n")
    evals = [{"kind": "eval", "step": 9, "accuracy": 0.2, "loss": 4.5, "train_time_s": 1.0},
             {"kind": "eval", "step": 19, "accuracy": 0.3, "loss": 3.9, "train_time_s": 2.0}]
    (tmp_path / "eval.jsonl").write_text(json.dumps(evals[0]) + "\n")
    decider = StopDecider(tmp_path, None, target_loss=4.0)
    assert decider.active and decider.poll(1.0) is None and not (tmp_path / "STOP").exists()
    with open(tmp_path / "eval.jsonl", "a") as handle:
        handle.write(json.dumps(evals[1]) + "\n")
    decision = decider.poll(2.0)
    assert decision["reason"] == "target_loss" and decision["eval_loss"] == 3.9 and decision["eval_step"] == 19
    assert json.loads((tmp_path / "STOP").read_text())["reason"] == "target_loss"


def test_time_to_a_loss_target_is_interpolated_between_evaluations():
    evals = pd.DataFrame({"train_time_s": [1.0, 2.0, 3.0], "loss": [5.0, 4.0, 2.0], "accuracy": [0.1, 0.2, 0.3]})
    assert time_to_loss_target(evals, 3.0) == pytest.approx(2.5)
    assert time_to_loss_target(evals, 5.5) == 1.0
    assert time_to_loss_target(evals, 1.0) is None


@pytest.mark.slow
def test_a_sim_run_of_a_tiny_language_model_reaches_a_loose_loss_target(write_yaml, tmp_path):
    path = write_yaml(SCENARIO, "lm.yaml")
    assert cli.main(["run", path, "--backend", "sim", "--output", str(tmp_path / "runs")]) == 0
    summary = pd.read_csv(next((tmp_path / "runs").rglob("summary.csv")))
    row = summary.iloc[0]
    assert (row["status"], row["backend"]) == ("ok", "sim")
    evals = [json.loads(line) for line in next((tmp_path / "runs").rglob("eval.jsonl")).read_text().splitlines()]
    assert all("perplexity" in e for e in evals) and evals[-1]["loss"] <= 4.0
    first_at_target = next(e for e in evals if e["loss"] <= 4.0)
    assert 0 < row["time_to_target_s"] <= first_at_target["train_time_s"]
    assert "sha256" in row["data_source"]
    report = next((tmp_path / "runs").rglob("report.md")).read_text()
    assert "target held-out loss 4;" in report and "target accuracy -" not in report
