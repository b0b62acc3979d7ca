"""SwarmSGD's asynchronous interaction on the simulator (deterministic virtual clock): partners are
drawn per interaction (not a per-round matching) and uniformly; a node never waits for a particular
peer (a slow rank leaves the others' step rate unchanged, where the round-based exchange is dragged
down); one interaction is exactly the pairwise average; the mean of the models is preserved."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.trainers.conftest import BASE_CONFIG, merge, records
from tests.trainers.test_sim import network
from trainers.algorithms import AlgorithmContext, register_algorithm
from trainers.algorithms.swarmsgd import SwarmSGD, SwarmSGDParams
from trainers.config import OptimizerConfig
from trainers.loading import load_config
from trainers.sim import ComputeModel, run_simulated

PROBES: dict[int, "SwarmProbe"] = {}  # rank -> the algorithm of the last simulated run


@register_algorithm
class SwarmProbe(SwarmSGD):
    """SwarmSGD that keeps itself for the test; ``spread``: rank-seeded N(0, 1) offsets after the
    start-up broadcast (so that replicas differ), recorded as ``initial``; ``frozen``: learning
    rate 0 (only the averaging moves the models; the config refuses lr 0)."""

    name = "swarmsgd_probe"
    spread = False
    frozen = False
    only_rank0_initiates = False

    def setup(self) -> None:
        super().setup()
        PROBES[self.comm.rank] = self
        if self.spread:
            generator = torch.Generator().manual_seed(100 + self.comm.rank)
            with torch.no_grad():
                for param in self._params:
                    param.add_(torch.randn(param.shape, generator=generator))
        self.initial = self.flat_parameters()

    def set_lr(self, lr: float) -> None:
        super().set_lr(0.0 if self.frozen else lr)

    def _due(self) -> bool:
        if self.only_rank0_initiates:  # one interaction in the whole run: rank 0's first
            return self.comm.rank == 0 and not self.swarm.partners
        return super()._due()


def simulate(tmp_path: Path, name: str, world_size: int, params: dict, steps: int,
             latency_s: float = 0.001, slow_rank=None, **probe) -> dict[int, SwarmProbe]:
    """Run SwarmProbe on ``world_size`` simulated ranks (10 ms of compute a step; ``slow_rank``
    computes 10x slower); returns each rank's algorithm."""
    PROBES.clear()
    defaults = {key: getattr(SwarmProbe, key) for key in probe}
    for key, value in probe.items():
        setattr(SwarmProbe, key, value)
    try:
        cfg = load_config(merge(BASE_CONFIG, {"steps": steps, "eval_every": steps, "output_dir": str(tmp_path / name),
                                              "algorithm": {"name": "swarmsgd_probe", "params": params}}))
        actions = [] if slow_rank is None else [(0.0, lambda sim: sim.compute_factor.__setitem__(slow_rank, 10.0))]
        run_simulated(cfg, world_size, network(world_size, latency_s, 10e6), ComputeModel(0.01, 0.001), actions)
    finally:
        for key, value in defaults.items():
            setattr(SwarmProbe, key, value)
    return dict(PROBES)


def mean_step_s(output_dir: Path, rank: int) -> float:
    """Mean step time of a rank, its last step (which waits for the others at the end) left out."""
    steps = records(output_dir, rank, "step")[:-1]
    return sum(r["step_s"] for r in steps) / len(steps)


def test_partners_are_drawn_per_interaction_uniformly_and_not_from_a_matching(tmp_path):
    n = 8
    probes = simulate(tmp_path, "uniform", n, {"H": 1, "quantize": "none"}, steps=150)
    partners = {rank: probes[rank].swarm.partners for rank in range(n)}
    started = sum(len(p) for p in partners.values())
    answered = {rank: len(probes[rank].swarm.answered) + probes[rank].swarm.crossed for rank in range(n)}
    assert started > 40 * n and sum(answered.values()) == started  # every request answered once
    # Not a per-round matching: in the k-th interaction of every node, some partner is picked by
    # two initiators, or picked without picking back (a matching pairs i and j both ways).
    periods = min(len(p) for p in partners.values())
    collisions = 0
    for k in range(periods):
        picked = [partners[rank][k] for rank in range(n)]
        collisions += len(set(picked)) < n or any(partners[p][k] != rank for rank, p in enumerate(picked))
    assert collisions > 0.9 * periods
    # ... and the number of requests a node answers varies (a matching gives each node one per round).
    assert max(answered.values()) - min(answered.values()) >= 5, answered
    # Uniform over the neighbours: offsets (partner - initiator) mod n pooled over the initiators,
    # chi-square with 6 degrees of freedom below its 0.999 quantile (22.46); fixed seed, no flake.
    counts = torch.zeros(n - 1)
    for rank, picks in partners.items():
        for partner in picks:
            assert partner != rank
            counts[(partner - rank) % n - 1] += 1
    expected = started / (n - 1)
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 22.46, (counts.tolist(), chi_square)


def test_a_slow_rank_leaves_the_others_step_rate_unchanged_where_rounds_drag_them_down(tmp_path):
    """Rank 3 computes 10x slower. The async interaction: ranks 0-2 keep their step time within 2%
    (and still average with rank 3, which answers from its receive path). The round-based
    exchange (the earlier SwarmSGD, kept as interaction: rounds) fails the same check: each round's
    partner is waited for, so ranks 0-2 slow down by more than 2x."""
    ratios = {}
    for interaction in ("async", "rounds"):
        params = {"H": 2, "interaction": interaction}
        base = simulate(tmp_path, f"{interaction}-even", 4, params, steps=40, latency_s=0.03)
        slow = simulate(tmp_path, f"{interaction}-slow", 4, params, steps=40, latency_s=0.03, slow_rank=3)
        ratios[interaction] = [mean_step_s(tmp_path / f"{interaction}-slow", r) / mean_step_s(tmp_path / f"{interaction}-even", r)
                               for r in range(3)]
        if interaction == "async":
            assert mean_step_s(tmp_path / "async-slow", 3) > 5 * mean_step_s(tmp_path / "async-even", 3)  # it is slow
            assert any(3 in slow[r].swarm.partners for r in range(3))  # the fast ones picked it ...
            assert any(r in slow[3].swarm.answered for r in range(3))  # ... and it answered them
            assert all(base[r].swarm.partners for r in range(4))
    assert all(abs(ratio - 1) < 0.02 for ratio in ratios["async"]), ratios
    assert all(ratio > 2 for ratio in ratios["rounds"]), ratios


def test_one_interaction_without_quantization_and_local_progress_is_exactly_the_average(tmp_path):
    probes = simulate(tmp_path, "exact", 4, {"H": 1, "quantize": "none"}, steps=6, frozen=True, spread=True,
                      only_rank0_initiates=True)
    partner = probes[0].swarm.partners[0]
    assert probes[0].swarm.partners == [partner] and probes[partner].swarm.answered == [0]
    x0, xp = probes[0].initial, probes[partner].initial
    average = x0 + (xp - x0) * 0.5
    assert torch.equal(probes[0].flat_parameters(), average)
    assert torch.allclose(probes[partner].flat_parameters(), average, rtol=0, atol=1e-6)  # xp + (x0 - xp)/2
    assert (x0 - xp).abs().max() > 1  # the two differed
    for rank in set(range(4)) - {0, partner}:
        assert torch.equal(probes[rank].flat_parameters(), probes[rank].initial)  # nobody else moved
    assert probes[0].syncs_applied == 1 and probes[partner].syncs_applied == 1


@pytest.mark.parametrize("quantize", ["none", "qsgd"])
def test_the_mean_of_the_models_is_preserved_and_they_reach_consensus(tmp_path, quantize):
    """lr = 0, replicas spread apart, every node interacting as often as it can (overlaps and
    crossings included): the mean model stays (float rounding apart), the disagreement falls."""
    n = 6
    probes = simulate(tmp_path, quantize, n, {"H": 1, "quantize": quantize}, steps=60, frozen=True, spread=True)
    initial = torch.stack([probes[r].initial for r in range(n)]).double()
    final = torch.stack([probes[r].flat_parameters() for r in range(n)]).double()
    assert (initial.mean(0) - final.mean(0)).abs().max().item() < 1e-5
    disagreement = lambda x: ((x - x.mean(0)) ** 2).sum().item()  # noqa: E731
    assert disagreement(final) < 0.01 * disagreement(initial)
    assert sum(probes[r].swarm.crossed for r in range(n)) > 0  # crossings happened and were cancelled


def _context(comm) -> AlgorithmContext:
    model = torch.nn.Linear(3, 2)
    return AlgorithmContext(model=model, comm=comm, loss_fn=None, optimizer=OptimizerConfig(), lr=0.1,
                            device=torch.device("cpu"))


def test_a_comm_without_tagged_messages_gets_rounds_on_auto_and_refuses_async(caplog):
    def no_driver():
        raise NotImplementedError("TcpComm has no tagged point-to-point messages")

    comm = SimpleNamespace(rank=0, world_size=2, stream_driver=no_driver)
    assert SwarmSGD(SwarmSGDParams(), _context(comm)).interaction == "rounds"
    assert "round-based exchange" in caplog.text
    with pytest.raises(ValueError, match=r"^interaction: async needs the comm's tagged point-to-point messages"):
        SwarmSGD(SwarmSGDParams(interaction="async"), _context(comm))


def test_a_single_rank_trains_alone(tmp_path):
    probes = simulate(tmp_path, "alone", 1, {"H": 1}, steps=5)
    assert probes[0].swarm.partners == [] and probes[0].syncs_applied == 0
