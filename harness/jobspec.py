"""One job's specification: made once from the scenario, dilated once, written once.

`job_spec` makes a `JobSpec` for one job of a run: the trainers' `Config` (built and checked when
the scenario was loaded, its output_dir now the job's folder), the network point, the compute
settings (a compute profile's min_compute_s is in the trainer config; on sim the compute model),
the fault actions compiled for the job's network point (harness/faults.py), the watchdogs, the
stop rule's budgets and the backend. Its times are emulated seconds.

`dilated(spec, k)` is the one place time dilation touches a job (docs/TIME_DILATION.md): every
duration x K (the trainers' time budget, snapshot interval, comm timeout and min_compute_s, the
fault times, the watchdogs, the time budget the stop rule waits for) and every link a fault sets
slowed by K (emulator/dilation.py). What comes out is in wall-clock seconds; the tun launch
(harness/jobs.py run_job) uses it as it is. Backend sim runs at K = 1.

`JobSpec.write()` writes what the job's processes read: config.json (the trainers' input, `python
-m trainers CONFIG`: the scenario's trainer settings and output_dir) and on sim sim.json (the
plan, the seed, the NIC, the compute model, the fault actions; harness/sim_job.py reads it).
The harness writes job.json when the job ends (harness/jobs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from emulator.dilation import dilate
from emulator.files import write_json_atomic
from emulator.plan import Plan

from .budget import EqualBudget
from .dilation import dilated_trainer, dilated_trainer_config
from .faults import SET_LINK, FaultAction, action_record, compile_actions
from .scenario import SIM_BACKEND, Job, Scenario

if TYPE_CHECKING:
    from trainers.config import Config

CONFIG_FILE = "config.json"
# A sim job's input beside config.json (harness/sim_job.py)
SIM_FILE = "sim.json"
# A sim job's default watchdog, in wall-clock seconds: its virtual budget says nothing of how long
# the simulation takes here.
SIM_JOB_TIMEOUT_S = 3600.0


def default_job_timeout_s(time_budget_s: Optional[float]) -> float:
    """A job's watchdog when the scenario gives none: twice its time budget (10 minutes without
    one) plus 3 minutes for start-up and evaluation (emulated seconds)."""
    return (time_budget_s or 600) * 2 + 180


@dataclass(frozen=True)
class StopBudgets:
    """What the harness's stop rule waits for (harness/jobs.py StopDecider): stop at
    `target_accuracy`, but only past both budgets, so that accuracy at equal budgets is known.
    `budget_time_s`: seconds of a rank's training clock. `target_loss`: the target as a held-out
    loss at or below it instead (a language model's)."""

    target_accuracy: Optional[float] = None
    budget_steps: Optional[int] = None
    budget_time_s: Optional[float] = None
    target_loss: Optional[float] = None

    @property
    def budget(self) -> EqualBudget:
        """The budgets as the one definition the summary and the report read (harness/budget.py)."""
        return EqualBudget.from_stop(self)


@dataclass(frozen=True)
class SimSettings:
    """What a job on backend sim gets besides its trainer config (sim.json).

    Args:
        plan_path: the network point's plan.json (the simulated network is built from it).
        nic_rate_bit_s: each node's NIC, or None.
        compute: the compute model: forward_backward_s, step_overhead_s, source, and
            start_offsets_s per rank where the scenario gives them (harness/sim_job.py SimRun).
        stand_in: the model the job stands for (harness/sim_job.py stand_in_record: its wire
            scale, real and stand-in sizes), or None.
    """

    plan_path: Path
    nic_rate_bit_s: Optional[float]
    compute: dict
    stand_in: Optional[dict] = None


@dataclass(frozen=True)
class JobSpec:
    """Everything one job of a run needs, typed, made once (`job_spec`).

    Args:
        job: the scenario's job (id, label, algorithm, seed, network point, params, ...).
        job_dir: the job's folder.
        backend: the backend's name ("tun", "sim", ...), as job.json says it; None: none given.
        nodes: the job's ranks (the network point's nodes).
        trainer: the trainers' Config, output_dir = job_dir (None for a user's command).
        trainer_document: the trainer settings as the scenario states them (what config.json
            says besides output_dir; at K > 1 with its durations dilated).
        faults: the fault actions of the job's network point, in order.
        timeout_s: the whole job's watchdog (on sim: wall-clock seconds, never dilated).
        stall_timeout_s: no record from any rank for this long ends the job (None: never).
        stop: the stop rule's target and budgets.
        cpu_share: cores per node (a cgroup CPU limit), or None.
        sim: on backend sim, the plan, NIC and compute model; None elsewhere.
        time_dilation: K the times above are dilated by (1: emulated seconds; `dilated`).
    """

    job: Job
    job_dir: Path
    backend: Optional[str]
    nodes: int
    trainer: Optional["Config"]
    trainer_document: dict
    faults: tuple[FaultAction, ...] = ()
    timeout_s: float = default_job_timeout_s(None)
    stall_timeout_s: Optional[float] = None
    stop: StopBudgets = StopBudgets()
    cpu_share: Optional[float] = None
    sim: Optional[SimSettings] = None
    time_dilation: float = 1.0

    @property
    def command(self) -> Optional[list[str]]:
        """A user's command run on every node instead of the trainers, or None."""
        return self.job.command

    def trainer_file(self) -> dict:
        """config.json: what the job's ranks read (the scenario's trainer settings, output_dir the job's)."""
        return {**self.trainer_document, "output_dir": str(self.job_dir)}

    def sim_file(self) -> dict:
        """sim.json: the plan, the seed, the NIC, the compute model and the fault actions."""
        sim = {"plan": str(self.sim.plan_path), "seed": self.job.seed, "nic_rate_bit_s": self.sim.nic_rate_bit_s,
               "compute": self.sim.compute, "faults": [action_record(action) for action in self.faults]}
        if self.sim.stand_in is not None:
            sim["stand_in"] = self.sim.stand_in
        return sim

    def write(self) -> None:
        """The job folder and what the job's processes read: config.json (not for a user's
        command), and sim.json on sim."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        if self.trainer is not None:
            write_json_atomic(self.job_dir / CONFIG_FILE, self.trainer_file())
        if self.sim is not None:
            write_json_atomic(self.job_dir / SIM_FILE, self.sim_file())

    def emulated_s(self, wall_s: float) -> float:
        """A wall-clock duration of this job in emulated seconds (for the console)."""
        return wall_s / self.time_dilation

    @property
    def restarted_nodes(self) -> set[str]:
        """Nodes a fault restarts after crashing them."""
        return {action.node for action in self.faults if action.op == "restart"}

    @property
    def link_faults(self) -> bool:
        return any(action.op == SET_LINK for action in self.faults)

    @property
    def stragglers(self) -> bool:
        return any(action.op == "cpu_factor" for action in self.faults)


def job_spec(scenario: Scenario, job: Job, job_dir: Path, plan: Plan, backend: Optional[str],
             faults: Optional[tuple[FaultAction, ...]] = None, sim: Optional[SimSettings] = None) -> JobSpec:
    """The spec of `job` of `scenario` in `job_dir` on the network point's `plan`, in emulated
    seconds. `faults`: the point's actions (compile_actions), compiled here when not given.
    `backend`: its name (`SIM_BACKEND` needs `sim`)."""
    if (backend == SIM_BACKEND) != (sim is not None):
        raise ValueError("a job on backend sim needs its sim settings, and only it")
    spec = scenario.spec
    if faults is None:
        faults = compile_actions(scenario.faults, plan.emulated_region_links()) if scenario.faults else ()
    trainer = None if job.trainer is None else dataclasses.replace(job.trainer, output_dir=str(job_dir))
    if sim is not None:
        timeout_s = spec.job_timeout_s or SIM_JOB_TIMEOUT_S
    else:
        timeout_s = spec.job_timeout_s or default_job_timeout_s(spec.stop.time_budget_s)
    stop = spec.stop
    return JobSpec(job=job, job_dir=job_dir, backend=backend, nodes=len(plan.nodes), trainer=trainer,
                   trainer_document=dict(job.trainer_config), faults=tuple(faults), timeout_s=timeout_s,
                   stall_timeout_s=spec.stall_timeout_s,
                   stop=StopBudgets(stop.target_accuracy if job.command is None else None,
                                    stop.budget_steps, stop.budget_time_s,
                                    stop.target_loss if job.command is None else None),
                   cpu_share=spec.cpu_share, sim=sim)


def dilated(spec: JobSpec, k: float) -> JobSpec:
    """`spec` (emulated seconds) for a network dilated by `k`: every duration x k and every link a
    fault sets slowed by k, in wall-clock seconds; the one place K is applied to a job. A fault's
    effect stays in the topology's units, as the scenario asked for it."""
    if spec.time_dilation != 1.0:
        raise ValueError(f"job {spec.job.job_id}: already dilated by {spec.time_dilation:g}")
    if k == 1.0:
        return spec
    if spec.sim is not None:
        raise ValueError("backend sim runs at time dilation 1 (its clock is virtual)")

    def times_k(seconds: Optional[float]) -> Optional[float]:
        return None if seconds is None else seconds * k

    def action(fault: FaultAction) -> FaultAction:
        args = fault.args
        if fault.op == SET_LINK and args[2] is not None:
            args = (args[0], args[1], dilate(args[2], k))
        return dataclasses.replace(fault, due_s=fault.due_s * k, args=args)

    return dataclasses.replace(
        spec,
        trainer=None if spec.trainer is None else dilated_trainer(spec.trainer, k),
        trainer_document=(spec.trainer_document if spec.trainer is None
                          else dilated_trainer_config(spec.trainer_document, k)),
        faults=tuple(action(fault) for fault in spec.faults),
        timeout_s=spec.timeout_s * k,
        stall_timeout_s=times_k(spec.stall_timeout_s),
        stop=dataclasses.replace(spec.stop, budget_time_s=times_k(spec.stop.budget_time_s)),
        time_dilation=k)
