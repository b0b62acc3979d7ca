"""DiLoCo against Streaming DiLoCo on the simulator: the byte LM on aws-4region, 8 nodes (issue 24).

Every job is the repository's own training code on the simulated network (``--backend sim``:
trainers/sim, emulator/simnet.py's FluidNetwork built from topologies/aws-4region.yaml with two
nodes per region). The workload is scenarios/paper-dts-lm.yaml's (byte-level Transformer, 2
blocks, d_model 64, seq_len 32, batch 16 per node, AdamW inner lr 0.003 with its cosine
schedule), shortened. The compute model is an assumption, printed: ``--compute-s`` virtual
seconds per forward + backward (default 0.1 s, an LLM-sized step next to the WAN's 70-220 ms
round trips; at paper-dts-lm's 6.2 ms no overlap of a few steps could hide a WAN round trip).

Columns: validation loss (nats per byte) of the output model (the global model) at the last
step, from the evaluator (trainers/evaluate.py, outside the measured run); bytes sent per node
over the run; bytes per sync event (the largest bytes a node sent in one step: the peak burst,
a bandwidth proxy); blocked s (comm_blocked_s summed over the run, per node); compute
utilisation = compute time / wall time (sum of compute_s over sum of step_s, per node, both
virtual). Medians over nodes, then median and range over seeds.

    PYTHONPATH=$PWD python bench/bench_streaming_diloco.py --seeds 0 1 2 --csv results/bench/streaming_diloco.csv
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from emulator.plan import make_plan  # noqa: E402
from emulator.simnet import FluidNetwork  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from trainers.evaluate import evaluate_job  # noqa: E402
from trainers.loading import load_config  # noqa: E402
from trainers.records import read_records  # noqa: E402
from trainers.sim import ComputeModel, run_simulated  # noqa: E402

NODES_PER_REGION = 2
H = 20
FRAGMENTS = 4
WORKLOAD = {
    "model": {"name": "transformer", "params": {"d_model": 64, "n_heads": 2, "n_layers": 2}},
    "dataset": {"name": "text_corpus", "test_fraction": 0.1, "max_test_samples": 500, "params": {"seq_len": 32}},
    "batch_size": 16,
    "lr": 0.003,
    "optimizer": {"name": "adamw"},
    "lr_schedule": {"name": "cosine", "warmup_steps": 20},
}


def variants() -> dict[str, dict]:
    """label -> algorithm section: DiLoCo, then Streaming DiLoCo (F = 4) at overlaps 0 .. H/F."""
    out = {"diloco": {"name": "diloco", "params": {"H": H}}}
    for overlap in (0, 1, 2, H // FRAGMENTS):
        out[f"streaming-t{overlap}"] = {"name": "streaming_diloco",
                                        "params": {"H": H, "fragments": FRAGMENTS, "overlap": overlap}}
    out[f"streaming-t{H // FRAGMENTS}-int4"] = {
        "name": "streaming_diloco",
        "params": {"H": H, "fragments": FRAGMENTS, "overlap": H // FRAGMENTS, "outer_precision": "int4"}}
    out["diloco-int4"] = {"name": "diloco", "params": {"H": H, "outer_precision": "int4"}}
    return out


def network():
    topology = load_topology(ROOT / "topologies" / "aws-4region.yaml")
    topology = topology.with_nodes({region: NODES_PER_REGION for region in topology.regions})
    return FluidNetwork.from_plan(make_plan(topology, prefix="wbs"))


def run_one(label: str, algorithm: dict, seed: int, steps: int, compute_s: float, out: Path) -> dict:
    output_dir = out / f"{label}-s{seed}"
    config = load_config({**WORKLOAD, "seed": seed, "steps": steps, "eval_every": steps,
                          "output_dir": str(output_dir), "algorithm": algorithm})
    net = network()
    started = time.perf_counter()
    run_simulated(config, net.size, net, ComputeModel(compute_s))
    wall_s = time.perf_counter() - started
    per_node = []
    for rank in range(net.size):
        steps_ = [r for r in read_records(output_dir / f"rank{rank}.jsonl") if r["kind"] == "step"]
        per_node.append({
            "bytes": sum(r["bytes_sent"] for r in steps_),
            "peak": max(r["bytes_sent"] for r in steps_),
            "events": sum(r["bytes_sent"] > 0 for r in steps_),
            "blocked": sum(r["comm_blocked_s"] for r in steps_),
            "util": sum(r["compute_s"] for r in steps_) / sum(r["step_s"] for r in steps_),
            "virtual_s": sum(r["step_s"] for r in steps_),
        })
    evaluation = evaluate_job(output_dir)[-1]
    median = lambda key: statistics.median(node[key] for node in per_node)  # noqa: E731
    return {"label": label, "seed": seed, "steps": steps, "val_loss": evaluation["loss"],
            "eval_step": evaluation["step"], "bytes_per_node": median("bytes"),
            "bytes_per_sync_event": median("peak"), "sync_events": median("events"),
            "blocked_s": median("blocked"), "compute_util": median("util"), "virtual_s": median("virtual_s"),
            "sim_wall_s": wall_s}


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compute-s", type=float, default=0.1)
    parser.add_argument("--only", nargs="*", help="labels to run (default: all)")
    parser.add_argument("--csv", type=Path, help="write every job's row here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = {k: v for k, v in variants().items() if not args.only or k in args.only}
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}; sim backend, aws-4region x "
          f"{NODES_PER_REGION} nodes per region; H {H}, F {FRAGMENTS}; {args.steps} steps; compute model "
          f"{args.compute_s} s per step (an assumption); seeds {args.seeds}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as tmp:
        for seed in args.seeds:
            for label, algorithm in chosen.items():
                row = run_one(label, algorithm, seed, args.steps, args.compute_s, Path(tmp))
                rows.append(row)
                if args.csv:  # after every job, so an interrupted sweep keeps what it measured
                    write_csv(args.csv, rows)
                print(f"# done {label} seed {seed}: loss {row['val_loss']:.4f}, sim took {row['sim_wall_s']:.0f} s",
                      flush=True)
    print("\n| algorithm | val loss (median [min, max] over seeds) | bytes / node | bytes / sync event | "
          "sync events | blocked s / node | compute util | virtual s | vs diloco: peak | vs diloco: blocked |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = [r for r in rows if r["label"] == "diloco"]
    for label in chosen:
        mine = [r for r in rows if r["label"] == label]
        med = lambda key, rs=mine: statistics.median(r[key] for r in rs)  # noqa: E731
        losses = [r["val_loss"] for r in mine]
        ratio = lambda key: f"{med(key) / med(key, base):.2f}" if base and med(key, base) else "-"  # noqa: E731
        print(f"| {label} | {statistics.median(losses):.4f} [{min(losses):.4f}, {max(losses):.4f}] | "
              f"{med('bytes_per_node') / 1e6:.2f} MB | {med('bytes_per_sync_event') / 1e3:.0f} kB | "
              f"{med('sync_events'):.0f} | {med('blocked_s'):.2f} | {med('compute_util'):.3f} | "
              f"{med('virtual_s'):.1f} | {ratio('bytes_per_sync_event')} | {ratio('blocked_s')} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
