"""The ready workloads of scenarios/workloads/ learn what their comments say, single-process, through
the trainers' own runner and the off-wire evaluator."""

from pathlib import Path

import pytest
import yaml

from trainers.datasets import FASHION_MNIST_DEFAULT

WORKLOADS = Path(__file__).resolve().parents[2] / "scenarios" / "workloads"


def _train(name: str, tmp_path, **overrides) -> list[dict]:
    from trainers.evaluate import evaluate_job
    from trainers.loading import load_config
    from trainers.runner import run

    document = yaml.safe_load((WORKLOADS / name).read_text())
    config = {**document["workload"], "steps": document["stop"]["steps"], "output_dir": str(tmp_path / "job"),
              **overrides}
    run(load_config(config))
    return evaluate_job(tmp_path / "job")


@pytest.mark.slow
@pytest.mark.skipif(not Path(FASHION_MNIST_DEFAULT).is_dir(), reason="Debian package dataset-fashion-mnist is not installed")
def test_fashion_mnist_lenet_reaches_78_percent_on_the_10000_test_images_in_800_steps(tmp_path):
    rows = _train("fashion-mnist-lenet.yaml", tmp_path, eval_every=400)
    assert [r["step"] for r in rows] == [399, 799]
    assert rows[-1]["accuracy"] >= 0.78  # measured 0.81 (seed 0); 10,000 images: one is 0.01 pp


@pytest.mark.slow
def test_the_stdlib_language_model_gets_below_its_loss_target_in_300_steps(tmp_path):
    rows = _train("stdlib-lm.yaml", tmp_path, eval_every=150)
    assert rows[-1]["loss"] <= 2.5 < rows[0]["loss"] + 1.0  # measured 2.32 after 300 steps (seed 0)
    assert rows[-1]["perplexity"] <= 12.2
