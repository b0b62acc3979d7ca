"""Targets for spawned test ranks (importable by the spawn start method)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def _init_env(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)


def comm_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Exercise every Comm operation once; write what each returned and the accounting as JSON."""
    _init_env(rank, world_size, port)
    from trainers.algorithms.hooks import allreduce_hook, fp16_compress_wrapper
    from trainers.comm import TorchComm

    comm = TorchComm("gloo", timeout_s=60)
    results: dict = {}
    x = torch.full((1000,), float(rank + 1))
    comm.all_reduce(x, op="sum")
    results["sum"] = x[0].item()
    x = torch.full((1000,), float(rank + 1))
    work = comm.all_reduce(x, op="avg", async_op=True)
    results["avg"] = work.wait()[0].item()
    results["after_all_reduce"] = comm.stats.per_op["all_reduce"].bytes_sent
    b = torch.full((10,), float(rank))
    comm.broadcast(b, src=1)
    results["broadcast"] = b.tolist()
    outputs = [torch.zeros(3) for _ in range(world_size)]
    comm.all_gather(outputs, torch.full((3,), float(rank)))
    results["all_gather"] = [o[0].item() for o in outputs]
    peer = 1 - rank
    send = torch.arange(5, dtype=torch.float32) + 100 * rank
    recv = torch.zeros(5)
    if rank == 0:
        comm.isend(send, peer).wait()
        comm.recv(recv, peer)
    else:
        handle = comm.irecv(recv, peer)
        handle.wait()
        comm.send(send, peer)
    results["p2p"] = recv.tolist()
    comm.barrier()
    # fp16 wrapper: payload halves, result lands in the original float32 buffer.
    g = torch.full((64,), float(rank) + 0.5)
    before = comm.stats.per_op["all_reduce"].bytes_sent
    averaged = fp16_compress_wrapper(allreduce_hook)(comm, g).wait()
    results["fp16_avg"] = averaged[0].item()
    results["fp16_same_buffer"] = averaged.data_ptr() == g.data_ptr()
    results["fp16_bytes"] = comm.stats.per_op["all_reduce"].bytes_sent - before
    results["stats"] = {op: vars(s) for op, s in comm.stats.per_op.items()}
    results["totals"] = [comm.stats.bytes_sent, comm.stats.bytes_recv, comm.stats.blocked_s]
    comm.shutdown()
    Path(out_dir, f"comm{rank}.json").write_text(json.dumps(results))


def sync_union_worker(rank: int, world_size: int, port: int, out_dir: str, steps: int, bucket_caps_mb: list[float]) -> None:
    """Train with `sync` on slice ``rank`` of fixed global batches, once per bucket size; save each result."""
    _init_env(rank, world_size, port)
    from tests.trainers.reference import global_batches, make_model
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.sync import Sync, SyncParams
    from trainers.comm import TorchComm
    from trainers.config import OptimizerConfig
    from trainers.training import loss_fn

    comm = TorchComm("gloo", timeout_s=60)
    for bucket_cap_mb in bucket_caps_mb:
        model = make_model()
        ctx = AlgorithmContext(
            model=model, comm=comm, loss_fn=loss_fn,
            optimizer=OptimizerConfig(momentum=0.9, weight_decay=1e-3), lr=0.05, device=torch.device("cpu"),
        )
        algorithm = Sync(SyncParams(bucket_cap_mb=bucket_cap_mb), ctx)
        algorithm.setup()
        for step, (x, y) in enumerate(global_batches(steps)):
            per_rank = len(x) // world_size
            part = slice(rank * per_rank, (rank + 1) * per_rank)
            algorithm.train_step(step, (x[part], y[part]))
        algorithm.finish()
        algorithm.bucketer.remove_hooks()
        torch.save(model.state_dict(), Path(out_dir, f"sync_{bucket_cap_mb}_{rank}.pt"))
        Path(out_dir, f"buckets_{bucket_cap_mb}_{rank}.json").write_text(json.dumps(len(algorithm.bucketer.buckets)))
    comm.shutdown()


def gloo_threads_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """TorchComm, then what a trainer does after it (an optimizer, whose first use imports
    torch._dynamo), one all-reduce, shutdown: write the native threads still running."""
    _init_env(rank, world_size, port)
    import gc

    from trainers.comm import TorchComm

    comm = TorchComm("gloo", timeout_s=60)
    model = torch.nn.Linear(4, 4)
    torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comm.allreduce_async(torch.ones(8), op="sum").wait()
    comm.shutdown()
    gc.collect()
    threads = sorted(Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task"))
    Path(out_dir, f"threads{rank}.json").write_text(json.dumps(threads))


def failing_worker(rank: int, world_size: int, port: int, out_dir: str, fail_rank: int, fail_step: int) -> None:
    """Run the real runner with a `sync` subclass that raises on one rank at one step."""
    _init_env(rank, world_size, port)
    from trainers.algorithms import register_algorithm
    from trainers.algorithms.sync import Sync
    from trainers.loading import load_config
    from trainers.runner import run

    @register_algorithm
    class FailingSync(Sync):
        name = "failing_sync"

        def train_step(self, step, batch):
            if self.comm.rank == fail_rank and step == fail_step:
                raise RuntimeError(f"injected fault at step {step}")
            return super().train_step(step, batch)

    config = load_config({
        "output_dir": out_dir, "steps": 20, "eval_every": 100, "batch_size": 8,
        "algorithm": {"name": "failing_sync"}, "comm": {"timeout_s": 30},
    })
    try:
        run(config)
    except Exception:
        raise SystemExit(1)


def run_configs_worker(rank: int, world_size: int, port: int, configs: list[dict], ports: list[int]) -> None:
    """Run several training configs one after another in the same rank processes.

    Each run gets its own rendezvous port; torch is imported once, which keeps the suite fast.
    """
    _init_env(rank, world_size, port)
    from trainers.loading import load_config
    from trainers.runner import run

    for config, run_port in zip(configs, ports):
        os.environ["MASTER_PORT"] = str(run_port)
        run(load_config(config))


def ring_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """ring_all_reduce against all_reduce for every op and awkward sizes; write both and the bytes."""
    _init_env(rank, world_size, port)
    from trainers.comm import TorchComm

    comm = TorchComm("gloo", timeout_s=60)
    results = []
    generator = torch.Generator().manual_seed(rank)
    for numel in (1, 2, 7, 1000, 100_003):
        for op in ("sum", "avg", "max", "min"):
            data = torch.randn(numel, generator=generator)
            ring, reference = data.clone(), data.clone()
            sent_before = comm.stats.bytes_sent
            comm.ring_all_reduce(ring, op=op)
            ring_bytes = comm.stats.bytes_sent - sent_before
            comm.all_reduce(reference, op=op)
            results.append({
                "numel": numel, "op": op, "max_error": (ring - reference).abs().max().item(), "ring_bytes": ring_bytes,
            })
    comm.shutdown()
    Path(out_dir, f"ring{rank}.json").write_text(json.dumps(results))


def slow_snapshot_worker(rank: int, world_size: int, port: int, config: dict, delay_s: float) -> None:
    """Run the real runner with snapshot writing made ``delay_s`` slower (a fault injected in the
    runner's writer), to show that the time is not on the training clock."""
    _init_env(rank, world_size, port)
    import time

    import trainers.runner
    from trainers.loading import load_config

    real_write = trainers.runner.write_snapshot

    def slow_write(*args, **kwargs):
        time.sleep(delay_s)
        return real_write(*args, **kwargs)

    trainers.runner.write_snapshot = slow_write
    trainers.runner.run(load_config(config))


def replica_mean_worker(rank: int, world_size: int, port: int, out_dir: str, steps: int, H: int) -> None:
    """Local SGD on slice ``rank`` of fixed batches for ``steps`` steps (replicas differ unless H
    divides steps); write this rank's snapshot, then the all-reduce average it replaces."""
    _init_env(rank, world_size, port)
    from tests.trainers.reference import global_batches, make_model
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.local_sgd import LocalSGD, LocalSGDParams
    from trainers.comm import TorchComm
    from trainers.config import OptimizerConfig
    from trainers.snapshots import write_snapshot
    from trainers.training import loss_fn

    comm = TorchComm("gloo", timeout_s=60)
    ctx = AlgorithmContext(model=make_model(), comm=comm, loss_fn=loss_fn, optimizer=OptimizerConfig(momentum=0.9),
                           lr=0.05, device=torch.device("cpu"))
    algorithm = LocalSGD(LocalSGDParams(H=H), ctx)
    algorithm.setup()
    for step, (x, y) in enumerate(global_batches(steps)):
        per_rank = len(x) // world_size
        algorithm.train_step(step, (x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]))
    before = comm.stats.snapshot()
    output = algorithm.output_state()
    write_snapshot(out_dir, rank, 0, steps - 1, 0.0, 0.0, output)
    snapshot_bytes = comm.stats.snapshot()[0] - before[0]
    torch.save(algorithm.averaged_copy().state_dict(), Path(out_dir, f"allreduce_average_{rank}.pt"))
    torch.save(ctx.model.state_dict(), Path(out_dir, f"replica_{rank}.pt"))
    Path(out_dir, f"snapshot_bytes_{rank}.json").write_text(json.dumps(snapshot_bytes))
    comm.shutdown()


def allreduce_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Every allreduce_async algorithm against gloo's all_reduce for every op and awkward sizes;
    write the largest error, a digest of the result's bits and the bytes accounted."""
    import hashlib

    _init_env(rank, world_size, port)
    from trainers.comm import TorchComm

    comm = TorchComm("gloo", timeout_s=60)
    results = []
    generator = torch.Generator().manual_seed(100 + rank)
    for numel in (1, 2, 7, 1000, 100_003):
        for op in ("sum", "avg", "max", "min"):
            data = torch.randn(numel, generator=generator)
            reference = data.clone()
            comm.all_reduce(reference, op=op)
            for algorithm in ("ring", "direct", "recursive_doubling", "auto"):
                ours = data.clone()
                sent_before, recv_before = comm.stats.bytes_sent, comm.stats.bytes_recv
                work = comm.allreduce_async(ours, op=op, algorithm=algorithm)
                returned = work.wait()
                results.append({
                    "numel": numel, "op": op, "algorithm": algorithm,
                    "max_error": (ours - reference).abs().max().item(),
                    "scale": reference.abs().max().item(),
                    "same_tensor": returned is ours,
                    "digest": hashlib.sha256(ours.numpy().tobytes()).hexdigest(),
                    "sent": comm.stats.bytes_sent - sent_before, "recv": comm.stats.bytes_recv - recv_before,
                })
    # Several in flight at once (DTS with t >= p): launch three, wait in order.
    tensors = [torch.full((5003,), float(rank + k)) for k in range(3)]
    works = [comm.allreduce_async(t, op="sum", algorithm=a) for t, a in zip(tensors, ("ring", "direct", "recursive_doubling"))]
    in_flight = [w.wait()[0].item() for w in works]
    comm.shutdown()
    Path(out_dir, f"allreduce{rank}.json").write_text(json.dumps({"rows": results, "in_flight": in_flight}))


def overlap_worker(rank: int, world_size: int, port: int, out_dir: str, one_way_delay_s: float, compute_s: float) -> None:
    """Blocked time of launch-then-compute-then-wait vs launch-and-wait, on a comm whose background
    messages each take ``one_way_delay_s`` longer to arrive (an artificial WAN on loopback)."""
    import time

    _init_env(rank, world_size, port)
    from trainers.comm import TorchComm

    class DelayedComm(TorchComm):
        """Every background receive completes no earlier than ``one_way_delay_s`` after it was
        posted (receives posted together wait together, as on a WAN)."""

        def tagged_irecv(self, tensor, src, tag):
            wait_fn, poll_fn = super().tagged_irecv(tensor, src, tag)
            arrives = time.perf_counter() + one_way_delay_s

            def delayed_wait():
                time.sleep(max(0.0, arrives - time.perf_counter()))
                return wait_fn()

            return delayed_wait, poll_fn

    comm = DelayedComm("gloo", timeout_s=60)
    results = {}
    for algorithm in ("ring", "direct", "recursive_doubling"):
        for mode in ("wait_at_once", "compute_then_wait"):
            comm.barrier()
            x = torch.full((4096,), float(rank))
            blocked_before = comm.stats.blocked_s
            start = time.perf_counter()
            work = comm.allreduce_async(x, op="sum", algorithm=algorithm)
            if mode == "compute_then_wait":
                busy_until = time.perf_counter() + compute_s
                while time.perf_counter() < busy_until:  # DTS's t local steps (the GIL taken between ops)
                    torch.mm(torch.ones(256, 256), torch.ones(256, 256))
            work.wait()
            results[f"{algorithm}/{mode}"] = {
                "blocked_s": comm.stats.blocked_s - blocked_before, "wall_s": time.perf_counter() - start,
                "correct": bool((x == sum(range(world_size))).all()),
            }
    comm.shutdown()
    Path(out_dir, f"overlap{rank}.json").write_text(json.dumps(results))


def eawild_service_worker(rank: int, world_size: int, port: int, out_dir: str, apply_s: float) -> None:
    """Rank 0 an `eawild` server, ranks 1.. its workers, exchanging once each at the same moment,
    first on a serial server, then on a concurrent one. The server's apply is made slow
    (``apply_s`` of sleep, which releases the GIL as torch's own ops do); each writes, per mode,
    the server's service intervals and each worker's exchange latency (time.monotonic, s)."""
    _init_env(rank, world_size, port)
    from trainers.algorithms import AlgorithmContext
    from trainers.algorithms.eawild import EAWild, EAWildParams
    from trainers.comm import TorchComm
    from trainers.config import OptimizerConfig
    from trainers.training import loss_fn

    class SlowApply(EAWild):
        """A fault hook: every apply takes ``apply_s`` longer; intervals and latencies recorded."""

        def server_apply(self, payload, want_reply, staleness):
            started = time.monotonic()
            time.sleep(apply_s)
            reply = super().server_apply(payload, want_reply, staleness)
            self.intervals.append((started, time.monotonic()))
            return reply

        def exchange(self, step, flat, want_reply, loss):
            started = time.monotonic()
            reply = super().exchange(step, flat, want_reply, loss)
            self.latencies.append(time.monotonic() - started)
            return reply

    comm = TorchComm("gloo", timeout_s=60)
    results = {}
    for mode in ("serial", "concurrent"):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        ctx = AlgorithmContext(model=model, comm=comm, loss_fn=loss_fn, optimizer=OptimizerConfig(), lr=0.1,
                               device=torch.device("cpu"))
        algorithm = SlowApply(EAWildParams(tau=1, server=mode), ctx)
        algorithm.intervals, algorithm.latencies = [], []
        algorithm.setup()
        comm.barrier()  # the workers start their exchanges together
        batch = (torch.randn(4, 8), torch.randint(0, 3, (4,)))
        algorithm.train_step(0, batch)
        algorithm.finish()
        comm.barrier()
        results[mode] = {"intervals": algorithm.intervals, "latencies": algorithm.latencies}
    comm.shutdown()
    Path(out_dir, f"eawild{rank}.json").write_text(json.dumps(results))
