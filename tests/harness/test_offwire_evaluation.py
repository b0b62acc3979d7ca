"""Evaluation is off the emulated wire and off the training clock, end to end on the tun backend.

The backend's own counters (the delay line's per-pair packets and bytes) must not move while the
evaluator evaluates a job's snapshots; the ranks' step records must not contain evaluation time.
"""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest

from emulator.backends.tun import TunBackend
from emulator.measure.counters import traffic_by_node
from emulator.plan import make_plan
from harness.jobs import run_job
from harness.jobspec import job_spec
from harness.results import load_run, summarize
from harness.scenario import load_scenario

pytestmark = pytest.mark.integration

SCENARIO = textwrap.dedent("""
    topology:
      name: ow
      address_pool: 10.234.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 20ms, rate: 100Mbit}]
    workload: {model: {name: mlp, params: {hidden_sizes: [32]}}, dataset: {name: digits}, eval_every: 2,
               batch_size: 32, lr: 0.1}
    stop: {steps: 20}
    algorithms: [{name: local_sgd, params: {H: 4}}]
""")


def test_evaluation_sends_no_byte_and_takes_no_training_time(test_prefix, write_yaml, tmp_path):
    scenario = load_scenario(write_yaml(SCENARIO, "scenario.yaml"))
    plan = make_plan(scenario.topology)
    backend = TunBackend(plan)
    backend.up()
    try:
        job = scenario.jobs[0]
        job_dir = tmp_path / "job"
        spec = dataclasses.replace(job_spec(scenario, job, job_dir, plan, backend.name), timeout_s=300)
        outcome = run_job(plan, spec, 29660, network=backend)
        assert outcome.status == "ok", (outcome, (job_dir / "rank0.log").read_text()[-2000:])
        evals = [json.loads(line) for line in (job_dir / "eval.jsonl").read_text().splitlines()]
        assert len(evals) == 10  # every 2 steps of 20, evaluated after the job (no target: no follow)
        # An evaluation-only phase: evaluate the whole job again, from scratch, with the network up.
        (job_dir / "eval.jsonl").rename(job_dir / "eval-first.jsonl")
        before = backend.counters(fresh=True)
        again = subprocess.run([sys.executable, "-m", "trainers.evaluate", str(job_dir)], capture_output=True,
                               text=True, timeout=300)
        after = backend.counters(fresh=True)
        assert again.returncode == 0, again.stderr
        moved = {node: t for node, t in traffic_by_node(before, after).items() if t["packets_sent"]}
        assert moved == {}, f"evaluation put packets on the emulated wire: {moved}"
        assert len((job_dir / "eval.jsonl").read_text().splitlines()) == 10
        # the job's own traffic was counted (the counters do work)
        wire = json.loads((job_dir / "wire.json").read_text())["nodes"]
        assert all(node["bytes_sent"] > 0 for node in wire.values())
    finally:
        backend.down()
    # Training time excludes the snapshots: step records' clock skips the time spent writing them.
    records = [json.loads(line) for line in (job_dir / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(steps) == 20
    excluded = sum(r.get("snapshot_s") or 0.0 for r in records)
    assert excluded > 0, "snapshot time is not reported"
