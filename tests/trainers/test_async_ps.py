"""`async_ps`: one worker is exactly single-process SGD; four ranks train; parameters are checked."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainers.conftest import BASE_CONFIG, merge, records, run_training
from trainers.algorithms import get_algorithm
from trainers.algorithms.async_ps import AsyncPS, AsyncPSParams
from trainers.algorithms.ps_common import split_ranges
from trainers.config import ConfigError, load_config
from trainers.datasets import BatchSampler, load_dataset, shard_indices
from trainers.models import build_model
from trainers.training import loss_fn


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"server_ranks": []}, "server_ranks"),
        ({"server_ranks": [0, 0]}, "server_ranks"),
        ({"server_ranks": [-1]}, "server_ranks"),
        ({"pull_every": 0}, "pull_every"),
    ],
)
def test_params_name_the_bad_field(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        AsyncPSParams(**changes)


def test_registered_and_ranges_cover_everything():
    assert get_algorithm("async_ps") is AsyncPS
    assert split_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert split_ranges(2, 2) == [(0, 1), (1, 2)]


class RunnerData:
    """The model init and per-rank batches the runner uses for a config (BASE_CONFIG + changes)."""

    def __init__(self, changes: dict, world_size: int):
        self.config = load_config(merge(BASE_CONFIG, {**changes, "output_dir": "/tmp/unused"}))
        config = self.config
        self.data = load_dataset(config.dataset, config.seed)
        shards = shard_indices(self.data.train_y, world_size, config.dataset.shard, config.dataset.alpha, config.seed)
        self.samplers = [BatchSampler(shards[r], config.batch_size, seed=config.seed * 1000 + r) for r in range(world_size)]

    def model(self) -> torch.nn.Module:
        config = self.config
        return build_model(config.model.name, config.model.params, self.data.input_shape, self.data.num_classes, config.seed)

    def next_batch(self, rank: int) -> tuple:
        indices = self.samplers[rank].next_indices()
        return self.data.train_x[indices], self.data.train_y[indices]


def single_process_sgd_on_rank(rank: int, world_size: int, steps: int, changes: dict) -> dict:
    """Plain SGD on the batches the runner gives ``rank`` of ``world_size`` (same data, sampler, init)."""
    runner_data = RunnerData(changes, world_size)
    model = runner_data.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=runner_data.config.lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss_fn(model, runner_data.next_batch(rank)).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.slow
def test_one_worker_is_single_process_sgd(tmp_path):
    """Server rank 0 + worker rank 1, pulling every step: no staleness, exactly SGD (1e-6)."""
    changes = {"steps": 20, "eval_every": 10, "save_final_model": True}
    out = run_training(tmp_path, 2, {**changes, "algorithm": {"name": "async_ps"}})
    reference = single_process_sgd_on_rank(1, 2, 20, changes)
    for rank in (0, 1):  # the server's parameters, and the worker's after its last pull
        trained = torch.load(out / f"rank{rank}_final.pt")
        difference = max((trained[k] - reference[k]).abs().max().item() for k in reference)
        assert difference < 1e-6, f"rank {rank} differs from single-process SGD by {difference}"
    worker_steps = records(out, 1, "step")
    assert [r["staleness"] for r in worker_steps] == [0] * 20
    server_steps = records(out, 0, "step")
    assert [r["staleness"] for r in server_steps] == [0] * 20
    # The server reports the loss its worker sent.
    assert [r["loss"] for r in server_steps] == pytest.approx([r["loss"] for r in worker_steps])
