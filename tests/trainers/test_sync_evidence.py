"""Evidence that the mechanism acted (Algorithm.note_sync -> the step records' syncs_applied), and
the `local_only` control: on sim its output equals the mean of replicas trained apart."""

import numpy as np
import pytest
import torch

from emulator.simnet import FluidNetwork
from tests.trainers.conftest import BASE_CONFIG, merge, records
from trainers.datasets import BatchSampler, load_dataset, shard_indices
from trainers.evaluate import combine_snapshots, evaluate_job
from trainers.loading import load_config
from trainers.models import build_model
from trainers.sim import ComputeModel, run_simulated
from trainers.snapshots import SNAPSHOT_DIR
from trainers.training import loss_fn, lr_at


def network(n, latency_s=0.02, rate_bytes=125e6):
    lat = np.full((n, n), latency_s)
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), rate_bytes), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=tuple(f"r{i}" for i in range(n)),
                        tcp=False)


def simulate(tmp_path, name, world_size, algorithm, **changes):
    cfg = load_config(merge(BASE_CONFIG, {"steps": 12, "eval_every": 4, "algorithm": algorithm, **changes,
                                          "output_dir": str(tmp_path / name)}))
    run_simulated(cfg, world_size, network(world_size), ComputeModel(0.004, 0.001))
    return tmp_path / name, cfg


def syncs_by_step(output_dir, rank) -> list[int]:
    return [r["syncs_applied"] for r in records(output_dir, rank, "step")]


@pytest.mark.parametrize("algorithm, expected", [
    # every step's gradient all-reduce is applied in that step
    ({"name": "sync"}, [1] * 12),
    # H = 4: averages at the ends of steps 3, 7, 11
    ({"name": "local_sgd", "params": {"H": 4}}, [0, 0, 0, 1] * 3),
    # launched when p steps are accumulated (step p - 1), applied t steps later: p - 1 + t = 5, 9;
    # the one launched at step 11 is applied by finish() in the last step
    ({"name": "dts", "params": {"p": 4, "t": 2}}, [0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 1]),
    # elastic exchanges at steps 0, tau, 2 tau
    ({"name": "easgd", "params": {"tau": 4}}, [1, 0, 0, 0] * 3),
    # outer steps at the ends of steps H - 1, 2H - 1, ...
    ({"name": "diloco", "params": {"H": 6}}, [0] * 5 + [1] + [0] * 5 + [1]),
    # neighbour mixing every step
    ({"name": "dpsgd"}, [1] * 12),
    # quantized counts through its base strategy
    ({"name": "quantized", "params": {"base": "local_sgd", "H": 6, "compressor": "fp16"}}, [0] * 5 + [1] + [0] * 5 + [1]),
    # never
    ({"name": "local_only"}, [0] * 12),
])
def test_each_algorithm_counts_the_synchronisations_it_applies(tmp_path, algorithm, expected):
    out, _ = simulate(tmp_path, algorithm["name"], 2, algorithm)
    for rank in range(2):
        assert syncs_by_step(out, rank) == expected, f"rank {rank}"


def test_p3_applies_a_steps_average_in_the_next_step_and_the_last_in_finish(tmp_path):
    out, _ = simulate(tmp_path, "p3", 2, {"name": "p3"})
    for rank in range(2):
        assert syncs_by_step(out, rank) == [0] + [1] * 10 + [2]


def test_a_parameter_server_counts_on_the_servers_the_updates_it_applies(tmp_path):
    out, _ = simulate(tmp_path, "async_ps", 3, {"name": "async_ps", "params": {"server_ranks": [0]}})
    assert sum(syncs_by_step(out, 0)) == 2 * 12  # each worker's gradient of each step
    assert sum(syncs_by_step(out, 1)) == sum(syncs_by_step(out, 2)) == 0  # a pull moves a replica, not the output


def test_swarmsgd_counts_an_average_when_it_is_applied_not_when_it_starts(tmp_path):
    out, _ = simulate(tmp_path, "swarmsgd", 2, {"name": "swarmsgd", "params": {"H": 4, "interaction": "rounds"}})
    counts = syncs_by_step(out, 0)
    assert counts[:3] == [0, 0, 0]  # the first round starts at the end of step 3
    assert sum(counts) == 3  # rounds started at steps 3, 7, 11, each applied once (the last by finish)


def test_swarmsgd_async_counts_each_half_of_an_interaction_where_it_is_applied(tmp_path):
    # 2 ranks, 6 ms steps, 20 ms one way: both start an interaction at the end of step 3 (a
    # crossing: rank 1 answers rank 0's, rank 0 cancels rank 1's). The request takes three one-way
    # delays (gloo's receive from any source answers the sender's notice first) and the reply one:
    # 80 ms, past the last step, so both halves are applied by finish (step 11), none before.
    out, _ = simulate(tmp_path, "swarmsgd-async", 2, {"name": "swarmsgd", "params": {"H": 4, "quantize": "none"}})
    assert syncs_by_step(out, 0) == syncs_by_step(out, 1) == [0] * 11 + [1]


def _trained_apart(cfg, world_size: int, rank: int) -> dict:
    """Rank ``rank``'s replica trained on its own in this process, the runner's seeds and shard
    rebuilt by hand, a plain SGD loop (no algorithm, no comm)."""
    torch.manual_seed(cfg.seed * 1000 + rank)
    data = load_dataset(cfg.dataset, cfg.seed)
    keys = data.train_y if data.train_y.dim() == 1 else data.train_y[:, 0]
    shards = shard_indices(keys, world_size, cfg.dataset.shard, cfg.dataset.alpha, cfg.seed)
    sampler = BatchSampler(shards[rank], cfg.batch_size, seed=cfg.seed * 1000 + rank)
    model = build_model(cfg.model.name, cfg.model.params, data.input_shape, data.num_classes, cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.optimizer.momentum,
                                nesterov=cfg.optimizer.nesterov, weight_decay=cfg.optimizer.weight_decay)
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.lr, cfg.lr_schedule, cfg.steps)
        indices = sampler.next_indices()
        optimizer.zero_grad(set_to_none=False)
        loss_fn(model, (data.inputs(data.train_x[indices]), data.train_y[indices])).backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_local_only_is_average_once_exactly(tmp_path):
    world_size = 3
    out, cfg = simulate(tmp_path, "local_only", world_size, {"name": "local_only"},
                        optimizer={"momentum": 0.9}, steps=15, eval_every=5)
    assert all(r["bytes_sent_total"] == 0 for rank in range(world_size) for r in records(out, rank, "step")[-1:])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the simulated ranks ran: the same reduction order, the same bits
    try:
        apart = [_trained_apart(cfg, world_size, rank) for rank in range(world_size)]
    finally:
        torch.set_num_threads(threads)
    last = {rank: torch.load(sorted((out / SNAPSHOT_DIR / f"rank{rank}").glob("*.pt"))[-1], weights_only=False)
            for rank in range(world_size)}
    assert {snap["step"] for snap in last.values()} == {cfg.steps - 1}
    for rank in range(world_size):  # each replica is its own training, untouched by the others
        for name, tensor in apart[rank].items():
            assert torch.equal(last[rank]["state"][name], tensor), (rank, name)
    trainable = [name for name, p in build_model(cfg.model.name, cfg.model.params, (1, 8, 8), 10, cfg.seed)
                 .named_parameters() if p.requires_grad]
    output = combine_snapshots("replica", last, trainable)  # what the evaluator evaluates
    for name, tensor in apart[0].items():
        mean = torch.stack([replica[name].to(torch.float64) for replica in apart]).mean(dim=0).to(tensor.dtype)
        assert torch.equal(output[name], mean), name
    final = evaluate_job(out)[-1]
    assert final["role"] == "replica" and final["ranks"] == list(range(world_size))
