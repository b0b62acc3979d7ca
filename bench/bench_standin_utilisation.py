"""Compute utilisation of data-parallel sync, DiLoCo and Streaming DiLoCo for stand-in models
(1B, 10B, 100B) across a WAN topology, as the bandwidth is swept (issue 24 §4 and "Done when").

Every point is one simulated job (backend sim, trainers.sim.run_simulated) of N nodes (default
aws-4region, 2 per region; the topology's RTTs, every inter-region link at the swept rate, each NIC
set to 100 Gbit/s so that the links, not the NICs, bind; `--uniform`: the intra-region links at the
swept rate too, the Streaming DiLoCo paper's one-bandwidth assumption; `--nic-at-rate`: each node's
NIC as well, a node's bandwidth rather than each link's). The ranks train a small MLP
on digits; every message is charged at the stand-in's size (`stand_in:`'s wire scale: P x
bytes_per_parameter, default 4 = fp32, over the MLP's fp32 bytes; a compressed payload scales the
same way) and every step costs the stand-in's step time:

    step_s = 6 x P x tokens_per_step / flops_per_s

(defaults: 65,536 tokens per node per step on 8 x H100 at 40 % of bf16 peak, 3.2e15 FLOP/s:
1.23 s for 10B, 0.123 s for 1B; a stated assumption, not a measurement; `--paper-step-times`
takes the Streaming DiLoCo paper's Table 4 step times instead, `--step-s` one given time).

Methods (`--methods`, comma-separated):
  sync            all-reduce the gradients every step (auto: the ring at these sizes)
  diloco          DiLoCo, fp32 pseudo-gradients all-reduced every H steps
  diloco-int8/-int4   the same, int8/int4 payloads all-gathered (trainers/compression.py)
  streaming       Streaming DiLoCo (H, F fragments, overlap tau), fp32 fragments all-reduced
  streaming-int4  the same, int4 payloads all-gathered (the paper's "overlapped FP4 com.")
  <any of those but sync and fp32>-ring   the payloads over the coded ring all-reduce instead
                  (outer_reduce: ring: 2 (n-1)/n payloads a node, re-encoded at each hop, one
                  link a node, 2 (n-1) latency-bound steps; INTELLECT-1's int8 ring)
F: `--fragments`, default the paper's "3 layers per fragment" (its Table 4 layer counts 24 / 48 /
108 for 1B / 10B / 100B) rounded to the nearest divisor of H (the trainer needs F | H): 10, 20, 25.
Streaming rows train an MLP of F - 1 hidden layers of 64 (2F tensors: F fragments within 10 % of
equal size but the last, a fifth); the others the 64-unit one-hidden-layer MLP (both only shape
what is charged: bytes follow the stand-in).

Utilisation is harness.results' compute_utilisation (compute time over the steps' time; virtual
seconds), the bandwidths its per-node mean and per-step peak. Sync runs a few steps (every step is
alike), the others 2 x H steps (two rounds). `bandwidth_for_utilisation` interpolates each curve
(log-linear between the two grid points around a target) to the bandwidth a target utilisation
needs; the script prints that table for `--targets` and, with `--plot`, draws the curves.

    # section 13's rows (defaults unchanged)
    PYTHONPATH=$PWD .venv/bin/python bench/bench_standin_utilisation.py
    # section 15b: uniform links, log grid, Streaming DiLoCo and compressed DiLoCo
    PYTHONPATH=$PWD .venv/bin/python bench/bench_standin_utilisation.py --uniform --grid 0.1,1000,4 \\
        --sizes 10e9 --methods diloco,diloco-int8,diloco-int4,streaming,streaming-int4 --out ...
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

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
METHODS = ("sync", "diloco", "diloco-int8", "diloco-int4", "streaming", "streaming-int4",
           "diloco-int8-ring", "diloco-int4-ring", "streaming-int8-ring", "streaming-int4-ring")

# Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", arXiv 2501.18512,
# Table 4 (appendix, "Simulation"): layers and step time (pure compute, Kaplan flops at 60 % MFU) per
# size, and the Gbit/s each method needs for a compute utilisation of 50/80/90/95/99 %; H = 100,
# Streaming variants with fragments of 3 layers.
PAPER_LAYERS = {1e9: 24, 10e9: 48, 100e9: 108}
PAPER_STEP_S = {1e9: 0.1, 10e9: 0.8, 100e9: 4.9}
PAPER_TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
PAPER_TABLE4 = {
    1e9: {"Data-Parallel": (86.8, 152.6, 184.2, 222.3, 569.0),
          "Vanilla DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
          "Streaming DiLoCo": (1.4, 5.2, 9.1, 16.0, 28.1),
          "Streaming DiLoCo w/ overlapped com.": (1.4, 4.3, 6.2, 9.1, 11.0),
          "Streaming DiLoCo w/ overlapped FP4 com.": (0.4, 0.9, 1.7, 2.0, 3.0)},
    10e9: {"Data-Parallel": (104.8, 222.3, 222.3, 268.3, 471.5),
           "Vanilla DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8),
           "Streaming DiLoCo": (1.7, 5.2, 9.1, 13.3, 19.3),
           "Streaming DiLoCo w/ overlapped com.": (1.7, 3.6, 5.2, 6.2, 7.5),
           "Streaming DiLoCo w/ overlapped FP4 com.": (0.4, 0.9, 1.4, 1.4, 1.7)},
    100e9: {"Data-Parallel": (184.2, 323.8, 390.7, 390.7, 471.5),
            "Vanilla DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2),
            "Streaming DiLoCo": (2.4, 6.2, 9.1, 11.0, 19.3),
            "Streaming DiLoCo w/ overlapped com.": (1.7, 3.6, 4.3, 5.2, 5.2),
            "Streaming DiLoCo w/ overlapped FP4 com.": (0.5, 0.9, 1.1, 1.1, 1.4)},
}


def step_seconds(parameters: float, tokens_per_step: float, flops_per_s: float) -> float:
    """One training step of a dense transformer of `parameters`: 6 FLOPs per parameter per token."""
    return 6 * parameters * tokens_per_step / flops_per_s


def fragments_for(parameters: float, H: int) -> int:
    """The paper's fragment count for a size (its layers / 3), as the divisor of H nearest to it
    (ties: the larger, the lower peak)."""
    if parameters not in PAPER_LAYERS:
        raise ValueError(f"fragments: no layer count for a {parameters:g}-parameter model in the paper's "
                         f"Table 4 ({sorted(PAPER_LAYERS)}); give --fragments")
    want = PAPER_LAYERS[parameters] / 3
    divisors = [d for d in range(1, H + 1) if H % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))


def bandwidth_for_utilisation(rows, target: float) -> Optional[float]:
    """The bandwidth (rows' unit, `rate_gbit_s`) at which one curve first reaches `target`
    compute utilisation: log-linear interpolation between the grid points on either side of the
    first crossing; the lowest rate if the curve starts at or above the target (an upper bound);
    None if no grid point reaches it.

    rows: mappings with `rate_gbit_s` and `compute_utilisation` (one method, one size).
    """
    points = sorted((float(r["rate_gbit_s"]), float(r["compute_utilisation"])) for r in rows)
    if not points:
        raise ValueError("rows: no points to interpolate")
    for i, (rate, util) in enumerate(points):
        if rate <= 0:
            raise ValueError(f"rate_gbit_s: must be > 0 on a log grid; got {rate:g}")
        if util < target:
            continue
        if i == 0:
            return rate
        low_rate, low_util = points[i - 1]
        fraction = (target - low_util) / (util - low_util)
        return math.exp(math.log(low_rate) + fraction * (math.log(rate) - math.log(low_rate)))
    return None


def log_grid(spec: str) -> list[float]:
    """`LOW,HIGH,PER_DECADE` (Gbit/s): log-spaced rates from LOW to HIGH inclusive."""
    try:
        low, high, per_decade = (float(x) for x in spec.split(","))
    except ValueError:
        raise SystemExit(f"--grid: want LOW,HIGH,PER_DECADE; got {spec!r}") from None
    if not (0 < low < high) or per_decade < 1:
        raise SystemExit(f"--grid: want 0 < LOW < HIGH and PER_DECADE >= 1; got {spec!r}")
    count = round(math.log10(high / low) * per_decade)
    return [float(f"{low * 10 ** (k / per_decade):.4g}") for k in range(count + 1)]


def parse_nodes(spec: Optional[str]) -> Optional[dict]:
    """`region=count,...` -> {region: count}."""
    if not spec:
        return None
    try:
        return {name: int(count) for name, count in (item.split("=") for item in spec.split(","))}
    except ValueError:
        raise SystemExit(f"--nodes: want REGION=COUNT,...; got {spec!r}") from None


def algorithm_for(method: str, H: int, fragments: int, overlap: int) -> tuple[str, dict, Optional[dict]]:
    """(label, trainer algorithm, model override or None) of a method."""
    if method == "sync":
        return "sync", {"name": "sync"}, None
    if method not in METHODS:
        raise SystemExit(f"--methods: unknown method {method!r}; known: {', '.join(METHODS)}")
    family, _, rest = method.partition("-")
    precision, _, reduce = rest.partition("-")
    precision = precision or "fp32"
    suffix = ("" if precision == "fp32" else f"-{precision}") + ("-ring" if reduce else "")
    params = {"H": H, "outer_precision": precision, **({"outer_reduce": "ring"} if reduce else {})}
    if family == "diloco":
        return f"diloco-H{H}{suffix}", {"name": "diloco", "params": params}, None
    params.update(fragments=fragments, overlap=overlap)   # family == "streaming" (METHODS has no other)
    model = {"name": "mlp", "params": {"hidden_sizes": [64] * (fragments - 1)}}
    return f"streaming-H{H}-F{fragments}-tau{overlap}{suffix}", {"name": "streaming_diloco", "params": params}, model


def network_topology(path: Path, per_region: int, nodes: Optional[dict], rate_bit_s: float, uniform: bool,
                     slow_start_after_idle: bool = True):
    """The topology at one sweep point: node counts, every inter-region link at `rate_bit_s`, with
    `uniform` the intra-region links too, and without `slow_start_after_idle` the nodes'
    net.ipv4.tcp_slow_start_after_idle = 0 (a connection keeps its window across idleness)."""
    topology = load_topology(path)
    if not slow_start_after_idle:
        topology = topology.with_sysctls({"net.ipv4.tcp_slow_start_after_idle": "0"})
    counts = nodes if nodes is not None else {r: per_region for r in topology.regions}
    topology = topology.with_nodes(counts).scaled(1.0, rate_bit_s)
    if uniform:
        topology = replace(topology, intra_region=replace(topology.intra_region, rate_bit_s=rate_bit_s))
    return topology


def one_point(algorithm: dict, steps: int, parameters: float, step_s: float, rate_bit_s: float,
              per_region: int, folder: Path, *, topology_path: Path = TOPOLOGY, nodes: Optional[dict] = None,
              uniform: bool = False, bytes_per_parameter: float = 4.0, model: Optional[dict] = None,
              slow_start_after_idle: bool = True, nic_at_rate: bool = False) -> dict:
    """One simulated job; its utilisation and bandwidths from its records (harness.results).
    `nic_at_rate`: every node's NIC at the swept rate too (a node's total, not each link's)."""
    topology = network_topology(topology_path, per_region, nodes, rate_bit_s, uniform, slow_start_after_idle)
    plan = make_plan(topology)
    network = FluidNetwork.from_plan(plan, nic_rate_bit_s=rate_bit_s if nic_at_rate else NIC_RATE_BIT_S, seed=0)
    workload = dict(WORKLOAD, model=model) if model is not None else WORKLOAD
    config = load_config({**workload, "seed": 0, "steps": steps, "algorithm": algorithm, "output_dir": str(folder)})
    stand_in = stand_in_record(StandIn(parameters=parameters, step_s=step_s, bytes_per_parameter=bytes_per_parameter),
                               step_s, real_parameters(config))
    started = time.perf_counter()
    run_simulated(config, len(plan.nodes), network, ComputeModel(step_s), wire_scale=stand_in["wire_scale"])
    wall = time.perf_counter() - started
    rows = [r for rank in range(len(plan.nodes)) for r in read_records(folder / f"rank{rank}.jsonl")
            if r["kind"] == "step"]
    metrics = utilisation_and_bandwidth(pd.DataFrame(rows))
    rank0 = [r for r in rows if r["rank"] == 0]
    return {**metrics, "virtual_s": rank0[-1]["time_s"], "steps": len(rank0), "wire_scale": stand_in["wire_scale"],
            "nodes": len(plan.nodes), "sim_wall_s": wall}


def nan_if_none(value: Optional[float]) -> float:
    return math.nan if value is None else value


def threshold_table(table: pd.DataFrame, targets: list[float]) -> pd.DataFrame:
    """Per (parameters, algorithm): the bandwidth (Gbit/s) each target utilisation needs."""
    out = []
    for (size, label), curve in table.groupby(["parameters", "algorithm"], sort=False):
        rows = curve.to_dict("records")
        out.append({"parameters": size, "algorithm": label,
                    **{f"{t:.0%}": nan_if_none(bandwidth_for_utilisation(rows, t)) for t in targets}})
    return pd.DataFrame(out)


def plot(table: pd.DataFrame, path: Path, target: float, title: str) -> list[Path]:
    """Utilisation against bandwidth, one panel per size, one line per method, `target` marked;
    the paper's Table 4 thresholds as markers where the size is one of its."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(dict.fromkeys(table["parameters"]))
    # one colour per method across the panels (a label less its size-dependent fragment count)
    family = table["algorithm"].str.replace(r"-F\d+", "", regex=True)
    palette = plt.get_cmap("tab10").colors
    colours = {name: palette[i % 10] for i, name in enumerate(dict.fromkeys(family))}
    paper_colours = {name: palette[(len(colours) + i) % 10]
                     for i, name in enumerate(dict.fromkeys(n for v in PAPER_TABLE4.values() for n in v))}
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.2), squeeze=False, sharey=True)
    for ax, size in zip(axes[0], sizes):
        part = table[table["parameters"] == size]
        for label, curve in part.groupby("algorithm", sort=False):
            curve = curve.sort_values("rate_gbit_s")
            ax.plot(curve["rate_gbit_s"], curve["compute_utilisation"], marker="o", markersize=3, label=label,
                    color=colours[family[curve.index[0]]])
        for name, values in PAPER_TABLE4.get(size, {}).items():
            if name == "Data-Parallel":
                continue
            ax.plot(values, PAPER_TARGETS, linestyle=":", marker="x", markersize=5, alpha=0.6,
                    label=f"paper: {name}", color=paper_colours[name])
        ax.axhline(target, color="grey", linewidth=0.8, linestyle="--")
        ax.text(part["rate_gbit_s"].min(), target + 0.01, f"{target:.0%}", fontsize=8)
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("bandwidth per link, Gbit/s")
        ax.set_title(f"{size / 1e9:g}B stand-in")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("compute utilisation")
    for ax in axes[0]:
        ax.legend(fontsize=6, loc="best")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    written = []
    for suffix in (".png", ".svg"):
        out = path.with_suffix(suffix)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=130)
        written.append(out)
    plt.close(fig)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates-gbit", default="0.1,0.3,1,3,10,30,100", help="swept rates, Gbit/s")
    parser.add_argument("--grid", default=None, help="LOW,HIGH,PER_DECADE: a log-spaced grid instead of --rates-gbit")
    parser.add_argument("--sizes", default="1e9,10e9", help="stand-in parameter counts")
    parser.add_argument("--methods", default="sync,diloco", help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--H", type=int, default=100, help="DiLoCo's inner steps per round")
    parser.add_argument("--fragments", type=int, default=None, help="Streaming DiLoCo's F (default: paper's, per size)")
    parser.add_argument("--overlap", type=int, default=1, help="Streaming DiLoCo's tau (paper: 1)")
    parser.add_argument("--sync-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of H steps the non-sync methods run")
    parser.add_argument("--no-slow-start-after-idle", action="store_true",
                        help="net.ipv4.tcp_slow_start_after_idle = 0 on the nodes (Linux default: 1)")
    parser.add_argument("--topology", type=Path, default=TOPOLOGY)
    parser.add_argument("--per-region", type=int, default=2, help="nodes per region")
    parser.add_argument("--nodes", default=None, help="REGION=COUNT,... instead of --per-region")
    parser.add_argument("--uniform", action="store_true",
                        help="every link (intra-region too) at the swept rate: the paper's one bandwidth")
    parser.add_argument("--nic-at-rate", action="store_true",
                        help="every node's NIC at the swept rate too: a node's bandwidth, not a link's")
    parser.add_argument("--bytes-per-parameter", type=float, default=4.0,
                        help="the stand-in's full-precision message bytes per parameter (1: an int8 ring)")
    parser.add_argument("--tokens-per-step", type=float, default=65_536, help="tokens per node per step")
    parser.add_argument("--flops-per-s", type=float, default=3.2e15, help="one node's sustained FLOP/s")
    parser.add_argument("--paper-step-times", action="store_true", help="the paper's Table 4 step times")
    parser.add_argument("--step-s", type=float, default=None, help="one step time for every size")
    parser.add_argument("--targets", default="0.5,0.8,0.9,0.95,0.99", help="utilisations to report bandwidth for")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to PATH.png and PATH.svg")
    parser.add_argument("--from-csv", type=Path, nargs="+", default=None,
                        help="simulate nothing: read CSVs this script wrote (one table: e.g. sweeps of "
                             "different methods in the same setting), print its tables, --plot it")
    args = parser.parse_args(argv)
    targets = [float(x) for x in args.targets.split(",")]
    if args.from_csv:
        table = pd.concat([pd.read_csv(path) for path in args.from_csv], ignore_index=True)
        print(threshold_table(table, targets).to_string(index=False, na_rep="not reached",
                                                        float_format=lambda v: f"{v:.3g}"))
        if args.plot:
            for out in plot(table, args.plot, 0.95, f"{', '.join(path.name for path in args.from_csv)}; dotted: arXiv 2501.18512 Table 4"):
                print(f"figure: {out}")
        return 0
    rates = [r * 1e9 for r in (log_grid(args.grid) if args.grid else [float(x) for x in args.rates_gbit.split(",")])]
    sizes = [float(x) for x in args.sizes.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    nodes = parse_nodes(args.nodes)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"python {platform.python_version()}; backend sim; {args.topology.name} x "
          f"{nodes if nodes else f'{args.per_region} per region'}, NIC "
          f"{'at the swept rate' if args.nic_at_rate else f'{NIC_RATE_BIT_S / 1e9:g} Gbit/s'}; "
          f"{'every link' if args.uniform else 'inter-region links'} at the swept rate; stand-in messages "
          f"{args.bytes_per_parameter:g} B/parameter; tcp_slow_start_after_idle "
          f"{0 if args.no_slow_start_after_idle else 1}; {args.rounds if args.rounds else 0} x H steps; step_s = "
          + (f"{args.step_s:g} s" if args.step_s else "paper Table 4" if args.paper_step_times else
             f"6 P x {args.tokens_per_step:g} tokens / {args.flops_per_s:g} FLOP/s"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="standin-") as tmp:
        for size in sizes:
            if args.step_s:
                step_s = args.step_s
            elif args.paper_step_times:
                if size not in PAPER_STEP_S:
                    raise SystemExit(f"--paper-step-times: the paper has no step time for {size:g} parameters")
                step_s = PAPER_STEP_S[size]
            else:
                step_s = step_seconds(size, args.tokens_per_step, args.flops_per_s)
            fragments = args.fragments or (fragments_for(size, args.H) if any(m.startswith("streaming")
                                                                               for m in methods) else 1)
            for method in methods:
                label, algorithm, model = algorithm_for(method, args.H, fragments, args.overlap)
                steps = args.sync_steps if method == "sync" else args.rounds * args.H
                for rate in rates:
                    folder = Path(tmp) / f"{label}-{size:g}-{rate:g}"
                    point = one_point(algorithm, steps, size, step_s, rate, args.per_region, folder,
                                      topology_path=args.topology, nodes=nodes, uniform=args.uniform,
                                      bytes_per_parameter=args.bytes_per_parameter, model=model,
                                      slow_start_after_idle=not args.no_slow_start_after_idle,
                                      nic_at_rate=args.nic_at_rate)
                    row = {"parameters": size, "algorithm": label, "rate_gbit_s": rate / 1e9, "step_s": step_s,
                           **point, "topology": args.topology.name, "uniform": args.uniform,
                           "bytes_per_parameter": args.bytes_per_parameter,
                           "slow_start_after_idle": not args.no_slow_start_after_idle,
                           "nic_at_rate": args.nic_at_rate}
                    rows.append(row)
                    print(f"{size / 1e9:>5g}B {label:<28} {rate / 1e9:>7g} Gbit/s  utilisation "
                          f"{row.get('compute_utilisation', float('nan')):.3f}  mean "
                          f"{row.get('mean_bandwidth_per_node_bit_s', 0) / 1e9:7.3f} Gbit/s  peak "
                          f"{row.get('peak_bandwidth_per_node_bit_s', 0) / 1e9:7.3f} Gbit/s  "
                          f"({row['steps']} steps, {row['virtual_s']:.1f} virtual s, {row['sim_wall_s']:.1f} s here)",
                          flush=True)
    table = pd.DataFrame(rows)
    print()
    print("compute utilisation (rows: stand-in and algorithm; columns: swept Gbit/s)")
    pivot = table.pivot_table(index=["parameters", "algorithm"], columns="rate_gbit_s", values="compute_utilisation",
                              sort=False)
    print(pivot.to_string(float_format=lambda v: f"{v:.3f}"))
    print()
    print("Gbit/s to reach a compute utilisation of (bandwidth_for_utilisation; log-linear between grid points)")
    print(threshold_table(table, targets).to_string(index=False, na_rep="not reached",
                                                    float_format=lambda v: f"{v:.3g}"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(table.columns))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nCSV: {args.out}")
    if args.plot:
        title = (f"{args.topology.name}, {table['nodes'].iloc[0]} nodes, "
                 f"{'every link' if args.uniform else 'inter-region links'} at the swept rate, H={args.H},\n"
                 f"tcp_slow_start_after_idle {0 if args.no_slow_start_after_idle else 1}; "
                 f"dotted: arXiv 2501.18512 Table 4")
        for out in plot(table, args.plot, 0.95, title):
            print(f"figure: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
