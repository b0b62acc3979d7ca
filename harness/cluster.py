"""`wanbench run --cluster ADDRESS`: a sweep's sim jobs as tasks of a Dask distributed cluster
(docs/SCALE_OUT.md: why Dask, how to start one on Slurm or on cloud VMs).

One task per sim job, and nothing shared between the harness and the workers but the scheduler:
`ship` reads the job's inputs as bytes (config.json, sim.json and the network point's plan.json,
which sim.json names by absolute path); on the worker `run_shipped` writes them into a temporary
folder of its own (the output_dir and the plan's path rewritten to it), runs the simulation and
the evaluator there (harness/jobs.py `simulate_job_dir`, the very code of a local run), and
returns the job's output files as bytes; `land` writes them into the job's folder with the
worker's folder name rewritten back to the job's, then job.json last, as run_sim_job does. The
snapshots stay on the worker (the evaluator read them there; nothing after the job reads them).
The phase logic (tuning picks) stays in the harness (harness/run.py).

A worker lost mid-task (killed, its VM preempted) is Dask's to handle: the scheduler hands the
task to another worker (up to `distributed.scheduler.allowed-failures` times, 3 by default;
beyond that the job is recorded failed with the scheduler's KilledWorker, and `--resume` runs it
again). A job is a pure function of its inputs on sim, so a re-run gives the same records.

Dask is imported here only, when --cluster is used: wanbench runs without it.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import tempfile
import time
import uuid
from pathlib import Path
from typing import Optional

from emulator.files import write_json_atomic
from emulator.schema import ConfigError

from .jobs import JobOutcome, simulate_job_dir, write_sim_job_record
from .jobspec import CONFIG_FILE, SIM_FILE, JobSpec

# What `pip install` brings the Dask client, scheduler and workers.
INSTALL_HINT = "pip install 'dask[distributed]' (or the project's extra: pip install -e '.[cluster]')"
# The plan's name in a worker's folder (beside the job's own folder).
SHIPPED_PLAN = "plan.json"
# How long connecting to the scheduler may take.
CONNECT_TIMEOUT_S = 30.0
# Output files not sent back: the snapshots (large; evaluated on the worker, read by nothing after
# the job) and the inputs (the harness wrote them into the job's folder before shipping them).
NOT_RETURNED = ("snapshots",)
# How often the harness looks at the tasks in flight.
WAIT_INTERVAL_S = 0.1


@dataclasses.dataclass(frozen=True)
class ShippedJob:
    """One sim job's inputs as bytes: what a worker needs, with no file shared with the harness.

    Args:
        job_id: the job's id (its folder's name on the worker too).
        config: config.json (output_dir rewritten on the worker).
        sim: sim.json (its plan's path rewritten on the worker).
        plan: the network point's plan.json.
        timeout_s: the job's watchdog, wall-clock seconds on the worker.
    """

    job_id: str
    config: bytes
    sim: bytes
    plan: bytes
    timeout_s: float


@dataclasses.dataclass
class ShippedResult:
    """What a worker sends back: the job's outcome, its output files (path in the job's folder ->
    bytes), the worker's host and the folder the job ran in there (rewritten on landing)."""

    outcome: JobOutcome
    files: dict[str, bytes]
    host: str
    worker_job_dir: str


def ship(spec: JobSpec) -> ShippedJob:
    """The job's inputs, written into its folder here (it shows what ran) and read back as bytes."""
    spec.write()
    return ShippedJob(spec.job.job_id, (spec.job_dir / CONFIG_FILE).read_bytes(),
                      (spec.job_dir / SIM_FILE).read_bytes(), Path(spec.sim.plan_path).read_bytes(),
                      spec.timeout_s)


def run_shipped(job: ShippedJob) -> ShippedResult:
    """On a worker: the job in a temporary folder of its own (removed after), its outputs as bytes."""
    with tempfile.TemporaryDirectory(prefix="wanbench-") as folder:
        job_dir = Path(folder) / job.job_id
        job_dir.mkdir()
        plan_path = Path(folder) / SHIPPED_PLAN
        plan_path.write_bytes(job.plan)
        write_json_atomic(job_dir / CONFIG_FILE, {**json.loads(job.config), "output_dir": str(job_dir)})
        write_json_atomic(job_dir / SIM_FILE, {**json.loads(job.sim), "plan": str(plan_path)})
        outcome = simulate_job_dir(job_dir, job.job_id, job.timeout_s)
        files = {}
        for path in sorted(job_dir.rglob("*")):
            relative = path.relative_to(job_dir)
            if path.is_file() and relative.parts[0] not in NOT_RETURNED and relative.name not in (CONFIG_FILE, SIM_FILE):
                files[relative.as_posix()] = path.read_bytes()
        return ShippedResult(outcome, files, socket.gethostname(), str(job_dir))


def land(spec: JobSpec, result: ShippedResult) -> JobOutcome:
    """A worker's result written into the job's folder (the worker's folder name, in the text the
    job wrote, replaced by the job's), then job.json last."""
    theirs, ours = result.worker_job_dir.encode(), str(spec.job_dir).encode()
    for name, content in result.files.items():
        target = spec.job_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.replace(theirs, ours))
    write_sim_job_record(spec, result.outcome, host=result.host)
    return result.outcome


def land_failure(spec: JobSpec, error: BaseException, wall_s: float) -> JobOutcome:
    """A task the cluster could not run (a worker lost too often, the project missing on a
    worker): job.json says failed and why; `--resume` runs it again."""
    outcome = JobOutcome(spec.job.job_id, "failed", wall_s, f"on the cluster: {type(error).__name__}: {error}")
    write_sim_job_record(spec, outcome)
    return outcome


class Cluster:
    """A client of the Dask scheduler at `address` (tcp://HOST:PORT).

    ConfigError naming --cluster when Dask is not installed or the scheduler does not answer.
    """

    def __init__(self, address: str, timeout_s: Optional[float] = None):
        try:
            from distributed import Client
        except ImportError:
            raise ConfigError("", f"needs Dask distributed, which is not installed: {INSTALL_HINT}",
                              source="--cluster") from None
        self.address = address
        try:
            self.client = Client(address, timeout=timeout_s or CONNECT_TIMEOUT_S, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as exc:
            raise ConfigError("", f"no Dask scheduler answers at {address}: {exc}", source="--cluster") from None

    def threads(self) -> int:
        """The workers' threads in all (the tasks the cluster runs at once), at least 1."""
        return max(1, sum(self.client.nthreads().values()))

    def describe(self) -> str:
        workers = self.client.nthreads()
        return f"{len(workers)} worker(s), {sum(workers.values())} thread(s) at {self.address}"

    def record(self) -> dict:
        """environment.json's `cluster`: the scheduler and each worker (address -> threads)."""
        return {"address": self.address, "workers": dict(self.client.nthreads())}

    def submit(self, spec: JobSpec):
        """The job as one task (a Dask future)."""
        return self.client.submit(run_shipped, ship(spec), key=f"wanbench-{spec.job.job_id}-{uuid.uuid4().hex[:8]}",
                                  pure=False)

    @staticmethod
    def wait_first(futures) -> tuple[set, set]:
        """(done, not done) once at least one of `futures` is done (looked at every
        WAIT_INTERVAL_S: Dask's own wait needs a default client, which this one is not)."""
        futures = set(futures)
        while True:
            done = {future for future in futures if future.done()}
            if done:
                return done, futures - done
            time.sleep(WAIT_INTERVAL_S)

    def cancel(self, futures) -> None:
        if futures:
            self.client.cancel(list(futures))

    def close(self) -> None:
        self.client.close()


def connect(address: Optional[str]) -> Optional[Cluster]:
    return None if address is None else Cluster(address)
