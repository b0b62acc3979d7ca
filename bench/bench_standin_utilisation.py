"""Compute utilisation of data-parallel sync and DiLoCo for 1B and 10B stand-in models across
aws-4region, as the inter-region bandwidth goes from 0.1 to 100 Gbit/s (issue 24 §4).

Every point is one simulated job (backend sim, trainers.sim.run_simulated) of 8 nodes (aws-4region,
2 per region; the topology's RTTs, every inter-region link at the swept rate, each NIC set to
100 Gbit/s so that the links, not the NICs, bind). The ranks train the digits MLP; every message
is charged at the stand-in's size (`stand_in:`'s wire scale: P x 4 bytes, fp32, over the MLP's
fp32 bytes) and every step costs the stand-in's step time:

    step_s = 6 x P x tokens_per_step / flops_per_s

(defaults: 65,536 tokens per node per step on 8 x H100 at 40 % of bf16 peak, 3.2e15 FLOP/s:
1.23 s for 10B, 0.123 s for 1B; a stated assumption, not a measurement). Sync all-reduces the
gradients every step (auto: the ring at these sizes); DiLoCo all-reduces fp32 pseudo-gradients
every H = 100 steps. Utilisation is harness.results' compute_utilisation (compute time over the
steps' time; virtual seconds), the bandwidths its per-node mean and per-step peak.

Sync runs a few steps (every step is alike), DiLoCo 2 x H steps (two rounds: compute and
communication in the ratio a long run has). Prints a table and writes a CSV.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_standin_utilisation.py
    PYTHONPATH=$PWD .venv/bin/python bench/bench_standin_utilisation.py --rates-gbit 1,10 --sizes 10e9
"""

from __future__ import annotations

import argparse
import csv
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pandas as pd  # noqa: E402

from emulator.plan import make_plan  # noqa: E402
from emulator.simnet import FluidNetwork  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from harness.results import utilisation_and_bandwidth  # noqa: E402
from harness.scenario import StandIn  # noqa: E402
from harness.sim_job import real_parameters, stand_in_record  # noqa: E402
from trainers.loading import load_config  # noqa: E402
from trainers.records import read_records  # noqa: E402
from trainers.sim import ComputeModel, run_simulated  # noqa: E402

TOPOLOGY = REPO / "topologies" / "aws-4region.yaml"
NIC_RATE_BIT_S = 100e9
WORKLOAD = {"model": {"name": "mlp", "params": {"hidden_sizes": [64]}}, "dataset": {"name": "digits"},
            "batch_size": 32, "lr": 0.05, "optimizer": {"name": "sgd", "momentum": 0.9}, "eval_every": 10_000}
DEFAULT_OUT = REPO / "results" / "bench" / "standin_utilisation.csv"


def step_seconds(parameters: float, tokens_per_step: float, flops_per_s: float) -> float:
    """One training step of a dense transformer of `parameters`: 6 FLOPs per parameter per token."""
    return 6 * parameters * tokens_per_step / flops_per_s


def one_point(algorithm: dict, steps: int, parameters: float, step_s: float, rate_bit_s: float,
              per_region: int, folder: Path) -> dict:
    """One simulated job; its utilisation and bandwidths from its records (harness.results)."""
    topology = load_topology(TOPOLOGY)
    topology = topology.with_nodes({r: per_region for r in topology.regions}).scaled(1.0, rate_bit_s)
    plan = make_plan(topology)
    network = FluidNetwork.from_plan(plan, nic_rate_bit_s=NIC_RATE_BIT_S, seed=0)
    config = load_config({**WORKLOAD, "seed": 0, "steps": steps, "algorithm": algorithm, "output_dir": str(folder)})
    stand_in = stand_in_record(StandIn(parameters=parameters, step_s=step_s), step_s, real_parameters(config))
    started = time.perf_counter()
    run_simulated(config, len(plan.nodes), network, ComputeModel(step_s), wire_scale=stand_in["wire_scale"])
    wall = time.perf_counter() - started
    rows = [r for rank in range(len(plan.nodes)) for r in read_records(folder / f"rank{rank}.jsonl")
            if r["kind"] == "step"]
    metrics = utilisation_and_bandwidth(pd.DataFrame(rows))
    rank0 = [r for r in rows if r["rank"] == 0]
    return {**metrics, "virtual_s": rank0[-1]["time_s"], "steps": len(rank0), "wire_scale": stand_in["wire_scale"],
            "sim_wall_s": wall}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates-gbit", default="0.1,0.3,1,3,10,30,100", help="inter-region rates, Gbit/s")
    parser.add_argument("--sizes", default="1e9,10e9", help="stand-in parameter counts")
    parser.add_argument("--H", type=int, default=100, help="DiLoCo's inner steps per round")
    parser.add_argument("--sync-steps", type=int, default=4)
    parser.add_argument("--per-region", type=int, default=2, help="nodes per region (4 regions)")
    parser.add_argument("--tokens-per-step", type=float, default=65_536, help="tokens per node per step")
    parser.add_argument("--flops-per-s", type=float, default=3.2e15, help="one node's sustained FLOP/s")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rates = [float(x) * 1e9 for x in args.rates_gbit.split(",")]
    sizes = [float(x) for x in args.sizes.split(",")]
    algorithms = [("sync", {"name": "sync"}, args.sync_steps),
                  (f"diloco-H{args.H}", {"name": "diloco", "params": {"H": args.H}}, 2 * args.H)]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"python {platform.python_version()}; backend sim; {TOPOLOGY.name} x {args.per_region} per region, "
          f"NIC {NIC_RATE_BIT_S / 1e9:g} Gbit/s; fp32 messages; step_s = 6 P x {args.tokens_per_step:g} tokens / "
          f"{args.flops_per_s:g} FLOP/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="standin-") as tmp:
        for size in sizes:
            step_s = step_seconds(size, args.tokens_per_step, args.flops_per_s)
            for label, algorithm, steps in algorithms:
                for rate in rates:
                    folder = Path(tmp) / f"{label}-{size:g}-{rate:g}"
                    point = one_point(algorithm, steps, size, step_s, rate, args.per_region, folder)
                    row = {"parameters": size, "algorithm": label, "rate_gbit_s": rate / 1e9, "step_s": step_s,
                           **point}
                    rows.append(row)
                    print(f"{size / 1e9:>5g}B {label:<12} {rate / 1e9:>6g} Gbit/s  utilisation "
                          f"{row.get('compute_utilisation', float('nan')):.3f}  mean "
                          f"{row.get('mean_bandwidth_per_node_bit_s', 0) / 1e9:7.3f} Gbit/s  peak "
                          f"{row.get('peak_bandwidth_per_node_bit_s', 0) / 1e9:7.3f} Gbit/s  "
                          f"({row['steps']} steps, {row['virtual_s']:.1f} virtual s, {row['sim_wall_s']:.1f} s here)",
                          flush=True)
    table = pd.DataFrame(rows)
    print()
    print("compute utilisation (rows: stand-in and algorithm; columns: inter-region Gbit/s)")
    pivot = table.pivot_table(index=["parameters", "algorithm"], columns="rate_gbit_s", values="compute_utilisation")
    print(pivot.to_string(float_format=lambda v: f"{v:.3f}"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table.columns))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nCSV: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
