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
from harness.faults import FaultSchedule, NetworkAndNodes, action_from_record, action_record, compile_actions
from harness.jobspec import JobSpec, dilated, job_spec
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
