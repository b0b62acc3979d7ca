"""The text_corpus dataset (byte-level LM on the stdlib's .py files or dataset.path) and the
evaluator's loss / perplexity for a language model."""

import hashlib
import json
import math
import platform

import pytest
import torch

from trainers.config import ConfigError, DatasetConfig
from trainers.datasets import (TextCorpusParams, corpus_files, load_dataset, load_text_corpus, stdlib_folder,
                               validation_file)


def _corpus(tmp_path, files: dict[str, bytes]):
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return tmp_path


def test_the_default_corpus_is_the_stdlib_py_files_sorted_with_version_and_hash():
    files = corpus_files(stdlib_folder(), "*.py")
    assert len(files) > 50 and [f.name for f in files] == sorted(f.name for f in files)
    bundle = load_dataset(DatasetConfig(name="text_corpus", test_fraction=0.1), seed=0)
    again = load_dataset(DatasetConfig(name="text_corpus", test_fraction=0.1), seed=7)
    expected = hashlib.sha256()
    for file in files:
        content = file.read_bytes()
        expected.update(file.name.encode() + b"\0" + len(content).to_bytes(8, "big") + content)
    assert f"Python {platform.python_version()} standard library" in bundle.source
    assert f"sha256 {expected.hexdigest()}" in bundle.source and f"{len(files)} files" in bundle.source
    # byte tokens, next-byte targets, and the same split whatever the seed
    assert bundle.kind == "tokens" and bundle.num_classes == 256 and bundle.input_shape == (64,)
    assert torch.equal(bundle.train_x[:, 1:], bundle.train_y[:, :-1])
    assert torch.equal(bundle.test_x, again.test_x) and bundle.source == again.source


def test_validation_is_whole_files_chosen_by_name(tmp_path):
    names = [f"m{i:02d}.py" for i in range(40)]
    root = _corpus(tmp_path, {name: (name.encode() + b"\n") * 30 for name in names})
    bundle = load_text_corpus(DatasetConfig(name="text_corpus", path=str(root), test_fraction=0.25),
                              TextCorpusParams(seq_len=8), seed=0)
    held = [n for n in names if validation_file(n, 0.25)]
    assert 0 < len(held) < len(names)
    text_of = lambda x, y: bytes(torch.cat([x[:, :1], y], dim=1).flatten().tolist())  # noqa: E731
    test_text, train_text = text_of(bundle.test_x, bundle.test_y), text_of(bundle.train_x, bundle.train_y)
    for name in names:
        side, other = (test_text, train_text) if name in held else (train_text, test_text)
        assert name.encode() in side and name.encode() not in other
    assert f"40 files ({len(held)} held out)" in bundle.source and str(root) in bundle.source


def test_a_user_corpus_takes_a_pattern_and_a_single_file_is_split_by_bytes(tmp_path):
    root = _corpus(tmp_path, {"a.txt": b"alpha " * 200, "sub/b.txt": b"beta " * 200, "c.md": b"gamma " * 200})
    bundle = load_dataset(DatasetConfig(name="text_corpus", path=str(root), params={"pattern": "**/*.txt",
                                                                                    "seq_len": 16}), seed=0)
    assert "2 files" in bundle.source and "'**/*.txt'" in bundle.source
    single = load_dataset(DatasetConfig(name="text_corpus", path=str(root / "c.md"), test_fraction=0.2,
                                        params={"seq_len": 16}), seed=0)
    assert "1 file " in single.source
    assert len(single.train_x) * 17 == pytest.approx(1200 * 0.8, abs=17) and len(single.test_x) >= 1


def test_a_missing_path_is_one_line_naming_dataset_path(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_dataset(DatasetConfig(name="text_corpus", path=str(tmp_path / "nope")), seed=0)
    assert str(error.value).startswith("dataset.path: ") and "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="^dataset.path: .*no files matching"):
        load_dataset(DatasetConfig(name="text_corpus", path=str(tmp_path)), seed=0)


def test_the_evaluator_reports_loss_and_perplexity_for_a_language_model(tmp_path):
    from trainers.evaluate import evaluate_job, target_reached
    from trainers.loading import load_config
    from trainers.runner import run

    root = _corpus(tmp_path / "corpus", {f"f{i}.py": bytes(range(32, 127)) * 20 for i in range(6)})
    config = load_config({"output_dir": str(tmp_path / "job"), "steps": 30, "eval_every": 15, "lr": 0.01,
                          "optimizer": {"name": "adamw"}, "target_loss": 3.0,
                          "model": {"name": "transformer", "params": {"d_model": 16, "n_heads": 2, "n_layers": 1}},
                          "dataset": {"name": "text_corpus", "path": str(root), "test_fraction": 0.3,
                                      "params": {"seq_len": 16}}})
    run(config)
    rows = evaluate_job(tmp_path / "job")
    assert [r["step"] for r in rows] == [14, 29]
    for row in rows:
        assert row["perplexity"] == pytest.approx(math.exp(row["loss"]))
    assert rows[-1]["loss"] < rows[0]["loss"] < math.log(256) + 0.5  # it learns the repeating bytes
    data = [json.loads(line) for line in (tmp_path / "job" / "rank0.jsonl").read_text().splitlines()
            if '"kind": "data"' in line]
    assert "sha256 " in data[0]["source"]
    assert target_reached({"accuracy": 0.1, "loss": 2.9}, None, 3.0)
    assert not target_reached({"accuracy": 0.1, "loss": 3.1}, None, 3.0)
    assert not target_reached({"accuracy": 0.1, "loss": float("nan")}, None, 3.0)


def test_one_target_only():
    from trainers.loading import load_config

    with pytest.raises(ConfigError, match="^target_loss: give one target"):
        load_config({"output_dir": "x", "target_accuracy": 0.5, "target_loss": 2.0})
