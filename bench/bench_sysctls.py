"""Sync's step time at both settings of net.ipv4.tcp_slow_start_after_idle (issue 21 item 4).

The quickstart's workload (an MLP on digits) with sync alone on aws-4region (one node per region
by default), a fixed step budget and no target, run once per (seed, congestion control,
tcp_slow_start_after_idle) through `wanbench run`, the settings given as the scenario's
`node_sysctls:`. For each seed the settings run back to back (interleaved), so drift of a shared
machine hits them alike. Per job it reads the steady step time (rank 0's step records after the
first STEADY_FROM: the median of their intervals) and the sysctls in force inside the nodes
(job.json's node_stack, read there during the job: the proof the setting was applied), then
prints a table of medians over seeds side by side, and the ratio of 0 to 1 per congestion control.

Congestion controls: "default" leaves the nodes' own (a new namespace inherits the host's; here
bbr), others set it with node_sysctls. Linux skips the restart after idle for a congestion control
that runs its own control loop (BBR: tcp_slow_start_after_idle_check), so under BBR the setting
is expected to change nothing; reno is the loss-based one the host allows in namespaces.

On sim (--backend sim) the same scenarios run on the simulator (emulator/simnet.py models the
window restart after idle, not the congestion control); its compute time is taken from the tun
jobs when both backends run (`--backend tun,sim`), else `sim.compute_s: auto`.

Writes every job to results/bench/bench_sysctls-<UTC time>.csv (+ .json with the environment).
Needs root for tun.

    WANBENCH_PREFIX=wbs .venv/bin/python bench/bench_sysctls.py --seeds 0,1,2 --backend tun,sim
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.console import teardown_on_signals  # noqa: E402
from harness.environment import environment  # noqa: E402
from harness.paths import RUNS_ROOT  # noqa: E402
from trainers.records import read_complete_records  # noqa: E402

RESULTS = REPO / "results" / "bench"
SSAI = "net.ipv4.tcp_slow_start_after_idle"
CC = "net.ipv4.tcp_congestion_control"
STEADY_FROM = 5  # steps left out of the steady step time (connection set-up, warm-up)
SCENARIO = """
name: {name}
description: bench_sysctls, sync on {backend}, {setting}
topology: {topology}
nodes: {{london: {per_region}, tokyo: {per_region}, oregon: {per_region}, ohio: {per_region}}}
backend: {backend}
workload:
  model: {{name: mlp, params: {{hidden_sizes: [64]}}}}
  dataset: {{name: digits}}
  batch_size: 32
  lr: 0.1
  optimizer: {{name: sgd, momentum: 0.9}}
  eval_every: 5
stop:
  steps: {steps}
algorithms:
  - {{name: sync}}
seeds: [{seed}]
node_sysctls: {sysctls}
verify: {{enabled: false}}
{sim}
"""


def run_scenario(text: str, name: str, backend: str) -> Path:
    """`wanbench run` of the scenario ``text``; returns its run directory."""
    with tempfile.TemporaryDirectory(dir=REPO / "results") as folder:  # nodes have a private /tmp
        path = Path(folder) / f"{name}.yaml"
        path.write_text(text)
        done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(path), "--backend", backend],
                              cwd=REPO, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"wanbench run {name} on {backend} failed: {done.stderr[-3000:]}")
    return max((RUNS_ROOT / name).iterdir(), key=lambda p: p.stat().st_mtime)


def steady_step_s(job_dir: Path) -> tuple[float, list[dict]]:
    """Rank 0's median step interval after STEADY_FROM steps (s), and every rank's step records."""
    records = [r for r in read_complete_records(job_dir / "rank0.jsonl") if r.get("kind") == "step"]
    times = [r["time_s"] for r in records][STEADY_FROM:]
    return statistics.median(b - a for a, b in zip(times, times[1:])), records


def compute_of(job_dir: Path) -> list[float]:
    """Every rank's forward + backward times (s) past the first two steps, for the sim's compute model."""
    found = []
    for path in sorted(job_dir.glob("rank*.jsonl")):
        steps = [r for r in read_complete_records(path) if r.get("kind") == "step"][2:]
        found += [r["compute_unpadded_s"] for r in steps if r.get("compute_unpadded_s") is not None]
    return found


def one_job(backend: str, seed: int, congestion: str, ssai: int, args, sim_section: str = "") -> dict:
    sysctls = {SSAI: ssai, **({} if congestion == "default" else {CC: congestion})}
    name = f"bench-sysctls-{backend}"
    text = SCENARIO.format(name=name, backend=backend, setting=f"slow start after idle {ssai}, congestion control {congestion}", topology=args.topology.resolve(),
                           per_region=args.nodes_per_region, steps=args.steps, seed=seed,
                           sysctls=json.dumps(sysctls), sim=sim_section)
    started = time.monotonic()
    run_dir = run_scenario(text, name, backend)
    wall = time.monotonic() - started
    job_dir = next((run_dir / "jobs").iterdir())
    job = json.loads((job_dir / "job.json").read_text())
    step_s, _ = steady_step_s(job_dir)
    in_force = (job.get("node_stack") or {}).get("sysctls") or {}
    return {"backend": backend, "seed": seed, "congestion_control": congestion, "slow_start_after_idle": ssai,
            "steady_step_s": step_s, "status": job.get("status"),
            "in_force_slow_start_after_idle": in_force.get(SSAI, ""),
            "in_force_congestion_control": in_force.get(CC, ""),
            "run": str(run_dir.relative_to(REPO)) if run_dir.is_relative_to(REPO) else str(run_dir),
            "wall_s": round(wall, 1), "compute": compute_of(job_dir)}


def main(argv=None) -> int:
    with teardown_on_signals():  # SIGTERM ends the bench like Ctrl-C, so the networks come down
        return _main(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated")
    parser.add_argument("--steps", type=int, default=40, help="step budget of each job")
    parser.add_argument("--nodes-per-region", type=int, default=1, help="x4 regions")
    parser.add_argument("--congestion-controls", default="default,reno",
                        help="comma-separated; default: the nodes' own (inherited from the host)")
    parser.add_argument("--backend", default="tun,sim", help="tun, sim or tun,sim")
    parser.add_argument("--topology", type=Path, default=REPO / "topologies" / "aws-4region.yaml")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    controls = args.congestion_controls.split(",")
    backends = args.backend.split(",")
    env = environment(args.backend, prefix=os.environ.get("WANBENCH_PREFIX", "wanb"), argv=sys.argv)
    print("# bench_sysctls", json.dumps(env), flush=True)
    rows = []
    if "tun" in backends:
        for seed in seeds:
            for congestion in controls:
                for ssai in (1, 0):
                    row = one_job("tun", seed, congestion, ssai, args)
                    rows.append(row)
                    print(f"tun seed {seed} cc {congestion:<7} ssai {ssai}: step {row['steady_step_s'] * 1e3:7.1f} ms "
                          f"(in the nodes: ssai {row['in_force_slow_start_after_idle']}, "
                          f"cc {row['in_force_congestion_control']}) {row['status']}", flush=True)
    if "sim" in backends:
        measured = [c for r in rows for c in r["compute"]]
        sim_section = (f"sim: {{compute_s: {statistics.fmean(measured):.6f}}}" if measured else "")
        # the sim models no congestion control: one job per setting of the window restart
        for seed in seeds:
            for ssai in (1, 0):
                row = one_job("sim", seed, "default", ssai, args, sim_section)
                row["congestion_control"] = "(not modelled)"
                rows.append(row)
                print(f"sim seed {seed} ssai {ssai}: step {row['steady_step_s'] * 1e3:7.1f} ms", flush=True)
    print(f"\nsync, {4 * args.nodes_per_region} nodes of {args.topology.name}, {args.steps} steps, "
          f"seeds {args.seeds}; steady step time (median over seeds, ms; min-max)\n")
    print("| backend | congestion control (in force) | ssai = 1 | ssai = 0 | 0 / 1 |\n|---|---|---|---|---|")
    for backend in backends:
        for congestion in sorted({r["congestion_control"] for r in rows if r["backend"] == backend}, key=str):
            cells, medians = [], {}
            for ssai in (1, 0):
                steps = [r["steady_step_s"] * 1e3 for r in rows
                         if r["backend"] == backend and r["congestion_control"] == congestion
                         and r["slow_start_after_idle"] == ssai]
                medians[ssai] = statistics.median(steps)
                cells.append(f"{medians[ssai]:.1f} ({min(steps):.1f}-{max(steps):.1f})")
            in_force = sorted({r["in_force_congestion_control"] for r in rows
                               if r["backend"] == backend and r["congestion_control"] == congestion} - {""})
            label = congestion + (f" ({', '.join(in_force)})" if in_force else "")
            print(f"| {backend} | {label} | {cells[0]} | {cells[1]} | {medians[0] / medians[1]:.3f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"bench_sysctls-{stamp}.csv"
    for row in rows:
        row.pop("compute", None)
    with path.open("w", newline="") as handle:
        handle.write(f"# {json.dumps(env)}\n")
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nwrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
