"""Run one rank of a training job: data, model, algorithm, step loop, evaluation and records.

Rank, world size and rendezvous come from the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Without them the run is a single process (rank 0 of 1).
"""

from __future__ import annotations

import io
import json
import os
import platform
import socket
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping, Optional

import torch

from trainers.algorithms import ALGORITHMS, AlgorithmContext, get_algorithm
from trainers.comm import Comm, PeerLost, TorchComm
from trainers.config import Config, ConfigError, from_dict, to_dict
from trainers.datasets import BatchSampler, load_dataset, shard_indices
from trainers.launch import free_port
from trainers.models import build_model
from trainers.records import RecordWriter
from trainers.training import evaluate, loss_fn, lr_at


@dataclass
class RunResult:
    """Outcome of :func:`run` on this rank."""

    steps: int
    stop_reason: str
    final_accuracy: Optional[float]


def ensure_single_process_env(env: MutableMapping[str, str]) -> None:
    """Fill in a world of one (rank 0, loopback rendezvous) when no launcher set the variables."""
    if "WORLD_SIZE" not in env and "RANK" not in env:
        env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        env.setdefault("MASTER_PORT", str(free_port()))


def run(config: Config) -> RunResult:
    """Train on this rank as ``config`` says, writing records; re-raises after recording a failure."""
    ensure_single_process_env(os.environ)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    output_dir = Path(config.output_dir)
    writer = RecordWriter(output_dir, rank, append=restarts > 0)  # a restarted rank adds to its records
    comm = None
    try:
        if rank == 0:
            (output_dir / "config.json").write_text(json.dumps(to_dict(config), indent=2) + "\n")
        device = _device(config)
        comm = _make_comm(config, device)
        writer.write(
            "start",
            restarts=restarts,
            world_size=world_size,
            algorithm=config.algorithm.name,
            model=config.model.name,
            dataset=config.dataset.name,
            host=socket.gethostname(),
            python=platform.python_version(),
            torch=torch.__version__,
            device=str(device),
            backend=config.comm.backend,
        )
        result = _train(config, comm, writer, device)
        writer.write("status", status="ok", steps=result.steps, stop_reason=result.stop_reason)
        return result
    except BaseException as error:
        writer.write(
            "status",
            status="failed",
            reason=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(),
        )
        raise
    finally:
        writer.close()
        if comm is not None:
            comm.shutdown()


def _make_comm(config: Config, device: torch.device) -> Comm:
    """The configured communication layer; tcp only for algorithms that tolerate a crash."""
    if config.comm.backend != "tcp":
        return TorchComm(config.comm.backend, config.comm.timeout_s, device)
    algorithm_cls = get_algorithm(config.algorithm.name)
    if not algorithm_cls.tolerates_crash:
        tolerant = sorted(name for name, cls in ALGORITHMS.items() if cls.tolerates_crash)
        raise ConfigError("comm.backend", f"tcp is for the crash-tolerant algorithms {tolerant}; "
                          f"{config.algorithm.name} needs every rank in every collective (use gloo or nccl)")
    from trainers.comm_tcp import TcpComm

    return TcpComm(config.comm.timeout_s, device)


def _device(config: Config) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA device")
    # Ranks beyond the GPU count share GPUs round-robin (fine for gloo; NCCL needs one GPU per rank).
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _train(config: Config, comm: TorchComm, writer: RecordWriter, device: torch.device) -> RunResult:
    rank, world_size = comm.rank, comm.world_size
    torch.manual_seed(config.seed * 1000 + rank)  # per-rank randomness (dropout); init is seeded below
    data = load_dataset(config.dataset, config.seed)
    shard_keys = data.train_y if data.train_y.dim() == 1 else data.train_y[:, 0]
    shards = shard_indices(shard_keys, world_size, config.dataset.shard, config.dataset.alpha, config.seed)
    sampler = BatchSampler(shards[rank], config.batch_size, seed=config.seed * 1000 + rank)
    model = build_model(config.model.name, config.model.params, data.input_shape, data.num_classes, config.seed).to(device)

    algorithm_cls = get_algorithm(config.algorithm.name)
    params = from_dict(algorithm_cls.Params, config.algorithm.params, "algorithm.params")
    context = AlgorithmContext(
        model=model, comm=comm, loss_fn=loss_fn, optimizer=config.optimizer, lr=config.lr, device=device
    )
    algorithm = algorithm_cls(params, context)
    membership = _Membership(comm, writer)
    first_step = 0
    if comm.elastic and comm.generation > 0:
        algorithm.rejoining = True
        algorithm.setup()
        admitted_at = membership.await_admission(algorithm)
        if admitted_at is None:
            return RunResult(steps=0, stop_reason="ended_before_rejoin", final_accuracy=None)
        first_step = admitted_at + 1
    else:
        algorithm.setup()

    bytes_sent_total = bytes_recv_total = 0
    stop_reason = "steps"
    final_accuracy: Optional[float] = None
    start = time.monotonic()
    step = first_step
    for step in range(first_step, config.steps):
        lr = lr_at(step, config.lr, config.lr_schedule, config.steps)
        algorithm.set_lr(lr)
        indices = sampler.next_indices()
        batch = (data.train_x[indices].to(device), data.train_y[indices].to(device))
        sent_0, recv_0, blocked_0 = comm.stats.snapshot()
        step_start = time.perf_counter()
        result = algorithm.train_step(step, batch)
        last = step == config.steps - 1
        if last:
            algorithm.finish()  # draining in-flight communication belongs to the last step
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so step_s includes the GPU work launched this step
        step_s = time.perf_counter() - step_start
        sent_1, recv_1, blocked_1 = comm.stats.snapshot()
        blocked = blocked_1 - blocked_0 if algorithm.measures_blocked_time else None
        bytes_sent_total += sent_1 - sent_0
        bytes_recv_total += recv_1 - recv_0
        writer.write(
            "step",
            step=step,
            epoch=sampler.epoch_float,
            loss=result.loss,
            lr=lr,
            step_s=step_s,
            compute_s=step_s - blocked if blocked is not None else None,
            comm_blocked_s=blocked,
            bytes_sent=sent_1 - sent_0,
            bytes_recv=recv_1 - recv_0,
            bytes_sent_total=bytes_sent_total,
            bytes_recv_total=bytes_recv_total,
            staleness=result.staleness,
        )
        if (step + 1) % config.eval_every == 0 or last:
            final_accuracy, stop = _evaluate_and_decide(config, algorithm, comm, writer, data, device, step, start,
                                                        membership)
            if stop is not None:
                stop_reason = stop
                if not last:
                    algorithm.finish()
                break
    if config.save_final_model:
        torch.save(model.state_dict(), Path(config.output_dir) / f"rank{rank}_final.pt")
    return RunResult(steps=step + 1, stop_reason=stop_reason, final_accuracy=final_accuracy)


def _evaluate_and_decide(config, algorithm, comm, writer, data, device, step, start,
                         membership: "_Membership") -> tuple[Optional[float], Optional[str]]:
    """Evaluate the deployable model (rank 0 writes the eval record) and agree on stopping.

    All ranks call ``deployable_model()`` (it may communicate); rank 0 evaluates, decides whether
    the target accuracy or time budget is reached, and broadcasts the decision so every rank stops
    at the same step. On an elastic comm that message also carries the membership (every time).
    Traffic here is reported in the eval record, not in step records.
    """
    sent_0, recv_0, _ = comm.stats.snapshot()
    eval_start = time.perf_counter()
    deployable = algorithm.deployable_model()
    accuracy = loss = None
    stop_code = 0
    if comm.rank == 0:
        accuracy, loss = evaluate(deployable, data.test_x, data.test_y, device)
        if config.target_accuracy is not None and accuracy >= config.target_accuracy:
            stop_code = 1
        elif config.time_budget_s is not None and time.monotonic() - start >= config.time_budget_s:
            stop_code = 2
    if comm.elastic:
        stop_code = membership.agree(algorithm, deployable, step, stop_code)
    elif config.target_accuracy is not None or config.time_budget_s is not None:
        flag = torch.tensor([stop_code], dtype=torch.int64, device=device)
        comm.broadcast(flag, src=0)
        stop_code = int(flag.item())
    sent_1, recv_1, _ = comm.stats.snapshot()
    if comm.rank == 0:
        writer.write(
            "eval",
            step=step,
            accuracy=accuracy,
            loss=loss,
            eval_s=time.perf_counter() - eval_start,
            eval_bytes_sent=sent_1 - sent_0,
            eval_bytes_recv=recv_1 - recv_0,
        )
    return accuracy, {0: None, 1: "target_accuracy", 2: "time_budget"}[stop_code]


class _Membership:
    """Which ranks take part, agreed at evaluation points on an elastic comm (see comm_tcp).

    Rank 0 (the coordinator) sends every live rank one message per evaluation point: the stop
    decision, the step, and per rank 0 (not live) or 1 + the generation of its live process.
    Restarted ranks waiting to join are admitted in it and also get the algorithm's rejoin state.
    Rank 0 writes a ``membership`` record whenever the set changes; an admitted rank writes a
    ``rejoin`` record.
    """

    def __init__(self, comm: Comm, writer: RecordWriter):
        self.comm = comm
        self.writer = writer
        self.live: dict[int, int] = {rank: 0 for rank in range(comm.world_size)}  # rank -> generation

    def agree(self, algorithm, deployable, step: int, stop_code: int) -> int:
        comm = self.comm
        if comm.rank == 0:
            joining = comm.joining_ranks()
            generations = comm.generations()
            live = {rank: generations[rank] for rank in comm.live_ranks() + joining}
            message = self._message(stop_code, step, live)  # as it was before any send failed
            payload = _pack(algorithm.rejoin_state(deployable)) if joining else None
            for rank in sorted(set(live) - {0}):
                try:
                    if rank in joining:
                        comm.send_admission(message, rank)
                        comm.send_admission(torch.tensor([payload.numel()], dtype=torch.int64), rank)
                        comm.send_admission(payload, rank)
                    else:
                        comm.send(message, rank)
                except PeerLost:
                    live.pop(rank)
        else:
            message = self._message(0, 0, {})
            comm.recv(message, 0)
            stop_code, live = int(message[0]), self._decode(message)
        self._apply(algorithm, step, live)
        return stop_code

    def await_admission(self, algorithm) -> Optional[int]:
        """On a restarted rank: wait (until rank 0 ends) to be admitted; returns the step it was
        admitted at, or None if the job ended first."""
        message = self._message(0, 0, {})
        self.comm.ready_to_join()
        while True:
            try:
                self.comm.recv(message, 0)
                break
            except TimeoutError:
                continue  # the next evaluation point may be far off
            except PeerLost:
                return None
        step, live = int(message[1]), self._decode(message)
        size = torch.zeros(1, dtype=torch.int64)
        self.comm.recv(size, 0)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.comm.recv(payload, 0)
        algorithm.load_rejoin_state(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False), step)
        self.live = {rank: generation for rank, generation in live.items() if rank != self.comm.rank}
        self._apply(algorithm, step, live)
        self.writer.write("rejoin", step=step, restarts=self.comm.generation, live=sorted(live))
        return step

    def _message(self, stop_code: int, step: int, live: dict[int, int]) -> torch.Tensor:
        flags = [live[r] + 1 if r in live else 0 for r in range(self.comm.world_size)]
        return torch.tensor([stop_code, step] + flags, dtype=torch.int64)

    def _decode(self, message: torch.Tensor) -> dict[int, int]:
        return {r: int(message[2 + r]) - 1 for r in range(self.comm.world_size) if message[2 + r] > 0}

    def _apply(self, algorithm, step: int, live: dict[int, int]) -> None:
        joined = sorted(r for r in live if self.live.get(r) != live[r])  # new, or a newer process
        lost = sorted(r for r in self.live if r not in live or self.live[r] != live[r])
        self.comm.set_membership(live)
        self.live = dict(live)
        if joined or lost:
            algorithm.on_membership(step, sorted(live), joined, lost)
            if self.comm.rank == 0:
                self.writer.write("membership", step=step, live=sorted(live), joined=joined, lost=lost)


def _pack(state: dict) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
