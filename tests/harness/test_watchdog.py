"""Watchdogs: a stuck rank or a dead rank ends the job with a clear status in bounded time."""

import dataclasses
import os
import signal
import textwrap
import time

import pytest

from emulator.backends.tun import TunBackend
from emulator.plan import make_plan
from harness.jobs import run_job
from harness.jobspec import job_spec
from harness.scenario import load_scenario

pytestmark = pytest.mark.integration

SCENARIO = textwrap.dedent("""
    topology:
      name: wd
      address_pool: 10.233.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 10ms, rate: 100Mbit}]
    workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 1000}
    stop: {steps: 1000000}
    algorithms: [{name: sync}]
""")


@pytest.fixture
def network(test_prefix, write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO, "scenario.yaml"))
    plan = make_plan(scenario.topology)
    backend = TunBackend(plan)
    backend.up()
    try:
        yield scenario, plan
    finally:
        backend.down()


def _stop_rank_after_records(job_dir, rank_pid, sig):
    """Wait until rank 1 has written step records, then signal it."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        path = job_dir / "rank1.jsonl"
        if path.exists() and path.read_text().count('"kind": "step"') >= 3:
            os.kill(rank_pid(), sig)
            return
        time.sleep(0.2)
    raise AssertionError("rank 1 never trained")


@pytest.mark.parametrize("sig, status", [(signal.SIGSTOP, "stalled"), (signal.SIGKILL, "failed")])
def test_stuck_or_dead_rank_ends_the_job(network, tmp_path, sig, status):
    scenario, plan = network
    job = scenario.jobs[0]
    job_dir = tmp_path / "job"
    rank_pids = {}

    def on_tick(records, elapsed):
        # run_job starts the ranks before its first tick; find rank 1 by its environment
        if not rank_pids:
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        env = open(f"/proc/{pid}/environ", "rb").read()
                    except OSError:
                        continue
                    # the trainer itself, not the node_enter process that stands for it
                    if f"WANBENCH_OUTPUT_DIR={job_dir}".encode() in env and b"RANK=1\x00" in env \
                            and open(f"/proc/{pid}/cmdline", "rb").read().split(b"\x00")[1:3] == [b"-m", b"trainers"]:
                        rank_pids[1] = int(pid)
        path = job_dir / "rank1.jsonl"
        if rank_pids and "sent" not in rank_pids and path.exists() \
                and path.read_text().count('"kind": "step"') >= 3:
            os.kill(rank_pids[1], sig)
            rank_pids["sent"] = time.monotonic()

    start = time.monotonic()
    spec = dataclasses.replace(job_spec(scenario, job, job_dir, plan, "tun"), timeout_s=240, stall_timeout_s=5)
    outcome = run_job(plan, spec, 29650, on_tick=on_tick)
    log = (job_dir / "rank1.log").read_text()[-1500:] if (job_dir / "rank1.log").exists() else ""
    assert "sent" in rank_pids, f"rank 1 was never signalled: {outcome}\n{log}"
    assert outcome.status == status, outcome
    # bounded: stall timeout (5 s) or failed-rank grace (10 s) plus teardown, not the job timeout
    assert time.monotonic() - rank_pids["sent"] < 40
    assert time.monotonic() - start < 200
    for pid in (rank_pids[1],):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert '"kind": "step"' in (job_dir / "rank0.jsonl").read_text()  # records kept
    assert "job_id" in (job_dir / "job.json").read_text()
