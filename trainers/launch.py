"""Start N ranks of ``python -m trainers`` on this machine over loopback (tests, benchmarks).

On real machines use torchrun; this helper exists so tests and benchmarks can bound run time
and always end the children they started (terminate, then kill), by PID.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class RankExit:
    """How one rank ended: its exit status and the tail of its stderr."""

    rank: int
    returncode: int
    stderr_tail: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_local(
    config_path: str | Path,
    world_size: int,
    timeout_s: float = 120.0,
    overrides: dict | None = None,
    threads_per_rank: int = 1,
    extra_env: dict | None = None,
) -> list[RankExit]:
    """Run ``world_size`` ranks to completion; raise TimeoutError (after killing them) on timeout.

    Args:
        config_path: config file every rank loads.
        world_size: number of ranks (processes).
        timeout_s: wall-clock limit for the whole run (s).
        overrides: dotted-key overrides passed as ``--set key=value``.
        threads_per_rank: intra-op threads per rank (OMP_NUM_THREADS); keep ranks x threads <= cores.
        extra_env: more environment variables for every rank.
    """
    port = free_port()
    args = [sys.executable, "-m", "trainers", str(config_path)]
    for key, value in (overrides or {}).items():
        args += ["--set", f"{key}={json.dumps(value)}"]
    processes: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(world_size):
            env = dict(os.environ)
            env.update(
                RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads_per_rank),
            )
            env.update(extra_env or {})
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            processes.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + timeout_s
        for process in processes:
            remaining = deadline - time.monotonic()
            try:
                process.wait(timeout=max(0.0, remaining))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"ranks still running after {timeout_s} s; they were terminated") from None
        exits = []
        for rank, (process, log) in enumerate(zip(processes, logs)):
            log.seek(0)
            exits.append(RankExit(rank, process.returncode, log.read()[-4000:]))
        return exits
    finally:
        stop_processes(processes)
        for log in logs:
            log.close()


def stop_processes(processes: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Terminate the still-running ``processes``, then kill those that outlive ``grace_s``."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
