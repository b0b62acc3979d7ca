"""`easgd` (synchronous) against a single-process simulation of the workers; `eawild` (asynchronous)
trains, and its concurrent server serves two workers at once (the serial one does not) and equals
the serial one with one worker."""

from __future__ import annotations

import pytest
import torch

import json

from tests.trainers.conftest import BASE_CONFIG, evaluations, merge, records, run_sessions, run_training
from tests.trainers.test_async_ps import RunnerData
from tests.trainers.workers import eawild_service_worker
from trainers.algorithms import get_algorithm
from trainers.algorithms.easgd import EASGD, EASGDParams
from trainers.algorithms.eawild import EAWild, EAWildParams
from trainers.config import ConfigError
from trainers.loading import load_config
from trainers.training import evaluate, loss_fn


@pytest.mark.parametrize("params_cls", [EASGDParams, EAWildParams])
@pytest.mark.parametrize(
    "changes, field, fragment",
    [
        ({"tau": 0}, "tau", "integer >= 1"),
        ({"alpha": 0.0}, "alpha", "> 0.0"),
        ({"alpha": 1.5}, "alpha", "<= 1.0"),
        ({"beta": -0.1}, "beta", "> 0.0"),
        ({"alpha": 0.1, "beta": 0.9}, "alpha", "not both"),
    ],
)
def test_params_name_the_bad_field(params_cls, changes, field, fragment):
    with pytest.raises(ConfigError, match=f"^{field}: .*{fragment}"):
        params_cls(**changes)


def test_eawild_server_is_serial_or_concurrent_by_name():
    assert EAWildParams().server == "concurrent"
    with pytest.raises(ConfigError, match=r"^server: must be one of \['serial', 'concurrent'\], got 'lockfree'"):
        EAWildParams(server="lockfree")


def test_registered_and_default_moving_rate():
    assert get_algorithm("easgd") is EASGD and get_algorithm("eawild") is EAWild
    assert EASGDParams().moving_rate(4) == pytest.approx(0.9 / 4)  # beta / p, beta = 0.9
    assert EASGDParams(alpha=0.3).moving_rate(4) == 0.3
    with pytest.raises(ConfigError, match="^server_ranks: "):
        EAWildParams(server_ranks=[])


def simulate_easgd(changes: dict, workers: int, steps: int, alpha: float, tau: int, momentum: float):
    """The paper's synchronous EASGD with ``workers`` replicas in one process, on the runner's batches.

    Returns the replicas and the centre (lists of parameter tensors).
    """
    runner_data = RunnerData(changes, workers)
    replicas = [runner_data.model() for _ in range(workers)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=runner_data.config.lr, momentum=momentum) for m in replicas]
    centre = [p.detach().clone() for p in replicas[0].parameters()]
    for step in range(steps):
        for rank, (model, optimizer) in enumerate(zip(replicas, optimizers)):
            optimizer.zero_grad()
            loss_fn(model, runner_data.next_batch(rank)).backward()  # gradient at x_i
        if step % tau == 0:
            with torch.no_grad():
                differences = [[p - c for p, c in zip(m.parameters(), centre)] for m in replicas]
                for model, difference in zip(replicas, differences):
                    for p, d in zip(model.parameters(), difference):
                        p -= alpha * d
                centre = [c + alpha * sum(d[i] for d in differences) for i, c in enumerate(centre)]
        for optimizer in optimizers:
            optimizer.step()
    return replicas, centre, runner_data


@pytest.mark.slow
def test_easgd_equals_simulation_of_four_workers_and_reaches_accuracy(tmp_path):
    """alpha = 1/4, tau = 1, momentum 0.9: every replica and the centre (through its held-out loss)
    match the simulation after 60 steps. Measured held-out accuracy of the centre: 0.908 at step
    60 (0.894 with the defaults alpha = 0.9/4, tau = 4); we ask for 0.85."""
    steps, alpha, tau = 60, 0.25, 1
    changes = {"steps": steps, "eval_every": 30, "save_final_model": True, "optimizer": {"momentum": 0.9}}
    out = run_training(tmp_path, 4, {**changes, "algorithm": {"name": "easgd", "params": {"alpha": alpha, "tau": tau}}})
    replicas, centre, runner_data = simulate_easgd(changes, 4, steps, alpha, tau, momentum=0.9)
    for rank, replica in enumerate(replicas):
        trained = torch.load(out / f"rank{rank}_final.pt")
        difference = max((trained[k] - v).abs().max().item() for k, v in replica.state_dict().items())
        assert difference < 1e-5, f"replica {rank} differs from the simulation by {difference}"
    centre_model = runner_data.model()
    with torch.no_grad():
        for p, c in zip(centre_model.parameters(), centre):
            p.copy_(c)
    accuracy, loss = evaluate(centre_model, runner_data.data.test_x, runner_data.data.test_y, torch.device("cpu"))
    evaluated = evaluations(out)[-1]
    assert evaluated["step"] == steps - 1
    assert evaluated["loss"] == pytest.approx(loss, abs=1e-5)
    assert evaluated["accuracy"] == pytest.approx(accuracy, abs=2e-3)  # one sample may flip on a near-tie
    assert evaluated["accuracy"] >= 0.85


@pytest.mark.slow
def test_eawild_reaches_accuracy_with_one_server_and_three_workers(tmp_path):
    """Defaults (alpha = 0.9/3, tau = 4), momentum 0.9. Measured: held-out accuracy of the centre
    0.89 at step 60, 0.94 at step 100. Asynchronous, so not bit-reproducible; we ask for 0.85 at
    step 100."""
    out = run_training(tmp_path, 4, {"steps": 100, "eval_every": 50, "optimizer": {"momentum": 0.9}, "algorithm": {"name": "eawild"}})
    evals = evaluations(out)
    assert evals[-1]["step"] == 99 and evals[-1]["accuracy"] >= 0.85
    for worker in (1, 2, 3):
        exchanged = [r["step"] for r in records(out, worker, "step") if r["staleness"] is not None]
        assert exchanged == list(range(0, 100, 4))  # one elastic exchange every tau steps


APPLY_S = 0.8  # each apply made this slow: long next to the loopback's and the processes' noise


@pytest.mark.slow
def test_a_concurrent_server_serves_two_workers_at_once_and_a_serial_one_does_not(tmp_path, spawn_ranks):
    """Server rank 0 and two workers exchanging at the same moment, every apply slowed to 0.8 s by
    a test subclass. Concurrent: the two services overlap in time, and neither worker's exchange
    takes as long as both applies (it never waited for the other's). Serial, the control: the
    services are one after the other, and the later worker's exchange holds both applies."""
    exits = spawn_ranks(eawild_service_worker, 3, str(tmp_path), APPLY_S, timeout_s=120)
    assert exits == [0, 0, 0]
    ranks = [json.loads((tmp_path / f"eawild{rank}.json").read_text()) for rank in range(3)]
    for mode in ("serial", "concurrent"):
        intervals = ranks[0][mode]["intervals"]
        assert len(intervals) == 2, f"{mode}: the server applied {len(intervals)} exchanges, not 2"
        (first_start, first_end), (second_start, second_end) = sorted(intervals)
        latencies = [ranks[worker][mode]["latencies"][0] for worker in (1, 2)]
        if mode == "concurrent":
            assert second_start < first_end, f"concurrent services did not overlap: {intervals}"
            assert max(latencies) < 2 * APPLY_S, f"a worker waited for the other's apply: {latencies}"
        else:
            assert second_start >= first_end, f"serial services overlapped: {intervals}"
            assert max(latencies) >= 2 * APPLY_S, f"the later worker did not wait for the other's apply: {latencies}"


def test_with_one_worker_the_concurrent_server_equals_the_serial_one_on_the_simulator(tmp_path):
    """Server rank 0, one worker, tau 2, momentum 0.9, 16 steps: the same centre, replica, losses
    and staleness bit for bit (the worker waits for each reply, so nothing runs at once); and the
    concurrent server's exchanges take less virtual time (each request's receive is posted ahead)."""
    from tests.trainers.test_sim import network
    from trainers.sim import ComputeModel, run_simulated

    outputs = {}
    for mode in ("serial", "concurrent"):
        outputs[mode] = tmp_path / mode
        changes = {"steps": 16, "eval_every": 8, "save_final_model": True, "optimizer": {"momentum": 0.9},
                   "algorithm": {"name": "eawild", "params": {"tau": 2, "server": mode}}}
        config = load_config(merge(BASE_CONFIG, {**changes, "output_dir": str(outputs[mode])}))
        run_simulated(config, 2, network(2, 0.02, 125e6), ComputeModel(0.005, 0.001))
    for rank in (0, 1):
        serial = torch.load(outputs["serial"] / f"rank{rank}_final.pt")
        concurrent = torch.load(outputs["concurrent"] / f"rank{rank}_final.pt")
        assert all(torch.equal(serial[k], concurrent[k]) for k in serial), f"rank {rank} differs"
        steps = {mode: records(outputs[mode], rank, "step") for mode in outputs}
        for field in ("loss", "staleness", "syncs_applied"):
            assert [r.get(field) for r in steps["serial"]] == [r.get(field) for r in steps["concurrent"]], field
    assert [r["staleness"] for r in records(outputs["concurrent"], 1, "step")] == [0, None] * 8
    assert records(outputs["concurrent"], 1, "step")[-1]["time_s"] < records(outputs["serial"], 1, "step")[-1]["time_s"]


@pytest.mark.slow
def test_with_one_worker_the_concurrent_server_equals_the_serial_one_on_gloo(tmp_path, spawn_ranks):
    """The same on real gloo ranks (the concurrent server's receiving thread, not the simulator's
    events): server rank 0 and one worker, 12 steps, tau 3; centre, replica and staleness equal."""
    base = {"steps": 12, "eval_every": 6, "save_final_model": True, "optimizer": {"momentum": 0.9}}
    outputs = run_sessions(spawn_ranks, tmp_path, 2, {
        mode: {**base, "algorithm": {"name": "eawild", "params": {"tau": 3, "server": mode}}}
        for mode in ("serial", "concurrent")})
    for rank in (0, 1):
        serial = torch.load(outputs["serial"] / f"rank{rank}_final.pt")
        concurrent = torch.load(outputs["concurrent"] / f"rank{rank}_final.pt")
        assert all(torch.equal(serial[k], concurrent[k]) for k in serial), f"rank {rank} differs"
    staleness = {mode: [r["staleness"] for r in records(outputs[mode], 1, "step")] for mode in outputs}
    assert staleness["serial"] == staleness["concurrent"] == [0, None, None] * 4


def test_a_concurrent_server_on_a_comm_without_tagged_messages_is_refused_naming_the_field():
    """nccl and the elastic tcp comm have no tagged messages on threads: the error says to use serial."""
    from trainers.algorithms import AlgorithmContext
    from trainers.comm import Comm
    from trainers.config import OptimizerConfig

    class PlainComm(Comm):  # a worker rank whose backend has point to point but no tagged messages
        def _broadcast(self, tensor, src):
            return (lambda: tensor), (lambda: True)

        def _barrier(self):
            return (lambda: None), (lambda: True)

        _all_reduce = _all_gather = _isend = _irecv = lambda self, *args: pytest.fail("not expected")

    ctx = AlgorithmContext(model=torch.nn.Linear(3, 2), comm=PlainComm(rank=1, world_size=2), loss_fn=loss_fn,
                           optimizer=OptimizerConfig(), lr=0.1, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="^server: concurrent needs tagged messages .*use server: serial"):
        EAWild(EAWildParams(), ctx).setup()
    EAWild(EAWildParams(server="serial"), ctx).setup()  # the serial server needs none


def test_on_the_simulator_four_workers_exchanges_overlap_on_a_concurrent_server_and_queue_on_a_serial_one(tmp_path):
    """tau 1, 12 steps, 20 ms one way, no NIC limit: the concurrent server's job takes the time a
    lone worker's does (each connection's receive is posted ahead, so the exchanges' messages
    overlap); the serial server's more than doubles (each exchange's messages wait for the one
    before: about four one-way delays each)."""
    from tests.trainers.test_sim import network
    from trainers.sim import ComputeModel, run_simulated

    def server_time_s(mode: str, workers: int) -> float:
        output = tmp_path / f"{mode}{workers}"
        changes = {"steps": 12, "eval_every": 12, "algorithm": {"name": "eawild", "params": {"tau": 1, "server": mode}}}
        run_simulated(load_config(merge(BASE_CONFIG, {**changes, "output_dir": str(output)})), workers + 1,
                      network(workers + 1, 0.02, 125e6), ComputeModel(0.005, 0.001))
        return sum(r["step_s"] for r in records(output, 0, "step"))

    assert server_time_s("concurrent", 4) == pytest.approx(server_time_s("concurrent", 1), rel=0.05)
    assert server_time_s("serial", 4) > 2 * server_time_s("serial", 1)
