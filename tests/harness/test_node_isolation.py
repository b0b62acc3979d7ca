"""Container-grade nodes through the harness: `wanbench exec` sees the node's own hostname, `down`
leaves no daemon behind, and a job whose rank goes over the node's memory limit is reported with a
clear reason (a scenario's node_limits override the topology's)."""

import dataclasses
import json
import textwrap
import time
from pathlib import Path

import pytest

from emulator.backends.tun import TunBackend
from emulator.plan import make_plan
from harness.jobs import run_job
from harness.jobspec import job_spec
from harness.scenario import load_scenario
from tests.conftest import run_wanbench

pytestmark = pytest.mark.integration

TOPOLOGY = textwrap.dedent("""
    name: iso
    address_pool: 10.243.0.0/24
    regions: {london: {nodes: 1}, tokyo: {nodes: 1}}
    links: [{between: [london, tokyo], rtt: 10ms, rate: 100Mbit}]
    node_limits: {memory: 2GB}
""")

# Rank 1 allocates 400 MB in a node limited to 120 MB (the scenario's limit); rank 0 has nothing to do.
HOG = ("import os, time\n"
       "if os.environ['RANK'] == '1':\n"
       "    x = b'x' * 400_000_000\n"
       "time.sleep(1)\n")


@pytest.fixture
def prefix(test_prefix):
    """The shared per-test prefix (tests/conftest.py), set in the environment and cleaned after."""
    return test_prefix


def wanbench(*args, check=True, timeout=120):
    return run_wanbench(*args, check=check, timeout=timeout)


def test_exec_hostname_and_down_ends_a_daemon(prefix, write_yaml):
    wanbench("up", write_yaml(TOPOLOGY), "--backend", "tun")
    try:
        assert wanbench("exec", "london-0", "--", "hostname").stdout.strip() == "london-0"
        wanbench("exec", "london-0", "--", "iperf3", "-s", "-D", "-p", "5997")
        time.sleep(0.2)
        daemons = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                   if _cmdline(p).startswith(b"iperf3\0-s\0-D\0-p\x005997")]
        assert len(daemons) == 1
    finally:
        wanbench("down")
    assert not Path(f"/proc/{daemons[0]}").exists() or _state(daemons[0]) == "Z"
    unknown = wanbench("exec", "london-0", "--", "true", check=False)
    assert unknown.returncode == 3 and "no network is up" in unknown.stderr


def _cmdline(path: Path) -> bytes:
    try:
        return (path / "cmdline").read_bytes()
    except OSError:
        return b""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_rank_over_the_node_memory_limit_fails_the_job_with_the_reason(prefix, write_yaml, tmp_path):
    write_yaml(TOPOLOGY, "iso.yaml")
    scenario = load_scenario(write_yaml(textwrap.dedent(f"""
        topology: iso.yaml
        node_limits: {{memory: 120MB}}
        command: [python3, -c, {json.dumps(HOG)}]
    """), "scenario.yaml"))
    assert scenario.topology.memory_bytes == 120_000_000  # the scenario's limit over the topology's
    plan = make_plan(scenario.topology)
    backend = TunBackend(plan)
    backend.up()
    try:
        spec = job_spec(scenario, scenario.jobs[0], tmp_path / "job", plan, backend.name)
        outcome = run_job(plan, dataclasses.replace(spec, timeout_s=60), 29710)
    finally:
        backend.down()
    assert outcome.status == "failed", outcome
    assert "rank 1 exited -9" in outcome.reason, outcome.reason
    assert "OOM killer: node tokyo-0 over its memory limit of 120 MB" in outcome.reason, outcome.reason
    assert "rank 0" not in outcome.reason.split(";")[0]
