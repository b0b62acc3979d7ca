"""CIFAR-10 and its generated stand-in (synthetic_cifar): shapes, determinism, learnability, the
explicit fallback and the source a job records."""

import pickle

import numpy as np
import pytest
import torch

from trainers.config import ConfigError, DatasetConfig
from trainers.datasets import CIFAR10_BATCHES, generate_cifar_shaped, load_dataset, SyntheticCifarParams
from trainers.loading import load_config
from trainers.models import build_model
from trainers.training import evaluate, loss_fn

SMALL = {"n_train": 3000, "n_test": 1000}


def cifar(path=None, **params) -> DatasetConfig:
    return DatasetConfig(name="cifar10", path=None if path is None else str(path), params=params)


def test_generated_images_have_cifars_shape_and_balanced_labels():
    data = load_dataset(DatasetConfig(name="synthetic_cifar", params=SMALL), seed=0)
    assert data.train_x.shape == (3000, 3, 32, 32) and data.test_x.shape == (1000, 3, 32, 32)
    assert data.train_x.dtype == torch.uint8  # a quarter of float32's memory
    assert (data.input_shape, data.num_classes, data.kind) == ((3, 32, 32), 10, "features")
    assert torch.bincount(data.train_y).tolist() == [300] * 10
    assert torch.bincount(data.test_y).tolist() == [100] * 10
    inputs = data.inputs(data.train_x[:500])
    assert inputs.dtype == torch.float32 and inputs.shape == (500, 3, 32, 32)
    assert inputs.mean().abs() < 0.1 and 0.9 < inputs.std() < 1.1  # normalised per channel
    saturated = ((data.train_x == 0) | (data.train_x == 255)).float().mean()
    assert saturated < 0.01  # the scale leaves almost every pixel inside 0..255
    assert data.source == "generated CIFAR-shaped (synthetic_cifar, seed 0, 3000 train / 1000 test images)"


def test_generated_images_are_the_same_for_a_seed_and_differ_between_seeds():
    params = SyntheticCifarParams(n_train=300, n_test=100)
    first, again = generate_cifar_shaped(params, 4), generate_cifar_shaped(params, 4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other = generate_cifar_shaped(params, 5)
    assert not torch.equal(first[0], other[0])
    # the test set does not depend on how many training images were asked for
    bigger = generate_cifar_shaped(SyntheticCifarParams(n_train=700, n_test=100), 4)
    assert torch.equal(first[2], bigger[2]) and torch.equal(first[3], bigger[3])
    # params.seed fixes the data whatever the run's seed
    fixed = {**SMALL, "n_train": 300, "n_test": 100, "seed": 4}
    a = load_dataset(DatasetConfig(name="synthetic_cifar", params=fixed), seed=0)
    b = load_dataset(DatasetConfig(name="synthetic_cifar", params=fixed), seed=9)
    assert torch.equal(a.train_x, first[0]) and torch.equal(a.train_x, b.train_x) and "seed 4" in b.source


def _train(model, data, steps: int, lr: float, batch_size: int = 64) -> float:
    """Plain SGD with momentum for `steps` seeded batches; held-out accuracy."""
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(steps):
        index = torch.randint(len(data.train_x), (batch_size,), generator=generator)
        optimizer.zero_grad()
        loss_fn(model, (data.inputs(data.train_x[index]), data.train_y[index])).backward()
        optimizer.step()
    accuracy, _ = evaluate(model, data.inputs(data.test_x), data.test_y, torch.device("cpu"))
    return accuracy


def test_a_small_convnet_learns_it_and_a_linear_model_on_pixels_does_not():
    torch.manual_seed(0)
    data = load_dataset(DatasetConfig(name="synthetic_cifar", params=SMALL), seed=0)
    convnet = build_model("lenet", {}, data.input_shape, data.num_classes, seed=0)
    linear = build_model("mlp", {"hidden_sizes": []}, data.input_shape, data.num_classes, seed=0)
    convnet_accuracy = _train(convnet, data, steps=300, lr=0.02)
    # the linear model gets more steps than the convnet: 16 passes over the training images
    linear_accuracy = _train(linear, data, steps=750, lr=0.002)
    # measured: 0.45 and 0.24 (chance: 0.1)
    assert convnet_accuracy > 0.35, convnet_accuracy
    assert convnet_accuracy < 0.9, convnet_accuracy                 # not solved in a few hundred steps
    assert linear_accuracy < 0.5, linear_accuracy                   # shifts and clutter defeat a template match
    assert convnet_accuracy > linear_accuracy + 0.1


def test_cifar10_without_its_batches_is_an_error_unless_the_fallback_is_asked_for(tmp_path):
    with pytest.raises(ConfigError, match=r"^dataset.path: cifar10 needs dataset.path.*fallback: generated"):
        load_dataset(cifar(), seed=0)
    with pytest.raises(ConfigError, match=r"^dataset.path: CIFAR-10 python batches missing under .*data_batch_1"):
        load_dataset(cifar(tmp_path), seed=0)
    with pytest.raises(ConfigError, match=r"^dataset.params.fallback: must be one of \['none', 'generated'\]"):
        load_dataset(cifar(tmp_path, fallback="synthetic"), seed=0)


def test_cifar10_falls_back_to_generated_images_when_asked_and_says_so(tmp_path):
    data = load_dataset(cifar(tmp_path, fallback="generated", generated={"n_train": 200, "n_test": 50}), seed=3)
    assert data.train_x.shape == (200, 3, 32, 32) and len(data.test_x) == 50
    assert data.source.startswith("generated CIFAR-shaped (synthetic_cifar, seed 3, 200 train / 50 test images) "
                                  "instead of CIFAR-10 (fallback: generated): CIFAR-10 python batches missing "
                                  f"under {tmp_path}")
    unset = load_dataset(cifar(fallback="generated", generated={"n_train": 200, "n_test": 50}), seed=3)
    assert torch.equal(unset.train_x, data.train_x) and "needs dataset.path" in unset.source
    # the resolved config shows the generator's settings the fallback would use
    config = load_config({"output_dir": "x", "model": {"name": "resnet20"},
                          "dataset": {"name": "cifar10", "params": {"fallback": "generated"}}})
    assert config.dataset.params.generated.n_train == 50_000


def _write_cifar_batches(folder, images_per_batch: int = 4) -> np.ndarray:
    rng = np.random.default_rng(0)
    every = []
    for name in CIFAR10_BATCHES:
        pixels = rng.integers(0, 256, size=(images_per_batch, 3072), dtype=np.uint8)
        every.append(pixels)
        with open(folder / name, "wb") as handle:
            pickle.dump({b"data": pixels, b"labels": list(range(images_per_batch))}, handle)
    return np.concatenate(every)


def test_cifar10_batches_are_read_as_they_were_and_the_source_names_the_folder(tmp_path):
    pixels = _write_cifar_batches(tmp_path)
    data = load_dataset(cifar(tmp_path, fallback="generated"), seed=0)  # batches there: no fallback
    assert data.source == f"CIFAR-10 from {tmp_path}"
    assert data.train_x.shape == (20, 3, 32, 32) and data.train_x.dtype == torch.uint8 and len(data.test_x) == 4
    # the same normalised inputs the loader produced when it stored float32
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    expected = (torch.from_numpy(pixels[:20].reshape(-1, 3, 32, 32)).float() / 255.0 - mean) / std
    assert torch.allclose(data.inputs(data.train_x), expected)


@pytest.mark.slow
def test_a_rank_records_the_data_it_trained_on_and_the_evaluator_reads_the_same(tmp_path):
    from tests.trainers.conftest import evaluations, records, run_training

    dataset = {"name": "cifar10", "path": str(tmp_path / "no-cifar-here"),
               "params": {"fallback": "generated", "generated": {"n_train": 64, "n_test": 20}}}
    out = run_training(tmp_path, 1, {"dataset": dataset, "batch_size": 16,
                                     "steps": 4, "eval_every": 2})
    [data] = records(out, 0, "data")
    assert data["source"].startswith("generated CIFAR-shaped (synthetic_cifar, seed 3, 64 train / 20 test images) "
                                     "instead of CIFAR-10 (fallback: generated): CIFAR-10 python batches missing")
    assert (data["train_samples"], data["test_samples"], data["input_shape"]) == (64, 20, [3, 32, 32])
    assert len(records(out, 0, "step")) == 4  # uint8 pixels scaled per batch
    assert all(0.0 <= row["accuracy"] <= 1.0 for row in evaluations(out))
