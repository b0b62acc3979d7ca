"""Run one rank of a training job: data, model, algorithm, step loop, snapshots, stopping and records.

Nothing here evaluates: at eval points each rank writes its part of the output model to
``<output_dir>/snapshots`` (trainers/snapshots.py) off the training clock and without
communicating; ``python -m trainers.evaluate`` evaluates them. The job ends after ``steps`` steps or
at the step named by the STOP file (trainers/stop.py), which every rank polls each step.

Rank, world size and rendezvous come from the torchrun environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK). Without them the run is a single process (rank 0 of 1).
A launcher that places ranks on GPUs (the wanbench harness: harness/gpus.py, docs/GPU.md) may
also set CUDA_VISIBLE_DEVICES to the rank's one GPU, WANBENCH_COMM_BACKEND (the backend to run
instead of comm.backend: gloo when the job's ranks share GPUs), WANBENCH_GPU_SHARED_BY and
WANBENCH_GPU_REASON; the ``start`` record's ``placement`` says what the rank got and why.
"""

from __future__ import annotations

import io
import os
import platform
import resource
import socket
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, MutableMapping, Optional

import torch

from trainers import clock
from trainers.algorithms import Algorithm, AlgorithmContext, get_algorithm
from trainers.comm import Comm, PeerLost, ProcessKilled, TcpComm, TorchComm
from trainers.config import COMM_BACKEND_VARIABLE, GPU_REASON_VARIABLE, GPU_SHARED_BY_VARIABLE, Config, to_dict  # noqa: F401
from trainers.datasets import BatchSampler, DataBundle, load_dataset, shard_indices
from trainers.padding import LayerPadding
from trainers.launch import free_port
# COMM_BACKEND_VARIABLE, LAUNCHER_BACKENDS and with_launcher_backend are named here too (the harness's
# tests read them from the runner, which reads the variable); the rule lives in loading.py
from trainers.loading import LAUNCHER_BACKENDS, resolve, uses_elastic_comm, with_launcher_backend  # noqa: F401
from trainers.models import build_model
from trainers.records import RESOLVED_CONFIG_FILE, RecordWriter, write_json_atomic
from trainers.snapshots import SnapshotSchedule, write_snapshot
from trainers.stop import StopRequest, StopWatcher, stop_step_from_records, write_stop
from trainers.training import loss_fn, lr_at


@dataclass
class RunResult:
    """Outcome of :func:`run` on this rank."""

    steps: int
    stop_reason: str
    stop_step_passed: bool = False


def ensure_single_process_env(env: MutableMapping[str, str]) -> None:
    """Fill in a world of one (rank 0, loopback rendezvous) when no launcher set the variables."""
    if "WORLD_SIZE" not in env and "RANK" not in env:
        env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        env.setdefault("MASTER_PORT", str(free_port()))


def run(config: Config, comm_factory: Optional[Callable[[], Comm]] = None) -> RunResult:
    """Train on this rank as ``config`` says, writing records; re-raises after recording a failure.

    ``comm_factory``: the communication layer to use instead of the one the torchrun environment
    and the config name (a simulated run's ranks share one process: ``trainers.sim``); the rank,
    world size and restart count (``generation``) are then the comm's. ``config`` is resolved
    (``trainers.loading.load_config``); one built by hand is resolved here.
    """
    comm: Optional[Comm] = comm_factory() if comm_factory is not None else None
    if comm is None:
        ensure_single_process_env(os.environ)
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    else:
        rank, world_size, restarts = comm.rank, comm.world_size, comm.generation
    output_dir = Path(config.output_dir)
    writer = RecordWriter(output_dir, rank, append=restarts > 0)  # a restarted rank adds to its records
    try:
        config = resolve(config)  # a loaded config's Params pass through as they are
        requested_backend = config.comm.backend
        if comm_factory is None:
            config = with_launcher_backend(config, os.environ)
        if rank == 0:
            # Its own file, replaced whole: the config file the ranks were started with may be
            # read by another rank still (in a run directory it is config.json).
            write_json_atomic(output_dir / RESOLVED_CONFIG_FILE, to_dict(config))
        device = _device(config)
        if comm is None:
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
            backend=comm.transport if comm_factory is not None else config.comm.backend,
            # which GPU (None on CPU), the backend asked for and the one run, and the launcher's why
            placement=_placement(device, requested_backend, config.comm.backend, os.environ),
            # which all-reduce: "gloo" or "ours:<algorithm>" (comm.allreduce; ddp's too, through its comm hook)
            transport=comm.transport,
        )
        result = _train(config, comm, writer, device)
        writer.write("status", status="ok", steps=result.steps, stop_reason=result.stop_reason,
                     stop_step_passed=result.stop_step_passed, snapshot_s_total=writer.excluded_s,
                     comm_bytes_sent=comm.stats.bytes_sent, comm_bytes_recv=comm.stats.bytes_recv,
                     comm_calls={op: s.calls for op, s in comm.stats.per_op.items() if s.calls},
                     max_rss_mib=max_rss_mib())
        return result
    except ProcessKilled:
        raise  # a killed process writes nothing more (trainers.sim's injected crash)
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


def max_rss_mib() -> float:
    """This process's peak resident memory (MiB; Linux reports ru_maxrss in KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _make_comm(config: Config, device: torch.device) -> Comm:
    """The communication layer of ``config``'s backend (decided by ``with_launcher_backend``)."""
    if uses_elastic_comm(config):
        return TcpComm(config.comm.timeout_s, device)
    return TorchComm(config.comm.backend, config.comm.timeout_s, device, config.comm.allreduce,
                     config.comm.max_in_flight)


def _device(config: Config) -> torch.device:
    """This rank's device: cuda:(LOCAL_RANK mod the visible GPUs).

    Under torchrun on a real machine that is the rank's own GPU (ranks beyond the GPU count share
    them round robin: fine for gloo, NCCL needs one GPU per rank). The wanbench harness starts
    every rank with LOCAL_RANK 0 (each node is a host of its own) and CUDA_VISIBLE_DEVICES set to
    the one GPU it chose for the rank, so cuda:0 is that GPU.
    """
    if config.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device: cuda was asked for but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _placement(device: torch.device, requested_backend: str, backend: str, env) -> dict:
    """The start record's ``placement``: the GPU this rank computes on (None on CPU) as the
    machine names it (its CUDA_VISIBLE_DEVICES entry, or its index when all are visible), the
    backend the config asked for and the one that runs, and the launcher's reason."""
    placement = {"gpu": None, "backend": backend, "backend_requested": requested_backend,
                 "fell_back": backend != requested_backend, "shared_by": None,
                 "reason": env.get(GPU_REASON_VARIABLE)}
    if device.type != "cuda":
        return placement
    listed = [entry.strip() for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    properties = torch.cuda.get_device_properties(device)
    shared_by = env.get(GPU_SHARED_BY_VARIABLE)
    placement.update(gpu=listed[device.index] if device.index < len(listed) else str(device.index),
                     visible_as=str(device), name=properties.name,
                     uuid=str(properties.uuid) if hasattr(properties, "uuid") else None,
                     shared_by=int(shared_by) if shared_by and shared_by.isdigit() else None)
    return placement


@dataclass
class _Training:
    """What a rank trains with, built by :func:`_build_training`.

    Args:
        data: the dataset (every rank loads all of it; ``sampler`` draws this rank's shard).
        sampler: this rank's batches.
        model: the local model (the algorithm holds it too).
        algorithm: set up, or rejoined and admitted.
        membership: the live ranks, agreed at eval points on an elastic comm.
        first_step: the step to train first (after the admission step for a rejoined rank).
    """

    data: DataBundle
    sampler: BatchSampler
    model: torch.nn.Module
    algorithm: Algorithm
    membership: "_Membership"
    first_step: int


def _build_training(config: Config, comm: Comm, writer: RecordWriter, device: torch.device) -> Optional[_Training]:
    """Set up this rank's training: seeds, data (and its ``data`` record), shard, model (on the
    clock and padded), the algorithm with its optimizer, and admission for a restarted rank on an
    elastic comm; then the ``output`` record. None when the job ended before a restarted rank was
    admitted."""
    rank, world_size = comm.rank, comm.world_size
    torch.manual_seed(config.seed * 1000 + rank)  # per-rank randomness (dropout); init is seeded below
    data = load_dataset(config.dataset, config.seed)
    # what this rank trains on, in one line: a dataset's files, or a generator and its seed (a
    # cifar10 job that fell back to generated images says so here)
    writer.write("data", dataset=config.dataset.name, source=data.source, train_samples=len(data.train_x),
                 test_samples=len(data.test_x), input_shape=list(data.input_shape), num_classes=data.num_classes)
    shard_keys = data.train_y if data.train_y.dim() == 1 else data.train_y[:, 0]
    shards = shard_indices(shard_keys, world_size, config.dataset.shard, config.dataset.alpha, config.seed)
    sampler = BatchSampler(shards[rank], config.batch_size, seed=config.seed * 1000 + rank)
    model = build_model(config.model.name, config.model.params, data.input_shape, data.num_classes, config.seed).to(device)
    clock.attach(model, config.layer_shares)  # before the algorithm's hooks: a virtual clock spreads backward over them
    if config.pad_layers:  # also before them: a gradient is padded before an algorithm sends it
        LayerPadding(model, config.min_compute_s, layer_shares=config.layer_shares)

    context = AlgorithmContext(
        model=model, comm=comm, loss_fn=loss_fn, optimizer=config.optimizer, lr=config.lr, device=device,
        min_compute_s=config.min_compute_s, seed=config.seed,
    )
    algorithm = get_algorithm(config.algorithm.name)(config.algorithm.params, context)
    membership = _Membership(comm, writer)
    first_step = 0
    if comm.elastic and comm.generation > 0:
        algorithm.rejoining = True
        algorithm.setup()
        admitted_at = membership.await_admission(algorithm)
        if admitted_at is None:
            return None
        first_step = admitted_at + 1
    else:
        algorithm.setup()
    output = algorithm.output_state()
    writer.write("output", role=output.role if output is not None else None)  # what this rank snapshots
    return _Training(data, sampler, model, algorithm, membership, first_step)


def _train(config: Config, comm: Comm, writer: RecordWriter, device: torch.device) -> RunResult:
    """The step loop: train, poll the STOP file, record each step, snapshot at eval points, agree
    on the membership on an elastic comm."""
    training = _build_training(config, comm, writer, device)
    if training is None:
        return RunResult(steps=0, stop_reason="ended_before_rejoin")
    data, sampler, algorithm = training.data, training.sampler, training.algorithm
    totals = _ByteTotals()
    schedule = SnapshotSchedule(config.eval_every, config.eval_every_s)
    stop = _StopControl(config, comm, writer)
    end = config.steps
    stop_reason = "steps"
    step = training.first_step
    clock.training_starts()  # a simulated rank may be held here to its start-up offset
    train_start = writer.clock()
    for step in range(training.first_step, config.steps):
        lr = lr_at(step, algorithm.peak_lr(step, config.lr), config.lr_schedule, config.steps)
        algorithm.set_lr(lr)
        indices = sampler.next_indices()
        batch = (data.inputs(data.train_x[indices].to(device)), data.train_y[indices].to(device))
        before = comm.stats.snapshot()
        syncs_before = algorithm.syncs_applied
        step_start = clock.perf_counter()
        result = algorithm.train_step(step, batch)
        clock.step_done()
        request = stop.poll(step)
        if request is not None and request.stop_step < end:
            end, stop_reason = request.stop_step, request.reason
        last = step >= end - 1
        if last:
            algorithm.finish()  # draining in-flight communication belongs to the last step
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # so step_s includes the GPU work launched this step
        step_s = clock.perf_counter() - step_start
        _write_step(writer, totals, step, sampler.epoch_float, lr, step_s, result, algorithm, before,
                    comm.stats.snapshot(), algorithm.syncs_applied - syncs_before)
        eval_index = schedule.index_at(step, writer.clock(), last)
        if eval_index is not None:
            _snapshot(algorithm, writer, config.output_dir, comm.rank, eval_index, step, train_start)
        if comm.elastic and ((step + 1) % config.eval_every == 0 or last):
            training.membership.agree(algorithm, step)
        if last:
            break
    if config.save_final_model:
        torch.save(training.model.state_dict(), Path(config.output_dir) / f"rank{comm.rank}_final.pt")
    return RunResult(steps=step + 1, stop_reason=stop_reason, stop_step_passed=stop.passed)


@dataclass
class _ByteTotals:
    """Bytes this rank's steps sent and received so far (the step records' ``*_total``)."""

    sent: int = 0
    recv: int = 0


def _write_step(writer: RecordWriter, totals: _ByteTotals, step: int, epoch: float, lr: float, step_s: float,
                result, algorithm: Algorithm, before: tuple[int, int, float], after: tuple[int, int, float],
                syncs: int = 0) -> None:
    """One ``step`` record; ``before`` and ``after``: the comm's (sent, received, blocked_s)
    around the step; ``syncs``: synchronisations the algorithm applied in it (``note_sync``)."""
    sent, recv = after[0] - before[0], after[1] - before[1]
    blocked = after[2] - before[2] if algorithm.measures_blocked_time else None
    totals.sent += sent
    totals.recv += recv
    writer.write(
        "step",
        step=step,
        epoch=epoch,
        loss=result.loss,
        lr=lr,
        step_s=step_s,
        compute_s=step_s - blocked if blocked is not None else None,
        compute_unpadded_s=algorithm.compute_unpadded_s,  # forward + backward before a profile's padding
        comm_blocked_s=blocked,
        bytes_sent=sent,
        bytes_recv=recv,
        bytes_sent_total=totals.sent,
        bytes_recv_total=totals.recv,
        staleness=result.staleness,
        syncs_applied=syncs,  # per step, not a running total: a restarted rank's process counts from 0
    )


def _snapshot(algorithm, writer: RecordWriter, output_dir: str, rank: int, eval_index: int, step: int,
              train_start: float) -> None:
    """Write this rank's part of the output model (no communication); the time it takes is taken
    off the training clock and recorded (``snapshot`` record: ``snapshot_s``, ``snapshot_s_total``)."""
    started = clock.perf_counter()
    output = algorithm.output_state()
    if output is None:
        writer.exclude(clock.perf_counter() - started)
        return
    now = writer.clock()
    size = write_snapshot(output_dir, rank, eval_index, step, now, now - train_start, output)
    snapshot_s = clock.perf_counter() - started
    writer.exclude(snapshot_s)
    writer.write("snapshot", eval_index=eval_index, step=step, train_time_s=now - train_start, role=output.role,
                 bytes=size, snapshot_s=snapshot_s, snapshot_s_total=writer.excluded_s)


class _StopControl:
    """When to end: the STOP file (polled once per step), and rank 0's own time budget.

    Rank 0 enforces ``time_budget_s`` on its training clock (from the first step) by writing the
    STOP file itself (first writer wins, so a harness's file takes precedence if it came first), but
    only if it sees every rank's records in output_dir: the other ranks could not see the file on a
    filesystem they do not share (then a ``warning`` record says so and only ``steps`` applies).
    """

    def __init__(self, config: Config, comm: Comm, writer: RecordWriter):
        self.output_dir = Path(config.output_dir)
        self.watcher = StopWatcher(self.output_dir)
        self.writer = writer
        self.world_size = comm.world_size
        self.budget_s = config.time_budget_s if comm.rank == 0 else None
        self.clock_at_start = writer.clock()
        self.passed = False  # the STOP file named a step this rank had already passed

    def poll(self, step: int) -> Optional[StopRequest]:
        request = self.watcher.poll()
        if request is None and self.budget_s is not None and self.writer.clock() - self.clock_at_start >= self.budget_s:
            self.budget_s = None  # decided once
            if all((self.output_dir / f"rank{r}.jsonl").exists() for r in range(self.world_size)):
                request = write_stop(self.output_dir, stop_step_from_records(self.output_dir), "time_budget")
                self.watcher.request = request
            else:
                self.writer.write("warning", step=step, message="time_budget_s not enforced: the other ranks' "
                                  "records are not in output_dir (no shared filesystem for the STOP file)")
        if request is not None and request.stop_step <= step and not self.passed:
            self.passed = True
            self.writer.write("warning", step=step, message=f"STOP file names stop_step {request.stop_step}, "
                              f"already passed: ending after step {step}")
        return request


class _Membership:
    """Which ranks take part, agreed at eval points on an elastic comm (see trainers/comm/tcp.py).

    This is control traffic, not evaluation: rank 0 (the coordinator) sends every live rank one
    small message per eval point (the step, and per rank 0 (not live) or 1 + the generation of its
    live process). Only when a restarted rank is admitted do the live ranks also build the
    deployable model (``deployable_model()``, which may communicate) so rank 0 can send the
    algorithm's rejoin state with the admission. Rank 0 writes a ``membership`` record whenever
    the set changes; an admitted rank writes a ``rejoin`` record.
    """

    def __init__(self, comm: Comm, writer: RecordWriter):
        self.comm = comm
        self.writer = writer
        self.live: dict[int, int] = {rank: 0 for rank in range(comm.world_size)}  # rank -> generation

    def agree(self, algorithm, step: int) -> None:
        comm = self.comm
        if comm.rank == 0:
            joining = comm.joining_ranks()
            generations = comm.generations()
            live = {rank: generations[rank] for rank in comm.live_ranks() + joining}
            message = self._message(step, live)  # as it was before any send failed
            for rank in sorted(set(live) - {0} - set(joining)):
                try:
                    comm.send(message, rank)
                except PeerLost:
                    live.pop(rank)
            if joining:
                payload = _pack(algorithm.rejoin_state(algorithm.deployable_model()))
                for rank in joining:
                    try:
                        comm.send_admission(message, rank)
                        comm.send_admission(torch.tensor([payload.numel()], dtype=torch.int64), rank)
                        comm.send_admission(payload, rank)
                    except PeerLost:
                        live.pop(rank)
        else:
            message = self._message(0, {})
            comm.recv(message, 0)
            live = self._decode(message)
            if self._joined(live):
                algorithm.deployable_model()  # its collectives, if any, are over the ranks live before
        self._apply(algorithm, step, live)

    def await_admission(self, algorithm) -> Optional[int]:
        """On a restarted rank: wait (until rank 0 ends) to be admitted; returns the step it was
        admitted at, or None if the job ended first."""
        message = self._message(0, {})
        self.comm.ready_to_join()
        while True:
            try:
                self.comm.recv(message, 0)
                break
            except TimeoutError:
                continue  # the next eval point may be far off
            except PeerLost:
                return None
        step, live = int(message[0]), self._decode(message)
        size = torch.zeros(1, dtype=torch.int64)
        self.comm.recv(size, 0)
        payload = torch.empty(int(size), dtype=torch.uint8)
        self.comm.recv(payload, 0)
        algorithm.load_rejoin_state(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False), step)
        self.live = {rank: generation for rank, generation in live.items() if rank != self.comm.rank}
        self._apply(algorithm, step, live)
        self.writer.write("rejoin", step=step, restarts=self.comm.generation, live=sorted(live))
        return step

    def _message(self, step: int, live: dict[int, int]) -> torch.Tensor:
        flags = [live[r] + 1 if r in live else 0 for r in range(self.comm.world_size)]
        return torch.tensor([step] + flags, dtype=torch.int64)

    def _decode(self, message: torch.Tensor) -> dict[int, int]:
        return {r: int(message[1 + r]) - 1 for r in range(self.comm.world_size) if message[1 + r] > 0}

    def _joined(self, live: dict[int, int]) -> list[int]:
        return sorted(r for r in live if self.live.get(r) != live[r])  # new, or a newer process

    def _apply(self, algorithm, step: int, live: dict[int, int]) -> None:
        joined = self._joined(live)
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
