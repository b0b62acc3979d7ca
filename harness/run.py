"""`wanbench run`: build the network, verify it, run every job's trainers in the nodes, tear down;
on backend sim, simulate each job over the network's plan instead (harness/sim_job.py).

Layout of a run directory (results/runs/<scenario>/<run-id>/):
    scenario.json          the resolved scenario (every job's full trainer config; with
                           time_dilation: auto, the K chosen and why: time_dilation_auto)
    environment.json       versions, kernel, backend, CPU/GPU, git commit, date
    <network-point>/plan.json, verify.json (not on sim)
    jobs/<job-id>/config.json (the trainers' input), config.resolved.json (rank 0: defaults filled
        in), rank<N>.jsonl, rank<N>.log, job.json (status, times); on sim, sim.json (the compute
        model, the NIC, the fault actions) and sim.log instead of rank<N>.log, times virtual
    summary.csv            one row per job (see harness/results.py)

Each job's files are written from its spec (harness/jobspec.py: made once per job, dilated once
on tun, read by run_job / run_sim_job); job.json when the job ends (harness/jobs.py).
    COMPLETE               written last; its absence marks an incomplete run
    INTERRUPTED            written instead when a signal or an error ended the run (with why)
    resumes.jsonl          one line per `wanbench run --resume` (when, jobs kept, folders cleared,
                           the environment it ran in: the jobs re-run may run on another commit)

The run folder appears with scenario.json and environment.json in it (made under a hidden name
and renamed), and a job's job.json is its last file (written atomically): a run killed at any
moment, SIGKILL included, leaves a folder that `resume_run` (`wanbench run --resume RUN_DIR`)
completes, re-running every job whose job.json is missing or not ok and keeping the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import shutil
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Optional

import pandas as pd

from emulator.backends import choose_backend
from emulator.files import write_json_atomic, write_text_atomic
from emulator.helpers import claim_network, release_network
from emulator.measure.verify import VerifyOptions, rate_warnings, verify
from emulator.plan import make_plan
from emulator.schema import ConfigError

from .auto_dilation import auto_time_dilation, measure_step_s
from .byo import failure_lines
from .environment import environment
from .faults import compile_actions
from .jobs import JobOutcome, evaluation_failed, last_records, run_job, run_sim_job, write_sim_job_record
from .jobspec import JobSpec, dilated, job_spec
from .paths import RUNS_ROOT
from .results import RunFrames, load_run, summarize, write_summary
from .rundir import SCENARIO_FILE, RunDir
from .scenario import (AUTO_TIME_DILATION, SIM_BACKEND, Job, NetworkPoint, Scenario, check_sim, check_stand_in,
                       load_scenario)
from .tuning import TUNING_FILE, Tuning
from .sim_job import SimRun, sim_run


@dataclasses.dataclass
class CompletedRun:
    """A finished run: its directory, its records (read once) and its summary (one row per job)."""

    run_dir: Path
    frames: RunFrames
    summary: pd.DataFrame


def scenario_record(scenario: Scenario, sim: Optional[SimRun] = None, reported: Optional[list[Job]] = None) -> dict:
    """What scenario.json holds: the resolved scenario, every job, how an auto K was chosen, and
    on sim the compute model (`sim`: each workload's seconds and where they came from).
    `reported`: under `tuning:`, the reported jobs made so far from the picks (after the tuning
    phase's jobs)."""
    jobs = [*scenario.jobs, *(reported or [])]
    record = {"name": scenario.name, "source_file": scenario.source_file,
              "spec": scenario.spec.model_dump(), "jobs": [job.record() for job in jobs]}
    if scenario.time_dilation_auto is not None:
        record["time_dilation_auto"] = scenario.time_dilation_auto
    if sim is not None:
        record["sim"] = sim.record()
    return record


def resolve_time_dilation(scenario: Scenario, console, measure=measure_step_s) -> Scenario:
    """`scenario` at a factor: `time_dilation: auto` measured and chosen here (before any network
    is built), said on the console; a given K unchanged."""
    if scenario.time_dilation != AUTO_TIME_DILATION:
        return scenario
    with console.status("time_dilation auto: timing the workload's forward + backward on this machine"):
        scenario = auto_time_dilation(scenario, measure)
    console.print(f"time dilation auto: K = {scenario.time_dilation:g} ({scenario.time_dilation_auto['why']})")
    return scenario


def prepare_sim(scenario: Scenario, console, measure=measure_step_s) -> tuple[Scenario, SimRun]:
    """`scenario` made ready for backend sim (ConfigError first for what sim cannot run), at time
    dilation 1 (the virtual clock has no CPU limit to hide: said when the scenario sets one), and
    its compute model, said on the console."""
    check_sim(scenario.spec, scenario.source_file)
    given = scenario.time_dilation
    if given != 1.0:
        console.print(f"time_dilation {given}: not applied on sim (the virtual clock has no CPU limit to "
                      "hide); a compute profile's min_compute_s still pads each step, in virtual seconds")
        scenario = scenario.with_time_dilation(1.0)
    with console.status("sim: the compute model (timing the workload's forward + backward where compute_s is auto)"):
        sim = sim_run(scenario, measure)
    sim.time_dilation_ignored = None if given == 1.0 else given
    for compute in sim.compute.values():
        console.print(f"sim compute: {compute['forward_backward_s'] * 1e3:.3g} ms per forward + backward "
                      f"+ {compute['step_overhead_s'] * 1e3:g} ms per step ({compute['source']})")
    for stand_in in sim.stand_in.values():
        console.print(f"sim stand-in: {stand_in['parameters']:.3g} parameters x {stand_in['bytes_per_parameter']:g} "
                      f"bytes; every message charged x {stand_in['wire_scale']:.4g} its real bytes "
                      f"(the real model: {stand_in['real_parameters']:,} parameters)")
    return scenario, sim


def run_scenario(scenario: Scenario, backend_name: str, runs_root: Path = RUNS_ROOT,
                 console=None, measure=measure_step_s, jobs: Optional[int] = 1,
                 cluster: Optional[str] = None) -> CompletedRun:
    """Run every job of `scenario`; its run directory is marked complete, or incomplete on error.
    `measure`: how `time_dilation: auto` (and sim's `compute_s: auto`) times a workload
    (harness/auto_dilation.py). `backend_name` "sim": no network is built, each job is simulated
    (harness/sim_job.py). `jobs`: sim jobs run this many at once (`--jobs N`; emulated ones one
    at a time). `cluster`: a Dask scheduler's address: each sim job is a task of that cluster
    (harness/cluster.py), `jobs` of them in flight (None: as many as its workers' threads)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    sim: Optional[SimRun] = None
    refuse_cluster(backend_name, cluster)
    if backend_name == SIM_BACKEND:
        backend_cls = None
        scenario, sim = prepare_sim(scenario, console, measure)
    else:
        backend_cls, reason = choose_backend(backend_name)
        check_stand_in(scenario.spec, scenario.source_file, backend_cls.name)  # refused off sim
        if reason:
            console.print(f"backend {reason}")
        scenario = resolve_time_dilation(scenario, console, measure)
    with _cluster(cluster, console) as client:  # connected first: no run folder if it does not answer
        run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        run_dir = runs_root / scenario.name / run_id
        if run_dir.exists():
            raise FileExistsError(f"{run_dir}: a run of this second exists already")
        # Made under a hidden name and renamed: a run folder always holds its scenario and environment
        # (a kill before the rename leaves only the hidden folder, with no job in it).
        partial = run_dir.with_name(f".{run_id}{PARTIAL_SUFFIX}")
        partial.mkdir(parents=True)
        write_json_atomic(partial / SCENARIO_FILE, scenario_record(scenario, sim))
        where = environment(SIM_BACKEND if sim else backend_cls.name)
        if client is not None:  # the jobs ran on the cluster's workers, not (only) this host
            where["cluster"] = client.record()
        write_json_atomic(partial / "environment.json", where)
        partial.rename(run_dir)
        return _run_in(run_dir, scenario, backend_cls, console, sim, jobs=jobs, cluster=client)


PARTIAL_SUFFIX = ".partial"
ORPHANED_AFTER_S = 60.0   # a live run renames its hidden folder within milliseconds of making it


def remove_orphaned_partials(runs_root: Path = RUNS_ROOT, older_than_s: float = ORPHANED_AFTER_S) -> list[Path]:
    """Remove the hidden `<scenario>/.<run-id>.partial` folders left by runs killed before their rename
    (they hold at most the scenario and environment files, never a job); returns what was removed.
    One younger than `older_than_s` may belong to a run starting now and is kept."""
    removed = []
    now = time.time()
    for folder in sorted(Path(runs_root).glob(f"*/.*{PARTIAL_SUFFIX}")):
        try:
            if folder.is_dir() and not folder.is_symlink() and now - folder.stat().st_mtime > older_than_s:
                shutil.rmtree(folder)
                removed.append(folder)
        except FileNotFoundError:  # renamed or removed meanwhile by its own run
            continue
    return removed


def refuse_cluster(backend_name: str, cluster: Optional[str]) -> None:
    """ConfigError naming --cluster for an emulated run: only sim jobs go through a cluster."""
    if cluster is not None and backend_name != SIM_BACKEND:
        raise ConfigError("", f"runs sim jobs only (backend {backend_name}: an emulated job needs a whole host, its "
                          "network and cores; run it without --cluster, or with --backend sim)", source="--cluster")


@contextlib.contextmanager
def _cluster(address: Optional[str], console):
    """The Dask cluster at `address` (harness/cluster.py), connected and said; None without one."""
    if address is None:
        yield None
        return
    from .cluster import Cluster

    client = Cluster(address)
    try:
        console.print(f"cluster: {client.describe()}; each sim job is one task")
        yield client
    finally:
        client.close()


def _run_in(run_dir: Path, scenario: Scenario, backend_cls, console, sim: Optional[SimRun],
            kept: frozenset = frozenset(), jobs: Optional[int] = 1, cluster=None) -> CompletedRun:
    """Run the jobs of `scenario` in `run_dir` but those in `kept` (ids of jobs already ok), then
    write the summary and COMPLETE (INTERRUPTED and a partial summary on error, re-raised)."""
    try:
        _run_points(scenario, backend_cls, run_dir, console, sim, kept, jobs, cluster)
    except BaseException as exc:
        # Keep what was recorded and say so: `report` flags runs without COMPLETE.
        (run_dir / "INTERRUPTED").write_text(f"{type(exc).__name__}: {exc}\n")
        try:
            write_summary(run_dir, summarize(load_run(run_dir)))
        except Exception:  # noqa: BLE001 - a partial summary is a courtesy, never a second failure
            pass
        raise
    frames = load_run(run_dir)
    frames.complete = True
    table = summarize(frames)
    write_summary(run_dir, table)
    (run_dir / "COMPLETE").write_text(datetime.datetime.now().isoformat())
    return CompletedRun(run_dir, frames, table)


def _normalized(value):
    """`value` as scenario.json holds it (JSON types: tuples as lists, str() of the rest)."""
    return json.loads(json.dumps(value, default=str))


def _first_difference(given, saved, path: str = "") -> Optional[tuple[str, object, object]]:
    """(dotted path, given value, saved value) of the first place two JSON values differ, or None."""
    if isinstance(given, dict) and isinstance(saved, dict):
        for key in [*given, *(k for k in saved if k not in given)]:
            found = _first_difference(given.get(key), saved.get(key), f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if isinstance(given, list) and isinstance(saved, list) and len(given) == len(saved):
        for index, (a, b) in enumerate(zip(given, saved)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found:
                return found
        return None
    return None if given == saved else (path or "(the whole document)", given, saved)


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _saved_sim(scenario: Scenario, saved: dict) -> SimRun:
    """The run's compute model and NIC as scenario.json saved them (not measured again: the jobs
    re-run must be charged what the kept ones were)."""
    from .auto_dilation import step_time_key

    keys = list(dict.fromkeys(step_time_key(job.trainer_config) for job in scenario.jobs))
    compute = saved.get("compute") or []
    if len(compute) != len(keys):
        raise ConfigError("sim.compute", f"holds {len(compute)} workloads, the scenario has {len(keys)}",
                          source=SCENARIO_FILE)
    stand_in = saved.get("stand_in") or []
    if len(stand_in) not in (0, len(keys)):
        raise ConfigError("sim.stand_in", f"holds {len(stand_in)} workloads, the scenario has {len(keys)}",
                          source=SCENARIO_FILE)
    return SimRun(dict(zip(keys, compute)), saved.get("nic_rate_bit_s"),
                  stand_in=dict(zip(keys, stand_in)),
                  time_dilation_ignored=saved.get("time_dilation_ignored"),
                  start_offsets=saved.get("start_offsets_s") or {},
                  topology_nic_rate_bit_s=saved.get("topology_nic_rate_bit_s"))


@dataclasses.dataclass
class ResumePlan:
    """What `--resume` found: the scenario as the run was made, its backend and compute model,
    the jobs kept (ok) and the job folders to clear (failed, interrupted, partial)."""

    run_dir: Path
    scenario: Scenario
    backend_name: str
    sim: Optional[SimRun]
    kept: frozenset
    cleared: list[Path]


def plan_resume(run_dir, scenario_file: Optional[str] = None, backend_name: Optional[str] = None) -> ResumePlan:
    """Check that `run_dir` is a run folder and that the scenario (`scenario_file`, default the
    file the run names) is the one it was made with; ConfigError (one line: the file, the field,
    both values) if not. Changes nothing."""
    run = RunDir(run_dir)
    saved = run.scenario  # ConfigError: not a run directory / not JSON
    where = str(run.path / SCENARIO_FILE)
    environment_backend = run.environment.get("backend")
    if not isinstance(saved.get("spec"), dict) or not isinstance(saved.get("jobs"), list) or not environment_backend:
        raise ConfigError("", "not a run folder wanbench made (scenario.json without spec or jobs, or no "
                          "environment.json)", source=str(run.path))
    if backend_name is not None and backend_name != environment_backend:
        raise ConfigError("", f"{backend_name}: the run was made on backend {environment_backend}; resume on "
                          "that one (leave --backend out)", source="--backend")
    source = scenario_file or saved.get("source_file")
    if not source or not Path(source).is_file():
        raise ConfigError("", f"the scenario file the run was made from ({source}) is not there: give it, "
                          "'wanbench run SCENARIO --resume RUN_DIR'", source=where)
    scenario = load_scenario(source)
    spec = saved["spec"]
    sim = None
    if environment_backend == SIM_BACKEND:
        check_sim(scenario.spec, scenario.source_file)
        scenario = scenario.with_time_dilation(1.0)
        sim = _saved_sim(scenario, saved.get("sim") or {})
    elif spec.get("time_dilation") is not None:  # K as the run resolved it (auto: measured then)
        scenario = scenario.with_time_dilation(spec["time_dilation"], saved.get("time_dilation_auto"))
    given = _normalized({"spec": scenario.spec.model_dump(),
                         "jobs": [{key: job.record()[key] for key in ("job_id", "network", "trainer_config")}
                                  for job in scenario.jobs]})
    made = {"spec": spec, "jobs": [{key: job.get(key) for key in ("job_id", "network", "trainer_config")}
                                   for job in saved["jobs"][:len(scenario.jobs)]]}
    difference = _first_difference(given, made)
    if difference is None:
        for point in scenario.network_points():
            plan_file = run.path / point.folder / "plan.json"
            if plan_file.is_file():
                plan = json.loads(make_plan(scenario.topology_for(point), time_dilation=scenario.time_dilation).to_json())
                found = _first_difference(plan, json.loads(plan_file.read_text()), f"{point.folder}/plan.json")
                if found:
                    difference = found
                    break
    if difference is not None:
        field, now, then = difference
        raise ConfigError(field, f"is {_short(now)} in {source}, {_short(then)} in the run ({where}): "
                          "resume runs the scenario the run was made with", source=source)
    kept, cleared = [], []
    for job in run.jobs:  # an ok job whose evaluator failed has no accuracy: it runs again
        (kept if job.info.get("status") == "ok" and not evaluation_failed(job.info) else cleared).append(job)
    return ResumePlan(run.path, scenario, environment_backend, sim,
                      frozenset(job.job_id for job in kept), [job.path for job in cleared])


def resume_run(run_dir, scenario_file: Optional[str] = None, backend_name: Optional[str] = None,
               console=None, jobs: Optional[int] = 1, cluster: Optional[str] = None) -> CompletedRun:
    """`wanbench run --resume RUN_DIR`: the jobs of an interrupted (or finished) run that are not
    ok run again, in the order an uninterrupted run takes (under `tuning:` the picks are made
    again from the kept and re-run candidates), the ok ones kept untouched; then the summary and
    COMPLETE as an uninterrupted run writes them. Checks first (`plan_resume`)."""
    from rich.console import Console

    console = console or Console(stderr=True)
    plan = plan_resume(run_dir, scenario_file, backend_name)
    refuse_cluster(plan.backend_name, cluster)
    run_dir = plan.run_dir
    backend_cls = None
    if plan.sim is None:
        backend_cls, reason = choose_backend(plan.backend_name)
        if reason:
            console.print(f"backend {reason}")
    for path in plan.cleared:
        shutil.rmtree(path)
    for marker in ("INTERRUPTED", "COMPLETE"):
        (run_dir / marker).unlink(missing_ok=True)
    with open(run_dir / "resumes.jsonl", "a") as log:  # the jobs run now may run on another commit or machine
        log.write(json.dumps({"time": datetime.datetime.now().isoformat(), "kept": len(plan.kept),
                              "cleared": [path.name for path in plan.cleared],
                              "environment": environment(plan.backend_name)}, default=str) + "\n")
    console.print(f"resume {run_dir}: {len(plan.kept)} job(s) kept (ok), {len(plan.cleared)} folder(s) "
                  "cleared (failed, interrupted or partial); every job not kept runs now")
    with _cluster(cluster, console) as client:
        completed = _run_in(run_dir, plan.scenario, backend_cls, console, plan.sim, plan.kept, jobs, client)
    superseded = _set_aside_superseded(run_dir)
    if superseded:  # the summary without them
        frames = load_run(run_dir)
        frames.complete = True
        completed = CompletedRun(run_dir, frames, summarize(frames))
        write_summary(run_dir, completed.summary)
    jobs_now = {path.name for path in (run_dir / "jobs").glob("*")}
    console.print(f"resume: {len(jobs_now - plan.kept)} job(s) re-run, {len(jobs_now & plan.kept)} kept"
                  + (f"; {len(superseded)} kept folder(s) no longer the run's (a pick changed) moved to "
                     f"{run_dir / SUPERSEDED_FOLDER}" if superseded else ""))
    return completed


SUPERSEDED_FOLDER = "superseded"


def _set_aside_superseded(run_dir: Path) -> list[str]:
    """Move job folders the resumed run did not make (a reported job of a pick that changed when
    a tuning candidate ran again: possible on an emulated network, never on sim) out of jobs/."""
    made = set(job["job_id"] for job in RunDir(run_dir).scenario.get("jobs") or [])
    stray = [path for path in sorted((run_dir / "jobs").glob("*")) if path.name not in made]
    for path in stray:
        (run_dir / SUPERSEDED_FOLDER).mkdir(exist_ok=True)
        path.rename(run_dir / SUPERSEDED_FOLDER / path.name)
    return [path.name for path in stray]


def _job_row(spec: JobSpec, stop, state: dict) -> list[str]:
    """One job's live line: label and seed, step, loss, accuracy, virtual time (sim), wall time, ETA."""
    job, simulated = spec.job, spec.sim is not None
    eta = ""
    if state["step"]:
        rate = state["step"] / max(state["elapsed"], 1e-9)
        left = (stop.steps - state["step"]) / rate
        if stop.time_budget_s and not simulated:  # a sim's budget is virtual, its ETA wall clock
            left = min(left, stop.time_budget_s - state["elapsed"])
        eta = f"ETA {max(0.0, left):.0f}s"
    loss = "-" if state["loss"] is None else f"{state['loss']:.3f}"
    acc = "-" if state["acc"] is None else f"{state['acc']:.3f}"
    virtual = [] if state["virtual"] is None else [f"virtual {state['virtual']:.1f}s"]
    return [f"[bold]{job.label}[/] seed {job.seed}", f"step {state['step']}/{stop.steps}",
            f"loss {loss}", f"acc {acc}", *virtual, f"{state['elapsed']:.0f}s", eta]


def _new_state() -> dict:
    return {"step": 0, "loss": None, "acc": None, "elapsed": 0.0, "virtual": None}


def _update_state(state: dict, spec: JobSpec, records: dict, elapsed: float) -> None:
    """A job's tick (rank 0's last records, wall seconds) into its live line's state."""
    state["elapsed"] = spec.emulated_s(elapsed)  # emulated seconds, like the ETA's budget
    if "step" in records:
        state["step"] = records["step"].get("step", 0)
        state["loss"] = records["step"].get("loss")
        if spec.sim is not None:
            state["virtual"] = records["step"].get("time_s")
    if "eval" in records:
        state["acc"] = records["eval"].get("accuracy")


@contextlib.contextmanager
def _progress(console, spec: JobSpec, stop):
    """A live line for one job (step, loss, accuracy, time, ETA); yields the tick run_job calls."""
    from rich.live import Live
    from rich.table import Table

    state = _new_state()

    def render():
        table = Table.grid(padding=(0, 2))
        table.add_row(*_job_row(spec, stop, state))
        return table

    with Live(render(), console=console, refresh_per_second=4, transient=True) as live:
        def tick(records, elapsed):
            _update_state(state, spec, records, elapsed)
            live.update(render())

        yield tick, state


class _Cancelled(BaseException):
    """Raised in a job's watch loop (its tick) when the run is ending: run_sim_job stops the job's
    processes and records it `interrupted`, as on Ctrl-C."""


class _Board:
    """The live lines of the sim jobs running at once, under a line for the whole phase: jobs
    done, running, waiting, and the time left (the mean wall time of the jobs done so far, times
    the jobs not done, over the jobs at once)."""

    def __init__(self, specs: list[JobSpec], at_once: int, stop):
        self.total, self.at_once, self.stop = len(specs), at_once, stop
        self.lock = threading.Lock()
        self.running: dict[str, tuple[JobSpec, dict]] = {}
        self.walls: list[float] = []
        self.started = time.monotonic()
        self.live = None

    def render(self):
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        done, running = len(self.walls), len(self.running)
        head = f"{done} of {self.total} jobs done, {running} running ({self.at_once} at once)"
        if self.walls:
            left = sum(self.walls) / len(self.walls) * (self.total - done) / self.at_once
            head += f", about {left:.0f}s left"
        table.add_row(head)
        for spec, state in list(self.running.values()):
            inner = Table.grid(padding=(0, 2))
            inner.add_row(*_job_row(spec, self.stop, state))
            table.add_row(inner)
        return table

    def _refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())

    def start(self, spec: JobSpec) -> dict:
        with self.lock:
            state = _new_state()
            self.running[spec.job.job_id] = (spec, state)
            self._refresh()
            return state

    def tick(self, spec: JobSpec, records: dict, elapsed: float) -> None:
        with self.lock:
            _update_state(self.running[spec.job.job_id][1], spec, records, elapsed)
            self._refresh()

    def end(self, spec: JobSpec, wall_s: float) -> None:
        with self.lock:
            self.running.pop(spec.job.job_id, None)
            self.walls.append(wall_s)
            self._refresh()


def _run_sim_jobs_at_once(specs: list[JobSpec], at_once: int, console, stop) -> None:
    """Run sim jobs `at_once` at a time (threads, each watching its job's own process), printing
    each job's line as it ends (in the order they end). On an error or Ctrl-C the jobs not started
    are dropped and the running ones stopped (recorded `interrupted`, as one at a time), then it
    re-raises."""
    from rich.live import Live

    if not specs:
        return
    board = _Board(specs, at_once, stop)
    cancel = threading.Event()

    def one(spec: JobSpec) -> tuple[JobOutcome, dict]:
        if cancel.is_set():
            raise _Cancelled()
        state = board.start(spec)

        def tick(records, elapsed):
            if cancel.is_set():
                raise _Cancelled()
            board.tick(spec, records, elapsed)

        started = time.monotonic()
        try:
            outcome = run_sim_job(spec, tick)
        finally:
            board.end(spec, time.monotonic() - started)
        return outcome, _with_final_accuracy(spec, state)

    pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="wanbench-job")
    with Live(board.render(), console=console, refresh_per_second=4, transient=True) as live:
        board.live = live
        futures = {pool.submit(one, spec): spec for spec in specs}
        try:
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in finished:
                    outcome, state = future.result()
                    _print_job_line(console, futures[future], outcome, state)
        except BaseException:
            cancel.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            board.live = None


def _run_sim_jobs_on_cluster(specs: list[JobSpec], cluster, at_once: int, console, stop) -> None:
    """Run sim jobs as tasks of `cluster` (harness/cluster.py), `at_once` in flight, each landed
    in its folder (outputs, then job.json) and its line printed as it ends. A task the cluster
    could not run is recorded failed (its reason says why). On an error or Ctrl-C the jobs not
    submitted are dropped, the tasks in flight cancelled and recorded `interrupted`, and it
    re-raises."""
    from rich.live import Live

    from .cluster import land, land_failure

    if not specs:
        return
    board = _Board(specs, at_once, stop)
    waiting = list(specs)
    running: dict = {}  # future -> (spec, its line's state, when submitted)
    with Live(board.render(), console=console, refresh_per_second=4, transient=True) as live:
        board.live = live
        try:
            while waiting or running:
                while waiting and len(running) < at_once:
                    spec = waiting.pop(0)
                    running[cluster.submit(spec)] = (spec, board.start(spec), time.monotonic())
                done, _ = cluster.wait_first(running)
                for future in done:
                    spec, state, submitted = running.pop(future)
                    try:
                        outcome = land(spec, future.result())
                    except Exception as exc:  # noqa: BLE001 - the task's error (KilledWorker, ...) is the job's reason
                        outcome = land_failure(spec, exc, time.monotonic() - submitted)
                    board.end(spec, time.monotonic() - submitted)
                    # no tick came from the worker: the line's step is rank 0's last record's
                    _update_state(state, spec, last_records(spec.job_dir / "rank0.jsonl", kinds=("step",)),
                                  outcome.wall_s)
                    _print_job_line(console, spec, outcome, _with_final_accuracy(spec, state))
        except BaseException:
            cluster.cancel(running)
            for spec, _, submitted in running.values():
                write_sim_job_record(spec, JobOutcome(spec.job.job_id, "interrupted", time.monotonic() - submitted,
                                                      "interrupted"))
            raise
        finally:
            board.live = None


def _run_points(scenario: Scenario, backend_cls, run_dir: Path, console, sim: Optional[SimRun] = None,
                kept: frozenset = frozenset(), jobs: Optional[int] = 1, cluster=None) -> None:
    """Build each network point in turn, verify it, run its jobs, tear it down; on sim (`sim`
    given), simulate each job over the point's plan instead. Under `tuning:` a point's jobs are
    its tuning phase; then each label's pick is made (tuning.json, harness/tuning.py) and the
    reported seeds run at the picks, on the same network. `kept`: ids of jobs already ok in
    `run_dir` (a resumed run), not run again; a point none of whose jobs runs builds no network.
    `jobs` > 1 or `cluster` on sim: `_run_sim_points_at_once` (`cluster`, harness/cluster.py: each
    job a task of that cluster, `jobs` in flight, None: as many as its threads); emulated jobs run
    one at a time whatever `jobs` is."""
    _say_run_settings(scenario, console, sim)
    if jobs is None:
        jobs = cluster.threads() if cluster is not None else 1
    if sim is not None and (jobs > 1 or cluster is not None):
        _run_sim_points_at_once(scenario, run_dir, console, sim, kept, jobs, cluster)
        return
    if jobs > 1:
        console.print(f"--jobs {jobs}: emulated jobs run one at a time (each needs every node of the network "
                      "and this host's cores to itself); only sim jobs run at once")
    ports = _MasterPorts(scenario.spec.master_port)
    tuning = Tuning(scenario, run_dir / TUNING_FILE) if scenario.spec.tuning is not None else None
    reported: list[Job] = []
    for point in scenario.network_points():
        with _network_point(scenario, point, backend_cls, run_dir, console) as network:
            plan = network.plan
            # the point's fault actions, compiled once, in emulated seconds
            faults = compile_actions(scenario.faults, plan.emulated_region_links()) if scenario.faults else ()

            def run(job: Job) -> None:
                port = ports.next()  # taken by a kept job too: the ports a run uses do not depend on a resume
                if job.job_id in kept:
                    return
                if sim is not None:
                    spec = job_spec(scenario, job, run_dir / job.folder, plan, SIM_BACKEND, faults,
                                    sim.job_settings(job, run_dir / point.folder / "plan.json", plan))
                else:
                    backend = network.ready()
                    spec = dilated(job_spec(scenario, job, run_dir / job.folder, plan, backend.name, faults),
                                   scenario.time_dilation)
                outcome, state = _run_one_job(spec, plan, network.backend, port, console, scenario.spec.stop)
                _print_job_line(console, spec, outcome, state)

            for job in [j for j in scenario.jobs if j.network == point]:
                run(job)
            if tuning is None:
                continue
            picked = _choose(tuning, run_dir, point, console, scenario)
            reported += picked
            write_json_atomic(run_dir / "scenario.json", scenario_record(scenario, sim, reported))
            for job in picked:
                run(job)


def _choose(tuning: Tuning, run_dir: Path, point: NetworkPoint, console, scenario: Scenario) -> list[Job]:
    """A point's picks from its tuning jobs (said on the console): the reported jobs to run."""
    picked, records = tuning.choose(load_run(run_dir), point)
    for record in records:
        console.print(f"  tuning: {record['label']} at {record['network']}: pick {record['pick']} "
                      f"(by {scenario.spec.tuning.by} on seed {scenario.spec.tuning.seed})")
    return picked


def _run_sim_points_at_once(scenario: Scenario, run_dir: Path, console, sim: SimRun, kept: frozenset,
                            jobs: int, cluster=None) -> None:
    """`--jobs N` on sim: the jobs of every network point in one pool, N at a time (each job is a
    process of its own over its point's plan: no network is built, so points need not take turns).
    Under `tuning:` two phases: every point's tuning jobs, then (the picks need them all) every
    point's reported jobs. Each job's results are those of a run one at a time. `cluster`: the
    jobs are its tasks instead of this host's processes."""
    points = []
    for point in scenario.network_points():
        with _network_point(scenario, point, None, run_dir, console) as network:  # writes plan.json
            faults = compile_actions(scenario.faults, network.plan.emulated_region_links()) if scenario.faults else ()
            points.append((point, network.plan, faults))

    def specs(phase: list[Job]) -> list[JobSpec]:
        made = []
        for point, plan, faults in points:
            for job in (j for j in phase if j.network == point and j.job_id not in kept):
                made.append(job_spec(scenario, job, run_dir / job.folder, plan, SIM_BACKEND, faults,
                                     sim.job_settings(job, run_dir / point.folder / "plan.json", plan)))
        return made

    def run(phase: list[JobSpec]) -> None:
        if cluster is not None:
            _run_sim_jobs_on_cluster(phase, cluster, jobs, console, scenario.spec.stop)
        else:
            _run_sim_jobs_at_once(phase, jobs, console, scenario.spec.stop)

    run(specs(scenario.jobs))
    if scenario.spec.tuning is None:
        return
    tuning = Tuning(scenario, run_dir / TUNING_FILE)
    reported = [job for point, _, _ in points for job in _choose(tuning, run_dir, point, console, scenario)]
    write_json_atomic(run_dir / "scenario.json", scenario_record(scenario, sim, reported))
    run(specs(reported))


def _say_run_settings(scenario: Scenario, console, sim: Optional[SimRun]) -> None:
    """What the console should know before the first job: the dilation, and on sim what is not done."""
    spec = scenario.spec
    k = scenario.time_dilation
    if k != 1.0:
        console.print(f"time dilation {k:g}: the network runs {k:g}x slower than the topology, "
                      f"reported times are divided by {k:g}")
    if sim is None:
        return
    skipped = ["verify (the network is a model: nothing to measure)"] if spec.verify.enabled else []
    skipped += ["cpu_share (compute is the model's)"] if spec.cpu_share is not None else []
    if spec.stop.target_accuracy is not None:
        skipped.append("stopping at target_accuracy (jobs run their steps or time budget: the evaluator "
                       "runs after the simulation; time_to_target is still read from its evaluations)")
    if skipped:
        console.print("sim: no " + "; no ".join(skipped))


class _MasterPorts:
    """A fresh rendezvous port for every job (no TIME_WAIT clash with the last one's), wrapping
    back to the scenario's master_port past 65000."""

    def __init__(self, first: int):
        self.first = first
        self.port = first

    def next(self) -> int:
        self.port = self.port + 1 if self.port < 65000 else self.first
        return self.port


class _PointNetwork:
    """One point's plan, and its network (None on sim), built and verified on first need."""

    def __init__(self, scenario: Scenario, plan, backend, point_dir: Path, console):
        self.scenario, self.plan, self.backend = scenario, plan, backend
        self.point_dir, self.console = point_dir, console
        self.up = False

    def ready(self):
        """The backend with the network up (built and verified the first time)."""
        if not self.up:
            self.backend.up()  # (a failed up() undoes itself, as before this was lazy)
            self.up = True  # down() is owed from here on
            if self.scenario.spec.verify.enabled:
                _verify_point(self.scenario, self.plan, self.point_dir, self.console)
        return self.backend


@contextlib.contextmanager
def _network_point(scenario: Scenario, point: NetworkPoint, backend_cls, run_dir: Path, console):
    """The network of one point: its plan written (<point>/plan.json), the network built and
    verified when a job first needs it (none on sim: `backend_cls` None), torn down after its
    jobs. Yields a _PointNetwork."""
    plan = make_plan(scenario.topology_for(point), time_dilation=scenario.time_dilation)
    point_dir = run_dir / point.folder
    point_dir.mkdir(exist_ok=True)  # a resumed run's is there (plan_resume: with this very plan)
    write_text_atomic(point_dir / "plan.json", plan.to_json())
    backend = backend_cls(plan) if backend_cls is not None else None
    console.print(f"[bold]{point.folder}[/]: {len(plan.nodes)} nodes on "
                  f"{backend.name if backend else 'sim (virtual clock, simulated network)'}")
    network = _PointNetwork(scenario, plan, backend, point_dir, console)
    if backend is not None:
        claim_network(plan.prefix)  # `clean` in another terminal leaves it alone while this run lives
    try:
        yield network
    finally:
        try:
            if network.up:
                backend.down()
        finally:
            if backend is not None:
                release_network(plan.prefix)


def _verify_point(scenario: Scenario, plan, point_dir: Path, console) -> None:
    """Measure the built network against its plan (verify.json) and say how far off it is."""
    settings = scenario.spec.verify
    # Steady-state goodput (slow start omitted, scaled with the RTT); no sparse probing here, it
    # would add ~5 s to every network point.
    options = VerifyOptions(probes=settings.probes, sparse_probes=0, throughput=settings.throughput,
                            duration_s=settings.duration_s)
    with console.status("verifying the network"):
        rows = verify(plan, options)
    write_json_atomic(point_dir / "verify.json", rows)
    worst = max(abs(r["rtt_p50_error_ms"]) for r in rows) if rows else 0.0
    console.print(f"  verify: {len(rows)} pairs, worst RTT p50 error {worst:.3f} ms")
    for line in rate_warnings(rows, options.min_rate_ratio):
        console.print(f"  [yellow]warning:[/] {line}")


def _run_one_job(spec: JobSpec, plan, backend, port: int, console, stop) -> tuple[JobOutcome, dict]:
    """Run one job (simulated on sim) with its live line; its outcome and the line's last state,
    with the evaluator's final accuracy (it may finish after the ranks)."""
    with _progress(console, spec, stop) as (tick, state):
        if spec.sim is not None:
            outcome = run_sim_job(spec, tick)
        else:
            outcome = run_job(plan, spec, port, tick, network=backend)
    return outcome, _with_final_accuracy(spec, state)


def _with_final_accuracy(spec: JobSpec, state: dict) -> dict:
    """The line's state with the evaluator's final accuracy (it may finish after the ranks)."""
    final = (last_records(spec.job_dir / "eval.jsonl", kinds=("eval",)).get("eval")
             # a user's script writes its evals in-band (trainers/byo.py)
             or last_records(spec.job_dir / "rank0.jsonl", kinds=("eval",)).get("eval") or {})
    state["acc"] = final.get("accuracy", state["acc"])
    return state


def _print_job_line(console, spec: JobSpec, outcome: JobOutcome, state: dict) -> None:
    mark = "[green]ok[/]" if outcome.status == "ok" else f"[red]{outcome.status}[/] {outcome.reason}"
    acc = "-" if state["acc"] is None else f"{state['acc']:.3f}"
    console.print(f"  {spec.job.label} seed {spec.job.seed}: {mark} in {outcome.wall_s:.1f}s, "
                  f"step {state['step']}, acc {acc}")
    for line in failure_lines(spec.job_dir, outcome.status, outcome.reason):  # rank, log, error
        console.print(f"    {line}", markup=False, highlight=False, soft_wrap=True)
