"""Benchmark evaluation off the wire: what a snapshot costs, and the training time it saves.

Two measurements, printed as tables with hardware, versions, config and date:

  * --snapshot: the cost of one eval point for a rank: ``output_state()`` of rank 0's replica and
    ``write_snapshot`` (torch.save to a temporary file + rename) into --dir, for the MLP on digits
    and for the largest model in trainers/models.py (VGG with its defaults on CIFAR-10-shaped
    input, 2.4 M parameters). Median and spread over --repeats writes, and the file size.
  * --clock: a 4-rank gloo job on loopback run by the code before this change (in-band evaluation:
    averaged_copy() all-reduce, rank 0 evaluates while the others wait, stop broadcast) and by this
    code (snapshots), alternating for --repeats rounds. Per variant, rank 0's training time (the
    training clock from the start of its first step to the end of its last, which is all the
    in-band evaluation too for the old code, none of the snapshot writing for the new) and its wall
    time over the same span; medians and the median of the per-round ratios. The old code is
    taken from --baseline-tree (a checkout of it, e.g. ``git worktree add /tmp/base 8ebcb7d``).

    .venv/bin/python bench/bench_offwire.py --snapshot
    .venv/bin/python bench/bench_offwire.py --clock --baseline-tree /tmp/base --algorithm local_sgd
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainers.launch import free_port, stop_processes  # noqa: E402
from trainers.models import build_model  # noqa: E402
from trainers.snapshots import OutputState, write_snapshot  # noqa: E402

SNAPSHOT_MODELS = (("mlp (digits, hidden [64])", "mlp", {"hidden_sizes": [64]}, (1, 8, 8), 10),
                   ("vgg (CIFAR-10 shape, defaults)", "vgg", {}, (3, 32, 32), 10))
ALGORITHMS = {"local_sgd": {"name": "local_sgd", "params": {"H": 4}}, "swarmsgd": {"name": "swarmsgd", "params": {"H": 4}},
              "dts": {"name": "dts", "params": {"p": 4, "t": 2}}, "sync": {"name": "sync"}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--snapshot", action="store_true", help="time one rank's snapshot writes")
    parser.add_argument("--clock", action="store_true", help="in-band evaluation vs snapshots, 4-rank loopback job")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where snapshots are written (node-local storage)")
    parser.add_argument("--repeats", type=int, default=20, help="writes per model (--snapshot) or rounds (--clock)")
    parser.add_argument("--baseline-tree", type=Path, help="checkout of the code with in-band evaluation (--clock)")
    parser.add_argument("--algorithm", choices=sorted(ALGORITHMS), default="local_sgd")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=4)
    return parser.parse_args(argv)


def header(args: argparse.Namespace) -> None:
    print(f"# bench_offwire {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"# host {platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} (shared machine), "
          f"python {platform.python_version()}, torch {torch.__version__}")
    print(f"# config {json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()})}")


def bench_snapshot(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    print("\n| model | parameters | file bytes | median ms per snapshot | min ms | max ms |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="we-snap-", dir=args.dir) as folder:
        for label, name, params, shape, classes in SNAPSHOT_MODELS:
            model = build_model(name, params, shape, classes, seed=0)
            times, size = [], 0
            for index in range(args.repeats):
                started = time.perf_counter()
                size = write_snapshot(folder, 0, index, step=index, time_s=0.0, train_time_s=0.0,
                                      output=OutputState("rank0", model.state_dict()))
                times.append(time.perf_counter() - started)
            count = sum(p.numel() for p in model.parameters())
            print(f"| {label} | {count:,} | {size:,} | {1e3 * statistics.median(times):.2f} | "
                  f"{1e3 * min(times):.2f} | {1e3 * max(times):.2f} |")


def run_job(tree: Path, out: Path, config: dict, world_size: int, timeout_s: float = 600) -> None:
    """Run ``python -m trainers`` from ``tree`` (its code is imported first) with ``world_size`` ranks."""
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{out.name}.json"
    path.write_text(json.dumps({**config, "output_dir": str(out)}))
    port = free_port()
    processes = []
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
            processes.append(subprocess.Popen([sys.executable, "-m", "trainers", str(path)], cwd=tree, env=env,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for process in processes:
            _, stderr = process.communicate(timeout=timeout_s)
            if process.returncode != 0:
                raise RuntimeError(f"{out}: a rank failed: {stderr.decode()[-2000:]}")
    finally:
        stop_processes(processes)


def rank0_times(out: Path) -> dict:
    """Rank 0's training time (first step start to last step end, training clock) and wall time."""
    rows = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    status = rows[-1]
    first, last = steps[0], steps[-1]
    return {"train_s": last["time_s"] - (first["time_s"] - first["step_s"]),
            "wall_s": last["time_unix"] - (first["time_unix"] - first["step_s"]),
            "snapshot_s": status.get("snapshot_s_total", 0.0),
            "eval_s": sum(r["eval_s"] for r in rows if r["kind"] == "eval"),
            "blocked_s": sum(r["comm_blocked_s"] or 0.0 for r in steps),
            "median_step_ms": 1e3 * statistics.median(r["step_s"] for r in steps)}


def bench_clock(args: argparse.Namespace) -> None:
    if args.baseline_tree is None or not (args.baseline_tree / "trainers" / "runner.py").is_file():
        raise SystemExit("--clock needs --baseline-tree: a checkout of the code with in-band evaluation")
    config = {"seed": 3, "batch_size": 16, "lr": 0.1, "steps": args.steps, "eval_every": args.eval_every,
              "model": {"name": "mlp", "params": {"hidden_sizes": [64]}}, "dataset": {"name": "digits"},
              "algorithm": ALGORITHMS[args.algorithm]}
    trees = {"in_band": args.baseline_tree.resolve(), "snapshots": REPO}
    results: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="we-clock-") as folder:
        for round_index in range(args.repeats):
            order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
            for name in order:
                out = Path(folder) / f"{name}{round_index}"
                run_job(trees[name], out, config, args.world_size)
                results[name].append(rank0_times(out))
                print(f"# round {round_index} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name][-1].items()),
                      flush=True)
    print(f"\n{args.world_size} ranks, gloo on 127.0.0.1, {args.algorithm}, MLP [64] on digits, {args.steps} steps, "
          f"eval point every {args.eval_every} steps, {args.repeats} rounds (order alternating); rank 0")
    print("\n| variant | median training time s | median wall time s | median eval_s (in-band) | median snapshot_s (off clock) "
          "| median comm_blocked_s | median ms/step |")
    print("|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"| {name} | {med['train_s']:.3f} | {med['wall_s']:.3f} | {med['eval_s']:.3f} | {med['snapshot_s']:.3f} "
              f"| {med['blocked_s']:.3f} | {med['median_step_ms']:.2f} |")
    ratios = [a["train_s"] / b["train_s"] for a, b in zip(results["in_band"], results["snapshots"])]
    wall = [a["wall_s"] / b["wall_s"] for a, b in zip(results["in_band"], results["snapshots"])]
    print(f"\nmedian per-round ratio in_band / snapshots: training time {statistics.median(ratios):.2f}x, "
          f"wall time {statistics.median(wall):.2f}x")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.snapshot or args.clock):
        raise SystemExit("choose --snapshot and/or --clock")
    header(args)
    if args.snapshot:
        bench_snapshot(args)
    if args.clock:
        bench_clock(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
