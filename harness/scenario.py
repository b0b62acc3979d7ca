"""Scenario files: a topology, a workload, the algorithms to compare, a stop rule, sweeps and seeds.

`load_scenario` validates everything — the topology, every algorithm's parameters (against the
trainers' own config classes) and the sweep axes — before anything privileged runs, and expands
the scenario into `Job`s: one trainer configuration per (network point, algorithm variant, seed),
each built once into the trainers' typed `Config` (an error names the scenario's field). A run
makes each job's `harness.jobspec.JobSpec` from it.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from .byo import check_command_paths, scenario_folder
from .dilation import ComputeProfile, LayerProfile, load_layer_shares, load_profile
from .faults import FaultEvent, FaultProgram, read_trace
from .inputs import topology_from_document
from emulator.dilation import MAX_TIME_DILATION, MIN_TIME_DILATION
from emulator.schema import ConfigError, config_error_from_pydantic, load_yaml_mapping
from emulator.plan import make_plan
from emulator.topology import MAX_NODES_PER_REGION, NicFields, NodeLimits, Topology, check_node_sysctls
from emulator.units import UnitError, parse_rate_bit_s

MAX_JOBS = 500
MAX_SEEDS = 20
# time_dilation: auto, K chosen from the measured step time and the compute profile
AUTO_TIME_DILATION = "auto"
# sim.compute_s: auto, the workload's forward + backward measured on this machine
AUTO_SIM_COMPUTE = "auto"
SIM_BACKEND = "sim"
# A run directory's folder of job folders (harness/run.py's layout)
JOBS_FOLDER = "jobs"

if TYPE_CHECKING:
    from trainers.config import Config


class AlgorithmEntry(BaseModel):
    """One algorithm to compare: its registry name, a label, its own parameters, and its own
    workload settings (e.g. {lr: 0.02} or {optimizer: {momentum: 0.5}}) over the scenario's."""

    model_config = ConfigDict(extra="forbid")
    name: str
    label: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,39}$")
    params: dict = {}
    workload: dict = {}


class StopRule(BaseModel):
    """When jobs end, and the equal budgets at which their accuracy is compared.

    steps / time_budget_s / target_accuracy end a job (whichever comes first). budget_steps and
    budget_time_s are where accuracy_at_step_budget and accuracy_at_time_budget are read, and a
    job stops at the target only past them; left out, the furthest every job that ended ok got
    (harness/budget.py EqualBudget). A job that ends before a budget has no value for it.
    target_loss instead of target_accuracy: the target is a held-out loss at or below it (a
    language model's validation loss, nats per token); time_to_target_s is the time to reach it.
    """

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(200, ge=1, le=10_000_000)
    time_budget_s: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600)
    target_accuracy: Optional[float] = Field(None, gt=0, le=1)
    target_loss: Optional[float] = Field(None, gt=0, le=1000)
    budget_steps: Optional[int] = Field(None, ge=1, le=10_000_000)
    budget_time_s: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600)

    @model_validator(mode="after")
    def _budgets_within_the_run(self):
        if self.target_accuracy is not None and self.target_loss is not None:
            raise ValueError("give one target: target_accuracy or target_loss, not both")
        if self.budget_steps is not None and self.budget_steps > self.steps:
            raise ValueError(f"budget_steps {self.budget_steps} is more than steps {self.steps}: no job gets there")
        if (self.budget_time_s is not None and self.time_budget_s is not None
                and self.budget_time_s > self.time_budget_s):
            raise ValueError(f"budget_time_s {self.budget_time_s:g} is more than time_budget_s "
                             f"{self.time_budget_s:g}: no job gets there")
        return self


    @model_serializer(mode="wrap")
    def _loss_target_only_when_set(self, handler):
        # scenario.json of a run without a loss target stays as it was before the field existed
        data = handler(self)
        if data.get("target_loss") is None:
            data.pop("target_loss", None)
        return data


class VerifySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    probes: int = Field(50, ge=1, le=100_000)
    throughput: bool = False
    duration_s: float = Field(3.0, gt=0, le=600)


def _check_rate(value: Optional[str]) -> None:
    """A rate like "100Mbit" (None passes), as a pydantic validator's ValueError."""
    if value is not None:
        try:
            parse_rate_bit_s(value)
        except UnitError as exc:
            raise ValueError(str(exc)) from None


class SweepAxes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    delay_scale: list[float] = Field([1.0], min_length=1, max_length=50)
    rate: list[Optional[str]] = Field([None], min_length=1, max_length=50)
    nodes_per_region: list[Optional[int]] = Field([None], min_length=1, max_length=50)
    # label (or name) -> parameter -> values, e.g. {dts: {p: [1, 4, 16]}}
    params: dict[str, dict[str, list]] = {}
    # label (or name) -> workload key (dotted) -> values, e.g. {async_ps: {lr: [0.01, 0.03, 0.1]}}:
    # a tuning sweep; the summary marks the best variant of each label (sweep_best)
    workload: dict[str, dict[str, list]] = {}

    @field_validator("params", "workload")
    @classmethod
    def _values(cls, axes):
        for label, keys in axes.items():
            for key, values in keys.items():
                if not values:
                    raise ValueError(f"{label}.{key}: give at least one value")
                if len(values) > 50:
                    raise ValueError(f"{label}.{key}: at most 50 values, got {len(values)}")
        return axes

    @field_validator("delay_scale")
    @classmethod
    def _scale(cls, values):
        for v in values:
            if not 0 <= v <= 1000:
                raise ValueError(f"delay_scale {v} out of range [0, 1000]")
        return values

    @field_validator("rate")
    @classmethod
    def _rate(cls, values):
        for v in values:
            _check_rate(v)
        return values

    @field_validator("nodes_per_region")
    @classmethod
    def _nodes(cls, values):
        for v in values:
            if v is not None and not 1 <= v <= MAX_NODES_PER_REGION:
                raise ValueError(f"nodes_per_region {v} out of range [1, {MAX_NODES_PER_REGION}]")
        return values


# tuning.by: how the pick among one label's candidates is made (harness/tuning.py says the tie-breaks)
TUNING_RULES = ("time_to_target", "accuracy_at_budget", "loss")
TUNING_PHASE = "tuning"
REPORTED_PHASE = "reported"
MAX_TUNING_VALUES = 20


class TuningSettings(BaseModel):
    """`tuning:`: one tuning protocol for every algorithm of the scenario (sync included).

    grid: dotted workload key -> values (e.g. {lr: [0.01, 0.03, 0.1]}); every algorithm label at
        every network point runs every combination on the tuning seed. An integer stays an integer
        (lr_schedule.warmup_steps: [25, 50]), a float a float.
    seed: the tuning seed (one of `seeds`); the other seeds are the reported ones, each label run
        with its pick.
    by: the rule that picks a label's candidate (harness/tuning.py): time_to_target (shortest;
        needs a target), accuracy_at_budget (highest at the run's equal budget) or loss (lowest
        held-out loss at that budget).
    linear_scaling: an algorithm that averages every worker's gradient each step (a global batch of
        workers x batch_size: sync, ddp, ps_sync, p3, quantized on sync) also runs the label's own
        lr (the lr it has without tuning) x workers, the linear-scaling rule's value for its
        larger batch, when that value is not in the grid already.
    """

    model_config = ConfigDict(extra="forbid")
    grid: dict[str, list[Union[int, float]]] = Field(min_length=1)
    seed: int
    by: Literal["time_to_target", "accuracy_at_budget", "loss"] = "time_to_target"
    linear_scaling: bool = True

    @field_validator("grid")
    @classmethod
    def _grid(cls, grid):
        for key, values in grid.items():
            if not values:
                raise ValueError(f"{key}: give at least one value")
            if len(values) > MAX_TUNING_VALUES:
                raise ValueError(f"{key}: at most {MAX_TUNING_VALUES} values, got {len(values)}")
            if len(set(values)) != len(values):
                raise ValueError(f"{key}: a value is listed twice ({values})")
        return grid

    @model_validator(mode="after")
    def _scaling_needs_lr(self):
        if self.linear_scaling and "lr" not in self.grid:
            raise ValueError("linear_scaling scales lr, and the grid has no lr: add lr to the grid or set "
                             "linear_scaling: false")
        return self


class SimSettings(BaseModel):
    """`backend: sim`: what the simulator charges for compute, and each node's NIC.

    compute_s: virtual seconds of one forward + backward ("auto": measured on this machine for
        one rank alone, harness/auto_dilation.py's measurement; a number makes runs repeatable
        bit for bit). A compute profile's min_compute_s padding still applies on top.
    overhead_s: virtual seconds per step outside forward + backward.
    nic: every node's NIC rate each way ("10Gbit"), shared max-min by its flows, in place of the
        topology's `nic:` on sim (the emulators take the topology's); None: the topology's NICs
        (emulator/topology.py DEFAULT_NIC_RATE_BIT_S where it names none).
    start_offsets_s: start-up skew: node name -> seconds from the job's first node's first step to
        this node's first step (every job), or algorithm label -> such a mapping (that algorithm's
        jobs); a node not named starts at 0. None: no start-up term (the simulated setup's own
        skew). trainers.sim.ComputeModel.start_offsets_s says how the simulator holds a rank.
    """

    model_config = ConfigDict(extra="forbid")
    compute_s: Union[float, Literal["auto"]] = AUTO_SIM_COMPUTE
    overhead_s: float = Field(0.0, ge=0, le=3600)
    nic: Optional[str] = None
    start_offsets_s: Optional[dict[str, Union[float, dict[str, float]]]] = None

    @field_validator("start_offsets_s", mode="before")
    @classmethod
    def _start_offsets_s(cls, value):
        if value is None:
            return value
        if not isinstance(value, dict) or not value:
            raise ValueError(f"must map node names to seconds, or algorithm labels to such maps, got {value!r}")
        nested = [isinstance(v, dict) for v in value.values()]
        if any(nested) and not all(nested):
            raise ValueError("give node -> seconds (every job) or label -> {node: seconds}, not both")
        for key, offsets in (value.items() if all(nested) else [("", value)]):
            for node, seconds in offsets.items():
                if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= 3600:
                    where = f"{key}.{node}" if key else node
                    raise ValueError(f"{where}: must be seconds in [0, 3600], got {seconds!r}")
        return value

    def start_offsets_for(self, label: str) -> Optional[dict[str, float]]:
        """Node name -> start offset (s) for the jobs of the algorithm entry `label`; None: none given."""
        given = self.start_offsets_s
        if not given:
            return None
        if all(isinstance(v, dict) for v in given.values()):
            return {node: float(s) for node, s in given[label].items()} if label in given else None
        return {node: float(s) for node, s in given.items()}

    @field_validator("compute_s", mode="before")
    @classmethod
    def _compute_s(cls, value):
        if value == AUTO_SIM_COMPUTE:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 3600:
            raise ValueError(f"must be seconds of one forward + backward, greater than 0 and at most 3600, "
                             f"or {AUTO_SIM_COMPUTE} (measured on this machine), got {value!r}")
        return float(value)

    @field_validator("nic")
    @classmethod
    def _nic(cls, value):
        _check_rate(value)
        return value

    @property
    def nic_rate_bit_s(self) -> Optional[float]:
        return None if self.nic is None else parse_rate_bit_s(self.nic)


# stand_in.parameters: at most 10 trillion (a typo guard, not a physical limit)
MAX_STAND_IN_PARAMETERS = 1e13
# stand_in.bytes_per_parameter: fp32's 4 unless given (int8: 1, bf16: 2, fp64: 8)
FP32_BYTES = 4


class StandIn(BaseModel):
    """The model a job stands for (backend sim only): the ranks train the scenario's small model,
    and every message and collective is charged on the simulated network at the stand-in's size
    (its parameters x bytes_per_parameter over the real model's fp32 bytes, times the real
    message's bytes: a compressed payload scales the same way), every step's compute at the
    stand-in's step time.

    parameters: the stand-in's parameter count (e.g. 10e9).
    bytes_per_parameter: bytes of one parameter of a full-precision message of the stand-in (4:
        fp32, 2: bf16); what an algorithm's compression does to the real model's messages it does
        to the stand-in's.
    step_s: virtual seconds of one training step of the stand-in (forward + backward + optimizer)
        on the accelerator it runs on; or
    compute_profile: a compute profile (profiles/NAME.yaml or a file) whose step_s that is.
    """

    model_config = ConfigDict(extra="forbid")
    parameters: float = Field(gt=0, le=MAX_STAND_IN_PARAMETERS)
    bytes_per_parameter: float = Field(FP32_BYTES, gt=0, le=16)
    step_s: Optional[float] = Field(None, gt=0, le=3600)
    compute_profile: Optional[str] = None

    @model_validator(mode="after")
    def _one_step_time(self):
        if (self.step_s is None) == (self.compute_profile is None):
            raise ValueError("give the stand-in's step time as step_s: SECONDS or compute_profile: NAME (one of them)")
        return self

    @property
    def bytes(self) -> float:
        """The stand-in's full-precision model in bytes (parameters x bytes_per_parameter)."""
        return self.parameters * self.bytes_per_parameter


class ScenarioFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    topology: str | dict
    nodes: Optional[dict[str, int]] = None
    # sim: no network is built; the trainers run on a virtual clock (harness/sim_job.py), set by `sim:`
    backend: Literal["auto", "tun", "tc", "mininet", "sim"] = "auto"
    workload: dict = {}
    stop: StopRule = StopRule()
    algorithms: list[AlgorithmEntry] = Field([], max_length=50)
    command: Optional[list[str]] = Field(None, min_length=1)
    # command's working folder, and more folders every node must see (relative: from the scenario's
    # folder; checked before anything is built: harness/byo.py)
    cwd: Optional[str] = None
    mounts: list[str] = Field([], max_length=50)
    seeds: list[int] = Field([0], min_length=1, max_length=MAX_SEEDS)
    sweep: SweepAxes = SweepAxes()
    # one learning-rate (or other workload) grid for every algorithm, picked on a tuning seed and
    # reported on the others (harness/tuning.py); None: every job runs its stated settings
    tuning: Optional[TuningSettings] = None
    verify: VerifySettings = VerifySettings()
    job_timeout_s: Optional[float] = Field(None, gt=0)   # default: 2 x time budget + 180 s
    stall_timeout_s: Optional[float] = Field(120.0, gt=0)  # no record from any rank for this long
    master_port: int = Field(29500, ge=1024, le=65000)
    cpu_share: Optional[float] = Field(None, gt=0, le=1024)   # cores per node (cgroup cpu quota)
    node_limits: NodeLimits = NodeLimits()  # memory, pids per node; override the topology's
    # sysctls in every node (emulator/topology.py NODE_SYSCTLS); override the topology's key by key
    node_sysctls: dict[str, str] = {}
    # every node's NIC each way, in place of the topology's (its regions' included), on every backend
    nic: Optional[NicFields] = None
    faults: list[FaultEvent] = Field([], max_length=1000)
    # Parameter-server algorithms (those whose params name server_ranks): "extra" gives them one
    # more node, in server_region (default: the topology's first region), as their server, so they
    # have as many workers as sync; "shared" runs the server on one of the workers' nodes.
    servers: Literal["extra", "shared"] = "extra"
    server_region: Optional[str] = None
    # The network K times slower and every reported time divided by K: the job then stands for
    # one on processors K times faster than this machine's (docs/TIME_DILATION.md). auto: K from
    # this machine's measured step time and the compute profile (harness/auto_dilation.py), so
    # that the padded step is never shorter than the real one.
    time_dilation: Union[float, Literal["auto"]] = 1.0
    # The accelerator the job stands for (profiles/NAME.yaml or a file): forward + backward padded
    # to its step time, in emulated seconds (harness/dilation.py)
    compute_profile: Optional[str] = None
    # Per-layer times measured on an accelerator ({file, model}: harness/dilation.py LayerProfile):
    # each step's compute spread over the layers by them, not by multiply-accumulates (on sim; on
    # the emulator with workload.pad_layers)
    layer_profile: Optional[LayerProfile] = None
    # backend sim only: the compute model and the NICs of the simulated network
    sim: SimSettings = SimSettings()
    # backend sim only: the model every job stands for (its bytes on the wire, its step time)
    stand_in: Optional[StandIn] = None

    @field_validator("node_sysctls", mode="before")
    @classmethod
    def _node_sysctls(cls, value):
        return check_node_sysctls(value)

    @model_serializer(mode="wrap")
    def _without_empty_sysctls(self, handler):
        # a scenario that sets none saves the scenario.json it saved before node_sysctls existed
        data = handler(self)
        if not data.get("node_sysctls"):
            data.pop("node_sysctls", None)
        if data.get("tuning") is None:  # likewise a scenario without a tuning protocol
            data.pop("tuning", None)
        if data.get("nic") is None:  # likewise a scenario that names no NIC
            data.pop("nic", None)
        if data.get("stand_in") is None:  # likewise a scenario without a stand-in model
            data.pop("stand_in", None)
        if data.get("layer_profile") is None:  # likewise a scenario without measured layer shares
            data.pop("layer_profile", None)
        return data

    @field_validator("time_dilation", mode="before")
    @classmethod
    def _time_dilation(cls, value):
        if value == AUTO_TIME_DILATION:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                MIN_TIME_DILATION <= value <= MAX_TIME_DILATION):
            raise ValueError(f"must be a number greater than or equal to {MIN_TIME_DILATION:g} and at most "
                             f"{MAX_TIME_DILATION:g}, or {AUTO_TIME_DILATION} (chosen from compute_profile), "
                             f"got {value!r}")
        return float(value)

    @model_validator(mode="after")
    def _something_to_run(self):
        if not self.algorithms and self.command is None:
            raise ValueError("give algorithms: [...] to compare, or command: [...] to run your own script")
        labels = [a.label or a.name for a in self.algorithms]
        duplicate = {x for x in labels if labels.count(x) > 1}
        if duplicate:
            raise ValueError(f"algorithm labels must be unique; give label: to tell {sorted(duplicate)} apart")
        return self


@dataclass(frozen=True)
class NetworkPoint:
    """One network setting of a sweep."""

    delay_scale: float = 1.0
    rate: Optional[str] = None
    nodes_per_region: Optional[int] = None
    extra_servers: int = 0          # nodes added for a parameter server (in the server region)

    @property
    def key(self) -> str:
        """The network setting a job is compared at (a server's extra node does not change it)."""
        parts = [f"delay{self.delay_scale:g}"]
        if self.rate:
            parts.append(f"rate{self.rate}")
        if self.nodes_per_region:
            parts.append(f"n{self.nodes_per_region}")
        return "-".join(parts)

    @property
    def folder(self) -> str:
        """The run directory's folder of the network built for this point."""
        return self.key + (f"-ps{self.extra_servers}" if self.extra_servers else "")


@dataclass
class Job:
    """One trainer run: every node of the network runs `trainer_config` (or the user's command)."""

    job_id: str
    network: NetworkPoint
    algorithm: str               # registry name
    label: str                   # what tables and plots call it (the base label plus swept values)
    seed: int
    params: dict = field(default_factory=dict)         # the swept/explicit algorithm params
    # The trainer settings as the scenario states them (emulated seconds, without output_dir): what
    # config.json and scenario.json say; the trainers fill in their defaults.
    trainer_config: dict = field(default_factory=dict)
    command: Optional[list[str]] = None
    base_label: str = ""         # the algorithm entry's label, before sweep values were added
    tuned: dict = field(default_factory=dict)  # workload values of a tuning sweep (dotted key -> value)
    cwd: Optional[str] = None    # the command's working folder (absolute)
    mounts: list[str] = field(default_factory=list)  # folders the nodes must see: the scenario's, its mounts:
    # `tuning:` (harness/tuning.py): "tuning" for a candidate run on the tuning seed, "reported" for
    # a reported seed run at its label's pick; "" in a scenario without tuning
    phase: str = ""
    tuning_group: str = ""       # the label the pick is made for (the label without the tuned values)
    # `trainer_config` resolved and checked by the trainers' loader, once, when the scenario was
    # loaded; its output_dir is the job's folder relative to the run directory (`folder`), which
    # the job spec places under the run's (None for a user's command).
    trainer: Optional["Config"] = field(default=None, repr=False, compare=False)

    @property
    def folder(self) -> str:
        """The job's folder, relative to its run directory."""
        return f"{JOBS_FOLDER}/{self.job_id}"

    def record(self) -> dict:
        """What scenario.json says of the job (its trainer settings as the scenario states them)."""
        record = dataclasses.asdict(dataclasses.replace(self, trainer=None))
        del record["trainer"]
        if not self.phase:  # a scenario without tuning saves the jobs it saved before tuning existed
            del record["phase"], record["tuning_group"]
        return record


@dataclass
class Scenario:
    name: str
    source_file: str
    spec: ScenarioFile
    topology: Topology
    jobs: list[Job]
    # how `time_dilation: auto` chose K (harness/auto_dilation.py, AutoDilation.record()); None
    # when K was given
    time_dilation_auto: Optional[dict] = None
    # the fault events with each trace's rows, read once here (compiled per network point by the run)
    faults: FaultProgram = field(default_factory=FaultProgram)
    # `tuning:`: per (network point, label) its candidates; `jobs` holds the tuning phase's jobs,
    # the reported phase's are made from each group's pick (TuningGroup.reported_jobs)
    tuning_groups: list["TuningGroup"] = field(default_factory=list)

    def topology_for(self, point: NetworkPoint) -> Topology:
        return _topology_for(self.topology, self.spec, point)

    @property
    def time_dilation(self) -> float | str:
        """K, or "auto" until harness/auto_dilation.py has chosen it."""
        return self.spec.time_dilation

    def with_time_dilation(self, k: float | str, auto: Optional[dict] = None) -> "Scenario":
        """This scenario at dilation `k` (jobs keep emulated seconds; the run dilates them), or at
        "auto" (ConfigError naming the file and field when there is no compute profile to choose
        K from). `auto`: how K was chosen, when it was."""
        if k == AUTO_TIME_DILATION:
            _check_auto_dilation(self.spec, self.source_file, "time_dilation (--time-dilation auto)")
        return dataclasses.replace(self, spec=self.spec.model_copy(update={"time_dilation": k}),
                                   time_dilation_auto=auto)

    def network_points(self) -> list[NetworkPoint]:
        seen: list[NetworkPoint] = []
        for job in self.jobs:
            if job.network not in seen:
                seen.append(job.network)
        return seen


def _topology_for(topology: Topology, spec: ScenarioFile, point: NetworkPoint) -> Topology:
    """The topology of one network point: node counts, a parameter server's extra node, scaling."""
    if point.nodes_per_region:
        topology = topology.with_nodes({r: point.nodes_per_region for r in topology.regions})
    if point.extra_servers:
        region = spec.server_region or next(iter(topology.regions))
        topology = topology.with_nodes({region: topology.regions[region] + point.extra_servers})
    rate = parse_rate_bit_s(point.rate) if point.rate else None
    if point.delay_scale != 1.0 or rate is not None:
        topology = topology.scaled(point.delay_scale, rate)
    return topology


def _uses_server_ranks(algorithm: str) -> bool:
    """A parameter-server algorithm: its parameters say which ranks are servers."""
    from trainers.algorithms import ALGORITHMS

    return algorithm in ALGORITHMS and "server_ranks" in {f.name for f in dataclasses.fields(ALGORITHMS[algorithm].Params)}


def _server_placement(topology: Topology, spec: ScenarioFile, point: NetworkPoint, params: dict,
                      algorithm: str) -> tuple[NetworkPoint, dict]:
    """Where a job runs: a parameter-server algorithm (without server_ranks of its own) gets one
    extra node as its server when `servers: extra`; its rank goes into the params."""
    if spec.servers != "extra" or "server_ranks" in params or not _uses_server_ranks(algorithm):
        return point, params
    point = dataclasses.replace(point, extra_servers=1)
    region = spec.server_region or next(iter(topology.regions))
    nodes = topology.regions[region] if not point.nodes_per_region else point.nodes_per_region
    plan = make_plan(_topology_for(topology, spec, point))
    return point, {**params, "server_ranks": [plan.node(f"{region}-{nodes}").rank]}


def _region_placement(topology: Topology, spec: ScenarioFile, point: NetworkPoint, params: dict,
                      algorithm: str) -> dict:
    """A region-aware algorithm (its params name region_sizes) without region_sizes of its own
    gets the job's nodes per region in rank order (make_plan numbers nodes region by region)."""
    from trainers.algorithms import ALGORITHMS

    if "region_sizes" in params or algorithm not in ALGORITHMS:
        return params
    if "region_sizes" not in {f.name for f in dataclasses.fields(ALGORITHMS[algorithm].Params)}:
        return params
    return {**params, "region_sizes": list(_topology_for(topology, spec, point).regions.values())}


def _merged(base: dict, override: dict) -> dict:
    """`base` with `override` laid over it, mappings merged key by key (neither is changed)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _nested(dotted: dict) -> dict:
    """{"optimizer.momentum": 0.5} -> {"optimizer": {"momentum": 0.5}}."""
    nested: dict = {}
    for key, value in dotted.items():
        *parents, leaf = key.split(".")
        node = nested
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return nested


def _trainer_config(spec: ScenarioFile, algorithm: str, params: dict, seed: int,
                    workload: Optional[dict] = None, profile: Optional[ComputeProfile] = None) -> dict:
    from trainers.loading import comm_backend_for

    config = _merged(spec.workload, workload or {})
    if profile is not None:
        config.setdefault("min_compute_s", profile.step_s)  # emulated seconds; the run dilates
    config["seed"] = seed
    config["steps"] = spec.stop.steps
    if spec.stop.time_budget_s is not None:
        config["time_budget_s"] = spec.stop.time_budget_s
    if spec.stop.target_accuracy is not None:
        config["target_accuracy"] = spec.stop.target_accuracy
    if spec.stop.target_loss is not None:
        config["target_loss"] = spec.stop.target_loss
    config["algorithm"] = {"name": algorithm, "params": params}
    # The trainers' policy (a crash-tolerant algorithm gets the elastic comm when nodes crash);
    # a workload that names a backend itself keeps it.
    backend = comm_backend_for(algorithm, nodes_crash=any(event.kind == "node_crash" for event in spec.faults))
    if backend is not None:
        config.setdefault("comm", {}).setdefault("backend", backend)
    return config


def _trainer(source: str, config: dict, job_folder: str, where: "_TrainerOrigin") -> "Config":
    """The job's trainer config, resolved and checked by the trainers' own loader (once per job);
    a ConfigError names the scenario's field the bad value came from."""
    from trainers.config import ConfigError as TrainerConfigError
    from trainers.loading import load_config

    try:
        return load_config({**config, "output_dir": job_folder})
    except TrainerConfigError as exc:
        raise ConfigError(where.scenario_field(exc.field), exc.message, source=source) from None


def _has(document: dict, dotted: str) -> bool:
    """Whether `document` gives the dotted field or a mapping above it (whose key was wrong)."""
    node: Any = document
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@dataclass(frozen=True)
class _TrainerOrigin:
    """Where the settings of one job's trainer config came from in the scenario: the algorithm
    entry (its index, label, params, workload), a sweep's values, the compute profile."""

    index: int
    label: str
    entry: AlgorithmEntry
    swept: dict        # parameter -> value from sweep.params
    tuned: dict        # dotted workload key -> value from sweep.workload
    workload: dict     # the scenario's workload
    profile: bool      # min_compute_s came from compute_profile (the workloads do not give it)
    tuned_from: str = ""  # where `tuned` came from: "" (sweep.workload.<label>) or "tuning.grid"

    def scenario_field(self, trainer_field: str) -> str:
        """The scenario's field for a trainer config field path (`algorithm.params.H` ->
        `algorithms[0].params.H`, `lr` -> `workload.lr` or `algorithms[0].workload.lr`, ...)."""
        head, _, rest = trainer_field.partition(".")
        if head == "algorithm":
            param = rest.partition(".")[2].split(".")[0].split("[")[0]
            if rest.startswith("params.") and param in self.swept:
                return f"sweep.params.{self.label}.{rest[len('params.'):]}"
            return f"algorithms[{self.index}]" + (f".{rest}" if rest else "")
        if trainer_field in ("steps", "time_budget_s", "target_accuracy", "target_loss"):
            return f"stop.{trainer_field}"
        if trainer_field == "seed":
            return "seeds"
        if not trainer_field:
            return "workload"
        for key in self.tuned:
            if trainer_field == key or trainer_field.startswith(key + ".") or key.startswith(trainer_field + "."):
                return f"{self.tuned_from or 'sweep.workload.' + self.label}.{key}"
        if _has(self.entry.workload, trainer_field):
            return f"algorithms[{self.index}].workload.{trainer_field}"
        if trainer_field == "min_compute_s" and self.profile and not _has(self.workload, trainer_field):
            return "compute_profile"
        return f"workload.{trainer_field}"


# Algorithms whose step applies the gradient averaged over every worker (a global batch of workers x
# batch_size), and so the linear-scaling rule's lr x workers (tuning.linear_scaling); quantized
# only on its sync base.
GLOBAL_BATCH_ALGORITHMS = ("sync", "ddp", "ps_sync", "p3")


def global_batch_workers(algorithm: str, params: dict, workers: int) -> int:
    """How many per-replica batches one step of `algorithm` averages: `workers` for an algorithm
    that averages every worker's gradient each step (GLOBAL_BATCH_ALGORITHMS, quantized on sync),
    1 for the others (each replica steps on its own batch)."""
    if algorithm in GLOBAL_BATCH_ALGORITHMS or (algorithm == "quantized" and params.get("base", "sync") == "sync"):
        return workers
    return 1


def tuned_suffix(tuned: dict) -> str:
    """What a label gets for its tuned values: {"lr": 0.1} -> "-lr0.1"."""
    return "".join(f"-{k.rsplit('.', 1)[-1]}{v}" for k, v in tuned.items())


@dataclass(frozen=True)
class _JobMaker:
    """What every job of a scenario is made from besides its own entry, point, values and seed."""

    spec: ScenarioFile
    source: str
    profile: Optional[ComputeProfile]
    cwd: Optional[str]
    mounts: list
    layer_shares: Optional[list] = None

    def job(self, index: int, entry: AlgorithmEntry, variant: dict, tuned: dict, base_point: NetworkPoint,
            point: NetworkPoint, placed: dict, seed: int, phase: str = "", label: Optional[str] = None,
            tuning_group: str = "") -> Job:
        """One job: entry `index` with its swept params `variant` (placed: with its server ranks)
        and tuned workload values, at a network point, on one seed; its trainer config checked."""
        spec, base = self.spec, entry.label or entry.name
        variant_label = base + "".join(f"-{k}{v}" for k, v in variant.items())
        label = label or variant_label + tuned_suffix(tuned)
        job = Job(job_id=f"{base_point.key}-{label}-seed{seed}", network=point, algorithm=entry.name,
                  label=label, seed=seed, params=placed, command=spec.command, base_label=base, tuned=tuned,
                  cwd=self.cwd, mounts=self.mounts, phase=phase, tuning_group=tuning_group)
        if spec.command is None:
            from_grid = "tuning.grid" if spec.tuning is not None else ""
            origin = _TrainerOrigin(index, base, entry, variant, tuned, spec.workload, self.profile is not None,
                                    from_grid)
            workload = _merged(entry.workload, _nested(tuned))
            job.trainer_config = _trainer_config(spec, entry.name, placed, seed, workload, self.profile)
            if self.layer_shares is not None:
                job.trainer_config["layer_shares"] = self.layer_shares
            job.trainer = _trainer(self.source, job.trainer_config, job.folder, origin)
        return job


@dataclass
class TuningGroup:
    """One label at one network point under `tuning:`: its candidates (each a dict of dotted
    workload key -> value) run on the tuning seed, and the reported seeds run at its pick.

    Args:
        label: the label the pick is made for (the entry's label with its swept params).
        candidates: the grid's combinations, then the linear-scaling value where it applies.
        linear_scaled: the candidate added by tuning.linear_scaling (None: none added).
        workers: the per-replica batches one step averages (1 where the algorithm steps alone).
    """

    label: str
    algorithm: str
    network: NetworkPoint            # where its jobs run (a parameter server's extra node included)
    base_point: NetworkPoint         # the network point it is compared at
    candidates: list[dict]
    linear_scaled: Optional[dict]
    workers: int
    base_lr: float                   # the label's lr without tuning (what linear scaling multiplies)
    tuning_seed: int
    reported_seeds: list[int]
    maker: _JobMaker = field(repr=False)
    index: int = 0
    entry: Optional[AlgorithmEntry] = field(default=None, repr=False)
    variant: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)   # placed (server ranks included)

    def _job(self, tuned: dict, seed: int, phase: str, label: str) -> Job:
        return self.maker.job(self.index, self.entry, self.variant, tuned, self.base_point, self.network,
                              self.params, seed, phase=phase, label=label, tuning_group=self.label)

    def tuning_jobs(self) -> list[Job]:
        """One job per candidate on the tuning seed (labelled with its values: sync-lr0.1)."""
        return [self._job(tuned, self.tuning_seed, TUNING_PHASE, self.label + tuned_suffix(tuned))
                for tuned in self.candidates]

    def reported_jobs(self, pick: dict) -> list[Job]:
        """One job per reported seed at the pick (labelled as the label itself: sync)."""
        if pick not in self.candidates:
            raise ValueError(f"{self.label}: pick {pick} is not one of its candidates {self.candidates}")
        return [self._job(pick, seed, REPORTED_PHASE, self.label) for seed in self.reported_seeds]


def _tuning_group(maker: _JobMaker, topology: Topology, index: int, entry: AlgorithmEntry, variant: dict,
                  base_point: NetworkPoint) -> TuningGroup:
    """The candidates of one label at one network point: every grid combination, and for an
    algorithm with a larger global batch its own lr x workers (tuning.linear_scaling)."""
    spec = maker.spec
    tuning = spec.tuning
    point, placed = _server_placement(topology, spec, base_point, {**entry.params, **variant}, entry.name)
    placed = _region_placement(topology, spec, point, placed, entry.name)
    nodes = sum(_topology_for(topology, spec, point).regions.values())
    workers = global_batch_workers(entry.name, placed, nodes - len(placed.get("server_ranks") or []))
    candidates = [dict(zip(tuning.grid, combo)) for combo in itertools.product(*tuning.grid.values())]
    base_lr = float(_merged(spec.workload, entry.workload).get("lr", _default_lr()))
    linear_scaled = None
    if tuning.linear_scaling and workers > 1:
        scaled = float(f"{base_lr * workers:.6g}")  # 0.08, not 0.08000000000000002
        linear_scaled = {"lr": scaled}
        for candidate in [{**c, "lr": scaled} for c in candidates]:  # with each value of the other keys
            if candidate not in candidates:
                candidates.append(candidate)
    label = (entry.label or entry.name) + "".join(f"-{k}{v}" for k, v in variant.items())
    reported = [seed for seed in spec.seeds if seed != tuning.seed]
    return TuningGroup(label, entry.name, point, base_point, candidates, linear_scaled, workers, base_lr,
                       tuning.seed, reported, maker, index, entry, variant, placed)


def _default_lr() -> float:
    """The trainers' lr where neither the workload nor the algorithm entry gives one."""
    from trainers.config import Config

    return next(f.default for f in dataclasses.fields(Config) if f.name == "lr")


def _check_tuning(spec: ScenarioFile, entries: list[AlgorithmEntry], source: str) -> None:
    """`tuning:` against the rest of the scenario: its seed among `seeds` with another to report
    on, no second tuning of the same label (sweep.workload), no algorithm of its own value for a
    grid key (the grid is the same for every algorithm), the trainers' workload to tune."""
    tuning = spec.tuning
    if spec.command is not None:
        raise ConfigError("tuning", "tunes the trainers' workload, and command: runs your own script", source=source)
    if tuning.seed not in spec.seeds:
        raise ConfigError("tuning.seed", f"{tuning.seed} is not among seeds {spec.seeds}: the tuning seed is one "
                          "of the scenario's seeds", source=source)
    if len(spec.seeds) < 2:
        raise ConfigError("seeds", f"tuning picks on seed {tuning.seed} and reports on the others: give at "
                          "least one more seed", source=source)
    if spec.sweep.workload:
        raise ConfigError(f"sweep.workload.{next(iter(spec.sweep.workload))}", "tuning.grid already tunes every "
                          "algorithm by one protocol: give the values in tuning.grid, or drop tuning", source=source)
    if tuning.by == "time_to_target" and spec.stop.target_accuracy is None and spec.stop.target_loss is None:
        raise ConfigError("tuning.by", "time_to_target needs stop.target_accuracy or stop.target_loss; or pick "
                          "by accuracy_at_budget or loss", source=source)
    for index, entry in enumerate(entries):
        for key in tuning.grid:
            if _has(entry.workload, key):
                raise ConfigError(f"algorithms[{index}].workload.{key}", f"tuning.grid.{key} gives every "
                                  "algorithm the same values: drop this one's own", source=source)


def _check_auto_dilation(spec: ScenarioFile, source: str, field: str = "time_dilation") -> None:
    """time_dilation: auto needs a compute profile (the step time K is chosen against) and the
    trainers' model (the step time measured); a user's command has none."""
    if spec.compute_profile is None:
        raise ConfigError(field, "auto chooses K from a compute profile's step time: add compute_profile: NAME "
                          "(profiles/) or give a factor", source=source)
    if spec.command is not None:
        raise ConfigError(field, "auto measures the trainers' model, and command: runs your own script: "
                          "give a factor", source=source)


def _check_faults(source: str, spec: ScenarioFile, topology: Topology) -> None:
    """Fault targets must exist in the topology (at its largest node count)."""
    counts = [n for n in spec.sweep.nodes_per_region if n] or [None]
    for index, event in enumerate(spec.faults):
        where = f"faults[{index}]"
        if event.node is not None:
            region, _, number = event.node.rpartition("-")
            per_region = [n or topology.regions.get(region, 0) for n in counts]
            if region not in topology.regions or not number.isdigit() or int(number) >= min(per_region):
                raise ConfigError(f"{where}.node", f"no node {event.node!r} in every network of this scenario", source=source)
        if event.between is not None or event.from_ is not None:
            for region in (event.between or [event.from_, event.to]):
                if region not in topology.regions:
                    raise ConfigError(where, f"unknown region {region!r} (regions: {', '.join(topology.regions)})", source=source)


def _fault_program(source: str, spec: ScenarioFile) -> FaultProgram:
    """The scenario's fault events with each trace file's rows, read once (a path relative to the
    scenario's folder); ConfigError naming faults[i].file when one cannot be read."""
    traces = {}
    for index, event in enumerate(spec.faults):
        if event.kind == "trace":
            path = Path(event.file) if Path(event.file).is_absolute() else Path(source).parent / event.file
            try:
                traces[index] = tuple(read_trace(path))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"faults[{index}].file", str(exc), source=source) from None
    return FaultProgram(tuple(spec.faults), traces)


def check_sim(spec: ScenarioFile, source: str) -> None:
    """What backend sim cannot run, as a ConfigError naming the file and field (before anything
    runs): a command of the user's own (the simulator runs the trainers, not a program), an
    algorithm whose communication bypasses the comm layer (trainers.sim.UNSUPPORTED_ALGORITHMS)
    and a GPU device."""
    from trainers.sim import UNSUPPORTED_ALGORITHMS  # here, not at the top: it imports torch

    for index, entry in enumerate(spec.algorithms):
        if entry.name in UNSUPPORTED_ALGORITHMS:
            raise ConfigError(f"algorithms[{index}].name", f"{entry.name} cannot run on backend sim: "
                              f"{UNSUPPORTED_ALGORITHMS[entry.name]}", source=source)
    for index, entry in enumerate(spec.algorithms):
        device = _merged(spec.workload, entry.workload).get("device", "cpu")
        if device != "cpu":
            where = f"algorithms[{index}].workload.device" if "device" in entry.workload else "workload.device"
            raise ConfigError(where, f"{device}: simulated ranks compute on the cpu (sim.compute_s or a "
                              "compute profile stands for the accelerator)", source=source)
    if spec.command is not None:
        raise ConfigError("command", "backend sim runs the trainers on a virtual clock, not a command of your "
                          "own: give algorithms, or run on tun", source=source)


def check_stand_in(spec: ScenarioFile, source: str, backend: Optional[str] = None) -> Optional[float]:
    """`stand_in:` against the rest of the scenario (ConfigError naming the file and field): only
    on backend sim (`backend`: the one the run uses; None: the scenario's own, where "auto" may
    still become sim), where it replaces sim.compute_s, sim.overhead_s and compute_profile (each
    would set the step's compute a second time); its compute profile must exist. Returns the
    stand-in's step time (s), or None without a stand-in."""
    stand_in = spec.stand_in
    if stand_in is None:
        return None
    backend = backend or spec.backend
    if backend not in ("auto", SIM_BACKEND):
        raise ConfigError("stand_in", f"runs only on backend sim (this run: {backend}): on an emulated network "
                          "the bytes moved are the real model's; run with --backend sim", source=source)
    for field in ("compute_s", "overhead_s"):
        if field in spec.sim.model_fields_set:
            raise ConfigError(f"sim.{field}", "stand_in sets each step's compute on sim (stand_in.step_s or "
                              "stand_in.compute_profile): give it there, not both", source=source)
    if spec.compute_profile is not None:
        raise ConfigError("compute_profile", "stand_in sets each step's compute on sim: give the profile as "
                          "stand_in.compute_profile, not both", source=source)
    if stand_in.step_s is not None:
        return stand_in.step_s
    try:
        return load_profile(stand_in.compute_profile, source).step_s
    except ConfigError as exc:
        if exc.field != "compute_profile":
            raise
        raise ConfigError("stand_in.compute_profile", exc.message, source=source) from None


def _layer_shares(spec: ScenarioFile, source: str) -> Optional[list]:
    """The trainers' ``layer_shares`` from the scenario's ``layer_profile`` (None without one).
    Refused where nothing would spread them: a command of the user's own, or an emulated backend
    whose workload does not pad its layers (pad_layers)."""
    if spec.layer_profile is None:
        return None
    if spec.command is not None:
        raise ConfigError("layer_profile", "spreads the trainers' compute over their model's layers; a command "
                          "of your own has none of ours", source=source)
    pads = bool(_merged(spec.workload, {}).get("pad_layers"))
    if spec.backend not in ("auto", SIM_BACKEND) and not pads:
        raise ConfigError("layer_profile", f"on backend {spec.backend} the shares spread a compute profile's pad: "
                          "set workload.pad_layers: true with compute_profile (on sim they spread sim.compute_s)",
                          source=source)
    return load_layer_shares(spec.layer_profile, source)


def scenario_from_dict(data: dict, source: str) -> Scenario:
    """Validate a parsed scenario document and expand it into jobs; ConfigError on any mistake."""
    try:
        spec = ScenarioFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(source, exc) from None
    topology = topology_from_document(data, source)  # `topology:` and `nodes:`, with the same errors
    name = spec.name or Path(source).stem

    _check_faults(source, spec, topology)
    faults = _fault_program(source, spec)
    cwd, mounts = check_command_paths(spec.cwd, spec.mounts, source)
    if cwd is not None and spec.command is None:
        raise ConfigError("cwd", "is the working folder of command:, and there is no command: (the trainers "
                          "need none)", source=source)
    mounts = list(dict.fromkeys([scenario_folder(source), *mounts]))
    if spec.backend == SIM_BACKEND:
        check_sim(spec, source)
    check_stand_in(spec, source)
    if spec.time_dilation == AUTO_TIME_DILATION:
        _check_auto_dilation(spec, source)
    profile = load_profile(spec.compute_profile, source) if spec.compute_profile else None
    if spec.server_region is not None and spec.server_region not in topology.regions:
        raise ConfigError("server_region", f"unknown region {spec.server_region!r} "
                          f"(regions: {', '.join(topology.regions)})", source=source)
    for label in spec.sweep.params:
        if label not in [a.label or a.name for a in spec.algorithms]:
            raise ConfigError(f"sweep.params.{label}", "no algorithm with this label or name", source=source)

    points = [NetworkPoint(d, r, n) for d, r, n in itertools.product(
        spec.sweep.delay_scale, spec.sweep.rate, spec.sweep.nodes_per_region)]
    jobs: list[Job] = []
    entries = spec.algorithms or [AlgorithmEntry(name="command", label="command")]
    labels = [entry.label or entry.name for entry in entries]
    for label in spec.sweep.workload:
        if label not in labels:
            raise ConfigError(f"sweep.workload.{label}", "no algorithm with this label or name", source=source)
    if spec.tuning is not None:
        _check_tuning(spec, entries, source)
    maker = _JobMaker(spec, source, profile, cwd, mounts, _layer_shares(spec, source))
    groups: list[TuningGroup] = []
    for index, entry in enumerate(entries):
        label = entry.label or entry.name
        swept = spec.sweep.params.get(label, {})
        variants = [dict(zip(swept, combo)) for combo in itertools.product(*swept.values())] or [{}]
        tuning = spec.sweep.workload.get(label, {})
        tunings = [dict(zip(tuning, combo)) for combo in itertools.product(*tuning.values())] or [{}]
        if spec.tuning is not None:
            for variant in variants:
                for base_point in points:
                    group = _tuning_group(maker, topology, index, entry, variant, base_point)
                    groups.append(group)
                    jobs += group.tuning_jobs()
            continue
        for variant, tuned in itertools.product(variants, tunings):
            for base_point in points:
                point, placed = _server_placement(topology, spec, base_point, {**entry.params, **variant}, entry.name)
                placed = _region_placement(topology, spec, point, placed, entry.name)
                jobs += [maker.job(index, entry, variant, tuned, base_point, point, placed, seed)
                         for seed in spec.seeds]
    labels_made = [job.label for job in jobs]
    seeds_per_label = 1 if spec.tuning is not None else len(spec.seeds)
    clash = sorted({x for x in labels_made if labels_made.count(x) > len(points) * seeds_per_label})
    if clash:
        raise ConfigError("sweep", f"two variants are both labelled {clash[0]!r}; give the algorithms distinct labels",
                          source=source)
    total = len(jobs) + sum(len(group.reported_seeds) for group in groups)
    if total > MAX_JOBS:
        raise ConfigError("sweep", f"expands to {total} runs, more than {MAX_JOBS}", source=source)
    scenario = Scenario(name=name, source_file=source, spec=spec, topology=topology, jobs=jobs, faults=faults,
                        tuning_groups=groups)
    if spec.sim.start_offsets_s:
        _check_start_offsets(scenario)
    return scenario


def _check_start_offsets(scenario: Scenario) -> None:
    """sim.start_offsets_s names algorithm labels the scenario has, and nodes that exist in a
    network point of a job they apply to (in another point's job they do not apply)."""
    given, source = scenario.spec.sim.start_offsets_s, scenario.source_file
    labels = [entry.label or entry.name for entry in scenario.spec.algorithms]
    by_label = all(isinstance(v, dict) for v in given.values())
    for label in given if by_label else []:
        if label not in labels:
            raise ConfigError(f"sim.start_offsets_s.{label}", f"no algorithm with this label or name "
                              f"(algorithms: {', '.join(labels)})", source=source)
    nodes: dict[str, set[str]] = {}  # label -> node names of its jobs' network points
    for job in scenario.jobs:
        plan = make_plan(scenario.topology_for(job.network))
        nodes.setdefault(job.base_label, set()).update(node.name for node in plan.nodes)
    for label, offsets in (given.items() if by_label else [(None, given)]):
        names = nodes.get(label, set()) if label else set().union(*nodes.values())
        for node in offsets:
            if node not in names:
                raise ConfigError(f"sim.start_offsets_s.{label + '.' if label else ''}{node}",
                                  f"no node of that name in the network points of the jobs it applies to "
                                  f"(nodes: {', '.join(sorted(names))})", source=source)


# `extends: base.yaml`: a scenario file that is another one with a few fields changed.
EXTENDS_KEY = "extends"
MAX_EXTENDS_DEPTH = 8
NOT_INHERITED = ("name",)  # a file's runs are filed under its own name (or its file's stem)


def merged_document(base: dict, child: dict) -> dict:
    """`child` over `base`: mappings merge key by key, at every depth; null removes the base's key
    (its default applies); any other value of the child (a list such as `algorithms` or `seeds`, a
    number, a string) replaces the base's."""
    merged = copy.deepcopy(base)
    for key, value in child.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merged_document(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def scenario_document(path) -> tuple[dict, list[Path]]:
    """A scenario file's mapping with its `extends:` chain resolved (the file's own fields over its
    base's, recursively; `name` is never inherited). A base must lie in the same folder, so that
    the relative paths it holds (topology, compute profile, command) mean what they mean there.
    ConfigError names the file and `extends` for a base that is missing, elsewhere or a cycle.
    Returns the mapping and the bases read, nearest first."""
    chain = [Path(path)]
    documents = [load_yaml_mapping(path)]
    while EXTENDS_KEY in documents[-1]:
        value, source = documents[-1][EXTENDS_KEY], str(chain[-1])
        if not isinstance(value, str) or not value.endswith((".yaml", ".yml")) or Path(value).name != value:
            raise ConfigError(EXTENDS_KEY, f"{value!r}: name a scenario file (.yaml) in the same folder, without "
                              "a folder", source=source)
        base = chain[-1].parent / value
        if base.resolve() in [p.resolve() for p in chain]:
            raise ConfigError(EXTENDS_KEY, "a cycle: " + " -> ".join(p.name for p in [*chain, base]), source=source)
        if len(chain) > MAX_EXTENDS_DEPTH:
            raise ConfigError(EXTENDS_KEY, f"more than {MAX_EXTENDS_DEPTH} files deep", source=str(path))
        if not base.is_file():
            raise ConfigError(EXTENDS_KEY, f"{value}: no such file in {chain[-1].parent}", source=source)
        chain.append(base)
        documents.append(load_yaml_mapping(base))
    merged: dict = {}
    for depth, document in enumerate(reversed(documents)):
        own = {k: v for k, v in document.items() if k != EXTENDS_KEY}
        if depth < len(documents) - 1:  # a base's: its name stays its own
            own = {k: v for k, v in own.items() if k not in NOT_INHERITED}
        merged = merged_document(merged, own)
    return merged, chain[1:]


def load_scenario(path) -> Scenario:
    """Read and validate a scenario file (its `extends:` bases resolved first); ConfigError names
    the file and the field (and the bases the field may have come from)."""
    document, bases = scenario_document(path)
    try:
        return scenario_from_dict(document, str(path))
    except ConfigError as exc:
        if not bases or exc.source != str(path):
            raise
        raise ConfigError(exc.field, exc.message, f"{path} (extends {' -> '.join(b.name for b in bases)})") from None
