"""Scenario expansion: per-algorithm workload settings and tuning sweeps become jobs."""

import json

import pandas as pd
import pytest

from emulator.schema import ConfigError
from harness.paths import PROJECT_ROOT
from harness.results import load_run, summarize
from emulator.plan import make_plan
from harness.scenario import load_scenario
from tests.harness.test_report import FakeJob, write_run

SCENARIO = """
topology: lan.yaml
workload:
  model: {name: mlp}
  dataset: {name: digits}
  lr: 0.1
  optimizer: {name: sgd, momentum: 0.9}
algorithms:
  - {name: sync}
  - {name: async_ps, workload: {lr: 0.02, optimizer: {momentum: 0.5}}}
  - {name: local_sgd, label: local, params: {H: 4}}
sweep:
  workload: {local: {lr: [0.05, 0.2], optimizer.momentum: [0.0, 0.9]}}
"""


def test_an_algorithm_gets_its_own_workload_settings(write_yaml):
    jobs = {job.label: job for job in load_scenario(write_yaml(SCENARIO, "s.yaml")).jobs}
    assert jobs["sync"].trainer_config["lr"] == 0.1
    ps = jobs["async_ps"].trainer_config
    # merged key by key: momentum changed, the optimizer's name kept
    assert ps["lr"] == 0.02 and ps["optimizer"] == {"name": "sgd", "momentum": 0.5}


def test_a_tuning_sweep_makes_one_labelled_job_per_combination(write_yaml):
    jobs = [job for job in load_scenario(write_yaml(SCENARIO, "s.yaml")).jobs if job.base_label == "local"]
    assert sorted(job.label for job in jobs) == ["local-lr0.05-momentum0.0", "local-lr0.05-momentum0.9",
                                                 "local-lr0.2-momentum0.0", "local-lr0.2-momentum0.9"]
    for job in jobs:
        assert job.trainer_config["lr"] == job.tuned["lr"]
        assert job.trainer_config["optimizer"]["momentum"] == job.tuned["optimizer.momentum"]
        assert job.trainer_config["algorithm"]["params"] == {"H": 4}


def test_a_tuning_sweep_of_an_unknown_label_is_refused(write_yaml):
    path = write_yaml(SCENARIO.replace("workload: {local:", "workload: {lokal:"), "s.yaml")
    with pytest.raises(ConfigError, match="sweep.workload.lokal: no algorithm with this label"):
        load_scenario(path)


def test_the_summary_marks_the_best_variant_of_a_tuning_sweep(tmp_path):
    jobs = [FakeJob("sync", evals={9: 0.9}),
            FakeJob("local_sgd", label="local-lr0.05", evals={9: 0.8}),
            FakeJob("local_sgd", label="local-lr0.2", evals={9: 0.95})]
    run_dir = write_run(tmp_path, jobs)
    for job_dir in (run_dir / "jobs").glob("*local*"):
        info = json.loads((job_dir / "job.json").read_text())
        lr = float(info["label"].rsplit("lr", 1)[1])
        (job_dir / "job.json").write_text(json.dumps({**info, "base_label": "local", "tuned": {"lr": lr}}))
    table = summarize(load_run(run_dir)).set_index("label")
    assert table.loc["local-lr0.2", "sweep_best"] is True and table.loc["local-lr0.05", "sweep_best"] is False
    assert table.loc["local-lr0.2", "tuned"] == "lr=0.2"
    assert pd.isna(table.loc["sync", "sweep_best"])  # not part of a tuning sweep


PS_SCENARIO = """
topology: aws-4region.yaml
workload: {model: {name: mlp}, dataset: {name: digits}}
algorithms: [{name: sync}, {name: async_ps}, {name: eawild, params: {server_ranks: [0]}}]
sweep: {nodes_per_region: [null, 2]}
"""


def test_a_parameter_server_gets_an_extra_node_so_it_has_as_many_workers_as_sync(write_yaml):
    scenario = load_scenario(write_yaml(PS_SCENARIO, "ps.yaml"))
    jobs = {(job.label, job.network.nodes_per_region): job for job in scenario.jobs}
    ps = jobs[("async_ps", None)]
    assert ps.network.extra_servers == 1 and ps.network.key == jobs[("sync", None)].network.key
    plan = make_plan(scenario.topology_for(ps.network))
    assert len(plan.nodes) == 5  # 4 workers, as many as sync's 4 ranks, plus the server
    server = plan.nodes[ps.params["server_ranks"][0]]
    assert server.name == "london-1"  # the first region's new node
    assert ps.trainer_config["algorithm"]["params"]["server_ranks"] == ps.params["server_ranks"]
    bigger = jobs[("async_ps", 2)]
    assert plan_node_names(scenario, bigger)[bigger.params["server_ranks"][0]] == "london-2"
    # server_ranks given by the user: it shares a worker's node, as asked
    assert jobs[("eawild", None)].network.extra_servers == 0
    assert {p.folder for p in scenario.network_points()} == {"delay1", "delay1-ps1", "delay1-n2", "delay1-n2-ps1"}


def plan_node_names(scenario, job):
    return [node.name for node in make_plan(scenario.topology_for(job.network)).nodes]


def test_servers_shared_keeps_the_node_count(write_yaml):
    scenario = load_scenario(write_yaml(PS_SCENARIO + "servers: shared\n", "ps.yaml"))
    assert all(job.network.extra_servers == 0 for job in scenario.jobs)


def test_the_summary_counts_workers_and_servers_apart(tmp_path):
    jobs = [FakeJob("sync", evals={9: 0.9}, nodes=2), FakeJob("async_ps", evals={9: 0.9}, nodes=3)]
    run_dir = write_run(tmp_path, jobs)
    job_dir = next((run_dir / "jobs").glob("*async_ps*"))
    info = json.loads((job_dir / "job.json").read_text())
    (job_dir / "job.json").write_text(json.dumps({**info, "params": {"server_ranks": [2]}}))
    # the server sends more per step than a worker
    lines = [json.loads(line) for line in (job_dir / "rank2.jsonl").read_text().splitlines()]
    for record in lines:
        if record["kind"] == "step":
            record["bytes_sent"] = 5000
            record["comm_blocked_s"] = 0.9
    (job_dir / "rank2.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    (job_dir / "wire.json").write_text(json.dumps({"nodes": {
        "a-0": {"rank": 0, "bytes_sent": 1100}, "b-0": {"rank": 1, "bytes_sent": 1300}, "a-1": {"rank": 2, "bytes_sent": 6000}}}))
    row = summarize(load_run(run_dir)).set_index("label").loc["async_ps"]
    assert row["workers"] == 2 and row["servers"] == 1
    assert row["bytes_sent_per_node"] == pytest.approx(10 * 1000)  # workers only
    assert row["server_bytes_sent_per_node"] == pytest.approx(10 * 5000)
    assert row["comm_blocked_fraction"] == pytest.approx(0.4)  # the server's 0.9 s waits are not counted
    assert row["wire_bytes_per_node"] == pytest.approx(1200) and row["server_wire_bytes_per_node"] == pytest.approx(6000)


@pytest.mark.parametrize("path", sorted((PROJECT_ROOT / "scenarios").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_scenario_validates(path):
    scenario = load_scenario(path)
    assert scenario.jobs


def test_the_cifar_workload_scenario_falls_back_to_generated_data_and_chooses_k_itself():
    scenario = load_scenario(PROJECT_ROOT / "scenarios" / "workloads-cifar.yaml")
    assert scenario.time_dilation == "auto" and scenario.spec.compute_profile == "v100-resnet50-amp-b64"
    config = scenario.jobs[0].trainer_config
    assert config["model"]["name"] == "resnet20" and config["batch_size"] == 64
    assert config["dataset"]["name"] == "cifar10" and config["dataset"]["params"] == {"fallback": "generated"}


def test_a_scenario_s_nic_replaces_the_topology_s_on_every_node(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO + "nic: {rate: 20Mbit}\n", "s.yaml"))
    plan = make_plan(scenario.topology_for(scenario.network_points()[0]))
    assert {node.nic_rate_bit_s for node in plan.nodes} == {20e6}
    assert scenario.spec.model_dump()["nic"] == {"rate": 20e6}
    plain = load_scenario(write_yaml(SCENARIO, "p.yaml"))
    assert "nic" not in plain.spec.model_dump()   # scenario.json as before NICs, when none is named
    assert {n.nic_rate_bit_s for n in make_plan(plain.topology_for(plain.network_points()[0])).nodes} == {10e9}
    for bad, field in (("nic: {rate: 20}", "nic.rate"), ("nic: {speed: 1Gbit}", "nic")):
        with pytest.raises(ConfigError) as info:
            load_scenario(write_yaml(SCENARIO + bad + "\n", "b.yaml"))
        assert f"b.yaml: {field}" in str(info.value) and "\n" not in str(info.value), str(info.value)


CHILD = """
extends: base.yaml
workload: {lr: 0.3, optimizer: {momentum: 0.5}}
algorithms: [{name: sync}, {name: local_sgd, label: local, params: {H: 8}}]
sweep: {workload: null}
seeds: [1, 2]
"""
CHILD_SPELLED_OUT = """
topology: lan.yaml
workload:
  model: {name: mlp}
  dataset: {name: digits}
  lr: 0.3
  optimizer: {name: sgd, momentum: 0.5}
algorithms: [{name: sync}, {name: local_sgd, label: local, params: {H: 8}}]
seeds: [1, 2]
"""


def test_a_scenario_that_extends_another_is_the_same_as_one_spelled_out(write_yaml):
    """`extends:` (harness/scenario.py scenario_document): mappings merge at every depth, lists and
    numbers replace, null removes, and the base's name is not inherited."""
    write_yaml("name: the-base\n" + SCENARIO, "base.yaml")
    child = load_scenario(write_yaml(CHILD, "child.yaml"))
    spelled = load_scenario(write_yaml(CHILD_SPELLED_OUT, "spelled.yaml"))
    assert child.name == "child" and spelled.name == "spelled"
    assert [(j.label, j.seed) for j in child.jobs] == [("sync", 1), ("sync", 2), ("local", 1), ("local", 2)]
    assert [j.trainer_config for j in child.jobs] == [j.trainer_config for j in spelled.jobs]
    assert child.jobs[0].trainer_config["optimizer"] == {"name": "sgd", "momentum": 0.5}  # name kept from the base
    assert child.spec.model_dump() == spelled.spec.model_dump()  # what the run folder's scenario.json records
    # two levels: a grandchild changes one number of the child's
    grandchild = load_scenario(write_yaml("extends: child.yaml\nworkload: {lr: 0.4}\n", "grandchild.yaml"))
    assert [j.trainer_config["lr"] for j in grandchild.jobs] == [0.4] * 4
    assert grandchild.jobs[0].trainer_config["optimizer"]["momentum"] == 0.5


@pytest.mark.parametrize("files, message", [
    ({"a.yaml": "extends: missing.yaml\n"}, "a.yaml: extends: missing.yaml: no such file in"),
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: a.yaml\n"}, "a cycle: a.yaml -> b.yaml -> a.yaml"),
    ({"a.yaml": "extends: ../b.yaml\n"}, "a.yaml: extends: '../b.yaml': name a scenario file (.yaml) in the same folder"),
    ({"a.yaml": "extends: [b.yaml]\n"}, "a.yaml: extends: ['b.yaml']: name a scenario file"),
])
def test_a_bad_extends_is_one_line_naming_the_file_and_the_field(write_yaml, files, message):
    paths = [write_yaml(text, name) for name, text in files.items()]
    with pytest.raises(ConfigError) as info:
        load_scenario(paths[0])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_mistake_inherited_from_a_base_names_the_base_too(write_yaml):
    write_yaml(SCENARIO.replace("lr: 0.1", "lr: -1"), "base.yaml")
    with pytest.raises(ConfigError) as info:
        load_scenario(write_yaml("extends: base.yaml\n", "child.yaml"))
    assert "child.yaml (extends base.yaml): workload.lr" in str(info.value)


def _evidence_of_extending_scenarios():
    found = []
    for record in sorted((PROJECT_ROOT / "results").rglob("scenario.json")):
        source = json.loads(record.read_text()).get("source_file") or ""
        path = PROJECT_ROOT / source
        if source and path.is_file() and "extends:" in path.read_text():
            found.append(record)
    return found


@pytest.mark.parametrize("record", _evidence_of_extending_scenarios(), ids=lambda p: p.parent.name)
def test_a_shipped_scenario_that_extends_a_base_is_what_its_committed_run_was_made_with(record):
    """The Streaming DiLoCo family was rewritten as `extends:` of one base after its runs: each
    file resolves to the very scenario its committed evidence recorded (scenario.json's spec)."""
    from harness.run import scenario_record

    saved = json.loads(record.read_text())
    scenario = load_scenario(PROJECT_ROOT / saved["source_file"])
    assert json.loads(json.dumps(scenario_record(scenario)["spec"], default=str)) == saved["spec"]
    # a tuned run records its reported jobs too (made from the picks, after the file's tuning jobs)
    made_from_the_file = [job for job in saved["jobs"] if job.get("phase") != "reported"]
    assert [(job["label"], job["seed"]) for job in made_from_the_file] == [(j.label, j.seed) for j in scenario.jobs]


def test_some_shipped_scenarios_extend_a_base():
    assert len(_evidence_of_extending_scenarios()) >= 10


def test_an_extends_chain_deeper_than_the_limit_is_refused(write_yaml):
    from harness.scenario import MAX_EXTENDS_DEPTH

    write_yaml(SCENARIO, "s0.yaml")
    for depth in range(1, MAX_EXTENDS_DEPTH + 2):
        write_yaml(f"extends: s{depth - 1}.yaml\n", f"s{depth}.yaml")
    assert load_scenario(write_yaml(f"extends: s{MAX_EXTENDS_DEPTH - 1}.yaml\n", "ok.yaml")).jobs
    with pytest.raises(ConfigError, match=f"deep.yaml: extends: more than {MAX_EXTENDS_DEPTH} files deep"):
        load_scenario(write_yaml(f"extends: s{MAX_EXTENDS_DEPTH + 1}.yaml\n", "deep.yaml"))
