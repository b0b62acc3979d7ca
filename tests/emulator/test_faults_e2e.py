"""Faults injected into real runs: a crash ends a sync job clearly; a straggler gets its CPU limit."""

import json
import subprocess
import sys
import textwrap

import pandas as pd
import pytest

from harness.cli import EXIT_JOB_FAILED

pytestmark = pytest.mark.integration

SCENARIO = textwrap.dedent("""
    name: faults
    topology:
      name: ft
      address_pool: 10.234.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 10ms, rate: 100Mbit}]
    backend: tun
    workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 5}
    stop: {steps: %d}
    algorithms: [{name: sync}]
    verify: {enabled: false}
    faults:
%s
""")


def run(write_yaml, tmp_path, steps, faults):
    path = write_yaml(SCENARIO % (steps, textwrap.indent(faults, "      ")), "scenario.yaml")
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", path, "--output",
                             str(tmp_path / "runs")], capture_output=True, text=True, timeout=400)
    run_dir = next((tmp_path / "runs" / "faults").iterdir())
    job_dir = next((run_dir / "jobs").iterdir())
    faults = [json.loads(line) for line in (job_dir / "faults.jsonl").read_text().splitlines()]
    return result, run_dir, job_dir, faults


def test_node_crash_fails_a_sync_job_and_names_the_fault(test_prefix, write_yaml, tmp_path):
    result, run_dir, job_dir, faults = run(write_yaml, tmp_path, 100000,
                                           "- {at: 12s, kind: node_crash, node: b-0}")
    # the run completes, the job is marked failed, and the run says so in its exit code
    assert result.returncode == EXIT_JOB_FAILED, result.stderr
    assert "error: killed by signal 9 (injected node_crash at" in result.stderr
    job = json.loads((job_dir / "job.json").read_text())
    assert job["status"] == "failed"
    assert "rank 1 exited -9 (injected node_crash at" in job["reason"]
    assert faults[0]["what"] == "node_crash b-0" and faults[0]["ok"]
    assert (run_dir / "COMPLETE").exists()
    summary = pd.read_csv(run_dir / "summary.csv")
    assert summary.loc[0, "status"] == "failed"


def test_straggler_gets_and_loses_its_cpu_limit(test_prefix, write_yaml, tmp_path):
    result, run_dir, job_dir, faults = run(
        write_yaml, tmp_path, 150, "- {at: 1s, kind: straggler, node: a-0, factor: 4, duration: 6s}")
    assert result.returncode == 0, result.stderr
    assert [f["what"] for f in faults] == ["straggler a-0 x4", "straggler a-0 ends"]
    assert faults[0]["effect"] == "cpu limit 0.25 cores" and faults[1]["effect"] == "cpu unlimited"
    assert json.loads((job_dir / "job.json").read_text())["status"] == "ok"
    from emulator import cgroups

    assert not cgroups.group_path(test_prefix, "a-0").exists()  # removed after the job


def test_link_changes_take_effect_on_the_tun_delay_line(test_prefix, write_yaml):
    """A partition drops everything, a delay change moves the RTT, and link_up restores the plan."""
    import dataclasses

    from emulator.backends.tun import TunBackend
    from emulator.netns import exec_argv
    from emulator.plan import make_plan
    from emulator.topology import load_topology

    topo = load_topology(write_yaml(textwrap.dedent("""
        name: lk
        address_pool: 10.235.0.0/24
        regions: {a: {nodes: 1}, b: {nodes: 1}}
        links: [{between: [a, b], rtt: 10ms, rate: 100Mbit}]
    """)))
    plan = make_plan(topo)
    backend = TunBackend(plan)
    a, b = plan.node("a-0"), plan.node("b-0")

    def ping(count=5):
        out = subprocess.run(exec_argv(a, ["ping", "-c", str(count), "-i", "0.05", "-W", "1", b.address]),
                             capture_output=True, text=True).stdout
        return [float(p.split("=")[1]) for line in out.splitlines() for p in line.split() if p.startswith("time=")]

    def delayed(spec_ms, rtts):
        # Every ping answered, the least never under the spec (the delay line is never early) and
        # under 1.5x it: a machine whose cores other jobs keep busy adds milliseconds to a ping.
        return len(rtts) == 5 and spec_ms - 0.5 < min(rtts) < 1.5 * spec_ms

    backend.up()
    try:
        rtts = ping()
        assert delayed(10.0, rtts), rtts
        backend.set_link("a", "b", None)
        assert ping(3) == []                      # partitioned
        backend.set_link("a", "b", dataclasses.replace(plan.region_links[("a", "b")], one_way_delay_ms=45.0))
        rtts = ping()
        assert delayed(50.0, rtts), rtts          # 45 ms there + 5 ms back
        backend.set_link("a", "b", plan.region_links[("a", "b")])
        rtts = ping()
        assert delayed(10.0, rtts), rtts
        import time

        time.sleep(1.5)  # the counters file is rewritten every second
        drops = {(c["src"], c["dst"]): c["drops_loss"] for c in backend.counters()}
        assert drops[("a-0", "b-0")] >= 3 and drops[("b-0", "a-0")] == 0  # the partition's pings
    finally:
        backend.down()


TOLERANT_SCENARIO = textwrap.dedent("""
    name: tolerant
    topology:
      name: tol
      address_pool: 10.236.0.0/24
      regions: {a: {nodes: 2}, b: {nodes: 2}}
      links: [{between: [a, b], rtt: 20ms, rate: 100Mbit}]
    backend: tun
    workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 20, lr: 0.05}
    stop: {steps: 1000000, time_budget_s: 45}
    algorithms: [{name: swarmsgd, params: {H: 2}}, {name: diloco, params: {H: 10}}]
    verify: {enabled: false}
    faults:
      - {at: 10s, kind: node_crash, node: b-0, restart_after: 3s}
""")


def test_tolerant_algorithms_survive_a_crash_and_take_the_node_back(test_prefix, write_yaml, tmp_path):
    """On the emulated WAN: the harness kills b-0 and restarts it; SwarmSGD and DiLoCo (on the elastic
    tcp comm, chosen because the scenario crashes a node) go on, readmit it, and end ok; the report
    shows the crash, the restart and the membership changes."""
    path = write_yaml(TOLERANT_SCENARIO, "scenario.yaml")
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", path, "--output", str(tmp_path / "runs")],
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr
    run_dir = next((tmp_path / "runs" / "tolerant").iterdir())
    summary = pd.read_csv(run_dir / "summary.csv")
    reasons = {d.name: json.loads((d / "job.json").read_text()).get("reason") for d in (run_dir / "jobs").iterdir()}
    assert list(summary["status"]) == ["ok", "ok"], (summary[["label", "status"]], reasons)
    for job_dir in sorted((run_dir / "jobs").iterdir()):
        job = json.loads((job_dir / "job.json").read_text())
        assert job["status"] == "ok" and "crash tolerated: rank 2 killed at" in job["reason"], job
        assert json.loads((job_dir / "config.json").read_text())["comm"]["backend"] == "tcp"
        faults = [json.loads(line) for line in (job_dir / "faults.jsonl").read_text().splitlines()]
        assert [f["what"] for f in faults] == ["node_crash b-0", "restart b-0"] and all(f["ok"] for f in faults)
        rank0 = [json.loads(line) for line in (job_dir / "rank0.jsonl").read_text().splitlines()]
        changes = [r for r in rank0 if r["kind"] == "membership"]
        assert changes[0]["lost"] == [2] and changes[1]["joined"] == [2], changes
        rank2 = [json.loads(line) for line in (job_dir / "rank2.jsonl").read_text().splitlines()]
        assert [r["kind"] for r in rank2].count("rejoin") == 1
        assert rank2[-1]["kind"] == "status" and rank2[-1]["status"] == "ok"
    assert (summary["final_accuracy"] > 0.85).all(), summary[["label", "final_accuracy"]]
    report = subprocess.run([sys.executable, "-m", "harness.cli", "report", str(run_dir), "--out",
                             str(tmp_path / "report")], capture_output=True, text=True, timeout=200)
    assert report.returncode == 0, report.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Faults" in text and "crash" in text and "rank 2 lost" in text and "rank 2 rejoined" in text
