"""One job on backend sim: `python -m harness.sim_job JOB_DIR` runs all of its ranks in this
process on a virtual clock (trainers.sim) over a fluid model of the point's network
(emulator.simnet).

The harness (harness/jobs.py `run_sim_job`, the job's harness/jobspec.py JobSpec) writes,
before starting it:
    JOB_DIR/config.json   the trainer config, as for a job on tun (output_dir: JOB_DIR)
    JOB_DIR/sim.json      {plan: the point's plan.json, seed, nic_rate_bit_s, compute: {forward_backward_s,
                          step_overhead_s, source[, start_offsets_s: per rank]},
                          faults: the job's fault actions (harness.faults.action_record)[,
                          stand_in: the model the job stands for (stand_in_record): its wire_scale
                          charges every message at the stand-in's bytes]}
and the ranks write what they write on tun (rank<N>.jsonl, snapshots/, config.resolved.json),
with every time in virtual seconds. Fault actions (link changes, stragglers, crashes and
restarts) are applied at their virtual times through `SimFaults`, the simulator's executor
(harness/faults.py's interface), and appended to JOB_DIR/faults.jsonl as on tun. A
job that went on through crashes prints tun's reason as its last line (`crash tolerated: ...`);
one that failed exits 1 with the error, which names the crash. The harness evaluates the
snapshots afterwards (trainers.evaluate), outside this process.

Also here: what the harness decides before a sim run (`SimRun`: the compute model of each
workload, measured or given; the NIC) and writes into scenario.json and each job's sim.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

from emulator.linkspec import LinkSpec
from emulator.plan import Plan

from .auto_dilation import StepMeasurement, measure_step_s, rank_threads, step_time_key
from .faults import FaultAction, action_from_record, run_action, simulated_compute_effect
from .jobs import crash_tolerated
from .jobspec import SIM_FILE, SimSettings
from .scenario import AUTO_SIM_COMPUTE, FP32_BYTES, SIM_BACKEND, Job, Scenario, StandIn, check_stand_in


# --- harness side: decided once per run, before any job ---------------------------------------


@dataclasses.dataclass
class SimRun:
    """What a sim run charges for compute, per workload, and the network's NICs.

    Args:
        compute: step_time_key(trainer config) -> {forward_backward_s, step_overhead_s, source}.
        nic_rate_bit_s: every node's NIC (the scenario's sim.nic, which replaces the topology's on
            sim), or None: each node has its topology's NIC (`topology_nic_rate_bit_s`).
        time_dilation_ignored: the scenario's time_dilation, not applied on sim (None when 1).
        start_offsets: algorithm label -> node name -> start offset (s), from sim.start_offsets_s;
            a label not in it: no start-up term.
        stand_in: step_time_key(trainer config) -> the stand-in model of its jobs (`stand_in_record`);
            empty: no stand-in.
    """

    compute: dict
    nic_rate_bit_s: Optional[float]
    time_dilation_ignored: Optional[float | str] = None
    start_offsets: dict = dataclasses.field(default_factory=dict)  # label -> {node: s} (sim.start_offsets_s)
    # region -> NIC rate (bit/s each way) from the topology: what the plan gives each node when
    # sim.nic does not replace it (recorded only then)
    topology_nic_rate_bit_s: Optional[dict] = None
    stand_in: dict = dataclasses.field(default_factory=dict)

    def job_compute(self, job: Job, plan: Optional[Plan] = None) -> dict:
        """The compute model of `job`'s workload, with the job's start offsets per rank where the
        scenario gives them (`plan`, the job's network point, maps node names to ranks)."""
        compute = dict(self.compute[step_time_key(job.trainer_config)])
        offsets = self.start_offsets.get(job.base_label or job.label) if self.start_offsets else None
        if offsets is not None:
            if plan is None:
                raise ValueError("start offsets need the job's plan to map node names to ranks")
            by_rank = {node.rank: offsets.get(node.name, 0.0) for node in plan.nodes}
            compute["start_offsets_s"] = [by_rank[rank] for rank in range(len(plan.nodes))]
        return compute

    def job_settings(self, job: Job, plan_path: Path, plan: Plan) -> SimSettings:
        """What `job`'s spec carries for sim.json besides its faults: the plan, the NIC, the compute."""
        return SimSettings(plan_path, self.nic_rate_bit_s, self.job_compute(job, plan),
                           self.stand_in.get(step_time_key(job.trainer_config)))

    def record(self) -> dict:
        """scenario.json's `sim`."""
        record = {"compute": list(self.compute.values()), "nic_rate_bit_s": self.nic_rate_bit_s,
                  "time_dilation_ignored": self.time_dilation_ignored}
        if self.start_offsets:
            record["start_offsets_s"] = self.start_offsets
        if self.nic_rate_bit_s is None and self.topology_nic_rate_bit_s:
            record["topology_nic_rate_bit_s"] = self.topology_nic_rate_bit_s
        if self.stand_in:
            record["stand_in"] = list(self.stand_in.values())
        return record


def sim_run(scenario: Scenario, measure: Callable[..., StepMeasurement] = measure_step_s) -> SimRun:
    """The compute model of each distinct workload of `scenario` (sim.compute_s, or with "auto"
    its forward + backward measured here once, for one rank alone with the threads a rank of the
    job would get: no contention scaling, the simulator runs ranks one after another) and the NIC."""
    settings = scenario.spec.sim
    stand_in_step_s = check_stand_in(scenario.spec, scenario.source_file, SIM_BACKEND)
    compute, stand_ins = {}, {}
    ranks = max(sum(scenario.topology_for(point).regions.values()) for point in scenario.network_points())
    for job in scenario.jobs:
        key = step_time_key(job.trainer_config)
        if key in compute:
            continue
        if stand_in_step_s is not None:
            stand_in = stand_in_record(scenario.spec.stand_in, stand_in_step_s, real_parameters(job.trainer))
            stand_ins[key] = stand_in
            compute[key] = {"forward_backward_s": stand_in_step_s, "step_overhead_s": 0.0,
                            "source": f"{scenario.source_file}: stand_in ({stand_in['step_source']})"}
            continue
        if settings.compute_s == AUTO_SIM_COMPUTE:
            m = measure(job.trainer, rank_threads(ranks))
            seconds = m.step_s
            source = (f"measured here: {m.workload}: {m.step_s * 1e3:.3g} ms per forward + backward "
                      f"({m.device}, {m.threads} thread(s), median of {len(m.samples) or '?'}, one rank alone)")
        else:
            seconds = settings.compute_s
            source = f"{scenario.source_file}: sim.compute_s"
        compute[key] = {"forward_backward_s": seconds, "step_overhead_s": settings.overhead_s, "source": source}
    offsets = {}
    for job in scenario.jobs:
        label = job.base_label or job.label
        given = settings.start_offsets_for(label)
        if given is not None:
            offsets[label] = given
    regions = scenario.topology.regions
    return SimRun(compute, settings.nic_rate_bit_s, start_offsets=offsets, stand_in=stand_ins,
                  topology_nic_rate_bit_s={r: scenario.topology.region_nic_bit_s(r) for r in regions})


def real_parameters(config) -> int:
    """How many parameters the trainer `config`'s model has (a job's `Job.trainer`), built here
    once as a rank builds it."""
    from trainers.datasets import load_dataset
    from trainers.models import build_model

    data = load_dataset(config.dataset, config.seed)
    model = build_model(config.model.name, config.model.params, data.input_shape, data.num_classes, config.seed)
    return sum(p.numel() for p in model.parameters())


def stand_in_record(stand_in: StandIn, step_s: float, real: int) -> dict:
    """What sim.json, scenario.json and job.json say of a stand-in model for a workload of `real`
    parameters: the stand-in as given, its step time and where it came from, and the wire scale
    (the stand-in's bytes over the real model's fp32 bytes: what every real message is charged
    times)."""
    if real <= 0:
        raise ValueError("stand_in: the workload's model has no parameters to scale")
    return {"parameters": stand_in.parameters, "bytes_per_parameter": stand_in.bytes_per_parameter,
            "step_s": step_s,
            "step_source": "step_s" if stand_in.step_s is not None else f"compute_profile {stand_in.compute_profile}",
            "real_parameters": int(real), "real_bytes": int(real) * FP32_BYTES,
            "wire_scale": stand_in.bytes / (int(real) * FP32_BYTES)}


# --- the job's process -------------------------------------------------------------------------


def load_engine() -> SimpleNamespace:
    """The simulator: trainers.sim (ComputeModel, run_simulated), emulator.simnet.FluidNetwork, and
    the trainers' clock's wall time (virtual while the simulation runs: its start's wall time plus
    virtual time, as in the records' time_unix)."""
    from emulator.simnet import FluidNetwork
    from trainers.clock import wall_time
    from trainers.sim import ComputeModel, run_simulated

    return SimpleNamespace(FluidNetwork=FluidNetwork, ComputeModel=ComputeModel, run_simulated=run_simulated,
                           wall_time=wall_time)


class SimFaults:
    """The fault executor inside a simulation (harness/faults.py's interface): links on the
    simulator's network (None, down, becomes the plan's link with every packet lost: the fluid
    network stalls its flows), stragglers as the simulator's compute factor, crashes and restarts
    by the simulator (its effect is what it says it did; it keeps who was killed when and
    restarted how often, and run_simulated hands it back)."""

    def __init__(self, plan: Plan, simulator=None):
        self.base = plan.emulated_region_links()
        self.ranks = {node.name: node.rank for node in plan.nodes}
        self.simulator = simulator

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        down = dataclasses.replace(self.base[(src_region, dst_region)], loss_fraction=1.0)
        self.simulator.network.set_link(src_region, dst_region, down if spec is None else spec)

    def set_cpu_factor(self, node: str, factor: float) -> str:
        self.simulator.compute_factor[self.ranks[node]] = factor
        return simulated_compute_effect(factor)

    def crash(self, node: str) -> str:
        return self.simulator.crash(self.ranks[node])

    def restart(self, node: str) -> str:
        return self.simulator.restart(self.ranks[node])


def fault_actions(actions: list[FaultAction], plan: Plan, record_path: Path,
                  wall_time: Callable[[], float]) -> list[tuple[float, Callable]]:
    """The job's fault `actions` as (virtual time, action(simulator)) for run_simulated, applied
    through `SimFaults`; each applied action is appended to `record_path` as on tun, with
    `wall_time()` (the virtual clock's reading, like the records' time_unix) as its time_unix."""
    executor = SimFaults(plan)
    by_time: dict[float, list[FaultAction]] = {}
    for action in actions:
        by_time.setdefault(action.due_s, []).append(action)

    def run(simulator, due_s: float, due: list[FaultAction]) -> None:
        executor.simulator = simulator
        for action in due:
            run_action(action, executor, record_path, due_s, wall_time())

    return [(due_s, lambda simulator, t=due_s, a=due: run(simulator, t, a))
            for due_s, due in sorted(by_time.items())]


@dataclasses.dataclass(frozen=True)
class SimJobInput:
    """What a sim job's process reads from its folder (what its JobSpec wrote): the trainers'
    config, the point's plan, the seed, the NIC, the compute model, the fault actions."""

    config: object  # trainers.config.Config
    plan: Plan
    seed: int
    nic_rate_bit_s: Optional[float]
    compute: dict
    faults: tuple[FaultAction, ...]
    stand_in: Optional[dict] = None

    @classmethod
    def read(cls, job_dir: Path) -> "SimJobInput":
        from trainers.loading import load_config

        sim = json.loads((job_dir / SIM_FILE).read_text())
        return cls(load_config(job_dir / "config.json"), Plan.from_json(Path(sim["plan"]).read_text()),
                   sim["seed"], sim.get("nic_rate_bit_s"), sim["compute"],
                   tuple(action_from_record(record) for record in sim.get("faults") or []), sim.get("stand_in"))


def main(argv: Optional[list[str]] = None, engine: Optional[SimpleNamespace] = None) -> int:
    """Run the job in JOB_DIR; `engine` stands in for the simulator (tests)."""
    parser = argparse.ArgumentParser(prog="python -m harness.sim_job", description=__doc__.splitlines()[0])
    parser.add_argument("job_dir", type=Path)
    args = parser.parse_args(argv)
    engine = engine or load_engine()  # run_simulated raises the open-files limit itself
    job_dir: Path = args.job_dir
    given = SimJobInput.read(job_dir)
    plan = given.plan
    network = engine.FluidNetwork.from_plan(plan, nic_rate_bit_s=given.nic_rate_bit_s, seed=given.seed)
    compute = engine.ComputeModel(**given.compute)
    actions = fault_actions(list(given.faults), plan, job_dir / "faults.jsonl", engine.wall_time)
    # a stand-in's scale only where there is one: a job without is run as it was before stand_in
    stand_in = {"wire_scale": given.stand_in["wire_scale"]} if given.stand_in else {}
    run = engine.run_simulated(given.config, len(plan.nodes), network, compute, actions, **stand_in)
    ended = [r for r in run if r is not None]  # a rank killed and not restarted has none
    stops = sorted({r.stop_reason for r in ended})
    print(f"sim: {len(run)} ranks, rank 0 took {run[0].steps if run and run[0] else 0} steps "
          f"({', '.join(stops) or 'no rank ran'})", flush=True)
    if run.crashed_at:  # the job's reason, as on tun (harness.jobs.run_sim_job reads it)
        print(crash_tolerated(run.crashed_at, run.restarts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
