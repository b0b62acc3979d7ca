"""Crash safety: `wanbench up`/`run` killed with SIGKILL at random moments, then `wanbench clean`.

After each kill and clean, the system's own tools must show nothing of ours: no namespace
(`ip netns list`), no link (`ip -o link`), no process whose command line names our state folder,
no /etc/netns entry. Trials are bounded in number and time.
"""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TOPOLOGY = textwrap.dedent("""
    name: crash
    address_pool: 10.232.0.0/24
    regions: {a: {nodes: 2}, b: {nodes: 2}, c: {nodes: 1}}
    defaults: {rate: 100Mbit}
    links:
      - {between: [a, b], rtt: 20ms}
      - {between: [a, c], rtt: 40ms}
      - {between: [b, c], rtt: 60ms}
""")
UP_TRIALS = 20
RUN_TRIALS = 3


def leftovers(prefix: str) -> list[str]:
    """Everything of ours the system still shows, by its own tools."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(prefix + "-")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found += [f"link {line.split(':')[1].strip()}" for line in links.splitlines()
              if line.split(":")[1].strip().startswith(prefix)]
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    marker = f"/run/wanbench/{prefix}/"
    found += [f"process {line.strip()[:80]}" for line in ps.splitlines() if marker in line]
    if Path("/etc/netns").exists():
        found += [f"etc {p.name}" for p in Path("/etc/netns").glob(f"{prefix}-*")]
    return found


def wanbench_argv(*args):
    return [sys.executable, "-m", "harness.cli", *args]


def kill_at_random(argv, low_s, high_s, rng):
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(low_s, high_s))
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    return proc.returncode


def test_sigkill_during_up_then_clean(test_prefix, write_yaml):
    topo = write_yaml(TOPOLOGY)
    rng = random.Random(1234)
    # Kill times are drawn within how long one whole `up` takes on this machine now (a fixed
    # window let a fast, idle machine finish `up` before most kills).
    started = time.monotonic()
    subprocess.run(wanbench_argv("up", topo, "--backend", "tun"), check=True, capture_output=True, timeout=120)
    up_s = time.monotonic() - started
    subprocess.run(wanbench_argv("clean"), check=True, capture_output=True, timeout=60)
    killed = 0
    for trial in range(UP_TRIALS):
        code = kill_at_random(wanbench_argv("up", topo, "--backend", "tun"), 0.0, 0.9 * up_s, rng)
        killed += code == -signal.SIGKILL
        subprocess.run(wanbench_argv("clean"), check=True, capture_output=True, timeout=60)
        assert leftovers(test_prefix) == [], f"trial {trial}"
    # most trials must really have been killed mid-way, or the test proves nothing
    assert killed >= UP_TRIALS // 2, killed


def test_sigkill_during_run_then_clean(test_prefix, write_yaml, tmp_path):
    write_yaml(TOPOLOGY, "topo.yaml")
    scenario = write_yaml(textwrap.dedent("""
        topology: topo.yaml
        backend: tun
        workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 5}
        stop: {steps: 200}
        algorithms: [{name: sync}]
        verify: {probes: 5}
    """), "scenario.yaml")
    rng = random.Random(99)
    for trial in range(RUN_TRIALS):
        code = kill_at_random(wanbench_argv("run", scenario, "--output", str(tmp_path / "runs")),
                              2.0, 12.0, rng)
        assert code == -signal.SIGKILL, "the run finished before the kill: make it longer"
        subprocess.run(wanbench_argv("clean"), check=True, capture_output=True, timeout=60)
        assert leftovers(test_prefix) == [], f"trial {trial}"
    # a killed run is visibly incomplete
    for run_dir in (tmp_path / "runs").glob("*/*"):
        assert not (run_dir / "COMPLETE").exists()


def test_sigterm_during_run_tears_down_and_keeps_records(test_prefix, write_yaml, tmp_path):
    write_yaml(TOPOLOGY, "topo.yaml")
    scenario = write_yaml(textwrap.dedent("""
        topology: topo.yaml
        backend: tun
        workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 5}
        stop: {steps: 100000}
        algorithms: [{name: sync}]
        verify: {enabled: false}
    """), "scenario.yaml")
    proc = subprocess.Popen(wanbench_argv("run", scenario, "--output", str(tmp_path / "runs")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    records = []
    while time.monotonic() < deadline and not records:
        records = [p for p in (tmp_path / "runs").glob("*/*/jobs/*/rank0.jsonl")
                   if '"kind": "step"' in p.read_text()]
        time.sleep(0.5)
    assert records, "training never started"
    # `clean` from another terminal while the run lives leaves its network and processes alone
    built = leftovers(test_prefix)
    assert any(item.startswith("netns") for item in built), built
    cleaned = subprocess.run(wanbench_argv("clean"), capture_output=True, text=True, timeout=60)
    assert cleaned.returncode == 0 and f"the network of run process {proc.pid}" in cleaned.stderr, cleaned.stderr
    assert leftovers(test_prefix) == built
    steps = records[0].read_text().count('"kind": "step"')
    time.sleep(2.0)
    assert proc.poll() is None and records[0].read_text().count('"kind": "step"') > steps  # it goes on training
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert leftovers(test_prefix) == []  # torn down without `clean`
    run_dir = records[0].parents[2]
    assert (run_dir / "INTERRUPTED").exists()
    assert '"kind": "step"' in records[0].read_text()  # records written so far are kept


def test_sigkill_of_the_runs_group_then_clean_leaves_no_evaluator(test_prefix, write_yaml, tmp_path):
    """The off-wire evaluator follows the job (target_accuracy) in a session of its own: after a
    SIGKILL of `wanbench run`'s process group and `clean`, no process of ours is left, by PID and by
    any command line naming the run's folder (issue 25: it kept polling)."""
    from emulator import helpers
    from emulator.processes import alive, cmdline, wait_gone

    write_yaml(textwrap.dedent("""
        name: crash2
        address_pool: 10.232.1.0/24
        regions: {a: {nodes: 1}, b: {nodes: 1}}
        links: [{between: [a, b], rtt: 20ms, rate: 100Mbit}]
    """), "topo.yaml")
    scenario = write_yaml(textwrap.dedent("""
        topology: topo.yaml
        backend: tun
        workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 5}
        stop: {steps: 100000, target_accuracy: 1.0}
        algorithms: [{name: sync}]
        verify: {enabled: false}
    """), "scenario.yaml")
    runs = tmp_path / "runs"
    proc = subprocess.Popen(wanbench_argv("run", scenario, "--output", str(runs)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    evaluator = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None and not evaluator:
            evaluator = [pid for pid in helpers.leftover_helpers(test_prefix) if "trainers.evaluate" in cmdline(pid)]
            time.sleep(0.2)
        assert evaluator, "no evaluator was started"
        time.sleep(2.0)
        assert alive(evaluator[0])
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    subprocess.run(wanbench_argv("clean"), check=True, capture_output=True, timeout=60)
    try:
        assert wait_gone(evaluator, 5.0) == []
        assert leftovers(test_prefix) == []
        ours = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if str(runs) in cmdline(pid)]
        assert ours == [], [cmdline(pid) for pid in ours]
    finally:  # a failed test leaves no evaluator behind either
        if alive(evaluator[0]) and "trainers.evaluate" in cmdline(evaluator[0]):
            os.kill(evaluator[0], signal.SIGKILL)
