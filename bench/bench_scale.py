"""How many emulated nodes this machine carries: 4 to 32 nodes on the tun backend (issue 13 §4).

For each node count (aws-4region with N nodes per region, intra-region links between them):

1. The network alone: time to `up` and `down`, the delay line's idle CPU, and iputils ping at 5 Hz
   (a tool we did not write) on an intra-region pair and two inter-region pairs, its mean over the
   configured RTT, with ping's own loopback base beside it.
2. Training through it: `wanbench run` of sync and SwarmSGD (MLP on digits, a fixed step budget,
   one intra-op thread per rank) while a sampler reads the delay line's CPU time and counters;
   from the run's records: rank start-up (writer created -> first step), step time median and
   its spread over ranks (p90/p10 of the ranks' median step times), steps/s, peak memory per rank
   (max_rss_mib), the job's wall time, and the delay line's lateness (counters' lag).

Prints one table per part and writes a CSV under results/bench/. Needs root (namespaces).

    WANBENCH_PREFIX=wbs .venv/bin/python bench/bench_scale.py                   # 4, 8, 16, 32 nodes
    WANBENCH_PREFIX=wbs .venv/bin/python bench/bench_scale.py --nodes-per-region 1,2 --steps 20
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from emulator import netns  # noqa: E402
from emulator.backends.base import Backend, read_state  # noqa: E402
from emulator.backends import tun_shortcut  # noqa: E402
from emulator.backends.tun import TunBackend  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from harness.console import teardown_on_signals  # noqa: E402
from harness.environment import environment  # noqa: E402
from harness.paths import RUNS_ROOT  # noqa: E402
from trainers.records import read_complete_records  # noqa: E402
from bench_delayline import cpu_seconds, ping_mean_ms  # noqa: E402  (one copy of each, in the delay-line bench)

RESULTS = REPO / "results" / "bench"
PING_RATE_HZ = 5
PING_SECONDS = 20


def network_case(topology_path: Path, per_region: int) -> dict:
    """Part 1: up/down time, idle CPU, and ping's error on three pairs."""
    topology = load_topology(topology_path)
    topology = topology.with_nodes({r: per_region for r in topology.regions})
    plan = make_plan(topology)
    backend = TunBackend(plan)
    backend.down()
    row = {"nodes": len(plan.nodes), "pairs": len(plan.nodes) * (len(plan.nodes) - 1)}
    started = time.monotonic()
    backend.up()
    try:
        row["up_s"] = time.monotonic() - started
        pid = read_state(plan.prefix)[0]["delayline_pid"]
        before, wall = cpu_seconds(pid), time.monotonic()
        time.sleep(3)
        row["delayline_idle_cpu_pct"] = 100 * (cpu_seconds(pid) - before) / (time.monotonic() - wall)
        node = {n.name: n for n in plan.nodes}
        regions = list(topology.regions)
        first = node[f"{regions[0]}-0"]
        pairs = [(first, node[f"{regions[-1]}-0"]), (node[f"{regions[2]}-0"], node[f"{regions[-1]}-0"])]
        if per_region > 1:
            pairs.insert(0, (first, node[f"{regions[0]}-1"]))
        count = PING_RATE_HZ * PING_SECONDS
        argv = ["ping", "-n", "-q", "-i", f"{1 / PING_RATE_HZ:g}", "-c", str(count), "-W", "2"]
        runs = [(a, b, subprocess.Popen(netns.exec_argv(a, argv + [b.address]), stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)) for a, b in pairs]
        base = subprocess.run(netns.exec_argv(first, argv + ["127.0.0.1"]), capture_output=True, text=True)
        row["ping_base_ms"] = ping_mean_ms(base.stdout)
        for a, b, run in runs:
            out = run.communicate(timeout=PING_SECONDS + 30)[0]
            spec = plan.link(a, b).one_way_delay_ms + plan.link(b, a).one_way_delay_ms
            mean = ping_mean_ms(out)
            kind = "intra" if a.region == b.region else f"{a.region}-{b.region}"
            row[f"ping_{kind}_error_ms"] = None if mean is None else mean - spec
        counters = json.loads((Backend.state_dir(plan.prefix) / "counters.json").read_text())
        row["ping_lag_mean_us"] = counters["lag"]["mean_us"]
    finally:
        started = time.monotonic()
        backend.down()
        row["down_s"] = time.monotonic() - started
    return row


SCENARIO = """name: scale-{nodes}
topology: {topology}
backend: tun
workload:
  model: {{name: mlp, params: {{hidden_sizes: [64]}}}}
  dataset: {{name: digits}}
  batch_size: 32
  lr: 0.1
  optimizer: {{name: sgd, momentum: 0.9}}
  eval_every: 20
stop: {{steps: {steps}, time_budget_s: 900}}
algorithms:
  - {{name: sync}}
  - {{name: swarmsgd, params: {{H: 4}}}}
sweep: {{nodes_per_region: [{per_region}]}}
verify: {{enabled: false}}
"""


class DelayLineSampler(threading.Thread):
    """Follows whichever delay line is up under `prefix`: its CPU time and its last counters."""

    def __init__(self, prefix: str):
        super().__init__(daemon=True)
        self.prefix = prefix
        self.cpu_s: dict[int, float] = {}
        self.counters: dict = {}
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.5):
            state = read_state(self.prefix)
            if state is None:
                continue
            pid = state[0].get("delayline_pid")
            if pid:
                self.cpu_s[pid] = max(self.cpu_s.get(pid, 0.0), cpu_seconds(pid))
            try:
                self.counters = json.loads((Backend.state_dir(self.prefix) / "counters.json").read_text())
            except (OSError, ValueError):
                pass


def job_rows(run_dir: Path) -> list[dict]:
    """Per job: start-up, step time and its spread over ranks, memory, wall time."""
    rows = []
    for job in sorted(run_dir.glob("jobs/*")):
        info = json.loads((job / "job.json").read_text())
        per_rank_step, startups, rss, steps_per_s = [], [], [], []
        for rank_file in sorted(job.glob("rank*.jsonl")):
            rank = read_complete_records(rank_file)
            start = next((r for r in rank if r["kind"] == "start"), None)
            steps = [r for r in rank if r["kind"] == "step"]
            status = next((r for r in reversed(rank) if r["kind"] == "status"), {})
            if not steps or start is None:
                continue
            per_rank_step.append(statistics.median(r["step_s"] for r in steps))
            startups.append(steps[0]["time_s"])
            span = steps[-1]["time_s"] - steps[0]["time_s"]
            if span > 0:
                steps_per_s.append((len(steps) - 1) / span)
            if status.get("max_rss_mib"):
                rss.append(status["max_rss_mib"])
        if not per_rank_step:
            continue
        ordered = sorted(per_rank_step)
        p10 = ordered[int(0.1 * (len(ordered) - 1))]
        p90 = ordered[int(round(0.9 * (len(ordered) - 1)))]
        rows.append({
            "job": job.name, "algorithm": info["algorithm"], "nodes": info["nodes"], "status": info["status"],
            "job_wall_s": info["wall_s"], "ranks_with_steps": len(per_rank_step),
            "startup_s_median": statistics.median(startups), "startup_s_max": max(startups),
            "step_s_median": statistics.median(per_rank_step), "step_s_p90_over_p10": p90 / p10 if p10 else None,
            "steps_per_s_median": statistics.median(steps_per_s) if steps_per_s else None,
            "max_rss_mib_median": statistics.median(rss) if rss else None,
            "max_rss_mib_max": max(rss) if rss else None,
        })
    return rows


def training_case(topology_path: Path, per_region: int, steps: int) -> list[dict]:
    """Part 2: one `wanbench run` (sync and swarmsgd) at this size, the delay line sampled."""
    prefix = os.environ.get("WANBENCH_PREFIX", "wanb")
    nodes = per_region * len(load_topology(topology_path).regions)
    with tempfile.TemporaryDirectory() as folder:
        scenario = Path(folder) / f"scale-{nodes}.yaml"
        scenario.write_text(SCENARIO.format(nodes=nodes, topology=topology_path.resolve(), steps=steps,
                                            per_region=per_region))
        sampler = DelayLineSampler(prefix)
        sampler.start()
        started = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(scenario)], cwd=REPO,
                                  capture_output=True, text=True, timeout=3600)
        finally:
            sampler.stopping.set()
            sampler.join()
        wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"wanbench run at {nodes} nodes failed: {done.stderr[-2000:]}")
    run_dir = max((RUNS_ROOT / f"scale-{nodes}").iterdir(), key=lambda p: p.stat().st_mtime)
    lag = sampler.counters.get("lag", {})
    arrival = sampler.counters.get("arrival", {})
    common = {"run": str(run_dir.relative_to(REPO)), "run_wall_s": wall,
              "delayline_cpu_pct": 100 * sum(sampler.cpu_s.values()) / wall,
              "lag_mean_us": lag.get("mean_us"), "lag_max_us": lag.get("max_us"),
              "late_over_1ms": lag.get("late_over_1ms"), "deliveries": lag.get("deliveries"),
              "arrival_wait_p99_us": arrival.get("wait_p99_us")}
    return [{**row, **common} for row in job_rows(run_dir)]


def fmt(value, spec=".3f") -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    # SIGTERM/SIGHUP end the bench like Ctrl-C, so the `finally` blocks take the network down (in
    # this process only: pyroute2's forked children die as by default)
    with teardown_on_signals():
        return _main(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes-per-region", default="1,2,4,8", help="comma-separated (x4 regions)")
    parser.add_argument("--steps", type=int, default=40, help="step budget of each training job")
    parser.add_argument("--topology", type=Path, default=REPO / "topologies" / "aws-4region.yaml")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--no-shortcut", action="store_true",
                        help="every pair through the delay line (WANBENCH_TUN_SHORTCUT_MS=off), as before the "
                             "kernel carried intra-region pairs")
    args = parser.parse_args(argv)
    netns.check_root()
    if args.no_shortcut:
        os.environ[tun_shortcut.ENV_VAR] = "off"  # this process's networks and `wanbench run`'s
    counts = [int(v) for v in args.nodes_per_region.split(",")]
    env = environment("tun", prefix=os.environ.get("WANBENCH_PREFIX", "wanb"), argv=sys.argv)
    print("# scale benchmark", json.dumps(env), flush=True)
    network_rows, training_rows = [], []
    for per_region in counts:
        row = network_case(args.topology, per_region)
        network_rows.append(row)
        print(f"nodes {row['nodes']:3d}: up {row['up_s']:5.1f} s, down {row['down_s']:4.1f} s, delay line idle "
              f"{row['delayline_idle_cpu_pct']:4.1f}% of a core; ping 5 Hz mean error (ms): intra "
              f"{fmt(row.get('ping_intra_error_ms'))}, "
              + ", ".join(f"{k[5:-9]} {fmt(v)}" for k, v in row.items()
                          if k.startswith("ping_") and k.endswith("_error_ms") and "intra" not in k)
              + f" (ping's own base {fmt(row['ping_base_ms'])})", flush=True)
    if not args.skip_training:
        for per_region in counts:
            for row in training_case(args.topology, per_region, args.steps):
                training_rows.append(row)
                print(f"nodes {row['nodes']:3d} {row['algorithm']:<9} {row['status']:<7} wall {row['job_wall_s']:6.1f} s  "
                      f"start-up {row['startup_s_median']:5.1f}/{row['startup_s_max']:5.1f} s  step "
                      f"{row['step_s_median']:.3f} s (p90/p10 over ranks {fmt(row['step_s_p90_over_p10'], '.2f')})  "
                      f"{fmt(row['steps_per_s_median'], '.2f')} steps/s  rss {fmt(row['max_rss_mib_median'], '.0f')}"
                      f"/{fmt(row['max_rss_mib_max'], '.0f')} MiB  delay line {row['delayline_cpu_pct']:4.1f}% "
                      f"lag mean {row['lag_mean_us']} us max {row['lag_max_us']} us, "
                      f"{row['late_over_1ms']} of {row['deliveries']} over 1 ms", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"bench_scale-{stamp}.csv"
    shortcut = {"shortcut": "off" if args.no_shortcut else "on"}
    rows = [{"part": "network", **shortcut, **r} for r in network_rows] + \
        [{"part": "training", **shortcut, **r} for r in training_rows]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (path.with_suffix(".json")).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
