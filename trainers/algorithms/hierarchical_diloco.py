"""`hierarchical_diloco`: DiLoCo across regions, model averaging inside each region.

Ranks are grouped into regions of consecutive ranks (``region_sizes``, e.g. [2, 2, 2, 2]: the
harness numbers nodes region by region in the topology's order, and fills ``region_sizes`` from
the job's nodes per region when the scenario does not set it; harness/scenario.py). Each rank
trains its replica with inner AdamW (as `diloco`) and

* every ``H_inner`` steps (except where an outer step falls) the replicas of a region are
  replaced by their mean: cheap, the region's links are short and fast;
* every ``H_outer`` steps (a multiple of ``H_inner``) the DiLoCo outer step runs over all ranks:
  the pseudo-gradient theta_g - theta_local is averaged over every rank, the outer Nesterov SGD
  moves theta_g, and every replica restarts from theta_g.

Sub-group exchange: trainers/comm has no process groups (every collective spans all ranks), so
both exchanges are point-to-point through each region's first rank (its leader): members send
their vector to the leader, which sums the region in rank order. Inside a region the leader
returns the mean. At an outer step the leaders then send their region sums to each other (one
message per pair of leaders: the only cross-region traffic, every ``H_outer`` steps, and only
leader to leader), each leader sums the regions' sums in region order, divides by the world size
and returns the mean to its members. Gather/scatter rather than a ring: regions are small (a few
nodes), one gather and one scatter is two one-way delays against a ring's 2(n-1), and the fixed
summation order gives every rank bitwise the same mean. Cost: the leader receives and sends
(n-1) whole vectors; a ring would balance that for large regions.

With one region and ``H_inner == H_outer`` this is `diloco` (up to summation order); with one rank
per region it is `diloco` with H = H_outer. Not crash tolerant; BatchNorm buffers are averaged
with the parameters at both levels (as `diloco` averages them at its outer step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult, flatten, unflatten_into
from trainers.algorithms.diloco_common import (
    GlobalModelAlgorithm, check_outer_sgd, float_buffers, outer_step, pseudo_gradient,
)
from trainers.config import ConfigError, require_int


@dataclass
class HierarchicalDiLoCoParams:
    """Args:
        H_inner: steps between averages inside a region.
        H_outer: steps between DiLoCo outer steps over all ranks (a multiple of H_inner).
        outer_lr, outer_momentum, nesterov: the outer SGD, as `diloco`.
        region_sizes: ranks per region in rank order (their sum must be the world size); None:
            one region of all ranks (the harness fills it from the scenario's nodes per region).
    """

    H_inner: int = 10
    H_outer: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    region_sizes: Optional[list[int]] = None

    def __post_init__(self) -> None:
        require_int("H_inner", self.H_inner, minimum=1)
        require_int("H_outer", self.H_outer, minimum=1)
        if self.H_outer % self.H_inner:
            raise ConfigError("H_outer", f"must be a multiple of H_inner ({self.H_inner}), got {self.H_outer}")
        check_outer_sgd(self.outer_lr, self.outer_momentum, self.nesterov)
        if self.region_sizes is not None:
            if not isinstance(self.region_sizes, list) or not self.region_sizes:
                raise ConfigError("region_sizes", f"expected a non-empty list of integers, got {self.region_sizes!r}")
            for size in self.region_sizes:
                if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                    raise ConfigError("region_sizes", f"expected integers >= 1, got {self.region_sizes!r}")


def region_leaders(region_sizes: list[int]) -> list[int]:
    """The first rank of each region (regions are runs of consecutive ranks)."""
    leaders, first = [], 0
    for size in region_sizes:
        leaders.append(first)
        first += size
    return leaders


class HierarchicalDiLoCo(GlobalModelAlgorithm):
    """Inner AdamW; replicas averaged inside a region every H_inner steps; DiLoCo's outer step every H_outer."""

    name = "hierarchical_diloco"
    Params = HierarchicalDiLoCoParams

    def __init__(self, params: HierarchicalDiLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        world, rank = ctx.comm.world_size, ctx.comm.rank
        sizes = params.region_sizes or [world]
        if sum(sizes) != world:
            raise ConfigError("region_sizes", f"{sizes} sums to {sum(sizes)} ranks, the job has {world}")
        self.leaders = region_leaders(sizes)
        self.region = max(i for i, leader in enumerate(self.leaders) if leader <= rank)
        self.leader = self.leaders[self.region]
        self.members = list(range(self.leader, self.leader + sizes[self.region]))
        self.inner_steps = 0
        self.rounds = 0

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.inner_steps += 1
        if self.inner_steps % self.params.H_outer == 0:
            self._outer_step()
        elif self.inner_steps % self.params.H_inner == 0:
            self._region_average()
        return StepResult(loss=loss)

    # -- exchanges ----------------------------------------------------------------------------

    def _region_sum(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """On the leader: the sum of the region's ``flat`` in rank order; members send theirs (None)."""
        if self.comm.rank != self.leader:
            self.comm.isend(flat, self.leader).wait()
            return None
        received = [torch.empty_like(flat) for _ in self.members[1:]]
        works = [self.comm.irecv(buffer, member) for buffer, member in zip(received, self.members[1:])]
        total = flat.clone()
        for work, buffer in zip(works, received):
            work.wait()
            total += buffer
        return total

    def _region_result(self, result: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """The leader sends ``result`` to its members; a member receives it."""
        if self.comm.rank == self.leader:
            for work in [self.comm.isend(result, member) for member in self.members[1:]]:
                work.wait()
            return result
        out = torch.empty_like(like)
        self.comm.irecv(out, self.leader).wait()
        return out

    def region_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over this rank's region (the same bits on every member)."""
        total = self._region_sum(flat)
        mean = total / len(self.members) if total is not None else None
        return self._region_result(mean, flat)

    def global_mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over all ranks; only leaders exchange across regions."""
        total = self._region_sum(flat)
        mean = None
        if total is not None:
            others = [leader for leader in self.leaders if leader != self.leader]
            received = {leader: torch.empty_like(total) for leader in others}
            recvs = [self.comm.irecv(received[leader], leader) for leader in others]
            sends = [self.comm.isend(total, leader) for leader in others]
            for work in recvs + sends:
                work.wait()
            received[self.leader] = total
            summed = torch.zeros_like(total)
            for leader in self.leaders:  # region order: the same sum on every leader
                summed += received[leader]
            mean = summed / self.comm.world_size
        return self._region_result(mean, flat)

    def _float_state(self, model: nn.Module) -> list[torch.Tensor]:
        return list(model.parameters()) + float_buffers(model)

    def _region_average(self) -> None:
        tensors = self._float_state(self.model)
        mean = self.region_mean(flatten(tensors))
        unflatten_into(mean, tensors)
        self.note_sync()

    def _outer_step(self) -> None:
        global_params = list(self.global_model.parameters())
        local_params = list(self.model.parameters())
        buffers = float_buffers(self.model)
        count = sum(p.numel() for p in local_params)
        # one message: the pseudo-gradient, then the buffers (averaged as they are)
        vector = torch.cat([pseudo_gradient(global_params, local_params), flatten(buffers)])
        mean = self.global_mean(vector)
        outer_step(global_params, mean[:count], self.outer_optimizer)
        unflatten_into(mean[count:], buffers)
        self.restart_replica()
        self.rounds += 1
        self.note_sync()
