"""The mechanism columns end to end on `--backend sim`: a DTS job whose first correction comes
after the target, and the `local_only` control beside it, are both marked "independent training"
in the summary and the report; sync is not."""

import io
import textwrap

import pandas as pd
import pytest
from rich.console import Console

import harness.run as run_module
from harness.report import INDEPENDENT_TRAINING, write_report
from harness.results import independent_training
from harness.scenario import load_scenario

SCENARIO = textwrap.dedent("""
    name: wbk-sync-evidence
    topology:
      name: simt
      address_pool: 10.234.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload:
      model: {name: mlp, params: {hidden_sizes: [64]}}
      dataset: {name: digits}
      batch_size: 32
      lr: 0.1
      optimizer: {name: sgd, momentum: 0.9}
      eval_every: 2
    stop: {steps: 36, target_accuracy: 0.8}
    algorithms:
      - {name: sync}
      - {name: dts, params: {p: 4, t: 30}}
      - {name: local_only}
    sim: {compute_s: 0.002, overhead_s: 0.0005}
""")


def _quiet():
    return Console(file=io.StringIO(), width=200)


@pytest.mark.slow
def test_a_speedup_before_the_first_synchronisation_is_marked_independent_training(write_yaml, tmp_path):
    scenario = load_scenario(write_yaml(SCENARIO, "e2e.yaml"))
    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=_quiet())
    table = completed.summary.set_index("label")
    assert (table["status"] == "ok").all() and table["time_to_target_s"].notna().all()
    # sync applies its all-reduce in every step from step 0; DTS p4 t30 its first correction at
    # step p - 1 + t = 33; local_only never
    assert table.loc["sync", "first_sync_step"] == 0 and table.loc["sync", "syncs_before_target"] > 0
    assert table.loc["dts", "first_sync_step"] == 33
    assert pd.isna(table.loc["local_only", "first_sync_step"]) and pd.isna(table.loc["local_only", "first_sync_s"])
    assert table.loc["dts", "first_sync_s"] > 0
    flagged = {label for label, row in table.iterrows() if independent_training(row.to_dict())}
    assert table.loc["dts", "syncs_before_target"] == 0 == table.loc["local_only", "syncs_before_target"]
    assert flagged == {"dts", "local_only"}
    # until its first correction DTS trains as local_only does: the same time to target
    assert table.loc["dts", "time_to_target_s"] == pytest.approx(table.loc["local_only", "time_to_target_s"])

    markdown = write_report([completed.run_dir], tmp_path / "report").markdown.read_text()
    rows = {line.split("|")[2].strip(): line for line in markdown.splitlines() if line.startswith("| delay")}
    assert f"({INDEPENDENT_TRAINING})" in rows["dts"] and f"({INDEPENDENT_TRAINING})" in rows["local_only"]
    assert INDEPENDENT_TRAINING not in rows["sync"]
    assert "its first was applied at step 33" in markdown and "it applied none at all" in markdown
