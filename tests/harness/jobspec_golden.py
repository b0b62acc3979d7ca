"""A small scenario with every kind of fault, and the files a run of it writes, normalized: what
tests/harness/test_jobspec.py compares with tests/harness/data/jobspec_golden.json (recorded from
the harness before the job spec: the files must not change)."""

import json
import textwrap
from pathlib import Path

from tests.harness.test_sim_harness import FAKE_ENGINE

SCENARIO = textwrap.dedent("""
    topology:
      name: golden
      address_pool: 10.236.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 2, eval_every_s: 0.5}
    stop: {steps: 6, time_budget_s: 30}
    compute_profile: v100-resnet50-fp32-b64
    algorithms: [{name: sync}, {name: swarmsgd, params: {H: 2}, workload: {lr: 0.05}}]
    faults:
      - {at: 0.1s, kind: link_down, between: [a, b]}
      - {at: 0.2s, kind: link_up, between: [a, b]}
      - {at: 0.05s, kind: link_change, from: a, to: b, rtt: 80ms, rate: 50Mbit}
      - {at: 0.12s, kind: loss_burst, between: [a, b], loss: 20%, duration: 0.1s}
      - {at: 0.01s, kind: trace, from: b, to: a, file: trace.csv}
      - {at: 0.15s, kind: straggler, node: b-0, factor: 3, duration: 0.1s}
      - {at: 0.3s, kind: node_crash, node: b-0, restart_after: 0.05s}
    sim: {compute_s: 0.002, overhead_s: 0.0005, nic: 1Gbit}
""")

TRACE = "time_s,rate,delay\n0,50Mbit,20ms\n0.02,5Mbit,\n0.04,,30ms\n"

# The stand-in engine of test_sim_harness, with a simulator that crashes and restarts ranks.
FAKE_ENGINE_CRASHES = FAKE_ENGINE.replace(
    "sim = SimpleNamespace(network=network, compute_factor={})",
    "sim = SimpleNamespace(network=network, compute_factor={}, crash=lambda r: f'rank {r} killed', "
    "restart=lambda r: f'rank {r} restarted (restart 1)')")


def normalized_run(run_dir: Path, tmp: Path) -> dict:
    """scenario.json and each job's config.json, sim.json, job.json (without wall_s),
    faults.jsonl and what the stand-in engine was given (fake.json), with the temporary folder's path replaced by <tmp>."""
    def read(path: Path):
        return json.loads(path.read_text().replace(str(tmp), "<tmp>"))

    out = {"scenario.json": read(run_dir / "scenario.json"), "jobs": {}}
    for job_dir in sorted((run_dir / "jobs").iterdir()):
        job = read(job_dir / "job.json")
        job.pop("wall_s")
        sim = read(job_dir / "sim.json")
        sim["plan"] = Path(sim["plan"]).name
        config = read(job_dir / "config.json")
        config["output_dir"] = Path(config["output_dir"]).name
        faults = [json.loads(line) for line in (job_dir / "faults.jsonl").read_text().splitlines()]
        out["jobs"][job_dir.name] = {"config.json": config, "sim.json": sim, "job.json": job,
                                     "faults.jsonl": faults, "engine": read(job_dir / "fake.json")}
    return out
