"""Benchmark Comm.allreduce_async's algorithms against gloo's all_reduce on an emulated WAN.

Builds the topology (default topologies/aws-4region.yaml, 4 nodes) with the tun backend under
WANBENCH_PREFIX (default `wfar`; it must start with `wf`), starts one rank per node inside its
namespace, and prints two tables, then tears the network down (also on Ctrl-C / SIGTERM):

1. per payload size (1 kB .. 16 MB) and algorithm (gloo, direct, recursive_doubling, ring, auto):
   the median over --repeats of one all-reduce's time (the slowest rank's; the algorithms take
   turns within every repeat, so drift in the shared machine hits all alike);
2. DTS (p=1, t=2) on an MLP of --dts-params float32 parameters, with each transport: the median
   step time and blocked time per step (the comm layer's blocked_s, only ``Work.wait()``), next
   to the time of that all-reduce alone, so the overlap is (all-reduce alone - blocked) / alone.

    sudo WANBENCH_PREFIX=wfar .venv/bin/python bench/bench_allreduce.py
    sudo .venv/bin/python bench/bench_allreduce.py --repeats 5 --sizes 1000 1000000

Needs root and /dev/net/tun. Prints hardware, versions, config and date; writes a CSV under
results/bench/.
"""

from __future__ import annotations

import argparse
import csv
import datetime
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

ALGORITHMS = ("gloo", "direct", "recursive_doubling", "ring", "auto")
SIZES = (1_000, 16_000, 256_000, 1_000_000, 4_000_000, 16_000_000)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default=str(REPO / "topologies" / "aws-4region.yaml"))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="payload bytes")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--repeats", type=int, default=7, help="timed all-reduces per size and algorithm")
    parser.add_argument("--dts-params", type=int, default=262_144, help="DTS model size (float32 parameters)")
    parser.add_argument("--dts-steps", type=int, default=30, help="timed DTS steps per transport")
    parser.add_argument("--dts-transports", nargs="*", default=["gloo", "auto", "ring"], choices=ALGORITHMS)
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="CSV directory")
    parser.add_argument("--rank-main", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- inside a node ----------------------------------------------------------------------------------


def rank_main(args: argparse.Namespace) -> int:
    import torch

    from trainers.comm import TorchComm

    torch.set_num_threads(1)
    comm = TorchComm("gloo", timeout_s=600)

    def slowest(seconds: float) -> float:
        value = torch.tensor([seconds])
        comm.all_reduce(value, op="max")
        return value.item()

    rows = []
    for nbytes in args.sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        times = {algorithm: [] for algorithm in args.algorithms}
        for algorithm in args.algorithms:  # one untimed round: connections, allocations
            comm.allreduce_async(tensor, "avg", algorithm=algorithm).wait()
        for _ in range(args.repeats):
            for algorithm in args.algorithms:
                comm.barrier()
                start = time.perf_counter()
                comm.allreduce_async(tensor, "avg", algorithm=algorithm).wait()
                times[algorithm].append(slowest(time.perf_counter() - start))
        for algorithm, samples in times.items():
            rows.append({"table": "allreduce", "bytes": tensor.numel() * 4, "algorithm": algorithm,
                         "median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
                         "repeats": len(samples)})
    rows += dts_rows(args, comm, slowest)
    if comm.rank == 0:
        Path(args.rank_main).write_text(json.dumps(rows))
    comm.shutdown()
    return 0


def dts_rows(args: argparse.Namespace, comm, slowest) -> list[dict]:
    """The real DTS algorithm (p=1, t=2) on a one-layer MLP, once per transport."""
    import torch
    from torch import nn

    from trainers.algorithms import AlgorithmContext, get_algorithm
    from trainers.config import OptimizerConfig

    width = int(args.dts_params ** 0.5)
    rows = []
    for transport in args.dts_transports:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh(), nn.Linear(width, 10, bias=False))
        comm.allreduce_algorithm = transport
        dts_cls = get_algorithm("dts")
        ctx = AlgorithmContext(model=model, comm=comm, optimizer=OptimizerConfig(),
                               loss_fn=lambda m, batch: nn.functional.cross_entropy(m(batch[0]), batch[1]),
                               lr=0.01, device=torch.device("cpu"))
        dts = dts_cls(dts_cls.Params(p=1, t=2), ctx)
        generator = torch.Generator().manual_seed(comm.rank)
        batch = (torch.randn(32, width, generator=generator), torch.randint(0, 10, (32,), generator=generator))
        flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
        alone = []
        for _ in range(5):  # the all-reduce DTS launches, alone
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce_async(flat.clone(), "avg").wait()
            alone.append(slowest(time.perf_counter() - start))
        for step in range(5):  # untimed: fill the pipeline of t in-flight exchanges
            dts.train_step(step, batch)
        comm.barrier()
        step_s, blocked_s, compute_s = [], [], []
        for step in range(5, 5 + args.dts_steps):
            blocked_0 = comm.stats.blocked_s
            start = time.perf_counter()
            dts.train_step(step, batch)
            step_s.append(time.perf_counter() - start)
            blocked_s.append(comm.stats.blocked_s - blocked_0)
            compute_s.append(step_s[-1] - blocked_s[-1])
        dts.finish()
        totals = torch.tensor([statistics.median(step_s), statistics.median(blocked_s), statistics.median(compute_s)])
        comm.all_reduce(totals, op="max")
        rows.append({"table": "dts", "algorithm": transport, "transport": comm.transport,
                     "bytes": flat.numel() * 4, "allreduce_alone_s": statistics.median(alone),
                     "step_s": totals[0].item(), "blocked_per_step_s": totals[1].item(),
                     "compute_per_step_s": totals[2].item(), "steps": args.dts_steps})
    return rows


# -- on the host ------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rank_main:
        return rank_main(args)
    prefix = os.environ.setdefault("WANBENCH_PREFIX", "wfar")
    if not prefix.startswith("wf"):
        print(f"WANBENCH_PREFIX={prefix!r}: this bench builds networks only under prefixes starting with 'wf'",
              file=sys.stderr)
        return 2
    from emulator.backends.tun import TunBackend
    from emulator.netns import exec_argv, interface_of
    from emulator.plan import make_plan
    from emulator.processes import stop as stop_processes
    from emulator.topology import load_topology
    from harness.console import teardown_on_signals
    from harness.environment import environment

    plan = make_plan(load_topology(args.topology))
    backend = TunBackend(plan)
    processes: list[subprocess.Popen] = []
    with teardown_on_signals(), tempfile.TemporaryDirectory(prefix=f"{prefix}-bench-") as tmp:
        result_path = Path(tmp) / "rows.json"
        try:
            backend.down()  # leftovers of an interrupted earlier run under this prefix
            backend.up()
            master = plan.nodes[0]
            for node in plan.nodes:
                ifname = interface_of(node)
                env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "RANK": str(node.rank),
                       "WORLD_SIZE": str(len(plan.nodes)), "LOCAL_RANK": "0", "MASTER_ADDR": master.address,
                       "MASTER_PORT": "29731", "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
                argv_ = [sys.executable, str(Path(__file__).resolve()), *(argv if argv is not None else sys.argv[1:]),
                         "--rank-main", str(result_path)]
                processes.append(subprocess.Popen(exec_argv(node, argv_), env=env, cwd=REPO))
            deadline = time.monotonic() + 3600
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if any(p.returncode != 0 for p in processes):
                print(f"a rank failed: exit codes {[p.returncode for p in processes]}", file=sys.stderr)
                return 1
            rows = json.loads(result_path.read_text())
        finally:
            stop_processes(processes)
            backend.down()
    report(args, plan, rows, environment())
    return 0


def report(args, plan, rows: list[dict], env: dict) -> None:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print("== bench_allreduce ==")
    for key, value in {**env, "date": date}.items():
        print(f"{key:>12}: {value}")
    print(f"{'network':>12}: {Path(args.topology).name}, tun backend, {len(plan.nodes)} nodes "
          f"({', '.join(n.name for n in plan.nodes)}), one rank each, gloo rendezvous")
    print(f"{'config':>12}: repeats={args.repeats} dts_params={args.dts_params} dts_steps={args.dts_steps}")
    table = [r for r in rows if r["table"] == "allreduce"]
    algorithms = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in table)]
    print("\nmedian time of one all-reduce (s, slowest rank); x: vs gloo")
    print(f"{'bytes':>12}" + "".join(f"{a:>20}" for a in algorithms))
    for nbytes in sorted({r["bytes"] for r in table}):
        by = {r["algorithm"]: r["median_s"] for r in table if r["bytes"] == nbytes}
        gloo = by.get("gloo")
        cells = [f"{by[a]:.3f}" + (f" ({by[a] / gloo:.2f}x)" if gloo and a != "gloo" else "") for a in algorithms]
        print(f"{nbytes:>12,}" + "".join(f"{c:>20}" for c in cells))
    dts = [r for r in rows if r["table"] == "dts"]
    if dts:
        print(f"\nDTS p=1 t=2, {dts[0]['bytes']:,} bytes per all-reduce (medians, slowest rank)")
        print(f"{'transport':>14}{'alone s':>10}{'step s':>10}{'blocked/step s':>16}{'compute/step s':>16}{'hidden':>8}")
        for r in dts:
            hidden = 1.0 - r["blocked_per_step_s"] / r["allreduce_alone_s"] if r["allreduce_alone_s"] else float("nan")
            print(f"{r['transport']:>14}{r['allreduce_alone_s']:>10.3f}{r['step_s']:>10.3f}"
                  f"{r['blocked_per_step_s']:>16.3f}{r['compute_per_step_s']:>16.4f}{hidden:>8.0%}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_allreduce_{date.replace(':', '')}.csv"
    fields = sorted({key for row in rows for key in row})
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nrows: {path}")


if __name__ == "__main__":
    sys.exit(main())
