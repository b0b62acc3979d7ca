"""Fixtures for multi-process trainer tests: loopback gloo ranks, bounded time, children always ended."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import yaml

from trainers.launch import RankExit, free_port, launch_local
from trainers.records import read_records


def _spawner():
    """A (run, stop) pair: run starts ranks and waits with a deadline; stop ends leftovers."""
    context = multiprocessing.get_context("spawn")
    started: list[multiprocessing.Process] = []

    def run(target, world_size: int, *args, timeout_s: float = 90.0) -> list[int]:
        port = free_port()
        processes = [context.Process(target=target, args=(rank, world_size, port, *args)) for rank in range(world_size)]
        for process in processes:
            process.start()
            started.append(process)
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in processes):
            raise TimeoutError(f"ranks still running after {timeout_s} s")
        return [p.exitcode for p in processes]

    def stop():
        for process in started:
            if process.is_alive():
                process.terminate()
        for process in started:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()

    return run, stop


@pytest.fixture
def spawn_ranks():
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    Returns the exit codes; processes still alive at the timeout (or at teardown) are
    terminated, then killed.
    """
    run, stop = _spawner()
    yield run
    stop()


@pytest.fixture(scope="module")
def spawn_ranks_module():
    """:func:`spawn_ranks` for module-scoped fixtures."""
    run, stop = _spawner()
    yield run
    stop()


BASE_CONFIG = {
    "seed": 3,
    "batch_size": 16,
    "lr": 0.1,
    "steps": 30,
    "eval_every": 10,
    "model": {"name": "mlp", "params": {"hidden_sizes": [32]}},
    "dataset": {"name": "digits"},
    "algorithm": {"name": "sync"},
}


def merge(base: dict, changes: dict) -> dict:
    """Recursive dict merge (changes win), for building configs in tests."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def run_training(directory: Path, world_size: int, changes: dict, timeout_s: float = 120.0) -> Path:
    """Write a config (BASE_CONFIG + changes) under ``directory``, run it on loopback, return the output dir.

    Fails the test with every failing rank's stderr tail if a rank exits non-zero.
    """
    directory.mkdir(parents=True, exist_ok=True)
    output_dir = directory / "out"
    config = merge(BASE_CONFIG, {**changes, "output_dir": str(output_dir)})
    config_path = directory / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    exits: list[RankExit] = launch_local(config_path, world_size, timeout_s=timeout_s)
    failed = [e for e in exits if e.returncode != 0]
    assert not failed, "\n".join(f"rank {e.rank} exited {e.returncode}:\n{e.stderr_tail}" for e in failed)
    return output_dir


def run_sessions(spawn_ranks, directory: Path, world_size: int, runs: dict[str, dict], timeout_s: float = 150.0) -> dict[str, Path]:
    """Run several configs (BASE_CONFIG + changes each) in one set of spawned ranks, in order.

    Returns the output directory of each named run. Saves process start-up (importing torch)
    per run; every run is still a real multi-process gloo job through ``trainers.runner.run``.
    """
    from tests.trainers.workers import run_configs_worker

    outputs = {name: directory / name for name in runs}
    configs = [merge(BASE_CONFIG, {**changes, "output_dir": str(outputs[name])}) for name, changes in runs.items()]
    ports = [free_port() for _ in configs]
    exits = spawn_ranks(run_configs_worker, world_size, configs, ports, timeout_s=timeout_s)
    assert exits == [0] * world_size, f"rank exit codes {exits}; see the status records under {directory}"
    return outputs


def records(output_dir: Path, rank: int, kind: str | None = None) -> list[dict]:
    """Records of one rank, optionally only those of ``kind``."""
    rows = read_records(output_dir / f"rank{rank}.jsonl")
    return [r for r in rows if kind is None or r["kind"] == kind]


def evaluations(output_dir: Path) -> list[dict]:
    """The evaluator's records for a finished job (its output model at each eval point)."""
    from trainers.evaluate import evaluate_job

    return evaluate_job(output_dir)
