"""Benchmark our trainers against torch's own implementations, side by side in the same run.

Pairs (same model, data, batch, ranks, and order interleaved across repeats):
  * `sync` (trainers.algorithms.sync: bucketed, overlapped all-reduce) vs torch DistributedDataParallel;
  * `local_sgd` (trainers.algorithms.local_sgd) vs torch PeriodicModelAverager + PostLocalSGDOptimizer
    (DDP with post_localSGD_hook and no warm-up: pure local steps between averages, as ours here).

Every variant is built once; then timed blocks of --steps steps alternate between the variants
for --repeats rounds. Reports per variant the median over rounds of a block's mean step time (the
slowest rank's) and the bytes sent per step, and per pair the median of the per-round ratios
(adjacent blocks share the machine's load). Our bytes come from the comm layer's accounting;
torch's from the same ring model applied to what it all-reduces (gradients every step;
parameters every H steps), since its traffic bypasses our layer. Prints hardware, versions,
config and date; writes a CSV under results/bench/. Ranks run on 127.0.0.1 with gloo.

    .venv/bin/python bench/bench_trainers.py                       # defaults below
    .venv/bin/python bench/bench_trainers.py --world-size 4 --repeats 7 --hidden 2048 2048

`--collectives` instead times one rank of gloo all_reduce vs Comm.ring_all_reduce per payload
size; start it once per node with the torchrun variables set (e.g. inside emulated WAN nodes):

    wanbench exec east-0 -- env RANK=0 WORLD_SIZE=2 MASTER_ADDR=<east-0> MASTER_PORT=29611 \
        GLOO_SOCKET_IFNAME=<node interface> .venv/bin/python bench/bench_trainers.py --collectives
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.environment import environment  # noqa: E402

VARIANTS = ("ours_sync", "torch_ddp", "ours_local_sgd", "torch_post_local_sgd", "ours_quantized", "torch_powersgd")
# Each "ours" variant is compared with the torch implementation a user would otherwise pick.
PAIRS = (("ours_sync", "torch_ddp"), ("ours_local_sgd", "torch_post_local_sgd"), ("ours_quantized", "torch_powersgd"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--features", type=int, default=256, help="input features of the synthetic data")
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024], help="MLP hidden widths")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per block (a multiple of --H)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant before the first block")
    parser.add_argument("--repeats", type=int, default=30, help="rounds of blocks (one block per variant per round)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size for sync and DDP (MiB)")
    parser.add_argument("--H", type=int, default=8, help="local steps between averages (local SGD)")
    parser.add_argument("--compressor", default="onebit", help="our quantized variant's compressor (vs PowerSGD)")
    parser.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD matrix approximation rank")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"), help="CSV directory")
    parser.add_argument("--collectives", action="store_true", help="time all_reduce vs ring_all_reduce as one rank (env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 10_000_000, 100_000_000], help="payload sizes for --collectives (bytes)")
    args = parser.parse_args(argv)
    if args.collectives:
        return args
    if args.world_size < 2:
        parser.error("--world-size: must be >= 2")
    if args.steps % args.H:
        parser.error("--steps: must be a multiple of --H so every block holds whole averaging periods")
    return args


def build(args):
    """The benchmark MLP with a fixed initialisation (identical on every rank and variant)."""
    from trainers.models import build_model

    model = build_model("mlp", {"hidden_sizes": args.hidden}, (args.features,), 10, seed=0)
    return model


def batches(args, rank: int):
    """Endless seeded synthetic (features, label) batches for one rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    while True:
        yield torch.randn(args.batch_size, args.features, generator=generator), torch.randint(10, (args.batch_size,), generator=generator)


def rank_main(rank: int, args: argparse.Namespace, port: int, result_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.local_sgd import LocalSGD, LocalSGDParams
    from trainers.algorithms.sync import Sync, SyncParams
    from trainers.comm import TorchComm
    from trainers.config import OptimizerConfig
    from trainers.training import loss_fn

    comm = TorchComm("gloo", timeout_s=300)
    n = args.world_size
    data = batches(args, rank)
    lr = 0.01

    def ours(variant: str):
        model = build(args)
        ctx = AlgorithmContext(model=model, comm=comm, loss_fn=loss_fn, optimizer=OptimizerConfig(momentum=0.9), lr=lr, device=torch.device("cpu"))
        if variant == "ours_sync":
            algorithm = Sync(SyncParams(bucket_cap_mb=args.bucket_cap_mb), ctx)
        elif variant == "ours_quantized":
            from trainers.algorithms.quantized import Quantized
            from trainers.config import from_dict

            params = from_dict(Quantized.Params, {"base": "sync", "compressor": args.compressor,
                                                  "bucket_cap_mb": args.bucket_cap_mb}, "quantized")
            algorithm = Quantized(params, ctx)
        else:
            algorithm = LocalSGD(LocalSGDParams(H=args.H, warmup_steps=0), ctx)
        algorithm.setup()
        step = 0

        def one_step():
            nonlocal step
            algorithm.train_step(step, next(data))
            step += 1

        return one_step, None

    def reference(variant: str):
        model = build(args)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ring = 2 * (n - 1) * param_bytes // n
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        if variant == "torch_ddp":
            ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            bytes_per_step = ring
        elif variant == "torch_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                                start_powerSGD_iter=2, min_compression_rate=2,
                                                use_error_feedback=True, warm_start=True)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            # Ring all-reduce of P and Q (float32) for each compressed matrix, of the rest uncompressed.
            elements = 0
            for p in model.parameters():
                if p.dim() >= 2:
                    rows, cols = p.shape[0], p.numel() // p.shape[0]
                    rank_r = min(args.powersgd_rank, rows, cols)
                    compressed = (rows + cols) * rank_r
                    elements += compressed if compressed * 2 <= p.numel() else p.numel()
                else:
                    elements += p.numel()
            bytes_per_step = 2 * (n - 1) * elements * 4 // n
        else:
            ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
            # No gradient all-reduce after the warm-up: pure local steps between averages.
            state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0, post_local_gradient_allreduce=False)
            ddp.register_comm_hook(state, post_localSGD_hook)
            averager = PeriodicModelAverager(period=args.H, warmup_steps=0)
            optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
            bytes_per_step = ring / args.H

        def one_step():
            optimizer.zero_grad()
            loss_fn(ddp, next(data)).backward()
            optimizer.step()

        return one_step, bytes_per_step

    # Every variant is built once and warmed up; then short timed blocks alternate between the
    # variants, round after round, so load from other processes on a shared machine falls on
    # all of them alike and each "ours / torch" pair can be compared block by block.
    steppers = {variant: (ours if variant.startswith("ours") else reference)(variant) for variant in VARIANTS}
    for one_step, _ in steppers.values():
        for _ in range(args.warmup):
            one_step()
    rows = []
    for repeat in range(args.repeats):
        # Rotate the order each round so no variant always runs first (cache, frequency effects).
        order = VARIANTS[repeat % len(VARIANTS):] + VARIANTS[: repeat % len(VARIANTS)]
        for variant in order:
            one_step, model_bytes = steppers[variant]
            comm.barrier()
            sent_0 = comm.stats.bytes_sent
            start = time.perf_counter()
            for _ in range(args.steps):
                one_step()
            elapsed = torch.tensor([time.perf_counter() - start])
            sent = comm.stats.bytes_sent - sent_0  # before the max-reduce below, which is ours only
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            rows.append({
                "repeat": repeat,
                "variant": variant,
                "step_s": elapsed.item() / args.steps,
                "bytes_sent_per_step": sent / args.steps if model_bytes is None else model_bytes,
                "bytes_source": "comm layer" if model_bytes is None else "ring model",
            })
    if rank == 0:
        Path(result_path).write_text(json.dumps(rows))
    comm.shutdown()


def collectives_main(args: argparse.Namespace) -> int:
    """One rank: median time of all_reduce and ring_all_reduce per size; rank 0 prints the table."""
    from trainers.comm import TorchComm

    torch.set_num_threads(args.threads)
    comm = TorchComm("gloo", timeout_s=600)
    rows = []
    for nbytes in args.sizes:
        tensor = torch.ones(max(1, nbytes // 4))
        times = {"all_reduce": [], "ring_all_reduce": []}
        for _ in range(args.repeats):
            for method in times:  # alternate so drift in the network hits both alike
                comm.barrier()
                start = time.perf_counter()
                if method == "all_reduce":
                    comm.all_reduce(tensor, op="avg")
                else:
                    comm.ring_all_reduce(tensor, op="avg")
                times[method].append(time.perf_counter() - start)
        rows.append((nbytes, statistics.median(times["all_reduce"]), statistics.median(times["ring_all_reduce"])))
    if comm.rank == 0:
        print(json.dumps({**environment(), "world_size": comm.world_size, "repeats": args.repeats}))
        print(f"{'bytes':>12}{'all_reduce s':>14}{'ring s':>10}{'ratio':>8}")
        for nbytes, gloo_s, ring_s in rows:
            print(f"{nbytes:>12,}{gloo_s:>14.3f}{ring_s:>10.3f}{ring_s / gloo_s:>8.2f}")
    comm.shutdown()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.collectives:
        return collectives_main(args)
    from trainers.launch import free_port

    env = environment()
    n_params = sum(p.numel() for p in build(args).parameters())
    print("== bench_trainers ==")
    for key, value in env.items():
        print(f"{key:>12}: {value}")
    config = {k: v for k, v in vars(args).items() if k not in ("out", "collectives", "sizes")}
    print(f"{'config':>12}: {json.dumps(config)}")
    print(f"{'model':>12}: MLP {args.features}-{'-'.join(map(str, args.hidden))}-10, {n_params} params ({n_params * 4 / 2**20:.2f} MiB float32)")
    print(f"{'backend':>12}: gloo on 127.0.0.1, {args.world_size} ranks x {args.threads} thread(s)")

    with tempfile.TemporaryDirectory() as tmp:
        result_path = str(Path(tmp) / "rows.json")
        context = mp.get_context("spawn")
        port = free_port()
        processes = [context.Process(target=rank_main, args=(r, args, port, result_path)) for r in range(args.world_size)]
        for process in processes:
            process.start()
        try:
            for process in processes:
                process.join(timeout=1800)
        finally:
            for process in processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5)
                if process.is_alive():
                    process.kill()
        if any(p.exitcode != 0 for p in processes):
            print(f"a rank failed: exit codes {[p.exitcode for p in processes]}", file=sys.stderr)
            return 1
        rows = json.loads(Path(result_path).read_text())

    summary = {}
    for variant in VARIANTS:
        times = [r["step_s"] for r in rows if r["variant"] == variant]
        mine = [r for r in rows if r["variant"] == variant]
        summary[variant] = {
            "median_step_ms": statistics.median(times) * 1e3,
            "min_step_ms": min(times) * 1e3,
            "max_step_ms": max(times) * 1e3,
            "bytes_sent_per_step": mine[0]["bytes_sent_per_step"],
            "bytes_source": mine[0]["bytes_source"],
        }
    print()
    print(f"{'variant':<22}{'median ms/step':>15}{'min':>9}{'max':>9}{'bytes sent/step':>17}  source")
    for variant, s in summary.items():
        print(f"{variant:<22}{s['median_step_ms']:>15.2f}{s['min_step_ms']:>9.2f}{s['max_step_ms']:>9.2f}{s['bytes_sent_per_step']:>17,.0f}  {s['bytes_source']}")
    print()
    # Paired: the ratio of two adjacent blocks of the same round, then the median over rounds;
    # adjacent blocks share the machine's load, so this is steadier than a ratio of medians.
    for ours_name, theirs in PAIRS:
        by_round = {(r["repeat"], r["variant"]): r["step_s"] for r in rows}
        paired = [by_round[(k, ours_name)] / by_round[(k, theirs)] for k in range(args.repeats)]
        quartiles = statistics.quantiles(paired, n=4) if len(paired) >= 2 else [paired[0]] * 3
        median_ratio = summary[ours_name]["median_step_ms"] / summary[theirs]["median_step_ms"]
        summary[ours_name][f"paired_ratio_vs_{theirs}"] = statistics.median(paired)
        print(
            f"step-time ratio {ours_name} / {theirs}: paired median {statistics.median(paired):.3f} "
            f"(IQR {quartiles[0]:.3f}-{quartiles[2]:.3f}), ratio of medians {median_ratio:.3f}  (target <= 1.0)"
        )

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = env["date"].replace(":", "").replace("+00:00", "Z")
    csv_path = out_dir / f"bench_trainers_{stamp}.csv"
    with open(csv_path, "w", newline="") as handle:
        stat_keys = list(dict.fromkeys(k for stats in summary.values() for k in stats))
        writer = csv.DictWriter(handle, fieldnames=["variant", *stat_keys, *env.keys(), "config"])
        writer.writeheader()
        for variant, s in summary.items():
            writer.writerow({"variant": variant, **s, **env, "config": json.dumps(config)})
    print(f"\nwrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
