"""`wanbench run --jobs N` against `--jobs 1`: the wall time of one sim sweep run both ways, side
by side in one invocation, and whether the two summaries are equal (wall-clock columns aside).

The sweep (default): LeNet on digits, 4 nodes on aws-4region, sync / local_sgd / dts, seeds 0-3:
12 jobs, each a process of its own (the simulator, then the evaluator). The runs alternate
(1, N, 1, N, ...) over ``--repeats`` rounds so that drift in the machine's load falls on both;
the table gives each run's wall time, the median per setting and the median of the per-round
ratios N/1. Each run's folder is under a temporary directory (removed afterwards); ``--csv``
appends one row per run.

    .venv/bin/python bench/bench_jobs.py                      # --jobs 2 vs 1, 1 round
    .venv/bin/python bench/bench_jobs.py --jobs 2 --repeats 2 --csv results/bench/jobs.csv
    .venv/bin/python bench/bench_jobs.py --workers 2           # --cluster: 2 Dask workers vs --jobs 1

``--workers W``: the parallel setting is `wanbench run --cluster` (harness/cluster.py) on a Dask
cluster started here for the benchmark, a scheduler and W one-thread workers as processes of
their own on 127.0.0.1 (ended afterwards), W tasks in flight.

It needs the machine to itself: other processes on its cores slow the parallel run more than
the serial one (fewer free cores), so the ratio measured then is pessimistic.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SWEEP = textwrap.dedent("""
    name: bench-jobs
    topology: {topologies}/aws-4region.yaml
    backend: sim
    workload:
      model: {{name: lenet}}
      dataset: {{name: digits}}
      batch_size: 32
      lr: 0.05
      eval_every: 20
    stop: {{steps: {steps}}}
    algorithms:
      - {{name: sync}}
      - {{name: local_sgd, params: {{H: 4}}}}
      - {{name: dts, params: {{t: 4, p: 2}}}}
    seeds: [0, 1, 2, 3]
    sim: {{compute_s: 0.01, overhead_s: 0.001}}
""")
WALL_CLOCK_COLUMNS = ["wall_s"]


def run_once(scenario_file: Path, runs: Path, jobs: int, cluster: str | None = None) -> tuple[float, pd.DataFrame]:
    from rich.console import Console

    from harness.run import run_scenario
    from harness.scenario import load_scenario

    started = time.perf_counter()
    completed = run_scenario(load_scenario(str(scenario_file)), "sim", runs, console=Console(file=io.StringIO()),
                             jobs=jobs, cluster=cluster)
    wall = time.perf_counter() - started
    summary = pd.read_csv(completed.run_dir / "summary.csv").drop(columns=WALL_CLOCK_COLUMNS)
    if set(summary["status"]) != {"ok"}:
        raise SystemExit(f"a job did not end ok in {completed.run_dir}: {summary['status'].tolist()}")
    return wall, summary


def start_cluster(folder: Path, workers: int) -> tuple[str, list[subprocess.Popen]]:
    """A Dask scheduler and `workers` one-thread workers on 127.0.0.1 (free ports): its address and
    the processes (end them by PID)."""
    from distributed import Client

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    scheduler_file = folder / "scheduler.json"
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--no-dashboard", "--scheduler-file", str(scheduler_file)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    deadline = time.monotonic() + 90
    while not scheduler_file.exists():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise SystemExit("the Dask scheduler did not start")
        time.sleep(0.2)
    address = json.loads(scheduler_file.read_text())["address"]
    procs += [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", "127.0.0.1",
                                "--nthreads", "1", "--no-dashboard"], env=env, cwd=folder,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(workers)]
    with Client(address, timeout=90, set_as_default=False) as client:
        client.wait_for_workers(workers, timeout=90)
    return address, procs


def sweep(args, tmp: Path, address, label) -> tuple[list, dict, bool]:
    """The rounds of (1, N): each run's wall time, the summaries, and whether they are equal."""
    scenario = Path(tmp, "sweep.yaml")
    scenario.write_text(SWEEP.format(topologies=ROOT / "topologies", steps=args.steps))
    rows, summaries = [], {}
    for round_ in range(args.repeats):
        for jobs in (1, args.jobs):
            wall, summary = run_once(scenario, Path(tmp, f"runs-{round_}-{jobs}"), jobs,
                                     address if jobs != 1 else None)
            rows.append({"round": round_, "jobs": jobs, "wall_s": wall, "jobs_in_sweep": len(summary)})
            summaries.setdefault(jobs, summary)
            print(f"round {round_}: {label[jobs]}: {wall:.1f} s for {len(summary)} jobs", flush=True)
    equal = summaries[1].equals(summaries[args.jobs])
    if not equal:  # say where
        diff = summaries[1].compare(summaries[args.jobs])
        print(diff.to_string(), file=sys.stderr)
    return rows, summaries, equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="the parallel setting (default 2)")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of (1, N) (default 1)")
    parser.add_argument("--steps", type=int, default=60, help="steps per job (default 60)")
    parser.add_argument("--csv", type=Path, default=None, help="append one row per run here")
    parser.add_argument("--workers", type=int, default=None,
                        help="the parallel setting on a local Dask cluster of this many workers (--cluster)")
    args = parser.parse_args()
    if args.workers is not None:
        if args.workers < 2:
            parser.error("--workers: at least 2 (the parallel setting against --jobs 1)")
        args.jobs = args.workers
    label = {1: "--jobs 1", args.jobs: f"--cluster ({args.jobs} workers)" if args.workers else f"--jobs {args.jobs}"}

    with tempfile.TemporaryDirectory(prefix="wanbench-bench-jobs-") as tmp:
        address, procs = start_cluster(Path(tmp), args.workers) if args.workers else (None, [])
        try:
            rows, summaries, equal = sweep(args, Path(tmp), address, label)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()

    walls = {jobs: [r["wall_s"] for r in rows if r["jobs"] == jobs] for jobs in (1, args.jobs)}
    ratios = [n["wall_s"] / one["wall_s"] for one, n in zip(rows[0::2], rows[1::2])]
    print()
    print(f"{'setting':<24} {'runs':>5} {'median wall s':>14}")
    for jobs, values in walls.items():
        print(f"{label[jobs]:<24} {len(values):>5} {statistics.median(values):>14.1f}")
    print(f"ratio {label[args.jobs]} / --jobs 1, median of {len(ratios)} round(s): {statistics.median(ratios):.3f} "
          f"(each: {', '.join(f'{r:.3f}' for r in ratios)}); summaries equal: {equal}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the end")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        new = not args.csv.exists()
        with open(args.csv, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["date", "cpus", "round", "jobs", "wall_s", "jobs_in_sweep",
                                                   "summaries_equal", "cluster_workers"])
            if new:
                writer.writeheader()
            for row in rows:
                writer.writerow({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                 "cpus": os.cpu_count(), **row, "summaries_equal": equal,
                                 "cluster_workers": args.workers if row["jobs"] != 1 else None})
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
