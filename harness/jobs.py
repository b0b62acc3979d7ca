"""One job's processes: one rank per node, started in the node, watched, crashed and restarted.

`JobProcesses` owns the ranks of a job (spawn, crash, restart, CPU throttling, exit codes, the
crash-tolerance policy); the fault executor drives it through `crash`, `restart` and
`set_cpu_factor`. `run_job` starts a job from its spec (harness/jobspec.py, already dilated: no
time here is scaled), applies its faults, watches it with three watchdogs and writes `job.json`;
`run_sim_job` does the same for a job on backend sim.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from emulator import cgroups, helpers
from emulator.files import write_json_atomic
from emulator.measure.counters import pair_deltas, traffic_by_node
from emulator.netns import exec_argv, interface_of
from emulator.plan import Plan, prefix
from emulator.processes import stop as stop_processes

from . import byo
from .budget import EqualBudget
from .faults import FaultSchedule, LinkControl, NetworkAndNodes
from .gpus import nccl_environment, place_job
from .jobspec import CONFIG_FILE, JobSpec
from trainers import jsonl
from trainers.records import RecordTail
from trainers.stop import stop_step_from_records, write_stop

from .paths import PROJECT_ROOT

# How long the other ranks may outlive a failed one before we end them.
FAILED_RANK_GRACE_S = 10.0
# How often the watch loop looks at the ranks, their records and the fault timeline.
WATCH_INTERVAL_S = 0.25
# The evaluator finishes the snapshots left when the ranks end within this long (else it is ended).
EVALUATOR_FINISH_TIMEOUT_S = 600.0
# Created when the ranks have ended: the following evaluator then evaluates what is left and exits.
RANKS_DONE_FILE = "RANKS_DONE"
# A sim job's process's output (its input, sim.json: harness/jobspec.py SIM_FILE).
SIM_LOG = "sim.log"
# How a job that went on through injected crashes says so (job.json's reason); a sim job's process
# prints it as its last line.
CRASH_TOLERATED = "crash tolerated: "


@dataclasses.dataclass
class JobOutcome:
    job_id: str
    status: str            # ok | failed | stalled | timeout | interrupted
    wall_s: float
    reason: str = ""


def crash_tolerated(crashed_at: dict[int, float], restarts: dict[int, int]) -> str:
    """The reason of a job that ended ok through injected crashes: each rank killed (s after the
    job's start) and how often it was restarted."""
    return CRASH_TOLERATED + "; ".join(
        f"rank {rank} killed at {t:.1f} s (injected)" + (f", restarted {restarts[rank]}x" if rank in restarts else "")
        for rank, t in sorted(crashed_at.items()))


def default_rank_threads(world: int) -> int:
    """Intra-op threads each rank gets unless OMP_NUM_THREADS says otherwise: the machine's cores
    shared out among the job's ranks, at least one."""
    return max(1, (os.cpu_count() or 1) // world)


class JobProcesses:
    """The ranks of one job: one process per node, in the node's namespace (and cgroup).

    Args:
        plan: the network the job runs on; rank r runs on plan.nodes[r].
        spec: what every rank runs (the trainers with `spec.trainer`, or the user's command), in
            `spec.job_dir` (config.json, rank<N>.log, the ranks' records), with `spec.cpu_share`
            cores per node (cgroup CPU quota; None: no limit).
        master_port: rank 0's rendezvous port (MASTER_PORT).
        throttled: create per-node cgroups even without a CPU limit (stragglers need them).
    """

    def __init__(self, plan: Plan, spec: JobSpec, master_port: int, throttled: bool = False):
        from trainers.loading import uses_elastic_comm  # here, not at the top: it imports torch

        self.plan = plan
        self.spec = spec
        self.job = spec.job
        self.job_dir = spec.job_dir
        self.master_port = master_port
        self.cpu_share = spec.cpu_share
        self.world = len(plan.nodes)
        self.procs: list[Optional[subprocess.Popen]] = [None] * self.world
        self.crashed_at: dict[int, float] = {}   # rank -> when we killed it on purpose (s after start)
        self.restarts: dict[int, int] = {}       # rank -> how often it was restarted
        self.restart_pending: set[int] = set()   # ranks a fault will restart later
        self._killed_pids: set[int] = set()      # processes we killed on purpose
        self._logs: list = []
        self._groups: dict[str, Path] = {}
        self._oom_kills_before: dict[str, int] = {}
        self._throttled = throttled or self.cpu_share is not None
        self.started_at: Optional[float] = None
        trainer = spec.trainer
        # A crash-tolerant job (comm backend tcp) goes on without a crashed rank and takes it back.
        self.tolerant = trainer is not None and uses_elastic_comm(trainer)
        # Each rank's GPU and comm backend (harness/gpus.py), decided before any rank starts: device
        # cuda without a GPU fails here, in one line (SystemCheckError), not in every rank.
        self.gpus = place_job(None if trainer is None else {"device": trainer.device,
                                                            "comm": {"backend": trainer.comm.backend}}, self.world)

    # Life cycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Write the job's files (config.json), make the nodes' cgroups and start every rank."""
        self.spec.write()
        # The kernel's OOM kills so far in each node's memory group (it lives as long as the network)
        self._oom_kills_before = {node.name: cgroups.oom_kills(self.plan.prefix, node.name)
                                  for node in self.plan.nodes}
        if self._throttled:
            for node in self.plan.nodes:
                self._groups[node.name] = cgroups.create(self.plan.prefix, node.name)
                cgroups.set_cpu_limit(self._groups[node.name], self.cpu_share)
        self.started_at = time.monotonic()
        for node in self.plan.nodes:
            self._spawn(node)

    def elapsed_s(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def stop(self) -> None:
        """End every rank still running (SIGTERM, then SIGKILL)."""
        stop_processes(self.procs)

    def close(self) -> None:
        """Close the logs and lift the CPU limits (the ranks must be gone).

        The groups belong to the nodes (on v2 the node's holder lives in the same group); the
        network's down removes them.
        """
        for log in self._logs:
            log.close()
        self._logs.clear()
        for group in self._groups.values():
            cgroups.set_cpu_limit(group, None)
        self._groups.clear()

    # What the fault timeline drives ---------------------------------------------------------
    def crash(self, node_name: str) -> str:
        """SIGKILL the node's rank (an injected node_crash)."""
        rank = self.plan.node(node_name).rank
        proc = self.procs[rank]
        proc.kill()
        self._killed_pids.add(proc.pid)
        self.crashed_at[rank] = self.elapsed_s()
        return f"rank {rank} (pid {proc.pid}) killed"

    def restart(self, node_name: str) -> str:
        """Start the node's rank again, as torchrun would (TORCHELASTIC_RESTART_COUNT), if the job
        can take it back."""
        node = self.plan.node(node_name)
        self.restart_pending.discard(node.rank)
        if self.procs[node.rank].poll() is None:
            return f"rank {node.rank} still running; not restarted"
        if self.spec.trainer is not None and not self.tolerant:
            # Policy: a rank of an algorithm built on collectives cannot rejoin; its job fails.
            from trainers.loading import cannot_take_back

            return f"not restarted: {cannot_take_back(self.spec.trainer.algorithm.name)}"
        self.restarts[node.rank] = self.restarts.get(node.rank, 0) + 1
        self._spawn(node, restarts=self.restarts[node.rank])
        return f"rank {node.rank} restarted as pid {self.procs[node.rank].pid}"

    def set_cpu_factor(self, node_name: str, factor: float) -> str:
        """Divide the node's CPU limit by `factor` (a straggler); 1 restores it."""
        cores = (self.cpu_share or 1.0) / factor if factor != 1.0 else self.cpu_share
        cgroups.set_cpu_limit(self._groups[node_name], cores)
        return "cpu unlimited" if cores is None else f"cpu limit {cores:.3g} cores"

    # Exit codes and the crash-tolerance policy ----------------------------------------------
    def exit_codes(self) -> list[Optional[int]]:
        return [proc.poll() for proc in self.procs]

    def tolerated(self, rank: int, code: Optional[int]) -> bool:
        """An exit that does not fail the job: clean, or our own kill in a crash-tolerant job."""
        return code == 0 or (self.tolerant and self.procs[rank].pid in self._killed_pids)

    def exit_reason(self, rank: int, code: int) -> str:
        text = f"rank {rank} exited {code}"
        if rank in self.crashed_at:
            text += f" (injected node_crash at {self.crashed_at[rank]:.1f} s)"
        node = self.plan.nodes[rank]
        if cgroups.oom_kills(self.plan.prefix, node.name) > self._oom_kills_before.get(node.name, 0):
            limit = (f"over its memory limit of {self.plan.memory_bytes / 1e6:g} MB" if self.plan.memory_bytes
                     else "the machine ran out of memory")
            text += f" (killed by the kernel's OOM killer: node {node.name} {limit})"
        return text

    def failing_ranks(self) -> list[int]:
        """Ranks that exited in a way that fails the job and that no fault will restart."""
        return [rank for rank, code in enumerate(self.exit_codes())
                if code is not None and not self.tolerated(rank, code) and rank not in self.restart_pending]

    def finished_outcome(self) -> Optional[JobOutcome]:
        """The outcome once every rank has exited (and no restart is due), else None."""
        codes = self.exit_codes()
        if any(code is None for code in codes) or self.restart_pending:
            return None
        bad = [(rank, code) for rank, code in enumerate(codes) if not self.tolerated(rank, code)]
        reason = "; ".join(self.exit_reason(rank, code) for rank, code in bad)
        if not bad and self.crashed_at:
            reason = crash_tolerated(self.crashed_at, self.restarts)
        return JobOutcome(self.job.job_id, "failed" if bad else "ok", self.elapsed_s(), reason)

    def failure_reasons(self) -> list[str]:
        """Why the job failed: every bad exit, and crashes whose rank was restarted meanwhile."""
        codes = self.exit_codes()
        reasons = [self.exit_reason(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        reasons += [f"rank {rank} killed by the injected node_crash at {t:.1f} s"
                    for rank, t in sorted(self.crashed_at.items()) if codes[rank] is None]
        return reasons

    # Internals ------------------------------------------------------------------------------
    def _environment(self, node, restarts: int) -> dict:
        master = self.plan.nodes[0]
        ifname = interface_of(node)
        return {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname,
                # NCCL over the node's interface only, as if every node were a host of its own
                **nccl_environment(ifname, host_id=f"{self.plan.prefix}.{node.name}"),
                # the rank's GPU (CUDA_VISIBLE_DEVICES: it is cuda:0 in the rank), the comm backend
                # when ranks share GPUs, and why: the rank writes them in its start record
                **self.gpus[node.rank].environment(),
                # one rank per node, each node a host of its own (torchrun's view of it): local rank 0
                "RANK": str(node.rank), "WORLD_SIZE": str(self.world),
                "LOCAL_RANK": "0", "MASTER_ADDR": master.address, "MASTER_PORT": str(self.master_port),
                "WANBENCH_NODE": node.name, "WANBENCH_OUTPUT_DIR": str(self.job_dir),
                # torchrun's variable: a crash-tolerant trainer (or a user's script) rejoins
                # instead of starting afresh
                "TORCHELASTIC_RESTART_COUNT": str(restarts),
                # one intra-op thread per node unless the user says otherwise: N nodes share the
                # machine's cores, and torch's default (all cores each) oversubscribes them
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(default_rank_threads(self.world))),
                "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                # `python`, `torchrun` of a command: the venv's, as for a user who activated it
                "PATH": byo.command_environment(os.environ)["PATH"]}

    def _argv(self) -> list[str]:
        if self.spec.command is not None:
            return list(self.spec.command)
        return [sys.executable, "-m", "trainers", str(self.job_dir / CONFIG_FILE)]

    def _spawn(self, node, restarts: int = 0) -> None:
        log = open(self.job_dir / f"rank{node.rank}.log", "a")
        self._logs.append(log)
        hook = cgroups.join_hook(self._groups[node.name]) if self._groups else None
        # start_new_session: a Ctrl-C in the terminal reaches us, and we end the ranks in order.
        # share: the job folder, the scenario's folder and mounts are visible in the node even under
        # the host's /tmp (the node's is its own); cwd: a command's `cwd:` (node_enter keeps it)
        self.procs[node.rank] = subprocess.Popen(exec_argv(node, self._argv(), share=[self.job_dir, *byo.shares_for(self.job)]),
                                                 env=self._environment(node, restarts),
                                                 cwd=getattr(self.job, "cwd", None) if self.job.command is not None else None,
                                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                                 preexec_fn=hook)


class Evaluator:
    """The job's evaluator (`python -m trainers.evaluate`): outside the emulated network (a host
    process, no namespace), at low priority (it nices itself to 19, one thread). It reads the
    snapshots the ranks write and appends the output model's accuracy to eval.jsonl; no evaluation
    byte crosses the WAN and no evaluation second is on the ranks' training clock.

    `follow`: evaluate while the job runs (the stop rule needs accuracy as it comes); otherwise all
    at once after the job.
    """

    def __init__(self, job_dir: Path, follow: bool):
        self.job_dir = job_dir
        self.follow = follow
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self._pid_file: Optional[Path] = None

    def _argv(self) -> list[str]:
        # --parent-pid: it ends by itself once the harness is gone (and with it the job's ranks:
        # their records would never end), however it was started
        argv = [sys.executable, "-m", "trainers.evaluate", str(self.job_dir), "--parent-pid", str(os.getpid())]
        if self.follow:
            argv += ["--follow", "--until-file", str(self.job_dir / RANKS_DONE_FILE)]
        return argv

    def start(self) -> None:
        self._log = open(self.job_dir / "evaluator.log", "a")
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc, self._pid_file = start_helper(self._argv(), env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def finish(self, timeout_s: float = EVALUATOR_FINISH_TIMEOUT_S) -> Optional[int]:
        """Once the ranks have ended: let the evaluator evaluate what is left (starting it now if it
        does not follow); returns its exit code (None if it had to be ended)."""
        (self.job_dir / RANKS_DONE_FILE).touch()
        if self.proc is None:
            self.start()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_processes([self.proc])
            return None
        finally:
            self.close()

    def stop(self) -> None:
        stop_processes([self.proc])
        self.close()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        helpers.unregister(self._pid_file)
        self._pid_file = None


def start_helper(argv: list[str], **popen) -> tuple[subprocess.Popen, Optional[Path]]:
    """Start a host helper of the run (the evaluator, a sim job's process) in a session of its own
    (a Ctrl-C reaches the harness, which ends it in order), dying with the harness (SIGTERM when
    it ends, SIGKILL included) and recorded for `wanbench clean` (emulator/helpers.py); the
    process and its PID file (None where the state folder is not writable)."""
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=helpers.die_with_parent(os.getpid()), **popen)
    return proc, helpers.register(prefix(), proc.pid, argv)


class StopDecider:
    """The harness's decision to end a job early: once the evaluator's records show
    `target_accuracy` (or a loss at or below `target_loss`) reached, and the budgets the scenario
    states passed (so that accuracy at equal budgets is known), write the STOP file the ranks poll
    (trainers.stop) with a stop step no rank has passed yet. A file in the job folder, not the
    emulated network, carries it."""

    def __init__(self, job_dir: Path, target_accuracy: Optional[float], budget: Optional[EqualBudget] = None,
                 target_loss: Optional[float] = None):
        self.job_dir = job_dir
        self.target_accuracy = target_accuracy
        self.target_loss = target_loss
        self.budget = budget if budget is not None else EqualBudget()  # harness/budget.py: what to pass first
        self.decision: Optional[dict] = None
        self._evals: Optional[RecordTail] = None  # follows eval.jsonl
        self._reached = False

    @property
    def active(self) -> bool:
        return self.target_accuracy is not None or self.target_loss is not None

    def _new_evals(self) -> list[dict]:
        """The evaluator's records since the last look (a line still being written waits)."""
        if self._evals is None:
            from trainers.evaluate import EVAL_FILE  # (imports torch: not at the harness's start-up)

            self._evals = RecordTail(self.job_dir / EVAL_FILE)
        return self._evals.read_new()

    def poll(self, elapsed_s: float) -> Optional[dict]:
        """The decision once taken (and the STOP file written), else None."""
        if not self.active or self.decision is not None:
            return self.decision
        from trainers.evaluate import target_reached

        for record in self._new_evals():
            if record.get("accuracy") is None:
                continue
            self._reached = self._reached or target_reached(record, self.target_accuracy, self.target_loss)
            steps_done = record.get("step", -1) + 1
            if self._reached and self.budget.waits_for(steps_done, record.get("train_time_s", 0.0)):
                reason = "target_accuracy" if self.target_accuracy is not None else "target_loss"
                request = write_stop(self.job_dir, stop_step_from_records(self.job_dir), reason)
                self.decision = {"reason": request.reason, "stop_step": request.stop_step,
                                 "decided_at_s": round(elapsed_s, 3), "eval_step": record.get("step"),
                                 "eval_accuracy": record["accuracy"]}
                if self.target_loss is not None:
                    self.decision["eval_loss"] = record.get("loss")
                break
        return self.decision


def last_records(path: Path, kinds=("step", "eval")) -> dict:
    """The latest record of each kind in a JSONL file (read from its end: trainers.jsonl)."""
    return jsonl.last_records(path, kinds)


def _progress_marks(job_dir: Path, world: int) -> list[int]:
    """Size of each rank's record file: it grows with every step a rank takes."""
    return [jsonl.written_bytes(job_dir / f"rank{rank}.jsonl") for rank in range(world)]


def _has_step(path: Path) -> bool:
    return jsonl.first_record(path, "step") is not None


def run_job(plan: Plan, spec: JobSpec, master_port: int, on_tick=None,
            network: Optional[LinkControl] = None) -> JobOutcome:
    """Run one job on a built network: one process per node, torchrun-style env, the spec's fault
    actions applied on their timeline, the evaluator outside the network, the stop rule applied.
    `spec`'s times are the wall clock's (harness/jobspec.py `dilated`).

    Watchdogs: the whole job is bounded by `spec.timeout_s`; once training has started, a job in
    which no rank writes a record for `spec.stall_timeout_s` is ended as "stalled" (a dead or
    stuck rank blocks the others' collectives, so nobody writes); a rank that exits non-zero ends
    the others after FAILED_RANK_GRACE_S. Records written so far are kept in every case.
    `network` (the backend) takes the link faults, gets the plan's links back at the end, and
    counts the job's wire bytes. `spec.stop`: target accuracy and the budgets to pass before
    stopping at it. `on_tick(records, elapsed_s)`: rank 0's last step and the last evaluation,
    wall-clock seconds since the start.
    """
    if spec.link_faults and network is None:
        raise ValueError("link faults need the network (backend) to change links on")
    ranks = JobProcesses(plan, spec, master_port, throttled=spec.stragglers)
    executor = NetworkAndNodes(network, ranks)
    schedule = FaultSchedule(spec.faults, executor, spec.job_dir / "faults.jsonl") if spec.faults else None
    ranks.restart_pending = {plan.node(node).rank for node in spec.restarted_nodes}
    decider = StopDecider(spec.job_dir, spec.stop.target_accuracy, spec.stop.budget, spec.stop.target_loss)
    evaluator = Evaluator(spec.job_dir, follow=decider.active) if spec.command is None else None
    outcome: Optional[JobOutcome] = None
    counters_before = _counters(network)
    stack = byo.node_stack(plan)  # congestion control and TCP sysctls in force in the nodes, for job.json
    try:
        ranks.start()
        if evaluator is not None and evaluator.follow:
            evaluator.start()
        outcome = _watch(ranks, schedule, spec.timeout_s, spec.stall_timeout_s, on_tick, decider)
        _write_wire_traffic(spec.job_dir, plan, counters_before, _counters(network))
        if evaluator is not None:
            evaluator.finish()
    except BaseException:
        ranks.stop()
        if evaluator is not None:
            evaluator.stop()
        outcome = JobOutcome(spec.job.job_id, "interrupted", ranks.elapsed_s(), "interrupted")
        raise
    finally:
        ranks.close()
        if network is not None:
            executor.restore(plan.region_links)  # the next job starts on the plan's links
        if outcome is not None:
            write_job_record(spec, outcome, stop_decision=decider.decision,
                             gpus=[placement.record() for placement in ranks.gpus], node_stack=stack)
    return outcome


def write_job_record(spec: JobSpec, outcome: JobOutcome, **extra) -> None:
    """job.json: the outcome and what the results tables need of the job (harness/results.py)."""
    job = spec.job
    write_json_atomic(spec.job_dir / "job.json", {**dataclasses.asdict(outcome), "label": job.label,
                                                  "algorithm": job.algorithm, "seed": job.seed,
                                                  "network": dataclasses.asdict(job.network),
                                                  "network_key": job.network.key,
                                                  "params": job.params, "nodes": spec.nodes,
                                                  "base_label": job.base_label or job.label,
                                                  "tuned": job.tuned, "backend": spec.backend,
                                                  **({"phase": job.phase, "tuning_group": job.tuning_group}
                                                     if job.phase else {}), **extra})


def sim_job_argv(job_dir: Path) -> list[str]:
    """The process that runs a sim job (harness/sim_job.py)."""
    return [sys.executable, "-m", "harness.sim_job", str(job_dir)]


# How a job's reason starts when its evaluator failed after the job's own ranks ended ok: the job
# is `ok` (its records stand) but has no accuracy; `wanbench run --resume` runs it again.
EVALUATOR_FAILED = "the evaluator "


def evaluation_failed(info: dict) -> bool:
    """Whether job.json `info` is of a job whose evaluator failed (see EVALUATOR_FAILED)."""
    return any(part.startswith(EVALUATOR_FAILED) for part in str(info.get("reason") or "").split("; "))


def run_sim_job(spec: JobSpec, on_tick=None) -> JobOutcome:
    """Run one job on backend sim: every rank in one process on a virtual clock
    (`python -m harness.sim_job`, reading config.json and sim.json written here), then the
    evaluator over its snapshots (`simulate_job_dir`), then job.json.

    Watchdog: the whole job is bounded by `spec.timeout_s` wall-clock seconds. `on_tick(records,
    elapsed_s)` as for run_job (rank 0's last step, wall seconds).
    """
    spec.write()
    outcome: Optional[JobOutcome] = None
    started = time.monotonic()
    try:
        outcome = simulate_job_dir(spec.job_dir, spec.job.job_id, spec.timeout_s, on_tick)
    except BaseException:
        outcome = JobOutcome(spec.job.job_id, "interrupted", time.monotonic() - started, "interrupted")
        raise
    finally:
        if outcome is not None:  # job.json last (atomic): an `ok` job's folder is complete
            write_sim_job_record(spec, outcome)
    return outcome


def write_sim_job_record(spec: JobSpec, outcome: JobOutcome, **extra) -> None:
    """A sim job's job.json (write_job_record with what a sim job adds)."""
    if spec.sim.stand_in is not None:
        extra["stand_in"] = spec.sim.stand_in
    write_job_record(spec, outcome, stop_decision=None, gpus=[], compute=spec.sim.compute, **extra)


def simulate_job_dir(job_dir: Path, job_id: str, timeout_s: float, on_tick=None) -> JobOutcome:
    """The processes of one sim job in `job_dir`, whose inputs (config.json, sim.json) are written:
    the simulation (`sim_job_argv`, output in sim.log), then the evaluator over its snapshots
    (after the simulation, never following it: a follower's stop would land at a step that
    depends on wall-clock timing, and the run would not repeat). Its outcome; job.json is the
    caller's. On an error or Ctrl-C both processes are ended and it re-raises.

    Used by run_sim_job here and by a cluster's worker (harness/cluster.py) in a folder of its own.
    """
    evaluator = Evaluator(job_dir, follow=False)
    outcome: Optional[JobOutcome] = None
    proc: Optional[subprocess.Popen] = None
    pid_file: Optional[Path] = None
    started = time.monotonic()
    log = open(job_dir / SIM_LOG, "a")
    try:
        env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc, pid_file = start_helper(sim_job_argv(job_dir), env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            elapsed = time.monotonic() - started
            if elapsed > timeout_s:
                stop_processes([proc])
                outcome = JobOutcome(job_id, "timeout", elapsed, f"no end after {timeout_s:.0f} s (wall clock)")
                break
            if on_tick:
                on_tick(last_records(job_dir / "rank0.jsonl", kinds=("step",)), elapsed)
            time.sleep(WATCH_INTERVAL_S)
        elapsed = time.monotonic() - started
        if outcome is None:
            code, last = proc.returncode, _last_line(job_dir / SIM_LOG)
            if code == 0:  # through injected crashes its last line says so, as tun's reason does
                reason = last if last.startswith(CRASH_TOLERATED) else ""
            else:  # the error, which names an injected crash (trainers.sim.run_simulated)
                reason = f"the simulation exited {code}: {last}"
            outcome = JobOutcome(job_id, "ok" if code == 0 else "failed", elapsed, reason)
        code = evaluator.finish()
        if code != 0:  # the job's records stand; its accuracy is missing, and the reason says why
            why = "ended at its time limit" if code is None else f"exited {code}: {_last_line(job_dir / 'evaluator.log')}"
            outcome.reason = "; ".join(filter(None, [outcome.reason, f"{EVALUATOR_FAILED}{why}"]))
    except BaseException:
        stop_processes([proc])
        evaluator.stop()
        raise
    finally:
        log.close()
        helpers.unregister(pid_file)
    return outcome


def _last_line(path: Path) -> str:
    """The last non-empty line of a log (a traceback's error), or ""."""
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _counters(network) -> Optional[list[dict]]:
    """A fresh reading of the backend's per-pair counters, or None where it keeps none."""
    if network is None or not hasattr(network, "counters"):
        return None
    try:
        return network.counters(fresh=True) or None
    except (OSError, RuntimeError):
        return None


def _write_wire_traffic(job_dir: Path, plan: Plan, before: Optional[list[dict]], after: Optional[list[dict]]) -> None:
    """wire.json: what each node (with its rank) sent over the emulated WAN during the job, from
    the backend's counters."""
    if before is None or after is None:
        return
    nodes = traffic_by_node(before, after)
    for name, traffic in nodes.items():
        traffic["rank"] = plan.node(name).rank
    write_json_atomic(job_dir / "wire.json", {"source": "backend counters", "nodes": nodes,
                                              "pairs": pair_deltas(before, after)})


def _watch(ranks: JobProcesses, schedule: Optional[FaultSchedule], timeout_s: float,
           stall_timeout_s: Optional[float], on_tick, decider: Optional[StopDecider] = None) -> JobOutcome:
    """Apply due faults and watch the ranks until they end or a watchdog ends them."""
    job_dir, world, job_id = ranks.job_dir, ranks.world, ranks.job.job_id
    failed_at: Optional[float] = None
    marks = _progress_marks(job_dir, world)
    last_progress = time.monotonic()
    armed = False  # the stall watchdog starts once every rank took a step (start-up is slow)
    while True:
        if schedule is not None:
            schedule.poll(ranks.elapsed_s())
        if decider is not None:
            decider.poll(ranks.elapsed_s())
        finished = ranks.finished_outcome()
        if finished is not None:
            return finished
        if failed_at is None and ranks.failing_ranks():
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
            reasons = ranks.failure_reasons()
            ranks.stop()
            return JobOutcome(job_id, "failed", ranks.elapsed_s(), "; ".join(reasons) + "; the other ranks were ended")
        now_marks = _progress_marks(job_dir, world)
        if now_marks != marks:
            marks, last_progress = now_marks, time.monotonic()
            if stall_timeout_s is not None and not armed:
                armed = all(_has_step(job_dir / f"rank{rank}.jsonl") for rank in range(world))
        elif armed and time.monotonic() - last_progress > stall_timeout_s:
            ranks.stop()
            return JobOutcome(job_id, "stalled", ranks.elapsed_s(), f"no rank wrote a record for {stall_timeout_s:.0f} s")
        if ranks.elapsed_s() > timeout_s:
            ranks.stop()
            return JobOutcome(job_id, "timeout", ranks.elapsed_s(), f"no end after {timeout_s:.0f} s")
        if on_tick:
            records = last_records(job_dir / "rank0.jsonl", kinds=("step",))
            records.update(last_records(job_dir / "eval.jsonl", kinds=("eval",)))
            on_tick(records, ranks.elapsed_s())
        time.sleep(WATCH_INTERVAL_S)
