"""`time_dilation: auto`: K from this machine's measured step time and the compute profile.

A compute profile pads every step's forward + backward to ``step_s x K`` wall-clock seconds
(harness/dilation.py). That stands for the profiled accelerator only while this machine's real
forward + backward is shorter than the padding; a longer one shows through as slower compute.
`auto` measures, before any network is built, how long the job's own model takes for one
forward + backward on one batch of its own data here (the median of a few steps after a warm-up,
with the intra-op threads a rank will get), scales it by how much slower a rank runs when the
job's ranks share the machine's cores, and picks

    K = ceil(headroom x rank_step_s / profile.step_s), at least 1, at most 1000 (headroom 1.5)

so that the padded step covers the real one with ``headroom`` to spare. scenario.json keeps the
measurement, K and why (`time_dilation_auto`); the console and the report say it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from emulator.dilation import MAX_TIME_DILATION, MIN_TIME_DILATION

from .dilation import ComputeProfile, load_profile
from .jobs import default_rank_threads
from .scenario import AUTO_TIME_DILATION, Scenario

if TYPE_CHECKING:
    from trainers.config import Config

# The padded step is at least this many times the estimated real one. Measured on this 2-core
# machine (ResNet-20, batch 64, one thread per rank): alone 0.36 s; 2 ranks at once 0.44-0.45 s
# each (1.2x, where the cores alone predict 1x); 4 ranks at once 0.84-0.98 s (up to 2.7x, where
# the cores predict 2x). 1.5 covers both.
AUTO_HEADROOM = 1.5
WARMUP_STEPS = 2
TIMED_STEPS = 5


@dataclass
class StepMeasurement:
    """One workload's forward + backward time on this machine.

    Args:
        workload: what was timed, e.g. "resnet20 on cifar10, batch 64".
        step_s: median of ``samples`` (seconds).
        samples: each timed step (seconds), after the warm-up steps.
        threads: torch intra-op threads it ran with (a rank's).
        device: cpu or cuda.
        data_source: the data the batch came from (the DataBundle's source).
    """

    workload: str
    step_s: float
    samples: list[float] = field(default_factory=list)
    threads: int = 1
    device: str = "cpu"
    data_source: str = ""


@dataclass
class AutoDilation:
    """How `time_dilation: auto` chose K (scenario.json's `time_dilation_auto`)."""

    k: float
    profile: str
    profile_step_s: float
    measured: list[StepMeasurement]
    ranks: int                 # the most ranks a network of the scenario runs at once
    cores: int
    cpu_share: Optional[float]
    contention: float          # how many times slower a rank steps when every rank computes at once
    rank_step_s: float         # the slowest workload's step x contention: what a rank will need
    headroom: float
    required_k: float          # headroom x rank_step_s / profile_step_s, before rounding and clamping
    clamped: bool              # K hit the 1000 limit: the padding is shorter than a rank's step
    why: str

    def record(self) -> dict:
        return asdict(self)


def step_time_key(trainer_config: dict) -> str:
    """What decides a job's step time: model, dataset, batch size and device (not the algorithm
    or the seed)."""
    return json.dumps({key: trainer_config.get(key) for key in ("model", "dataset", "batch_size", "device")},
                      sort_keys=True, default=str)


def measure_step_s(config: "Config", threads: int, warmup: int = WARMUP_STEPS, steps: int = TIMED_STEPS,
                   clock: Callable[[], float] = time.perf_counter) -> StepMeasurement:
    """Time the forward + backward of the trainer `config`'s model (a job's, `Job.trainer`) on one
    batch of its own data, as a rank computes it (the trainers' loss, the padded part of a step),
    with `threads` intra-op threads: `warmup` untimed steps, then the median of `steps` timed
    ones. `clock` is injectable."""
    import torch

    from trainers.datasets import load_dataset
    from trainers.models import build_model
    from trainers.training import loss_fn

    device = torch.device("cuda" if config.device == "cuda" else "cpu")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = load_dataset(config.dataset, config.seed)
        model = build_model(config.model.name, config.model.params, data.input_shape, data.num_classes,
                            config.seed).to(device)
        model.train()
        first = torch.arange(min(config.batch_size, len(data.train_x)))
        batch = (data.inputs(data.train_x[first].to(device)), data.train_y[first].to(device))
        samples = []
        for index in range(warmup + steps):
            model.zero_grad(set_to_none=False)
            started = clock()
            loss_fn(model, batch).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = clock() - started
            if index >= warmup:
                samples.append(elapsed)
    finally:
        torch.set_num_threads(previous_threads)
    workload = f"{config.model.name} on {config.dataset.name}, batch {config.batch_size}"
    return StepMeasurement(workload, statistics.median(samples), samples, threads, device.type, data.source)


def contention_factor(ranks: int, cores: int, threads: int, cpu_share: Optional[float]) -> float:
    """How many times slower one rank's step is when all `ranks` compute at once: each runs
    `threads` threads but gets only its share of the cores (cores / ranks, or its node's cpu_share
    if smaller); 1 when its threads fit."""
    available = cores / ranks
    if cpu_share is not None:
        available = min(available, cpu_share)
    return max(1.0, threads / available)


def choose_time_dilation(profile: ComputeProfile, measured: list[StepMeasurement], ranks: int, cores: int,
                         cpu_share: Optional[float] = None, headroom: float = AUTO_HEADROOM) -> AutoDilation:
    """K such that the padded step (profile.step_s x K) covers the slowest measured workload's
    step at the job's contention, with `headroom`; at least 1, at most 1000 (pure)."""
    if not measured:
        raise ValueError("no step time measured")
    slowest = max(measured, key=lambda m: m.step_s)
    contention = (1.0 if slowest.device == "cuda"
                  else contention_factor(ranks, cores, slowest.threads, cpu_share))
    rank_step_s = slowest.step_s * contention
    required = headroom * rank_step_s / profile.step_s
    k = float(min(MAX_TIME_DILATION, max(MIN_TIME_DILATION, math.ceil(required - 1e-9))))
    clamped = required > MAX_TIME_DILATION
    share = f" and cpu_share {cpu_share:g}" if cpu_share is not None else ""
    why = (f"{slowest.workload}: {slowest.step_s * 1e3:.1f} ms per forward + backward here "
           f"({slowest.device}, {slowest.threads} thread(s), median of {len(slowest.samples) or '?'})")
    if slowest.device == "cuda":
        why += ", one GPU per rank assumed"
    else:
        why += (f"; {ranks} ranks on {cores} cores{share}: x{contention:g} -> {rank_step_s * 1e3:.1f} ms "
                "per rank step")
    why += (f"; x{headroom:g} headroom / {profile.name}'s {profile.step_s * 1e3:g} ms = {required:.2f} "
            f"-> K = {k:g}")
    if clamped:
        why += (f" (clamped at {MAX_TIME_DILATION:g}: the padding, {profile.step_s * k:.2f} s, is shorter than "
                "a rank's step; compute_unpadded_s in the step records shows by how much)")
    return AutoDilation(k, profile.name, profile.step_s, measured, ranks, cores, cpu_share, contention,
                        rank_step_s, headroom, required, clamped, why)


def rank_threads(ranks: int, environ=os.environ) -> int:
    """The intra-op threads each rank of a job of `ranks` will get (harness/jobs.py's rule)."""
    value = environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else default_rank_threads(ranks)


def auto_time_dilation(scenario: Scenario, measure: Callable[["Config", int], StepMeasurement] = measure_step_s,
                       cores: Optional[int] = None, headroom: float = AUTO_HEADROOM) -> Scenario:
    """`scenario` with `time_dilation: auto` replaced by the chosen K and how it was chosen
    (`Scenario.time_dilation_auto`); every distinct workload of its jobs is measured once
    (`measure(job.trainer, threads)`, injectable). A scenario at a given K is returned as is."""
    if scenario.time_dilation != AUTO_TIME_DILATION:
        return scenario
    profile = load_profile(scenario.spec.compute_profile, scenario.source_file)
    ranks = max(sum(scenario.topology_for(point).regions.values()) for point in scenario.network_points())
    threads = rank_threads(ranks)
    workloads = {step_time_key(job.trainer_config): job.trainer for job in scenario.jobs}
    measured = [measure(config, threads) for config in workloads.values()]
    choice = choose_time_dilation(profile, measured, ranks, cores or os.cpu_count() or 1,
                                  scenario.spec.cpu_share, headroom)
    return scenario.with_time_dilation(choice.k, auto=choice.record())
