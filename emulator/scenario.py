"""Scenario files: a topology, a workload, the algorithms to compare, a stop rule, sweeps and seeds.

`load_scenario` validates everything — the topology, every algorithm's parameters (against the
trainers' own config classes) and the sweep axes — before anything privileged runs, and expands
the scenario into `Job`s: one trainer configuration per (network point, algorithm variant, seed).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .faults import FaultEvent, read_trace
from .inputs import topology_of
from .schema import ConfigError, config_error_from_pydantic, load_yaml_mapping
from .topology import MAX_NODES_PER_REGION, Topology
from .units import UnitError, parse_rate_bit_s

MAX_JOBS = 500
MAX_SEEDS = 20


class AlgorithmEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    label: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,39}$")
    params: dict = {}


class StopRule(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(200, ge=1, le=10_000_000)
    time_budget_s: Optional[float] = Field(None, gt=0, le=7 * 24 * 3600)
    target_accuracy: Optional[float] = Field(None, gt=0, le=1)


class VerifySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    probes: int = Field(50, ge=1, le=100_000)
    throughput: bool = False
    duration_s: float = Field(3.0, gt=0, le=600)


class SweepAxes(BaseModel):
    model_config = ConfigDict(extra="forbid")
    delay_scale: list[float] = Field([1.0], min_length=1, max_length=50)
    rate: list[Optional[str]] = Field([None], min_length=1, max_length=50)
    nodes_per_region: list[Optional[int]] = Field([None], min_length=1, max_length=50)
    # label (or name) -> parameter -> values, e.g. {dts: {p: [1, 4, 16]}}
    params: dict[str, dict[str, list]] = {}

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
            if v is not None:
                try:
                    parse_rate_bit_s(v)
                except UnitError as exc:
                    raise ValueError(str(exc)) from None
        return values

    @field_validator("nodes_per_region")
    @classmethod
    def _nodes(cls, values):
        for v in values:
            if v is not None and not 1 <= v <= MAX_NODES_PER_REGION:
                raise ValueError(f"nodes_per_region {v} out of range [1, {MAX_NODES_PER_REGION}]")
        return values


class ScenarioFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    description: str = ""
    topology: str | dict
    nodes: Optional[dict[str, int]] = None
    backend: Literal["auto", "tun", "tc", "mininet"] = "auto"
    workload: dict = {}
    stop: StopRule = StopRule()
    algorithms: list[AlgorithmEntry] = Field([], max_length=50)
    command: Optional[list[str]] = Field(None, min_length=1)
    seeds: list[int] = Field([0], min_length=1, max_length=MAX_SEEDS)
    sweep: SweepAxes = SweepAxes()
    verify: VerifySettings = VerifySettings()
    job_timeout_s: Optional[float] = Field(None, gt=0)   # default: 2 x time budget + 180 s
    stall_timeout_s: Optional[float] = Field(120.0, gt=0)  # no record from any rank for this long
    master_port: int = Field(29500, ge=1024, le=65000)
    cpu_share: Optional[float] = Field(None, gt=0, le=1024)   # cores per node (cgroup cpu quota)
    faults: list[FaultEvent] = Field([], max_length=1000)

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

    @property
    def key(self) -> str:
        parts = [f"delay{self.delay_scale:g}"]
        if self.rate:
            parts.append(f"rate{self.rate}")
        if self.nodes_per_region:
            parts.append(f"n{self.nodes_per_region}")
        return "-".join(parts)


@dataclass
class Job:
    """One trainer run: every node of the network runs `trainer_config` (or the user's command)."""

    job_id: str
    network: NetworkPoint
    algorithm: str               # registry name
    label: str                   # what tables and plots call it
    seed: int
    params: dict = field(default_factory=dict)         # the swept/explicit algorithm params
    trainer_config: dict = field(default_factory=dict)  # without output_dir (set per run)
    command: Optional[list[str]] = None


@dataclass
class Scenario:
    name: str
    source_file: str
    spec: ScenarioFile
    topology: Topology
    jobs: list[Job]

    def topology_for(self, point: NetworkPoint) -> Topology:
        topology = self.topology
        if point.nodes_per_region:
            topology = topology.with_nodes({r: point.nodes_per_region for r in topology.regions})
        rate = parse_rate_bit_s(point.rate) if point.rate else None
        if point.delay_scale != 1.0 or rate is not None:
            topology = topology.scaled(point.delay_scale, rate)
        return topology

    def network_points(self) -> list[NetworkPoint]:
        seen: list[NetworkPoint] = []
        for job in self.jobs:
            if job.network not in seen:
                seen.append(job.network)
        return seen


def _trainer_config(spec: ScenarioFile, algorithm: str, params: dict, seed: int) -> dict:
    config = copy.deepcopy(spec.workload)
    config["seed"] = seed
    config["steps"] = spec.stop.steps
    if spec.stop.time_budget_s is not None:
        config["time_budget_s"] = spec.stop.time_budget_s
    if spec.stop.target_accuracy is not None:
        config["target_accuracy"] = spec.stop.target_accuracy
    config["algorithm"] = {"name": algorithm, "params": params}
    if any(event.kind == "node_crash" for event in spec.faults) and _tolerates_crash(algorithm):
        # Policy: an algorithm that can go on without a crashed rank runs on the elastic comm when
        # the scenario crashes nodes (unless the workload names a backend itself).
        config.setdefault("comm", {}).setdefault("backend", "tcp")
    return config


def _tolerates_crash(algorithm: str) -> bool:
    from trainers.algorithms import ALGORITHMS

    return algorithm in ALGORITHMS and ALGORITHMS[algorithm].tolerates_crash


def _check_trainer_config(source: str, field_prefix: str, config: dict) -> None:
    """Validate with the trainers' own loader so the error names the scenario's field."""
    from trainers.config import ConfigError as TrainerConfigError
    from trainers.config import load_config

    try:
        load_config({**config, "output_dir": "/nonexistent-check-only"})
    except TrainerConfigError as exc:
        path = exc.path or ""
        if path.startswith("algorithm.params"):
            where = field_prefix + path[len("algorithm"):]
        elif path.startswith("algorithm"):
            where = field_prefix + path[len("algorithm"):]
        elif path in ("steps", "time_budget_s", "target_accuracy"):
            where = f"stop.{path}"
        elif path == "seed":
            where = "seeds"
        else:
            where = f"workload.{path}" if path else "workload"
        raise ConfigError(source, where, exc.reason) from None
    algorithm = config["algorithm"]["name"]
    if (config.get("comm") or {}).get("backend") == "tcp" and not _tolerates_crash(algorithm):
        raise ConfigError(source, "workload.comm.backend",
                          f"tcp is only for crash-tolerant algorithms; {algorithm} needs every rank in every collective")


def _check_faults(source: str, spec: ScenarioFile, topology: Topology) -> None:
    """Fault targets must exist in the topology (at its largest node count) and traces must parse."""
    counts = [n for n in spec.sweep.nodes_per_region if n] or [None]
    for index, event in enumerate(spec.faults):
        where = f"faults[{index}]"
        if event.node is not None:
            region, _, number = event.node.rpartition("-")
            per_region = [n or topology.regions.get(region, 0) for n in counts]
            if region not in topology.regions or not number.isdigit() or int(number) >= min(per_region):
                raise ConfigError(source, f"{where}.node", f"no node {event.node!r} in every network of this scenario")
        if event.between is not None or event.from_ is not None:
            for region in (event.between or [event.from_, event.to]):
                if region not in topology.regions:
                    raise ConfigError(source, where, f"unknown region {region!r} (regions: {', '.join(topology.regions)})")
        if event.kind == "trace":
            path = Path(event.file) if Path(event.file).is_absolute() else Path(source).parent / event.file
            try:
                read_trace(path)
            except (OSError, ValueError) as exc:
                raise ConfigError(source, f"{where}.file", str(exc)) from None


def scenario_from_dict(data: dict, source: str) -> Scenario:
    """Validate a parsed scenario document and expand it into jobs; ConfigError on any mistake."""
    try:
        spec = ScenarioFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(source, exc) from None
    topology = topology_of(source)  # resolves `topology:` and `nodes:`, with the same errors
    name = spec.name or Path(source).stem

    _check_faults(source, spec, topology)
    for label in spec.sweep.params:
        if label not in [a.label or a.name for a in spec.algorithms]:
            raise ConfigError(source, f"sweep.params.{label}", "no algorithm with this label or name")

    points = [NetworkPoint(d, r, n) for d, r, n in itertools.product(
        spec.sweep.delay_scale, spec.sweep.rate, spec.sweep.nodes_per_region)]
    jobs: list[Job] = []
    entries = spec.algorithms or [AlgorithmEntry(name="command", label="command")]
    for index, entry in enumerate(entries):
        label = entry.label or entry.name
        swept = spec.sweep.params.get(label, {})
        variants = [dict(zip(swept, combo)) for combo in itertools.product(*swept.values())] or [{}]
        for variant in variants:
            params = {**entry.params, **variant}
            variant_label = label + "".join(f"-{k}{v}" for k, v in variant.items())
            if spec.command is None:
                _check_trainer_config(source, f"algorithms[{index}]",
                                      _trainer_config(spec, entry.name, params, spec.seeds[0]))
            for point in points:
                for seed in spec.seeds:
                    job_id = f"{point.key}-{variant_label}-seed{seed}"
                    jobs.append(Job(
                        job_id=job_id, network=point, algorithm=entry.name, label=variant_label,
                        seed=seed, params=params,
                        trainer_config=_trainer_config(spec, entry.name, params, seed) if spec.command is None else {},
                        command=spec.command))
    if len(jobs) > MAX_JOBS:
        raise ConfigError(source, "sweep", f"expands to {len(jobs)} runs, more than {MAX_JOBS}")
    return Scenario(name=name, source_file=source, spec=spec, topology=topology, jobs=jobs)


def load_scenario(path) -> Scenario:
    """Read and validate a scenario file; ConfigError names the file and the field."""
    return scenario_from_dict(load_yaml_mapping(path), str(path))
