"""Simulated jobs (``--backend sim``): every rank of a job in one process, on a virtual clock.

Each rank runs the real trainer (``trainers.runner.run``: its model, data shard, optimizer and
algorithm, so accuracy is real) in a thread of its own; the engine (:mod:`trainers.sim.engine`)
runs one rank at a time in virtual-time order. Communication goes through :class:`SimComm`
(the one comm layer, on the simulated network the harness hands in: ``emulator.simnet``), and
every time the trainers read or spend goes through the virtual clock (``trainers.clock``). The
ranks write the same files a real job writes (``rank<N>.jsonl``, snapshots, the resolved config),
with virtual times, so results, summaries and reports read them unchanged.

Crashes: ``Simulator.crash`` kills a rank's process at a virtual time (its thread unwinds
without another record, its flows stop) and ``Simulator.restart`` starts a fresh one (restart
count one more), as the harness does on tun. A job on the elastic comm (``comm.backend: tcp``,
what a crash-tolerant algorithm gets when a scenario crashes nodes) runs on
:class:`ElasticSimComm` (:mod:`trainers.sim.elastic`: TcpComm's membership, PeerLost one one-way
delay after the crash, a restarted rank rejoining at an evaluation point); any other job runs on
:class:`SimComm`, whose communication fails once a crash has reached it, and the run fails with
the crash named.

Deterministic: the same config, network, compute model and faults give the same records, bit for
bit (``time_unix`` apart: it is the wall time the run started plus virtual time).

A stand-in model (``wire_scale``, the harness's ``stand_in:``): the ranks train the real, small
model, and every byte they move is charged on the network as ``wire_scale`` bytes (the big
model's size over the small one's), with the compute model standing for the big model's step.

Not simulated: torch DDP (its reducer talks to torch.distributed itself: ``ddp`` is refused),
GPUs (ranks compute on the CPU; a compute model or profile stands for the accelerator).
"""

from __future__ import annotations

import dataclasses
import resource
import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import nn

from trainers import clock
from trainers.config import Config
from trainers.datasets import shared_datasets

from .comm import SimComm
from .elastic import ElasticSimComm
from .engine import ComputeModel, Deadlock, Simulator
from trainers.padding import backward_shares, layer_macs, measured_shares, owning_layers  # as on the wall clock

__all__ = ["ComputeModel", "Deadlock", "ElasticSimComm", "SimComm", "SimulatedRun", "Simulator", "run_simulated",
           "UNSUPPORTED_ALGORITHMS"]

# Algorithms whose communication does not go through the comm layer.
UNSUPPORTED_ALGORITHMS = {"ddp": "torch DDP's reducer talks to torch.distributed itself, not to the comm layer"}


class SimClock:
    """``trainers.clock`` on the simulator: readings are virtual time, compute charges the model."""

    def __init__(self, sim: Simulator, epoch_unix: float):
        self.sim = sim
        self.epoch_unix = epoch_unix
        self._charged: dict[int, float] = {}  # rank -> compute already charged this forward+backward
        self._padded: dict[int, float] = {}   # rank -> layers' pads (``pad``) this forward+backward

    def perf_counter(self) -> float:
        self.sim.settle()
        return self.sim.now

    monotonic = perf_counter

    def time(self) -> float:
        self.sim.settle()
        return self.epoch_unix + self.sim.now

    def sleep(self, seconds: float) -> None:
        self.sim.sleep(seconds)

    def pad(self, seconds: float) -> None:
        """A layer's pad (``pad_layers``): virtual time that ``compute_done`` counts as compute,
        as the wall clock's does (its compute is the time since the pass started)."""
        rank = self.sim.rank
        self._padded[rank] = self._padded.get(rank, 0.0) + seconds
        self.sim.sleep(seconds)

    def forget(self, rank: int) -> None:
        """A rank's process was replaced: what its killed predecessor charged is no one's."""
        self._charged.pop(rank, None)
        self._padded.pop(rank, None)

    def compute_s(self, rank: int) -> float:
        """``rank``'s forward + backward time by the compute model (s), its straggler factor applied."""
        return self.sim.compute.forward_backward_s * self.sim.compute_factor.get(rank, 1.0)

    def compute_done(self, started: float) -> float:
        """The forward + backward's compute: the model's (what is left of it charged now) plus
        the layers' pads. Without counting the pads, a step's own pad to ``min_compute_s`` would
        be added on top of them (the step charged twice its profile)."""
        rank = self.sim.rank
        total = self.compute_s(rank)
        self.sim.sleep(total - self._charged.pop(rank, 0.0))
        return total + self._padded.pop(rank, 0.0)

    def step_done(self) -> None:
        overhead = self.sim.compute.step_overhead_s * self.sim.compute_factor.get(self.sim.rank, 1.0)
        self.sim.sleep(overhead)

    def training_starts(self) -> None:
        """Hold this rank to its start offset (``Simulator.training_starts``)."""
        self.sim.training_starts()

    def attach(self, model: nn.Module, layer_shares: Optional[list] = None) -> None:
        """Spread each forward + backward over ``model``'s layers, so that what an algorithm does
        from its hooks overlaps the rest of the pass: see :class:`_ComputeSpread` (``layer_shares``:
        measured per-layer shares, trainers.padding.measured_shares)."""
        _ComputeSpread(self, model, layer_shares)

    def charged_s(self, rank: int) -> float:
        """What ``rank`` has spent of its current forward + backward so far (s)."""
        return self._charged.get(rank, 0.0)

    def charge(self, seconds: float) -> None:
        """Spend ``seconds`` of this rank's forward + backward now (never more than it has left)."""
        rank = self.sim.rank
        already = self._charged.get(rank, 0.0)
        spend = min(seconds, self.compute_s(rank) - already)
        self._charged[rank] = already + spend
        self.sim.sleep(spend)


class _ComputeSpread:
    """How one rank's forward + backward time is spread over its model's layers (the modules that
    own parameters): in proportion to each layer's multiply-accumulates, estimated in the first
    forward pass as weight elements x output positions (a conv layer's weights meet every pixel, a
    linear layer's every sample), so a conv net's time sits in its convolutions even where its
    parameters sit in the fully connected layers. The forward share (``forward_fraction``) is
    charged as each layer's forward ends, the rest as each parameter's gradient is accumulated (a
    layer's share split by its parameters' sizes). In the first step, before the estimate exists,
    the forward share is charged with the first gradient.

    With measured ``layer_shares`` (trainers.padding.measured_shares: per layer, its share of the
    step in the forward and in the backward pass, as an accelerator spent it) those are charged
    instead, from the first step, and the compute model's ``forward_fraction`` is not used (the
    shares carry it)."""

    def __init__(self, clock: SimClock, model: nn.Module, layer_shares: Optional[list] = None):
        self.clock = clock
        self.layers = owning_layers(model)
        self.macs = [0] * len(self.layers)    # per layer, summed over the first forward pass
        self.estimated = False                 # set by the first gradient: the first forward is over
        self.share: dict[int, float] = {}      # id(param) -> its share of the backward pass
        self.forward_shares: Optional[list[float]] = None  # measured, per layer
        if layer_shares is not None:
            self.forward_shares, self.share = measured_shares(self.layers, layer_shares)
            self.estimated = True
        for index, (module, params) in enumerate(self.layers):
            module.register_forward_hook(lambda m, inputs, output, index=index: self._forward_done(index, output))
            for param in params:
                param.register_post_accumulate_grad_hook(lambda p, index=index: self._gradient_done(p))

    def _forward_done(self, index: int, output) -> None:
        module, params = self.layers[index]
        if self.forward_shares is not None:
            self.clock.charge(self.clock.compute_s(self.clock.sim.rank) * self.forward_shares[index])
        elif not self.estimated:
            self.macs[index] += layer_macs(module, params, output)
        elif sum(self.macs):
            compute = self.clock.compute_s(self.clock.sim.rank)
            fraction = layer_macs(module, params, output) / sum(self.macs)
            self.clock.charge(self.clock.sim.compute.forward_fraction * compute * fraction)

    def _gradient_done(self, param: nn.Parameter) -> None:
        if not self.estimated:
            self._estimate()
        rank = self.clock.sim.rank
        compute = self.clock.compute_s(rank)
        if self.forward_shares is not None:  # measured: the backward share is in the share
            self.clock.charge(compute * self.share[id(param)])
            return
        forward = self.clock.sim.compute.forward_fraction
        first = self.clock.charged_s(rank) == 0.0  # the forward was not charged layer by layer
        self.clock.charge((forward * compute if first else 0.0) + (1 - forward) * compute * self.share[id(param)])

    def _estimate(self) -> None:
        """Fix each parameter's share of the backward pass (by parameter sizes where no forward
        pass was seen: then the forward is charged with the first gradient every step)."""
        self.estimated = True
        self.share = backward_shares(self.layers, self.macs)


@dataclasses.dataclass(frozen=True)
class SimulatedRun(Sequence):
    """What :func:`run_simulated` hands back: each rank's ``RunResult`` (its last process's; None
    for a rank killed and not restarted), indexed and iterated as a list, and the crash facts,
    which the simulator kept (what the harness's ``JobProcesses`` keeps on tun).

    Args:
        results: per rank.
        crashed_at: rank -> virtual s of its last kill (``Simulator.crashed_at``).
        restarts: rank -> how often it was restarted, ranks never restarted left out
            (``Simulator.generation``).
    """

    results: list
    crashed_at: dict[int, float]
    restarts: dict[int, int]

    @classmethod
    def of(cls, sim: Simulator, results: list) -> "SimulatedRun":
        return cls(list(results), dict(sim.crashed_at),
                   {rank: generation for rank, generation in enumerate(sim.generation) if generation})

    def __getitem__(self, index):
        return self.results[index]

    def __len__(self) -> int:
        return len(self.results)


def run_simulated(config: Config, world_size: int, network, compute: ComputeModel,
                  actions: Sequence[tuple[float, Callable[[Simulator], None]]] = (),
                  max_time_s: Optional[float] = None, wire_scale: float = 1.0) -> SimulatedRun:
    """Run ``world_size`` ranks of ``config`` on ``network`` and ``compute``; returns each rank's
    ``RunResult`` with the ranks killed and restarted (:class:`SimulatedRun`).
    ``actions``: (virtual s, fn(simulator)) run at those times (faults: link changes through
    ``simulator.network.set_link``, stragglers through ``simulator.compute_factor``, crashes and
    restarts through ``simulator.crash`` / ``simulator.restart``). ``wire_scale``: every message
    and collective charged at this many times its real bytes (a stand-in model,
    ``Simulator.wire_bytes``). Raises the first rank's error, naming the ranks killed before it
    (every rank's records say how it ended)."""
    from trainers.loading import cannot_take_back, uses_elastic_comm
    from trainers.runner import run

    if config.algorithm.name in UNSUPPORTED_ALGORITHMS:
        raise ValueError(f"algorithm {config.algorithm.name} cannot run on sim: "
                         f"{UNSUPPORTED_ALGORITHMS[config.algorithm.name]}")
    if config.device != "cpu":
        raise ValueError(f"device {config.device}: simulated ranks compute on the cpu (a compute model stands "
                         "for the accelerator)")
    if getattr(network, "size", world_size) != world_size:
        raise ValueError(f"the network has {network.size} nodes, the job {world_size} ranks")
    _raise_open_files_limit()
    sim = Simulator(world_size, network, compute, max_time_s=max_time_s, wire_scale=wire_scale)
    sim_clock = SimClock(sim, time.time())
    results: list = [None] * world_size
    elastic = uses_elastic_comm(config)

    def comm(rank: int, generation: int):
        if elastic:
            return ElasticSimComm(sim, rank, generation)
        return SimComm(sim, rank, config.comm.allreduce, config.comm.max_in_flight)

    def target(rank: int, generation: int = 0) -> Callable[[], None]:
        def body():
            sim_clock.forget(rank)
            results[rank] = run(config, comm_factory=lambda: comm(rank, generation))
        return body

    if elastic:
        sim.respawn = target  # a restarted process rejoins (its comm's generation > 0)
    else:
        sim.restart_refusal = cannot_take_back(config.algorithm.name)
    previous = clock.install(sim_clock)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks run one at a time; one thread keeps every reduction's order fixed
    try:
        with shared_datasets():
            sim.run([target(rank) for rank in range(world_size)], actions)
    finally:
        clock.install(previous)
        torch.set_num_threads(threads)
    killed = "; ".join(f"rank {r} killed by the injected node_crash at {t:.3f} s"
                       for r, t in sorted(sim.crashed_at.items()))
    if sim.errors:
        rank, error = min(sim.errors.items())
        raise RuntimeError(f"{killed + '; ' if killed else ''}rank {rank} failed at simulated {sim.now:.3f} s: "
                           f"{type(error).__name__}: {error}") from error
    if killed and not elastic:  # the others ended before the crash reached them: still a lost rank
        raise RuntimeError(f"{killed}: {cannot_take_back(config.algorithm.name)}")
    return SimulatedRun.of(sim, results)


def _raise_open_files_limit() -> None:
    """Every rank keeps its records file open: 1,024 ranks need more than the usual 1,024 files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # Linux's fs.nr_open default
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
