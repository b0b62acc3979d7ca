"""`wanbench run`: build the network, verify it, run every job's trainers in the nodes, tear down.

Layout of a run directory (results/runs/<scenario>/<run-id>/):
    scenario.json          the resolved scenario (every job's full trainer config)
    environment.json       versions, kernel, backend, CPU/GPU, git commit, date
    <network-point>/verify.json
    jobs/<job-id>/config.json, rank<N>.jsonl, rank<N>.log, job.json (status, times)
    summary.csv            one row per job (see emulator/results.py)
    COMPLETE               written last; its absence marks an incomplete run
    INTERRUPTED            written instead when a signal or an error ended the run (with why)
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from . import cgroups
from .faults import FaultTimeline
from .netns import exec_argv, interface_of
from .processes import stop as stop_processes
from .plan import Plan, make_plan
from .scenario import Job, Scenario

PROJECT_ROOT = Path(__file__).resolve().parent.parent
RUNS_ROOT = PROJECT_ROOT / "results" / "runs"
# How long the other ranks may outlive a failed one before we end them.
FAILED_RANK_GRACE_S = 10.0


def write_json_atomic(path: Path, data) -> None:
    """Write JSON via temp file + rename, so a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(path)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" when unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def environment(backend: str) -> dict:
    """What a benchmark number depends on: versions, machine, backend, commit, date."""
    import torch

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
    }


@dataclasses.dataclass
class JobOutcome:
    job_id: str
    status: str            # ok | failed | timeout | interrupted
    wall_s: float
    reason: str = ""


def _last_records(path: Path, kinds=("step", "eval")) -> dict:
    """The latest record of each kind in a JSONL file (read from its tail)."""
    found: dict = {}
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 16384))
            lines = handle.read().splitlines()
    except OSError:
        return found
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        kind = record.get("kind")
        if kind in kinds and kind not in found:
            found[kind] = record
        if len(found) == len(kinds):
            break
    return found


def _progress_marks(job_dir: Path, world: int) -> list[int]:
    """Size of each rank's record file: it grows with every step a rank takes."""
    marks = []
    for rank in range(world):
        try:
            marks.append((job_dir / f"rank{rank}.jsonl").stat().st_size)
        except OSError:
            marks.append(0)
    return marks


def _has_step(path: Path) -> bool:
    try:
        return b'"kind": "step"' in path.read_bytes()
    except OSError:
        return False


def launch_job(plan: Plan, job: Job, job_dir: Path, master_port: int, timeout_s: float,
               on_tick=None, stall_timeout_s: Optional[float] = None, backend=None,
               faults: Sequence = (), cpu_share: Optional[float] = None,
               trace_folder: Path = Path(".")) -> JobOutcome:
    """Run one job: one process per node, torchrun-style env, faults injected on a timeline.

    Watchdogs: the whole job is bounded by `timeout_s`; once training has started, a job in which
    no rank writes a record for `stall_timeout_s` is ended as "stalled" (a dead or stuck rank
    blocks the others' collectives, so nobody writes); a rank that exits non-zero ends the others
    after FAILED_RANK_GRACE_S. Records written so far are kept in every case.
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    world = len(plan.nodes)
    master = plan.nodes[0]
    if job.command is None:
        config = {**job.trainer_config, "output_dir": str(job_dir)}
        write_json_atomic(job_dir / "config.json", config)
        argv = [sys.executable, "-m", "trainers", str(job_dir / "config.json")]
    else:
        argv = list(job.command)
    needs_cgroups = cpu_share is not None or any(e.kind == "straggler" for e in faults)
    groups = {node.name: cgroups.create(plan.prefix, node.name) for node in plan.nodes} if needs_cgroups else {}
    for group in groups.values():
        cgroups.set_cpu_limit(group, cpu_share)
    procs: list[subprocess.Popen] = [None] * world  # type: ignore[list-item]
    logs = []
    crashed: dict[int, float] = {}      # rank -> when we killed it on purpose
    killed_pids: set[int] = set()       # processes we killed on purpose (their exit is not a failure
    restarts: dict[int, int] = {}       # of a crash-tolerant job)
    restart_pending: set[int] = set()
    # A crash-tolerant job (comm backend tcp) goes on without a crashed rank and takes it back.
    tolerant = (job.trainer_config.get("comm") or {}).get("backend") == "tcp" and job.command is None
    start = time.monotonic()
    outcome: Optional[JobOutcome] = None

    def spawn(node, restarts: int = 0) -> None:
        ifname = interface_of(node)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname,
               "TP_SOCKET_IFNAME": ifname, "RANK": str(node.rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": "0", "MASTER_ADDR": master.address, "MASTER_PORT": str(master_port),
               "WANBENCH_NODE": node.name, "WANBENCH_OUTPUT_DIR": str(job_dir),
               # torchrun's variable: a crash-tolerant trainer (or a user's script) rejoins instead
               # of starting afresh
               "TORCHELASTIC_RESTART_COUNT": str(restarts),
               # one intra-op thread per node unless the user says otherwise: N nodes share the
               # machine's cores, and torch's default (all cores each) oversubscribes them
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world))),
               "PYTHONPATH": str(PROJECT_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(job_dir / f"rank{node.rank}.log", "a")
        logs.append(log)
        hook = cgroups.join_hook(groups[node.name]) if groups else None
        # start_new_session: a Ctrl-C in the terminal reaches us, and we end the ranks in order.
        procs[node.rank] = subprocess.Popen(exec_argv(node, argv), env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=hook)

    def crash_node(name: str) -> str:
        node = plan.node(name)
        procs[node.rank].kill()
        killed_pids.add(procs[node.rank].pid)
        crashed[node.rank] = time.monotonic() - start
        return f"rank {node.rank} (pid {procs[node.rank].pid}) killed"

    def restart_node(name: str) -> str:
        node = plan.node(name)
        restart_pending.discard(node.rank)
        if procs[node.rank].poll() is None:
            return f"rank {node.rank} still running; not restarted"
        if job.command is None and not tolerant:
            # Policy: a rank of an algorithm built on collectives cannot rejoin; its job fails.
            return (f"not restarted: {job.trainer_config['algorithm']['name']} needs every rank in every "
                    "collective and cannot take a rank back (the job fails)")
        restarts[node.rank] = restarts.get(node.rank, 0) + 1
        spawn(node, restarts=restarts[node.rank])
        return f"rank {node.rank} restarted as pid {procs[node.rank].pid}"

    def set_cpu_factor(name: str, factor: float) -> str:
        cores = (cpu_share or 1.0) / factor if factor != 1.0 else cpu_share
        cgroups.set_cpu_limit(groups[name], cores)
        return "cpu unlimited" if cores is None else f"cpu limit {cores:.3g} cores"

    def set_link(src_region: str, dst_region: str, spec) -> None:
        if backend is None:
            raise RuntimeError("no backend to change links on")
        backend.set_link(src_region, dst_region, spec)

    timeline = None
    if faults:
        timeline = FaultTimeline(faults, dict(plan.region_links), set_link, crash_node, restart_node,
                                 set_cpu_factor, job_dir / "faults.jsonl", trace_folder)
        restart_pending = {plan.node(e.node).rank for e in faults
                           if e.kind == "node_crash" and e.restart_after is not None}

    def tolerated(rank: int, code) -> bool:
        """An exit that does not fail the job: clean, or our own kill in a crash-tolerant job."""
        return code == 0 or (tolerant and procs[rank].pid in killed_pids)

    def exit_reason(rank: int, code: int) -> str:
        text = f"rank {rank} exited {code}"
        if rank in crashed:
            text += f" (injected node_crash at {crashed[rank]:.1f} s)"
        return text

    try:
        for node in plan.nodes:
            spawn(node)
        failed_at: Optional[float] = None
        marks = _progress_marks(job_dir, world)
        last_progress = time.monotonic()
        armed = False  # the stall watchdog starts once every rank took a step (start-up is slow)
        while True:
            if timeline is not None:
                timeline.poll(time.monotonic() - start)
            codes = [p.poll() for p in procs]
            if all(code is not None for code in codes) and not restart_pending:
                bad = [(i, c) for i, c in enumerate(codes) if not tolerated(i, c)]
                status = "ok" if not bad else "failed"
                reason = "; ".join(exit_reason(i, c) for i, c in bad)
                if not bad and crashed:
                    reason = "crash tolerated: " + "; ".join(
                        f"rank {i} killed at {t:.1f} s (injected)" + (f", restarted {restarts[i]}x" if i in restarts else "")
                        for i, t in sorted(crashed.items()))
                outcome = JobOutcome(job.job_id, status, time.monotonic() - start, reason)
                break
            failing = [i for i, c in enumerate(codes)
                       if c is not None and not tolerated(i, c) and i not in restart_pending]
            if failed_at is None and failing:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > FAILED_RANK_GRACE_S:
                bad = [exit_reason(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
                # a crashed rank that was restarted meanwhile is running again: still name the crash
                bad += [f"rank {i} killed by the injected node_crash at {t:.1f} s" for i, t in sorted(crashed.items())
                        if codes[i] is None]
                stop_processes(procs)
                outcome = JobOutcome(job.job_id, "failed", time.monotonic() - start,
                                     "; ".join(bad) + "; the other ranks were ended")
                break
            now_marks = _progress_marks(job_dir, world)
            if now_marks != marks:
                marks, last_progress = now_marks, time.monotonic()
                if stall_timeout_s is not None and not armed:
                    armed = all(_has_step(job_dir / f"rank{rank}.jsonl") for rank in range(world))
            elif armed and time.monotonic() - last_progress > stall_timeout_s:
                stop_processes(procs)
                outcome = JobOutcome(job.job_id, "stalled", time.monotonic() - start,
                                     f"no rank wrote a record for {stall_timeout_s:.0f} s")
                break
            if time.monotonic() - start > timeout_s:
                stop_processes(procs)
                outcome = JobOutcome(job.job_id, "timeout", time.monotonic() - start,
                                     f"no end after {timeout_s:.0f} s")
                break
            if on_tick:
                on_tick(_last_records(job_dir / "rank0.jsonl"), time.monotonic() - start)
            time.sleep(0.25)
    except BaseException:
        stop_processes(procs)
        outcome = JobOutcome(job.job_id, "interrupted", time.monotonic() - start, "interrupted")
        raise
    finally:
        for log in logs:
            log.close()
        if backend is not None and timeline is not None:
            for (src, dst), spec in plan.region_links.items():
                if timeline.current.get((src, dst)) != spec:
                    backend.set_link(src, dst, spec)  # the next job starts on the topology's links
        for group in groups.values():
            cgroups.remove(group)
        if outcome is not None:
            write_json_atomic(job_dir / "job.json", {**dataclasses.asdict(outcome), "label": job.label,
                                                     "algorithm": job.algorithm, "seed": job.seed,
                                                     "network": dataclasses.asdict(job.network),
                                                     "network_key": job.network.key,
                                                     "params": job.params, "nodes": world})
    return outcome


def run_scenario(scenario: Scenario, backend_name: str, runs_root: Path = RUNS_ROOT,
                 console=None) -> Path:
    """Run every job of `scenario`; return the run directory (complete, or marked incomplete)."""
    from rich.console import Console

    from .cli import choose_backend
    from .results import summarize, write_summary

    console = console or Console(stderr=True)
    backend_cls = choose_backend(backend_name)
    run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = runs_root / scenario.name / run_id
    run_dir.mkdir(parents=True, exist_ok=False)
    write_json_atomic(run_dir / "scenario.json", {
        "name": scenario.name, "source_file": scenario.source_file,
        "spec": scenario.spec.model_dump(), "jobs": [dataclasses.asdict(j) for j in scenario.jobs]})
    write_json_atomic(run_dir / "environment.json", environment(backend_cls.name))
    stop = scenario.spec.stop
    timeout_s = scenario.spec.job_timeout_s or ((stop.time_budget_s or 600) * 2 + 180)

    try:
        _run_points(scenario, backend_cls, run_dir, console, timeout_s)
    except BaseException as exc:
        # Keep what was recorded and say so: `report` flags runs without COMPLETE.
        (run_dir / "INTERRUPTED").write_text(f"{type(exc).__name__}: {exc}\n")
        try:
            write_summary(run_dir, summarize(run_dir))
        except Exception:  # noqa: BLE001 - a partial summary is a courtesy, never a second failure
            pass
        raise
    table = summarize(run_dir)
    write_summary(run_dir, table)
    (run_dir / "COMPLETE").write_text(datetime.datetime.now().isoformat())
    return run_dir


def _run_points(scenario: Scenario, backend_cls, run_dir: Path, console, timeout_s: float) -> None:
    """Build each network point in turn, verify it, run its jobs, tear it down."""
    from rich.live import Live
    from rich.table import Table

    from .verify import VerifyOptions, verify

    spec = scenario.spec
    stop = spec.stop
    port = spec.master_port
    for point in scenario.network_points():
        plan = make_plan(scenario.topology_for(point))
        point_dir = run_dir / point.key
        point_dir.mkdir()
        (point_dir / "plan.json").write_text(plan.to_json())
        backend = backend_cls(plan)
        console.print(f"[bold]{point.key}[/]: {len(plan.nodes)} nodes on {backend.name}")
        backend.up()
        try:
            if spec.verify.enabled:
                options = VerifyOptions(probes=spec.verify.probes, throughput=spec.verify.throughput,
                                        duration_s=spec.verify.duration_s, omit_s=0.0)
                with console.status("verifying the network"):
                    rows = verify(plan, options)
                write_json_atomic(point_dir / "verify.json", rows)
                worst = max(abs(r["rtt_p50_error_ms"]) for r in rows) if rows else 0.0
                console.print(f"  verify: {len(rows)} pairs, worst RTT p50 error {worst:.3f} ms")
            for job in [j for j in scenario.jobs if j.network == point]:
                port = port + 1 if port < 65000 else spec.master_port  # a fresh port: no TIME_WAIT clash
                state = {"step": 0, "loss": None, "acc": None, "elapsed": 0.0}

                def render():
                    table = Table.grid(padding=(0, 2))
                    eta = ""
                    if state["step"]:
                        rate = state["step"] / max(state["elapsed"], 1e-9)
                        left = (stop.steps - state["step"]) / rate
                        if stop.time_budget_s:
                            left = min(left, stop.time_budget_s - state["elapsed"])
                        eta = f"ETA {max(0.0, left):.0f}s"
                    loss = "-" if state["loss"] is None else f"{state['loss']:.3f}"
                    acc = "-" if state["acc"] is None else f"{state['acc']:.3f}"
                    table.add_row(f"[bold]{job.label}[/] seed {job.seed}", f"step {state['step']}/{stop.steps}",
                                  f"loss {loss}", f"acc {acc}", f"{state['elapsed']:.0f}s", eta)
                    return table

                with Live(render(), console=console, refresh_per_second=4, transient=True) as live:
                    def tick(records, elapsed):
                        state["elapsed"] = elapsed
                        if "step" in records:
                            state["step"] = records["step"].get("step", 0)
                            state["loss"] = records["step"].get("loss")
                        if "eval" in records:
                            state["acc"] = records["eval"].get("accuracy")
                        live.update(render())

                    outcome = launch_job(plan, job, run_dir / "jobs" / job.job_id, port, timeout_s, tick,
                                         stall_timeout_s=spec.stall_timeout_s, backend=backend,
                                         faults=spec.faults, cpu_share=spec.cpu_share,
                                         trace_folder=Path(scenario.source_file).parent)
                mark = "[green]ok[/]" if outcome.status == "ok" else f"[red]{outcome.status}[/] {outcome.reason}"
                console.print(f"  {job.label} seed {job.seed}: {mark} in {outcome.wall_s:.1f}s, "
                              f"step {state['step']}, acc {state['acc']}")
        finally:
            backend.down()
