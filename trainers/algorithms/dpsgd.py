"""`dpsgd`: D-PSGD (Lian et al. 2017), synchronous neighbour averaging on a communication graph.

Every step, rank i sends its parameters x_i to its neighbours and, while they travel, computes its
gradient g_i at x_i; then x_i <- sum_j W_ij x_j - lr * g_i (the local optimizer applies g_i to the
mixed model, so momentum and weight decay stay local). W is the Metropolis-Hastings matrix of the
graph (doubly stochastic, so the mean of the replicas follows plain SGD on the mean gradient).
Graphs: ``ring``, ``torus`` (most square 2-D torus) and ``random`` (Erdos-Renyi with
``edge_probability``, drawn anew each step from ``seed`` and the step, identical on every rank).
A rank waits only for its neighbours, never for all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.gossip_common import (
    Graph, GossipAlgorithm, metropolis_weights, random_graph, ring_graph, torus_graph,
)
from trainers.config import require_choice, require_float, require_int


@dataclass
class DPSGDParams:
    """Args: topology: ring | torus | random; edge_probability: chance of each link of the random
    graph (drawn every step); seed: seed of the random graphs (the same on every rank)."""

    topology: Literal["ring", "torus", "random"] = "ring"
    edge_probability: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        require_choice("topology", self.topology, ("ring", "torus", "random"))
        require_float("edge_probability", self.edge_probability, minimum=0.0, maximum=1.0)
        require_int("seed", self.seed, minimum=0)


class DPSGD(GossipAlgorithm):
    """Decentralized parallel SGD: mix with graph neighbours every step, then a local gradient step."""

    name = "dpsgd"
    Params = DPSGDParams

    def __init__(self, params: DPSGDParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        n = self.comm.world_size
        self._fixed_graph = {"ring": ring_graph, "torus": torus_graph}.get(params.topology, lambda _: None)(n)

    def graph(self, step: int) -> Graph:
        """The communication graph of ``step``."""
        if self._fixed_graph is not None:
            return self._fixed_graph
        return random_graph(self.comm.world_size, self.params.edge_probability, self.params.seed, step)

    def train_step(self, step: int, batch: tuple) -> StepResult:
        rank = self.comm.rank
        graph = self.graph(step)
        weights = metropolis_weights(graph)[rank]
        local = self.flat_parameters()
        received, works = self.start_exchange(list(graph[rank]), local)
        loss = self.forward_backward(batch)  # gradient at x_i while the models travel
        received = self.wait_exchange(received, works)
        # A neighbour that is gone gives its weight to the local model (rows still sum to 1).
        missing = sum(weights[peer].item() for peer in graph[rank] if peer not in received)
        mixed = local * (weights[rank].item() + missing)
        for peer, model in received.items():
            mixed.add_(model, alpha=weights[peer].item())
        self.load_flat_parameters(mixed)
        if received:
            self.note_sync()
        self.optimizer.step()
        return StepResult(loss=loss, staleness=0)
