"""The simulator against the emulator: the same scenario on tun and on sim (issue 13 §2).

For each node count (aws-4region with N nodes per region), one scenario (the quickstart's
workload: an MLP on digits, a fixed step budget, evaluated every few steps) with sync, local SGD,
DTS, SwarmSGD, async PS and DiLoCo runs first through the emulated WAN (`wanbench run --backend
tun`), then on the simulator (`--backend sim`) with the compute model taken from the tun run's
own records: the mean forward + backward (``compute_unpadded_s``) and the mean rest of a step
outside communication (``compute_s - compute_unpadded_s``) over every rank's steps. The
network model is the same plan. Per job it prints tun's and sim's steps/s, time to the target
accuracy and bytes sent per step per node, and the relative error of each (sim / tun - 1), then
the median and worst absolute error. Writes a CSV under results/bench/. Needs root (tun).

Start-up (``--start-offsets tun``, the default): tun's ranks begin their first step apart
(process start-up, data loading, the first broadcast on 2 shared cores: 0.3-0.6 s at 4 nodes,
0.7-1.2 s at 16); the sim half is given each tun job's own skew, per node, as
``sim.start_offsets_s`` (``start_offsets``: each rank's first step record's ``time_unix - step_s``,
less the job's earliest), so its ranks' first steps are as far apart as tun's.
``--start-offsets none`` simulates without them (the calibration before the start-up term).

Steps/s is also read in steady state (``steady_steps_per_s``: each rank's steps after its first
``STEADY_FROM`` over the time they took, median over the job's ranks), because tun's ranks start
up to ~0.3 s apart (process start-up, data loading) while sim's start together: with async PS a
worker next to the server runs alone at ~10 ms a step until the remote workers' first messages
come, which the whole-run figure counts and no network model should.

    WANBENCH_PREFIX=wbc .venv/bin/python bench/bench_sim_calibration.py                 # 4, 8, 16 nodes
    WANBENCH_PREFIX=wbc .venv/bin/python bench/bench_sim_calibration.py --nodes-per-region 1 --steps 40
    WANBENCH_PREFIX=wbc .venv/bin/python bench/bench_sim_calibration.py --set inflight-padded --nodes-per-region 1
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.console import teardown_on_signals  # noqa: E402
from harness.environment import environment  # noqa: E402
from harness.paths import RUNS_ROOT  # noqa: E402
from trainers.records import read_complete_records  # noqa: E402

RESULTS = REPO / "results" / "bench"
ALGORITHMS = """
  - {name: sync}
  - {name: local_sgd, params: {H: 8}}
  - {name: dts, params: {p: 4, t: 2}}
  - {name: swarmsgd, params: {H: 4}}
  - {name: async_ps}
  - {name: diloco, params: {H: 8}}
"""
SCENARIO = """
name: {name}
description: bench_sim_calibration, {nodes} nodes on {backend}
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
  target_accuracy: {target}
algorithms:{algorithms}
seeds: [{seed}]
verify: {{enabled: false}}
{sim}
"""
# Issue 21 §7: the jobs the first calibration left out. DTS with t/p = 8 keeps 8 all-reduces in
# flight (max_in_flight raised to 8 so that neither side throttles it; at the default 4 both
# queue the rest, the closed form tests/trainers/test_sim.py checks), t/p = 4 at the default
# limit, and three jobs whose compute is padded to 0.1 s a step (a stand-in accelerator: the
# padding sleeps, so the network has the CPU while it runs).
IN_FLIGHT_AND_PADDED = """
  - {name: sync}
  - {name: dts, label: dts-p2-t16-inflight8, params: {p: 2, t: 16}, workload: {comm: {max_in_flight: 8}}}
  - {name: dts, label: dts-p4-t16, params: {p: 4, t: 16}}
  - {name: sync, label: sync-padded, workload: {min_compute_s: 0.1}}
  - {name: dts, label: dts-p4-t2-padded, params: {p: 4, t: 2}, workload: {min_compute_s: 0.1}}
  - {name: local_sgd, label: local_sgd-padded, params: {H: 8}, workload: {min_compute_s: 0.1}}
"""
ALGORITHM_SETS = {"default": ALGORITHMS, "inflight-padded": IN_FLIGHT_AND_PADDED}
METRICS = ("steps_per_s", "steady_steps_per_s", "time_to_target_s", "bytes_per_step_per_node")
STEADY_FROM = 10  # steps of each rank left out of steady_steps_per_s (start-up skew, warm-up)


def run_scenario(text: str, name: str, backend: str) -> Path:
    """`wanbench run` of the scenario ``text``; returns its run directory."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.yaml"
        path.write_text(text)
        done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(path), "--backend", backend],
                              cwd=REPO, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise RuntimeError(f"wanbench run {name} on {backend} failed: {done.stderr[-3000:]}")
    return max((RUNS_ROOT / name).iterdir(), key=lambda p: p.stat().st_mtime)


def _min_compute_s(job_dir: Path) -> float:
    """The job's compute profile pad (``min_compute_s`` in its config.json; 0 without one)."""
    try:
        config = json.loads((job_dir / "config.json").read_text())
    except (OSError, ValueError):
        return 0.0
    return float(config.get("min_compute_s") or 0.0)


def compute_model(run_dir: Path) -> dict:
    """The mean forward + backward and the mean rest of a step, over every rank's steps
    (the first two steps of each rank left out: warm-up). The rest is what a step spent outside
    communication beyond its forward + backward *as padded*: a padded job's ``compute_s``
    includes its ``min_compute_s`` pad, which the sim charges itself (``Algorithm.pad_compute``),
    so the pad is not overhead (counting it made one padded job inflate every job's overhead)."""
    forward_backward, rest = [], []
    for path in sorted(run_dir.glob("**/rank*.jsonl")):
        pad = _min_compute_s(path.parent)
        steps = [r for r in read_complete_records(path) if r.get("kind") == "step"][2:]
        for record in steps:
            if record.get("compute_unpadded_s") is not None:
                forward_backward.append(record["compute_unpadded_s"])
                if record.get("compute_s") is not None:
                    rest.append(max(0.0, record["compute_s"] - max(record["compute_unpadded_s"], pad)))
    # means, not medians: the ranks share 2 cores on tun, and a step waits for its slowest rank, so
    # the tail of the compute times is part of what tun's steps cost
    return {"compute_s": statistics.fmean(forward_backward), "overhead_s": statistics.fmean(rest) if rest else 0.0,
            "samples": len(forward_backward)}


def start_offsets(job_dir: Path) -> dict[str, float]:
    """Node name -> seconds from the job's earliest first step to this node's first step, on the
    wall clock: each rank's first step began at its step record's ``time_unix`` less its
    ``step_s`` (its step loop, after start-up, data loading and the setup broadcast; the
    training clock's zero for that rank in harness.results). Ranks are named by the job's
    network point's plan.json."""
    job = json.loads((job_dir / "job.json").read_text())
    extra = (job.get("network") or {}).get("extra_servers")
    plan = json.loads((job_dir.parents[1] / (job["network_key"] + (f"-ps{extra}" if extra else "")) / "plan.json").read_text())
    names = {node["rank"]: node["name"] for node in plan["nodes"]}
    firsts = {}
    for path in sorted(job_dir.glob("rank*.jsonl")):
        step = next(r for r in read_complete_records(path) if r.get("kind") == "step")
        firsts[names[int(path.stem.removeprefix("rank"))]] = step["time_unix"] - step["step_s"]
    earliest = min(firsts.values())
    return {node: round(first - earliest, 6) for node, first in sorted(firsts.items())}


def tun_congestion_control(run_dir: Path) -> str | None:
    """The congestion control tun's nodes ran (job.json's ``node_stack``; None if unrecorded)."""
    for path in sorted((run_dir / "jobs").glob("*/job.json")):
        stack = json.loads(path.read_text()).get("node_stack") or {}
        name = (stack.get("sysctls") or {}).get("net.ipv4.tcp_congestion_control")
        if name:
            return str(name)
    return None


def job_dirs(run_dir: Path) -> dict[str, Path]:
    """Label -> job directory (one seed per label in this bench)."""
    return {json.loads(path.read_text())["label"]: path.parent for path in (run_dir / "jobs").glob("*/job.json")}


def steady_steps_per_s(job_dir: Path) -> float | None:
    """Median over the job's ranks of (steps after the first STEADY_FROM) / (the time they took)."""
    rates = []
    for path in sorted(job_dir.glob("rank*.jsonl")):
        times = [r["time_s"] for r in read_complete_records(path) if r.get("kind") == "step"]
        if len(times) > STEADY_FROM + 1 and times[-1] > times[STEADY_FROM]:
            rates.append((len(times) - 1 - STEADY_FROM) / (times[-1] - times[STEADY_FROM]))
    return statistics.median(rates) if rates else None


def summary(run_dir: Path) -> pd.DataFrame:
    table = pd.read_csv(run_dir / "summary.csv")
    jobs = {}
    for path in (run_dir / "jobs").glob("*/job.json"):
        job = json.loads(path.read_text())
        jobs[(job["label"], job["seed"])] = path.parent
    table["steady_steps_per_s"] = [steady_steps_per_s(jobs[(label, seed)]) if (label, seed) in jobs else None
                                   for label, seed in zip(table["label"], table["seed"])]
    return table.set_index("label")


def relative_error(sim, tun):
    if sim is None or tun is None or pd.isna(sim) or pd.isna(tun) or tun == 0:
        return None
    return float(sim) / float(tun) - 1.0


def shown(path: Path) -> str:
    """A run directory relative to the repository where it lies inside it."""
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def case(per_region: int, steps: int, target: float, topology: Path, algorithms: str,
         tun_dir: Path | None = None, with_offsets: bool = True, seed: int = 0) -> list[dict]:
    nodes = 4 * per_region
    name = f"calibration-{nodes}"
    common = dict(nodes=nodes, per_region=per_region, steps=steps, target=target, topology=topology.resolve(),
                  algorithms=algorithms, seed=seed)
    started = time.monotonic()
    if tun_dir is None:
        tun_dir = run_scenario(SCENARIO.format(name=name, backend="tun", sim="", **common), name, "tun")
    tun_wall = time.monotonic() - started
    model = compute_model(tun_dir)
    # the tun jobs this case simulates (an earlier tun run may hold more than --algorithms names)
    listed = {label: job_dir for label, job_dir in job_dirs(tun_dir).items()
              if re.search(rf"(label|name): {re.escape(label)}[,}}]", algorithms)}
    offsets = {label: start_offsets(job_dir) for label, job_dir in listed.items()} if with_offsets else {}
    sim_section = f"sim: {{compute_s: {model['compute_s']:.6f}, overhead_s: {model['overhead_s']:.6f}"
    sim_section += f", start_offsets_s: {json.dumps(offsets)}}}" if offsets else "}"
    congestion = tun_congestion_control(tun_dir)
    if congestion:  # the sim applies restart after idle unless told the nodes ran BBR (issue 21)
        sim_section += f"\nnode_sysctls: {{net.ipv4.tcp_congestion_control: {congestion}}}"
    started = time.monotonic()
    sim_dir = run_scenario(SCENARIO.format(name=name, backend="sim", sim=sim_section, **common), name, "sim")
    sim_wall = time.monotonic() - started
    tun, sim = summary(tun_dir), summary(sim_dir)
    tun_jobs, sim_jobs = job_dirs(tun_dir), job_dirs(sim_dir)
    rows = []
    for label in [label for label in tun.index if label in listed]:
        row = {"nodes": nodes, "label": label, "seed": seed, "compute_s": model["compute_s"], "overhead_s": model["overhead_s"],
               "tun_run": shown(tun_dir), "sim_run": shown(sim_dir),
               "tun_wall_s": tun_wall, "sim_wall_s": sim_wall,
               # the first steps' spread (s): what tun measured, and what the sim half ran with
               "tun_start_skew_s": max(start_offsets(tun_jobs[label]).values()),
               "sim_start_skew_s": max(start_offsets(sim_jobs[label]).values()) if label in sim_jobs else None,
               "start_offsets": "tun" if offsets else "none"}
        for metric in METRICS:
            a = tun.loc[label].get(metric)
            b = sim.loc[label].get(metric) if label in sim.index else None
            row[f"tun_{metric}"], row[f"sim_{metric}"] = a, b
            row[f"error_{metric}"] = relative_error(b, a)
        rows.append(row)
    return rows


def fmt(value, spec=".3f") -> str:
    return "-" if value is None or (isinstance(value, float) and pd.isna(value)) else format(value, spec)


def main(argv=None) -> int:
    with teardown_on_signals():  # SIGTERM ends the bench like Ctrl-C, so the networks come down
        return _main(argv)


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes-per-region", default="1,2,4", help="comma-separated (x4 regions)")
    parser.add_argument("--steps", type=int, default=60, help="step budget of each job")
    parser.add_argument("--target", type=float, default=0.8, help="target accuracy for time to target")
    parser.add_argument("--set", dest="algorithm_set", choices=sorted(ALGORITHM_SETS), default="default",
                        help="default: six algorithms, one all-reduce in flight at most; inflight-padded: DTS "
                             "with 8 and 4 all-reduces in flight, and jobs padded to 0.1 s a step (issue 21 §7)")
    parser.add_argument("--algorithms", default=None, help="comma-separated names (default: all of the set)")
    parser.add_argument("--topology", type=Path, default=REPO / "topologies" / "aws-4region.yaml")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds: one tun run and one sim run per seed and node count (the "
                             "seed sets the data order, the initial model and the start-up)")
    parser.add_argument("--tun-runs", default=None,
                        help="comma-separated run directories of earlier tun halves, one per node count and "
                             "seed (node counts outer), to simulate again without re-running tun")
    parser.add_argument("--start-offsets", choices=("tun", "none"), default="tun",
                        help="tun: give the sim half each tun job's start-up skew (sim.start_offsets_s); "
                             "none: simulate without a start-up term")
    args = parser.parse_args(argv)
    algorithms = ALGORITHM_SETS[args.algorithm_set]
    if args.algorithms:
        wanted = args.algorithms.split(",")
        algorithms = "\n" + "\n".join(line for line in algorithms.strip("\n").split("\n")
                                      if line.split("name: ")[1].split(",")[0].rstrip("}") in wanted) + "\n"
    env = environment("tun+sim", prefix=os.environ.get("WANBENCH_PREFIX", "wanb"), argv=sys.argv)
    print("# sim calibration", json.dumps(env), flush=True)
    rows = []
    counts = [int(v) for v in args.nodes_per_region.split(",")]
    seeds = [int(v) for v in args.seeds.split(",")]
    cases = [(per_region, seed) for per_region in counts for seed in seeds]
    tun_runs = [Path(p).resolve() for p in args.tun_runs.split(",")] if args.tun_runs else []
    tun_runs += [None] * (len(cases) - len(tun_runs))  # the cases without one run tun now
    for (per_region, seed), tun_run in zip(cases, tun_runs):
        for row in case(per_region, args.steps, args.target, args.topology, algorithms, tun_run,
                        args.start_offsets == "tun", seed):
            rows.append(row)
            print(f"nodes {row['nodes']:3d} {row['label']:<22} seed {seed} compute {row['compute_s'] * 1e3:6.2f} ms "
                  f"(+{row['overhead_s'] * 1e3:5.2f})  start skew tun {row['tun_start_skew_s']:.2f} "
                  f"sim {fmt(row['sim_start_skew_s'], '.2f')} s  "
                  + "  ".join(f"{m} tun {fmt(row[f'tun_{m}'])} sim {fmt(row[f'sim_{m}'])} "
                              f"err {fmt(row[f'error_{m}'], '+.1%')}" for m in METRICS), flush=True)
    print("\n| metric | jobs | median abs error | worst abs error |\n|---|---|---|---|")
    for metric in METRICS:
        errors = [abs(r[f"error_{metric}"]) for r in rows if r[f"error_{metric}"] is not None]
        if errors:
            print(f"| {metric} | {len(errors)} | {statistics.median(errors):.1%} | {max(errors):.1%} |")
    if len(seeds) > 1:  # per job over the seeds: the median error and its range
        print("\n| nodes | job | " + " | ".join(f"{m} error median [min..max]" for m in METRICS)
              + " |\n|---|---|" + "---|" * len(METRICS))
        for key in dict.fromkeys((r["nodes"], r["label"]) for r in rows):
            mine = [r for r in rows if (r["nodes"], r["label"]) == key]
            cells = []
            for metric in METRICS:
                errors = [r[f"error_{metric}"] for r in mine if r[f"error_{metric}"] is not None]
                cells.append(f"{statistics.median(errors):+.1%} [{min(errors):+.1%}..{max(errors):+.1%}]"
                             if errors else "-")
            print(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + " |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = RESULTS / f"bench_sim_calibration-{stamp}.csv"
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1, default=str))
    print(f"\nwrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
