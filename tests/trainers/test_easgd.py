"""`easgd` (synchronous) against a single-process simulation of the workers; `eawild` (asynchronous) trains."""

from __future__ import annotations

import pytest
import torch

from tests.trainers.conftest import evaluations, records, run_training
from tests.trainers.test_async_ps import RunnerData
from trainers.algorithms import get_algorithm
from trainers.algorithms.easgd import EASGD, EASGDParams
from trainers.algorithms.eawild import EAWild, EAWildParams
from trainers.config import ConfigError
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
