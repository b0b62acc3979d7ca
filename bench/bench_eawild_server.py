"""EA-wild's server: exchanges applied per second against the number of workers, serial vs
concurrent server (``eawild`` ``server: serial | concurrent``), side by side in one run.

Two parts, each a table and rows of one CSV under results/bench/:

* ``sim`` (the simulator, ``--backend sim``'s engine; deterministic, one run each): real eawild
  jobs (the runner, tau 1: every worker exchanges every step) of 1 server (rank 0) and W workers
  on a uniform network (``--latency-ms`` one way, ``--rate-gbit``), each worker computing
  ``--compute-ms`` per step, every node's NIC ``--nic-gbit`` each way (the server's shared by all
  its connections). Throughput: exchanges the server applied (its ``syncs_applied``)
  per virtual second of its training (the sum of its ``step_s``). An apply takes no virtual time
  on the simulator, so this is the network-side serialization alone: the serial server receives
  one message at a time (gloo's rendezvous: a receive posted, the sender told, the data sent),
  the concurrent one keeps a receive posted on every connection.
* ``real`` (gloo ranks on 127.0.0.1, wall clock): 1 server and W workers in processes, each
  worker making ``--exchanges`` exchanges back to back (no compute) of a centre of ``--numel``
  float32 elements; serial and concurrent alternate over ``--repeats`` rounds in the same
  processes. Throughput: W x exchanges over the time from a barrier to the server having applied
  them all; per worker count the median over rounds, and the median of the per-round ratios.
  On a machine with few cores, CPU contention (W + 1 processes, their threads) bounds it.

    .venv/bin/python bench/bench_eawild_server.py                   # both parts, defaults below
    .venv/bin/python bench/bench_eawild_server.py --parts sim --sim-workers 1 2 4 8 16 32
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.environment import environment  # noqa: E402

MODES = ("serial", "concurrent")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("sim", "real"), default=["sim", "real"])
    parser.add_argument("--sim-workers", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--sim-steps", type=int, default=40, help="steps of each simulated job")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="one-way delay between any two ranks (sim)")
    parser.add_argument("--rate-gbit", type=float, default=1.0, help="each path's rate (sim)")
    parser.add_argument("--nic-gbit", type=float, default=1.0,
                        help="every node's NIC, each way (sim): the server's is shared by all its connections")
    parser.add_argument("--compute-ms", type=float, default=5.0, help="a worker's forward + backward (sim)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[256], help="MLP hidden widths on digits (sim)")
    parser.add_argument("--real-workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--exchanges", type=int, default=20, help="exchanges per worker per round (real)")
    parser.add_argument("--numel", type=int, default=250_000, help="float32 elements of the centre (real)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per worker count (real)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="CSV directory")
    return parser.parse_args(argv)


# -- sim ----------------------------------------------------------------------------------------


def sim_rows(args: argparse.Namespace) -> list[dict]:
    from emulator.simnet import FluidNetwork
    from trainers.loading import load_config
    from trainers.records import read_records
    from trainers.sim import ComputeModel, run_simulated

    rows = []
    with tempfile.TemporaryDirectory(prefix="wanbench-bench-eawild-") as scratch:
        for workers in args.sim_workers:
            n = workers + 1
            latency = np.full((n, n), args.latency_ms / 1e3)
            np.fill_diagonal(latency, 0.0)
            for mode in MODES:
                network = FluidNetwork(latency_s=latency, rate=np.full((n, n), args.rate_gbit * 1e9 / 8),
                                       jitter_s=np.zeros((n, n)), loss=np.zeros((n, n)), tcp_window=1e12,
                                       region_of=tuple(f"r{i}" for i in range(n)), tcp=False,
                                       nic=args.nic_gbit * 1e9 / 8)
                output = Path(scratch, f"{mode}-{workers}")
                config = load_config({
                    "output_dir": str(output), "seed": 0, "steps": args.sim_steps, "eval_every": args.sim_steps,
                    "batch_size": 16, "lr": 0.05, "dataset": {"name": "digits"},
                    "model": {"name": "mlp", "params": {"hidden_sizes": args.hidden}},
                    "algorithm": {"name": "eawild", "params": {"tau": 1, "server": mode}},
                })
                started = time.perf_counter()
                run_simulated(config, n, network, ComputeModel(args.compute_ms / 1e3))
                steps = [r for r in read_records(output / "rank0.jsonl") if r["kind"] == "step"]
                applied = sum(r["syncs_applied"] for r in steps)
                virtual_s = sum(r["step_s"] for r in steps)
                widths = [64, *args.hidden, 10]  # digits: 64 features, 10 classes
                payload = 4 * sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
                rows.append({"part": "sim", "workers": workers, "mode": mode, "exchanges": applied,
                             "seconds": virtual_s, "exchanges_per_s": applied / virtual_s,
                             "bytes_per_exchange": payload, "wall_s": round(time.perf_counter() - started, 2)})
    return rows


# -- real (one process per rank) ------------------------------------------------------------------


def real_rank(rank: int, world_size: int, port: int, args: argparse.Namespace, out: str) -> None:
    """Rank 0 the server, the others workers; every round one serial and one concurrent server."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.eawild import EAWild, EAWildParams
    from trainers.comm import TorchComm
    from trainers.config import OptimizerConfig

    comm = TorchComm("gloo", timeout_s=600)
    samples = {mode: [] for mode in MODES}
    for round_index in range(args.repeats + 1):  # round 0 untimed: connections, allocations
        for mode in (MODES if round_index % 2 else MODES[::-1]):  # alternate which goes first
            torch.manual_seed(0)
            model = torch.nn.Linear(1000, max(1, args.numel // 1000), bias=False)
            ctx = AlgorithmContext(model=model, comm=comm, loss_fn=lambda m, b: m(b).sum(),
                                   optimizer=OptimizerConfig(), lr=0.01, device=torch.device("cpu"))
            algorithm = EAWild(EAWildParams(tau=1, server=mode), ctx)
            algorithm.setup()
            flat = torch.cat([p.detach().view(-1) for p in model.parameters()])
            comm.barrier()
            started = time.perf_counter()
            if algorithm.is_server:
                algorithm.serve(args.exchanges - 1)  # returns once every worker's exchanges are applied
                seconds = time.perf_counter() - started
            else:
                for step in range(args.exchanges):
                    flat = algorithm.exchange(step, flat, want_reply=True, loss=0.0)[0]
            algorithm.finish()
            comm.barrier()
            if algorithm.is_server and round_index:
                samples[mode].append(seconds)
    comm.shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(samples))


def real_rows(args: argparse.Namespace) -> list[dict]:
    from trainers.launch import free_port

    rows = []
    context = mp.get_context("spawn")
    for workers in args.real_workers:
        world = workers + 1
        with tempfile.TemporaryDirectory(prefix="wanbench-bench-eawild-") as scratch:
            out = str(Path(scratch, "rank0.json"))
            port = free_port()
            processes = [context.Process(target=real_rank, args=(r, world, port, args, out)) for r in range(world)]
            for process in processes:
                process.start()
            for process in processes:
                process.join(900)
            for process in processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
            if any(p.exitcode != 0 for p in processes):
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in processes]}")
            samples = json.loads(Path(out).read_text())
        total = workers * args.exchanges
        ratios = [s / c for s, c in zip(samples["serial"], samples["concurrent"])]  # time ratio = rate ratio
        for mode in MODES:
            seconds = statistics.median(samples[mode])
            rows.append({"part": "real", "workers": workers, "mode": mode, "exchanges": total, "seconds": seconds,
                         "exchanges_per_s": total / seconds, "bytes_per_exchange": args.numel // 1000 * 1000 * 4,
                         "repeats": args.repeats, "min_s": min(samples[mode]), "max_s": max(samples[mode]),
                         "concurrent_over_serial_median_of_rounds": statistics.median(ratios)})
    return rows


# -- report ---------------------------------------------------------------------------------------


def report(args: argparse.Namespace, rows: list[dict], env: dict) -> Path:
    print("== bench_eawild_server ==")
    for key, value in env.items():
        print(f"{key:>14}: {value}")
    for part in args.parts:
        part_rows = [r for r in rows if r["part"] == part]
        if part == "sim":
            print(f"\nsim: 1 server + W workers, tau 1, {args.sim_steps} steps, {args.latency_ms} ms one way, "
                  f"{args.rate_gbit} Gbit/s paths, {args.nic_gbit} Gbit/s NICs, {args.compute_ms} ms compute, MLP {args.hidden} on digits "
                  f"({part_rows[0]['bytes_per_exchange']:,} B of parameters each way per exchange); virtual time")
        else:
            print(f"\nreal: gloo on 127.0.0.1, 1 server + W workers, {args.exchanges} exchanges each back to back, "
                  f"{args.numel // 1000 * 1000:,} float32; medians of {args.repeats} rounds; wall time")
        print(f"{'workers':>8}{'serial exch/s':>15}{'concurrent exch/s':>19}{'concurrent/serial':>19}")
        for workers in sorted({r["workers"] for r in part_rows}):
            by_mode = {r["mode"]: r for r in part_rows if r["workers"] == workers}
            ratio = by_mode["concurrent"].get("concurrent_over_serial_median_of_rounds",
                                              by_mode["concurrent"]["exchanges_per_s"] / by_mode["serial"]["exchanges_per_s"])
            print(f"{workers:>8}{by_mode['serial']['exchanges_per_s']:>15.1f}"
                  f"{by_mode['concurrent']['exchanges_per_s']:>19.1f}{ratio:>18.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_eawild_server_{env['date'].replace(':', '')}.csv"
    fields = list(dict.fromkeys(key for row in rows for key in row)) + ["date", "git_commit", "cpu_count",
                                                                         "load_avg_1m", "argv"]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "date": env["date"], "git_commit": env.get("git_commit"),
                             "cpu_count": env.get("cpu_count"), "load_avg_1m": env.get("load_avg_1m"),
                             "argv": " ".join(sys.argv[1:])})
    print(f"\nrows: {path}")
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    if "sim" in args.parts:
        rows += sim_rows(args)
    if "real" in args.parts:
        rows += real_rows(args)
    report(args, rows, environment())
    return 0


if __name__ == "__main__":
    sys.exit(main())
