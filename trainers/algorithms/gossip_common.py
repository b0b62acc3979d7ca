"""Shared pieces of the decentralized (gossip) algorithms `dpsgd`, `adpsgd` and `swarmsgd`.

Communication graphs and partner schedules are pure functions of (world size, seed, step), so
every rank computes the same graph without talking to anyone, and tests can compute it too.
Every replica differs; the deployable model is the mean of all replicas, computed at evaluation
with one all_reduce (counted in the eval record, not in step records).

Crash tolerance (on an elastic comm): an exchange skips peers that are not live and drops a peer
lost during the exchange (:meth:`GossipAlgorithm.wait_exchange`); each algorithm says what a
missing model means (D-PSGD gives its weight to the local model, AD-PSGD and SwarmSGD skip the
average). A restarted rank starts again from the mean of the live replicas.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, flatten, unflatten_into
from trainers.comm import PeerLost, Work
from trainers.snapshots import OutputState

Graph = list[set[int]]  # neighbours of each rank (undirected: j in graph[i] <=> i in graph[j])


def ring_graph(world_size: int) -> Graph:
    """Each rank linked to rank +-1 (mod world size); 2 ranks share one link, 1 rank has none."""
    return [{(i - 1) % world_size, (i + 1) % world_size} - {i} for i in range(world_size)]


def torus_shape(world_size: int) -> tuple[int, int]:
    """(rows, columns) of the most square 2-D torus with ``world_size`` nodes (rows <= columns)."""
    rows = max(r for r in range(1, math.isqrt(world_size) + 1) if world_size % r == 0)
    return rows, world_size // rows


def torus_graph(world_size: int) -> Graph:
    """2-D torus: rank r = row * columns + column, linked up, down, left and right with wrap-around."""
    rows, columns = torus_shape(world_size)
    graph: Graph = []
    for rank in range(world_size):
        row, column = divmod(rank, columns)
        neighbours = {
            ((row - 1) % rows) * columns + column, ((row + 1) % rows) * columns + column,
            row * columns + (column - 1) % columns, row * columns + (column + 1) % columns,
        }
        graph.append(neighbours - {rank})
    return graph


def _generator(seed: int, index: int) -> torch.Generator:
    # Same (seed, index) -> same stream on every rank; distinct indices give unrelated streams.
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def random_graph(world_size: int, edge_probability: float, seed: int, step: int) -> Graph:
    """Erdos-Renyi graph: each pair linked with ``edge_probability``, drawn anew for every ``step``."""
    draws = torch.rand(world_size, world_size, generator=_generator(seed, step))
    graph: Graph = [set() for _ in range(world_size)]
    for i in range(world_size):
        for j in range(i + 1, world_size):
            if draws[i, j].item() < edge_probability:
                graph[i].add(j)
                graph[j].add(i)
    return graph


def metropolis_weights(graph: Graph) -> torch.Tensor:
    """Doubly stochastic mixing matrix of ``graph`` (Metropolis-Hastings weights, float64).

    W_ij = 1 / (1 + max(deg_i, deg_j)) for linked i != j, W_ii = 1 - sum of row i, 0 elsewhere;
    symmetric with rows summing to 1. On a regular graph every weight is 1 / (degree + 1).
    """
    n = len(graph)
    weights = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in graph[i]:
            weights[i, j] = 1.0 / (1 + max(len(graph[i]), len(graph[j])))
        weights[i, i] = 1.0 - weights[i].sum()
    return weights


def random_matching(world_size: int, seed: int, index: int) -> list[Optional[int]]:
    """Partner of each rank in a uniformly random matching for round ``index`` (None: no partner,
    the odd one out when the world size is odd)."""
    order = torch.randperm(world_size, generator=_generator(seed, index)).tolist()
    partners: list[Optional[int]] = [None] * world_size
    for a, b in zip(order[0::2], order[1::2]):
        partners[a], partners[b] = b, a
    return partners


def bipartite_matching(world_size: int, seed: int, index: int) -> list[Optional[int]]:
    """AD-PSGD's bipartite schedule: even ranks (active) each paired with a random odd rank
    (passive) for step ``index``; an active rank left over (odd world size) has no partner."""
    active = list(range(0, world_size, 2))
    passive = list(range(1, world_size, 2))
    shuffled = [passive[i] for i in torch.randperm(len(passive), generator=_generator(seed, index)).tolist()]
    partners: list[Optional[int]] = [None] * world_size
    for a, p in zip(active, shuffled):
        partners[a], partners[p] = p, a
    return partners


class GossipAlgorithm(Algorithm):
    """Base of the gossip algorithms: replicas exchange whole models with a few peers, point to point.

    Parameters (not buffers) are gossiped; the deployable model averages both.
    """

    tolerates_crash = True

    def __init__(self, params, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self._params = [p for p in self.model.parameters() if p.is_floating_point()]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise ValueError(f"{self.name}: gossip needs one parameter dtype, the model has {sorted(map(str, dtypes))}")

    def flat_parameters(self) -> torch.Tensor:
        """A new 1-D copy of the gossiped parameters."""
        return flatten(self._params)

    def load_flat_parameters(self, flat: torch.Tensor) -> None:
        """Write ``flat`` (as from :meth:`flat_parameters`) into the model's parameters."""
        unflatten_into(flat, self._params)

    def start_exchange(self, peers: list[int], payload: torch.Tensor) -> tuple[dict[int, torch.Tensor], list[Work]]:
        """Send ``payload`` to every live peer and receive one of the same shape from each, in the background.

        Returns the receive buffers by peer and the handles to wait on (valid after
        :meth:`wait_exchange`). Peers that are not live are left out.
        """
        received: dict[int, torch.Tensor] = {}
        works: list[Work] = []
        for peer in sorted(peers):
            if not self.comm.is_live(peer):
                continue
            try:
                works.append(self.comm.isend(payload, peer))
                received[peer] = torch.empty_like(payload)
                works.append(self.comm.irecv(received[peer], peer))
            except PeerLost:
                received.pop(peer, None)
        return received, works

    def wait_exchange(self, received: dict[int, torch.Tensor], works: list[Work]) -> dict[int, torch.Tensor]:
        """Wait for an exchange; returns the models that arrived, by peer (a peer lost meanwhile is left out)."""
        for work in works:
            try:
                work.wait()
            except PeerLost as lost:
                received.pop(lost.rank, None)
        return received

    def output_state(self) -> OutputState:
        """Every rank's replica (no communication); their mean is the output model."""
        return self.replica_state()

    def deployable_model(self) -> nn.Module:
        """The mean of all replicas (one all_reduce, traffic counted in the eval record)."""
        return self.averaged_copy()
