"""The job spec (harness/jobspec.py): made once per job from the scenario, dilated once, written
once; the files a run writes are those it wrote before the spec (tests/harness/data/)."""

import dataclasses
import io
import json
import sys
from pathlib import Path

import pytest

import harness.jobs as jobs_module
import harness.run as run_module
from emulator.plan import make_plan
from emulator.schema import ConfigError
from harness.faults import FaultSchedule, NetworkAndNodes, action_from_record, action_record
from harness.jobspec import dilated, job_spec
from harness.scenario import load_scenario
from harness.sim_job import SimJobInput, sim_run
from tests.harness.jobspec_golden import FAKE_ENGINE_CRASHES, SCENARIO, TRACE, normalized_run

GOLDEN = json.loads((Path(__file__).parent / "data" / "jobspec_golden.json").read_text())


@pytest.fixture
def scenario_file(tmp_path):
    (tmp_path / "trace.csv").write_text(TRACE)
    (tmp_path / "s.yaml").write_text(SCENARIO)
    return tmp_path / "s.yaml"


def test_a_sim_run_writes_the_files_it_wrote_before_the_job_spec(scenario_file, tmp_path, monkeypatch):
    """scenario.json, config.json, sim.json, job.json, faults.jsonl and what the engine was given,
    for a scenario with every kind of fault, equal to what the harness wrote before the spec."""
    from rich.console import Console

    script = tmp_path / "fake.py"
    script.write_text(FAKE_ENGINE_CRASHES)
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(script), str(job_dir)])
    completed = run_module.run_scenario(load_scenario(scenario_file), "sim", tmp_path / "runs",
                                        console=Console(file=io.StringIO()))
    now = normalized_run(completed.run_dir, tmp_path)
    assert now["scenario.json"] == GOLDEN["sim"]["scenario.json"]
    assert sorted(now["jobs"]) == sorted(GOLDEN["sim"]["jobs"])
    for job_id, files in GOLDEN["sim"]["jobs"].items():
        for name, content in files.items():
            assert now["jobs"][job_id][name] == content, (job_id, name)


def _tun_specs(scenario, plan, tmp_path, k):
    return {job.job_id: dilated(job_spec(scenario, job, tmp_path / job.job_id, plan, "tun"), k)
            for job in scenario.jobs}


def test_the_tun_side_at_k4_hands_the_ranks_and_the_network_what_it_did_before(scenario_file, tmp_path):
    """At K = 4: config.json's durations, the faults' records (wall-clock due times, effects in
    the topology's units) and the links the backend is given (slowed by K), as before the spec."""
    golden = GOLDEN["tun_k4"]
    scenario = load_scenario(scenario_file)
    plan = make_plan(scenario.topology_for(scenario.network_points()[0]), time_dilation=4.0)
    specs = _tun_specs(scenario, plan, tmp_path, 4.0)
    for job_id, spec in specs.items():
        file = spec.trainer_file()
        assert file.pop("output_dir") == str(tmp_path / job_id)
        assert file == golden["configs"][job_id]

    calls = []

    class Recorder:
        def set_link(self, src, dst, spec):
            calls.append(["link", src, dst, None if spec is None else dataclasses.asdict(spec)])

        def crash(self, node):
            calls.append(["crash", node])
            return "killed"

        def restart(self, node):
            calls.append(["restart", node])
            return "restarted"

        def set_cpu_factor(self, node, factor):
            calls.append(["cpu", node, factor])
            return f"x{factor}"

    spec = next(iter(specs.values()))
    recorder = Recorder()
    FaultSchedule(spec.faults, NetworkAndNodes(recorder, recorder), tmp_path / "faults.jsonl").poll(1e9)
    records = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    for record in records:
        del record["time_unix"], record["applied_s"]
    assert records == golden["faults"]
    assert calls == golden["calls"]


def test_the_spec_is_built_once_and_read_back_from_its_files(scenario_file, tmp_path):
    """A sim job's spec, written: config.json loads into the spec's Config, sim.json into its
    plan, compute model and fault actions (what `python -m harness.sim_job` reads)."""
    from trainers.loading import load_config

    scenario = load_scenario(scenario_file)
    sim = sim_run(scenario)
    point = scenario.network_points()[0]
    plan = make_plan(scenario.topology_for(point))
    (tmp_path / "plan.json").write_text(plan.to_json())
    job = next(job for job in scenario.jobs if job.algorithm == "swarmsgd")
    spec = job_spec(scenario, job, tmp_path / job.folder, plan, "sim", sim=sim.job_settings(job, tmp_path / "plan.json", plan))
    assert spec.trainer.output_dir == str(tmp_path / "jobs" / job.job_id)
    assert job.trainer.output_dir == "jobs/" + job.job_id          # the job's folder in any run
    assert spec.trainer.comm.backend == "tcp"                      # the trainers' rule, decided once
    spec.write()
    assert json.loads((spec.job_dir / "config.json").read_text()) == {**job.trainer_config,
                                                                      "output_dir": str(spec.job_dir)}
    given = SimJobInput.read(spec.job_dir)
    assert given.config == spec.trainer == load_config(spec.job_dir / "config.json")
    assert given.faults == spec.faults and len(spec.faults) == 16
    assert given.compute == spec.sim.compute and given.seed == job.seed and given.nic_rate_bit_s == 1e9
    assert given.plan.to_json() == plan.to_json()
    assert [action_from_record(action_record(a)) for a in spec.faults] == list(spec.faults)


def test_dilation_is_one_boundary_every_wall_clock_time_is_the_emulated_one_times_k(scenario_file, tmp_path):
    text = SCENARIO.replace("backend: sim", "backend: tun\njob_timeout_s: 900\nstall_timeout_s: 60").replace(
        "stop: {steps: 6, time_budget_s: 30}", "stop: {steps: 6, time_budget_s: 30, budget_time_s: 20, target_accuracy: 0.9}")
    scenario_file.write_text(text)
    scenario = load_scenario(scenario_file)
    k = 7.0
    plan = make_plan(scenario.topology_for(scenario.network_points()[0]), time_dilation=k)
    job = scenario.jobs[0]
    emulated = job_spec(scenario, job, tmp_path, plan, "tun")
    wall = dilated(emulated, k)
    assert (emulated.time_dilation, wall.time_dilation) == (1.0, k)
    assert wall.timeout_s == 900 * k and wall.stall_timeout_s == 60 * k
    assert wall.stop.budget_time_s == 20 * k and wall.stop.target_accuracy == 0.9 and wall.stop.budget_steps is None
    for dotted, emulated_s in (("time_budget_s", 30.0), ("eval_every_s", 0.5), ("min_compute_s", 0.18),
                               ("comm.timeout_s", 300.0)):
        head, _, leaf = dotted.partition(".")
        config = getattr(wall.trainer, head) if leaf else wall.trainer
        document = wall.trainer_document[head] if leaf else wall.trainer_document
        assert getattr(config, leaf or head) == pytest.approx(emulated_s * k), dotted
        assert document[leaf or head] == pytest.approx(emulated_s * k), dotted
    assert emulated.trainer.time_budget_s == 30.0 and job.trainer_config["time_budget_s"] == 30.0  # untouched
    assert (wall.trainer.steps, wall.trainer.lr) == (emulated.trainer.steps, emulated.trainer.lr)
    assert len(wall.faults) == len(emulated.faults) == 16
    for slow, fault in zip(wall.faults, emulated.faults):
        assert slow.due_s == pytest.approx(fault.due_s * k) and (slow.what, slow.effect) == (fault.what, fault.effect)
        if fault.op == "set_link" and fault.args[2] is not None:
            before, after = fault.args[2], slow.args[2]
            assert after.one_way_delay_ms == pytest.approx(before.one_way_delay_ms * k)
            assert after.rate_bit_s == pytest.approx(before.rate_bit_s / k)
            assert after.loss_fraction == before.loss_fraction
        else:
            assert slow.args == fault.args
    assert wall.emulated_s(7.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="already dilated"):
        dilated(wall, k)


BAD_FIELDS = """
topology: lan.yaml
workload: {model: {name: mlp}, dataset: {name: digits}, lr: 0.1}
stop: {steps: 10}
algorithms:
  - {name: sync}
  - {name: local_sgd, label: local, params: {H: 4}, workload: {batch_size: 16}}
"""


@pytest.mark.parametrize("change, field, words", [
    (("params: {H: 4}", "params: {H: 0}"), "algorithms[1].params.H", "must be an integer"),
    (("params: {H: 4}", "params: {H: 4, nope: 1}"), "algorithms[1].params.nope", "unknown key"),
    (("lr: 0.1", "lr: -1"), "workload.lr", "must be a number"),
    (("{batch_size: 16}", "{batch_size: 0}"), "algorithms[1].workload.batch_size", "must be an integer"),
    (("dataset: {name: digits}", "dataset: {name: digits, shard: skewed}"), "workload.dataset.shard", "must be one of"),
    (("stop: {steps: 10}", "stop: {steps: 10}\nsweep: {params: {local: {H: [2, -1]}}}"), "sweep.params.local.H",
     "must be an integer"),
    (("stop: {steps: 10}", "stop: {steps: 10}\nsweep: {workload: {sync: {lr: [0.1, 0]}}}"), "sweep.workload.sync.lr",
     "must be a number"),
    (("{name: sync}", "{name: synk}"), "algorithms[0].name", "synk"),
])
def test_a_bad_trainer_field_names_the_scenario_field(write_yaml, change, field, words):
    path = write_yaml(BAD_FIELDS.replace(*change), "bad.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert (caught.value.source, caught.value.field) == (path, field), str(caught.value)
    assert words in caught.value.message and "\n" not in str(caught.value)
