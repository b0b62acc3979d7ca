"""The CLI end to end on the tun backend: up/exec/down leave nothing; run writes a whole run dir."""

import json
import subprocess
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import run_wanbench

pytestmark = pytest.mark.integration

TWO_REGIONS = textwrap.dedent("""
    name: e2e
    address_pool: 10.231.0.0/24
    regions: {east: {nodes: 1}, west: {nodes: 1}}
    defaults: {rate: 200Mbit}
    links:
      - {between: [east, west], rtt: 30ms}
""")


def wanbench(*args, check=True, timeout=300):
    return run_wanbench(*args, check=check, timeout=timeout)


def namespaces(prefix):
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix + "-")]


def our_processes(prefix):
    from emulator.clean import our_background_pids

    return our_background_pids(prefix)


def test_up_exec_down_leaves_nothing(test_prefix, write_yaml):
    topo = write_yaml(TWO_REGIONS)
    wanbench("up", topo, "--backend", "tun")
    try:
        assert sorted(namespaces(test_prefix)) == [f"{test_prefix}-east-0", f"{test_prefix}-west-0"]
        ping = wanbench("exec", "east-0", "--", "ping", "-c", "3", "-i", "0.2", "west-0")
        rtts = [float(part.split("=")[1]) for line in ping.stdout.splitlines()
                for part in line.split() if part.startswith("time=")]
        assert len(rtts) == 3 and all(29.5 < rtt < 40 for rtt in rtts), ping.stdout
        # a second `up` under the same prefix is refused with a clear line, exit 3
        again = wanbench("up", topo, check=False)
        assert again.returncode == 3 and "already up" in again.stderr
        # exec passes the command's exit status through
        assert wanbench("exec", "west-0", "--", "false", check=False).returncode == 1
    finally:
        wanbench("down")
    assert namespaces(test_prefix) == []
    assert our_processes(test_prefix) == []
    assert not list(Path("/etc/netns").glob(f"{test_prefix}-*"))
    assert "no network is up" in wanbench("down").stderr  # idempotent: exit 0 again
    assert "removed 0 object" in wanbench("clean").stderr


def test_clean_removes_what_a_killed_up_left(test_prefix, write_yaml):
    wanbench("up", write_yaml(TWO_REGIONS), "--backend", "tun")
    # simulate a crash of everything: the state file is lost, the delay line is still running
    (Path("/run/wanbench") / test_prefix / "state.json").unlink()
    assert our_processes(test_prefix)
    out = wanbench("clean").stderr
    assert "namespace" in out
    assert namespaces(test_prefix) == [] and our_processes(test_prefix) == []
    assert "removed 0 object" in wanbench("clean").stderr  # idempotent


def test_run_writes_a_complete_run_directory(test_prefix, write_yaml, tmp_path):
    write_yaml(TWO_REGIONS, "topo.yaml")
    scenario = write_yaml(textwrap.dedent("""
        name: e2e-run
        topology: topo.yaml
        backend: tun
        workload:
          model: {name: mlp, params: {hidden_sizes: [32]}}
          dataset: {name: digits}
          batch_size: 32
          lr: 0.1
          eval_every: 5
        stop: {steps: 10}
        algorithms:
          - {name: sync}
          - {name: local_sgd, params: {H: 5}}
        verify: {probes: 20}
    """), "scenario.yaml")
    result = wanbench("run", scenario, "--output", str(tmp_path / "runs"), timeout=600)
    run_dirs = list((tmp_path / "runs" / "e2e-run").iterdir())
    assert len(run_dirs) == 1
    run_dir = run_dirs[0]
    assert (run_dir / "COMPLETE").exists()
    env = json.loads((run_dir / "environment.json").read_text())
    assert env["backend"] == "tun" and env["torch"]
    verify = json.loads((run_dir / "delay1" / "verify.json").read_text())
    assert {(r["src"], r["dst"]) for r in verify} == {("east-0", "west-0"), ("west-0", "east-0")}
    assert all(abs(r["rtt_p50_ms"] - 30.0) < 3.0 for r in verify)
    summary = pd.read_csv(run_dir / "summary.csv")
    assert sorted(summary["label"]) == ["local_sgd", "sync"]
    assert (summary["status"] == "ok").all()
    assert (summary["steps"] == 10).all()
    sync = summary.set_index("label").loc["sync"]
    local = summary.set_index("label").loc["local_sgd"]
    # local SGD (H=5) averages twice in 10 steps where sync all-reduces 10 times
    assert local["bytes_sent_per_node"] < sync["bytes_sent_per_node"] / 2
    assert sync["throughput_speedup_vs_sync"] == pytest.approx(1.0)
    # the delay line's own counters: every job put its tensors (plus headers and control) on the wire
    print("wire vs tensor bytes per node:", summary[["label", "bytes_sent_per_node", "wire_bytes_per_node"]].to_dict("records"))
    for row in (sync, local):
        assert row["wire_bytes_per_node"] >= row["bytes_sent_per_node"]
    assert local["wire_bytes_per_node"] < sync["wire_bytes_per_node"]
    for rank in (0, 1):
        records = (run_dir / "jobs").glob(f"*/rank{rank}.jsonl")
        assert len(list(records)) == 2
    assert "sync" in result.stdout  # the comparison table
    assert namespaces(test_prefix) == []


def test_cpu_share_limits_what_exec_runs(test_prefix, write_yaml):
    from emulator import cgroups

    wanbench("up", write_yaml(TWO_REGIONS), "--backend", "tun", "--cpu-share", "0.25")
    try:
        group = cgroups.group_path(test_prefix, "east-0")
        assert cgroups.cpu_limit(group) == pytest.approx(0.25)
        # the process that exec runs is in its node's group
        out = wanbench("exec", "east-0", "--", "cat", "/proc/self/cgroup").stdout
        assert f"{test_prefix}-east-0" in out
    finally:
        wanbench("down")
    assert not cgroups.group_path(test_prefix, "east-0").exists()
