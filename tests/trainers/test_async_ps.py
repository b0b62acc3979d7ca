"""`async_ps`: one worker is exactly single-process SGD; four ranks train; parameters are checked."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainers.conftest import evaluations, BASE_CONFIG, merge, records, run_training
from trainers.algorithms import get_algorithm
from trainers.algorithms.async_ps import AsyncPS, AsyncPSParams
from trainers.algorithms.ps_common import split_ranges
from trainers.config import ConfigError
from trainers.loading import load_config
from trainers.datasets import BatchSampler, load_dataset, shard_indices
from trainers.models import build_model
from trainers.training import evaluate, loss_fn


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"server_ranks": []}, "server_ranks"),
        ({"server_ranks": [0, 0]}, "server_ranks"),
        ({"server_ranks": [-1]}, "server_ranks"),
        ({"pull_every": 0}, "pull_every"),
        ({"staleness_aware_lr": "yes"}, "staleness_aware_lr"),
    ],
)
def test_params_name_the_bad_field(changes, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        AsyncPSParams(**changes)


@pytest.mark.parametrize("aware, expected", [(True, -0.1 - 0.1 / 4), (False, -0.2)])
def test_a_stale_gradient_moves_the_server_by_lr_over_its_staleness(aware, expected):
    """Zhang et al.'s staleness-aware rule on the server's own apply: lr / max(1, staleness)."""
    server = AsyncPS.__new__(AsyncPS)  # only the server's apply, without a comm
    server.params, server.lr = AsyncPSParams(staleness_aware_lr=aware), 0.1
    server.server_param = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    server.shard = server.server_param.data
    server.server_optimizer = torch.optim.SGD([server.server_param], lr=0.1)
    server.server_apply(torch.ones(3), want_reply=False, staleness=0)  # fresh: the full lr
    reply = server.server_apply(torch.ones(3), want_reply=True, staleness=4)
    assert torch.allclose(reply, torch.full((3,), expected))


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


@pytest.mark.slow
def test_two_servers_one_worker_pulling_every_other_step_is_still_sgd(tmp_path):
    """Servers [2, 0] (rank 2 holds the first range, rank 0 the second; the deployable model is
    gathered from both) and a worker that pulls every 2nd step and steps locally with plain SGD in
    between: with momentum 0 that is still exactly SGD. Staleness at a pull counts the worker's
    own unpulled push."""
    changes = {"steps": 10, "eval_every": 10, "save_final_model": True}
    out = run_training(tmp_path, 3, {**changes, "algorithm": {"name": "async_ps", "params": {"server_ranks": [2, 0], "pull_every": 2}}})
    reference = single_process_sgd_on_rank(1, 3, 10, changes)
    trained = torch.load(out / "rank1_final.pt")
    assert max((trained[k] - reference[k]).abs().max().item() for k in reference) < 1e-6
    assert [r["staleness"] for r in records(out, 1, "step")] == [None, 1] * 5
    # The evaluator joined the servers' ranges (rank 2's and rank 0's snapshots): the worker's
    # parameters after its last pull.
    worker_model = RunnerData(changes, 3).model()
    worker_model.load_state_dict(trained)
    data = RunnerData(changes, 3).data
    accuracy, loss = evaluate(worker_model, data.test_x, data.test_y, torch.device("cpu"))
    assert evaluations(out)[-1]["loss"] == pytest.approx(loss, abs=1e-6)


@pytest.mark.slow
def test_reaches_accuracy_with_one_server_and_three_workers(tmp_path):
    """Measured (seed 3, MLP [32] on digits, batch 16, lr 0.1, no momentum, rank 0 the server):
    held-out accuracy of the server's parameters 0.85 at step 60, 0.90 at step 100. Asynchronous,
    so not bit-reproducible; we ask for 0.80 at step 100."""
    out = run_training(tmp_path, 4, {"steps": 100, "eval_every": 50, "algorithm": {"name": "async_ps"}})
    evals = evaluations(out)
    assert evals[-1]["step"] == 99 and evals[-1]["accuracy"] >= 0.80
    staleness = [r["staleness"] for r in records(out, 0, "step") if r["staleness"] is not None]
    assert staleness and max(staleness) >= 1  # three workers pushing: the server sees stale gradients
    for worker in (1, 2, 3):
        assert all(r["staleness"] is not None for r in records(out, worker, "step"))  # pulls every step
