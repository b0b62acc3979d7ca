"""`adpsgd`: AD-PSGD (Lian et al. 2018), pairwise model averaging with a random partner, no barrier.

Ranks are split as in the paper's deadlock-free bipartite scheme: even ranks are active, odd
ranks passive, and only active-passive pairs average. Instead of a lock, the pairing of each step
is a random matching drawn from ``seed`` and the step (identical on every rank), so the two ends
of a pair agree without any coordination and a rank waits only for its partner, never for all
ranks. Each step: read the local model x_i, start exchanging it with the partner, compute the
gradient at x_i meanwhile (the paper's concurrent read/compute), then x_i <- (x_i + x_p) / 2
and apply the gradient with the local optimizer. A rank left without partner (odd world size)
takes a purely local step.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainers.algorithms.base import StepResult
from trainers.algorithms.gossip_common import GossipAlgorithm, bipartite_matching
from trainers.config import require_int


@dataclass
class ADPSGDParams:
    """Args: seed: seed of the per-step partner schedule (the same on every rank)."""

    seed: int = 0

    def __post_init__(self) -> None:
        require_int("seed", self.seed, minimum=0)


class ADPSGD(GossipAlgorithm):
    """Asynchronous decentralized SGD: average with one random (active/passive) partner per step."""

    name = "adpsgd"
    Params = ADPSGDParams

    def partner(self, step: int):
        """This rank's partner at ``step`` (None: none this step)."""
        return bipartite_matching(self.comm.world_size, self.params.seed, step)[self.comm.rank]

    def train_step(self, step: int, batch: tuple) -> StepResult:
        partner = self.partner(step)
        if partner is None:
            return StepResult(loss=self._local_step(batch), staleness=None)
        local = self.flat_parameters()
        received, works = self.start_exchange([partner], local)
        loss = self.forward_backward(batch)
        received = self.wait_exchange(received, works)
        if partner in received:  # else the partner is gone: a purely local step
            self.load_flat_parameters(local.add_(received[partner]).mul_(0.5))
            self.note_sync()
        self.optimizer.step()
        return StepResult(loss=loss, staleness=0)

    def _local_step(self, batch: tuple) -> float:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        return loss
