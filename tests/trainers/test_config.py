"""Config loading: strict keys, named fields in errors, resolved defaults, and the CLI's exit codes."""

import json
import subprocess
import sys

import pytest

from trainers.config import ConfigError, to_dict
from trainers.loading import load_config


def base(**changes):
    config = {"output_dir": "/tmp/unused", "algorithm": {"name": "sync"}}
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "changes, field, fragment",
    [
        ({"stepz": 3}, "stepz", "unknown key"),
        ({"model": {"name": "mlp", "width": 3}}, "model.width", "unknown key"),
        ({"steps": 0}, "steps", "integer >= 1, got 0"),
        ({"lr": -1}, "lr", "> 0.0"),
        ({"batch_size": "8"}, "batch_size", "must be an integer"),
        ({"device": "tpu"}, "device", "one of ['cpu', 'cuda']"),
        ({"dataset": {"shard": "dirichlet", "alpha": 0}}, "dataset.alpha", "> 0.0"),
        ({"optimizer": {"momentum": 1.5}}, "optimizer.momentum", "in [0.0, 1.0]"),
        ({"lr_schedule": {"name": "linear"}}, "lr_schedule.name", "one of"),
        ({"comm": {"backend": "nccl"}}, "comm.backend", "needs device: cuda"),
        ({"algorithm": {"name": "local_sgd", "params": {"H": 0}}}, "algorithm.params.H", "integer >= 1, got 0"),
        ({"algorithm": {"name": "dts", "params": {"t": -1}}}, "algorithm.params.t", "integer >= 0"),
        ({"algorithm": {"name": "dts", "params": {"delay": 1}}}, "algorithm.params.delay", "unknown key"),
        ({"algorithm": {"name": "diloco", "params": {"outer_lr": 0}}}, "algorithm.params.outer_lr", "> 0.0"),
        ({"algorithm": {"name": "sync", "params": {"bucket_cap_mb": -2}}}, "algorithm.params.bucket_cap_mb", "> 0.0"),
        ({"algorithm": {"name": "allreduce"}}, "algorithm.name", "unknown algorithm"),
        ({"algorithm": {"name": "local_sgd", "params": {"collective": "tree"}}}, "algorithm.params.collective", "one of"),
        ({"model": {"name": "mlp", "params": {"hidden_sizes": [0]}}}, "model.params.hidden_sizes[0]", ">= 1"),
        ({"model": {"name": "transformer"}}, "model.name", "takes tokens inputs"),
        ({"dataset": {"name": "synthetic", "params": {"n_classes": 1}}}, "dataset.params.n_classes", ">= 2"),
    ],
)
def test_bad_values_fail_naming_the_field(changes, field, fragment):
    with pytest.raises(ConfigError) as caught:
        load_config(base(**changes))
    assert caught.value.field == field
    assert str(caught.value).startswith(f"{field}: ")
    assert fragment in str(caught.value)


def test_missing_output_dir_is_named():
    with pytest.raises(ConfigError, match="^output_dir: is required"):
        load_config({"steps": 3})


def test_defaults_are_resolved_into_params():
    config = load_config(base(algorithm={"name": "diloco", "params": {"H": 5}}))
    written = to_dict(config)  # what config.resolved.json holds
    assert written["algorithm"]["params"] == {
        "H": 5, "outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "collective": "allreduce",
        "outer_precision": "fp32", "outer_reduce": "allgather", "warmup_steps": 0, "warmup_lr": None, "bucket_cap_mb": 25.0,
    }
    assert written["model"]["params"] == {"hidden_sizes": [64]}


def test_overrides_and_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: out\nalgorithm: {name: local_sgd}\n")
    config = load_config(path, {"algorithm.params.H": 8, "steps": 7})
    assert config.algorithm.params.H == 8 and config.steps == 7


def test_cli_check_prints_resolved_config_and_rejects_bad_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps(base(algorithm={"name": "dts", "params": {"p": 2}})))
    done = subprocess.run([sys.executable, "-m", "trainers", str(good), "--check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["algorithm"]["params"] == {"p": 2, "t": 0}

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(base(algorithm={"name": "dts", "params": {"p": 0}})))
    done = subprocess.run([sys.executable, "-m", "trainers", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "algorithm.params.p: must be an integer >= 1, got 0" in done.stderr
    assert str(bad) in done.stderr


def test_cli_help_lists_algorithms():
    done = subprocess.run([sys.executable, "-m", "trainers", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for name in ("sync", "ddp", "local_sgd", "dts", "diloco", "RANK", "WORLD_SIZE"):
        assert name in done.stdout


@pytest.mark.parametrize("field, message, source", [
    ("algorithm.params.H", "must be an integer >= 1, got 0", "run.yaml"),
    ("steps", "is required", ""),
    ("", "config file not found: x.yaml", ""),
    ("bad\nkey", "two\nlines  and\ttabs", "s.yaml"),
])
def test_config_error_has_the_emulators_shape(field, message, source):
    """One ConfigError shape in both packages (they do not import each other, so it is kept twice)."""
    from emulator.schema import ConfigError as EmulatorConfigError

    def shape(error):
        return str(error), error.field, error.message, error.source

    pairs = [
        (ConfigError(field, message, source), EmulatorConfigError(field, message, source)),
        (ConfigError(field, message, source).prefixed("workload"),
         EmulatorConfigError(field, message, source).prefixed("workload")),
        (ConfigError(field, message), EmulatorConfigError(field, message)),
    ]
    for ours, theirs in pairs:
        assert type(ours) is ConfigError and shape(ours) == shape(theirs)
        assert "\n" not in str(ours) and "\t" not in str(ours)


def test_params_are_parsed_once_and_written_back_in_the_files_form():
    from trainers.algorithms.local_sgd import LocalSGDParams
    from trainers.loading import resolve

    config = load_config(base(algorithm={"name": "local_sgd", "params": {"H": 3}}))
    assert isinstance(config.algorithm.params, LocalSGDParams) and config.algorithm.params.H == 3
    again = resolve(config)  # what the runner does with a loaded config: the Params pass through
    assert again.algorithm.params is config.algorithm.params and again.model.params is config.model.params
    written = to_dict(config)
    assert written["algorithm"]["params"]["H"] == 3 and isinstance(written["algorithm"]["params"], dict)
    assert to_dict(load_config(json.loads(json.dumps(written)))) == written  # config.resolved.json loads back


def test_params_must_be_a_mapping_where_they_are_read():
    with pytest.raises(ConfigError, match=r"^algorithm.params: must be a mapping, got 5$"):
        load_config(base(algorithm={"name": "sync", "params": 5}))
    with pytest.raises(ConfigError, match=r"^model.params: must be a mapping, got None$"):
        load_config(base(model={"name": "mlp", "params": None}))


def test_the_backend_a_rank_runs_is_decided_in_one_place():
    from trainers.config import COMM_BACKEND_VARIABLE
    from trainers.loading import comm_backend_to_run, with_launcher_backend

    gloo = load_config(base())
    assert comm_backend_to_run(gloo, {}) == "gloo"
    assert comm_backend_to_run(gloo, {COMM_BACKEND_VARIABLE: "nccl"}) == "nccl"
    assert with_launcher_backend(gloo, {COMM_BACKEND_VARIABLE: "gloo"}) is gloo
    with pytest.raises(ConfigError, match=f"^{COMM_BACKEND_VARIABLE}: must be one of"):
        comm_backend_to_run(gloo, {COMM_BACKEND_VARIABLE: "tcp"})
    elastic = load_config(base(algorithm={"name": "async_ps"}, comm={"backend": "tcp"}))
    with pytest.raises(RuntimeError, match="cannot replace comm.backend tcp"):
        comm_backend_to_run(elastic, {COMM_BACKEND_VARIABLE: "gloo"})
