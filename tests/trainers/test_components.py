"""Single-process checks of data, sharding, models, schedules and the record writer."""

import gzip
import math
from pathlib import Path

import pytest
import torch

from trainers.config import ConfigError, DatasetConfig, LRScheduleConfig
from trainers.datasets import BatchSampler, _read_idx, load_dataset, shard_indices
from trainers.models import build_model
from trainers.records import RecordWriter, read_records, resolved_config_path, write_json_atomic
from trainers.training import loss_fn, lr_at

FASHION = Path("/usr/share/datasets/fashion-mnist")


def test_iid_shards_partition_the_data():
    labels = torch.arange(103) % 10
    shards = shard_indices(labels, 4, "iid", alpha=1.0, seed=0)
    joined = torch.cat(shards).sort().values
    assert torch.equal(joined, torch.arange(103))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert all(torch.equal(a, b) for a, b in zip(shards, shard_indices(labels, 4, "iid", 1.0, seed=0)))


def test_dirichlet_shards_are_skewed_by_alpha():
    labels = torch.arange(4000) % 10

    def mean_classes_per_rank_share(alpha):
        shards = shard_indices(labels, 4, "dirichlet", alpha=alpha, seed=1)
        assert torch.equal(torch.cat(shards).sort().values, torch.arange(4000))
        # Largest single-class share of each rank's shard, averaged: 0.1 when balanced.
        return sum(torch.bincount(labels[s], minlength=10).max().item() / len(s) for s in shards) / 4

    assert mean_classes_per_rank_share(0.05) > 0.35
    assert mean_classes_per_rank_share(1000.0) < 0.15


def test_batch_sampler_is_seeded_and_counts_epochs():
    a = BatchSampler(torch.arange(10), 4, seed=5)
    b = BatchSampler(torch.arange(10), 4, seed=5)
    batches = [a.next_indices() for _ in range(5)]
    assert all(torch.equal(x, b.next_indices()) for x in batches)
    assert a.epoch == 2  # 2 full batches per pass of 10 (the short tail is skipped)


def test_digits_split_is_held_out_and_seeded():
    data = load_dataset(DatasetConfig(name="digits"), seed=0)
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.train_x) + len(data.test_x) == 1797
    assert abs(len(data.test_x) - 0.2 * 1797) <= 1
    again = load_dataset(DatasetConfig(name="digits"), seed=0)
    assert torch.equal(data.test_y, again.test_y)


@pytest.mark.skipif(not FASHION.is_dir(), reason="Debian package dataset-fashion-mnist is not installed")
def test_fashion_mnist_reads_gzipped_and_plain_idx(tmp_path):
    data = load_dataset(DatasetConfig(name="fashion_mnist", max_test_samples=100), seed=0)
    assert data.train_x.shape == (60000, 1, 28, 28) and len(data.test_x) == 100
    inputs = data.inputs(data.train_x[:1000])
    assert 0.0 <= inputs.min() and inputs.max() <= 1.0
    plain = tmp_path / "t10k-labels-idx1-ubyte"
    plain.write_bytes(gzip.decompress((FASHION / "t10k-labels-idx1-ubyte.gz").read_bytes()))
    assert (_read_idx(plain) == _read_idx(FASHION / "t10k-labels-idx1-ubyte")).all()


def test_file_datasets_explain_what_is_missing(tmp_path):
    with pytest.raises(ConfigError, match="^dataset.path: .*data_batch_1"):
        load_dataset(DatasetConfig(name="cifar10", path=str(tmp_path)), seed=0)
    with pytest.raises(ConfigError, match="^dataset.path: .*not found"):
        load_dataset(DatasetConfig(name="fashion_mnist", path=str(tmp_path)), seed=0)
    with pytest.raises(ConfigError, match="^dataset.path: .*no class sub-folders"):
        load_dataset(DatasetConfig(name="imagefolder", path=str(tmp_path)), seed=0)


def test_imagefolder_reads_class_folders(tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="Pillow not installed")
    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.new("RGB", (20, 12), colour).save(tmp_path / cls / f"{i}.png")
    data = load_dataset(DatasetConfig(name="imagefolder", path=str(tmp_path), params={"image_size": 8}, test_fraction=0.2), seed=0)
    assert data.num_classes == 2 and data.input_shape == (3, 8, 8)
    assert len(data.train_x) + len(data.test_x) == 10


@pytest.mark.parametrize(
    "name, dataset, params",
    [
        ("mlp", "synthetic", {}),
        ("lenet", "digits", {}),
        ("resnet20", "digits", {"blocks_per_stage": 1, "width": 8}),
        ("vgg", "digits", {}),
        ("transformer", "synthetic_tokens", {"d_model": 32}),
    ],
)
def test_every_model_trains_on_a_batch(name, dataset, params):
    data = load_dataset(DatasetConfig(name=dataset), seed=0)
    model = build_model(name, params, data.input_shape, data.num_classes, seed=0)
    batch = (data.train_x[:16], data.train_y[:16])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    first = loss_fn(model, batch)
    for _ in range(20):
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
    assert loss_fn(model, batch).item() < first.item()  # it can fit a batch
    twin = build_model(name, params, data.input_shape, data.num_classes, seed=0)
    fresh = build_model(name, params, data.input_shape, data.num_classes, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(twin.parameters(), fresh.parameters()))


def test_vgg_keeps_most_parameters_in_the_fc_layers():
    model = build_model("vgg", {}, (3, 32, 32), 10, seed=0)
    linear = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert linear / sum(p.numel() for p in model.parameters()) > 0.8


def test_lr_schedules():
    constant = LRScheduleConfig(warmup_steps=4)
    assert [lr_at(s, 1.0, constant, 10) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = LRScheduleConfig(name="cosine", min_lr=0.1)
    assert lr_at(0, 1.0, cosine, 11) == 1.0
    assert math.isclose(lr_at(5, 1.0, cosine, 11), 0.55)
    assert math.isclose(lr_at(10, 1.0, cosine, 11), 0.1)
    step = LRScheduleConfig(name="step", step_size=3, gamma=0.5)
    assert [lr_at(s, 1.0, step, 10) for s in (0, 2, 3, 6)] == [1.0, 1.0, 0.5, 0.25]


def test_record_writer_flushes_each_line(tmp_path):
    writer = RecordWriter(tmp_path, rank=2)
    writer.write("step", step=0, loss=float("nan"), value=torch.tensor(1.5))
    # Readable before close: a crash right now would keep the line.
    rows = read_records(tmp_path / "rank2.jsonl")
    assert rows[0]["kind"] == "step" and rows[0]["rank"] == 2 and rows[0]["loss"] is None and rows[0]["value"] == 1.5
    assert rows[0]["time_s"] >= 0 and rows[0]["time_unix"] > 1.6e9
    writer.close()
    writer.close()


def test_json_is_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / "config.resolved.json"
    write_json_atomic(path, {"steps": 3})
    write_json_atomic(path, {"steps": 4})
    assert path.read_text() == '{\n  "steps": 4\n}\n'
    with pytest.raises(TypeError):
        write_json_atomic(path, {"steps": object()})  # fails half-way: the old file stays, no litter
    assert path.read_text() == '{\n  "steps": 4\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    assert path.stat().st_mode == plain.stat().st_mode  # readable as any file the run writes


def test_the_resolved_config_is_found_in_new_and_old_run_directories(tmp_path):
    assert resolved_config_path(tmp_path) is None  # rank 0 has not started
    (tmp_path / "config.json").write_text("{}")  # an older run: rank 0 overwrote the input with it
    assert resolved_config_path(tmp_path) == tmp_path / "config.json"
    write_json_atomic(tmp_path / "config.resolved.json", {})
    assert resolved_config_path(tmp_path) == tmp_path / "config.resolved.json"
