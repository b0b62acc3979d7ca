"""Run configuration: a plain dataclass tree, loaded strictly from YAML or JSON.

Each component owns its config dataclass and checks it in ``__post_init__``. Errors are raised as
:class:`ConfigError` whose message starts with the dotted field path, e.g.
``algorithm.params.H: must be an integer >= 1, got 0``. Unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.reason = message
        super().__init__(f"{path}: {message}" if path else message)

    def prefixed(self, prefix: str) -> "ConfigError":
        """Return the same error with ``prefix`` prepended to its field path."""
        path = f"{prefix}.{self.path}" if self.path else prefix
        return ConfigError(path, self.reason)


# ---------------------------------------------------------------------------------------------
# Checks used by the __post_init__ methods. They raise with the field's own name; from_dict adds
# the path of the enclosing section, so each dataclass does not need to know where it lives.


def require_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> None:
    """Fail unless ``value`` is an int (not bool) within [minimum, maximum]."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        bounds = _bounds_text(minimum, maximum)
        raise ConfigError(name, f"must be an integer{bounds}, got {value!r}")


def require_float(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    min_exclusive: bool = False,
) -> None:
    """Fail unless ``value`` is a real number within the bounds (``min_exclusive``: value > minimum)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and minimum is not None:
        ok = value > minimum if min_exclusive else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        low = f" > {minimum}" if min_exclusive else None
        bounds = low + (f" and <= {maximum}" if maximum is not None else "") if low else _bounds_text(minimum, maximum)
        raise ConfigError(name, f"must be a number{bounds}, got {value!r}")


def require_choice(name: str, value: Any, choices: typing.Iterable[str]) -> None:
    """Fail unless ``value`` is one of ``choices``."""
    choices = list(choices)
    if value not in choices:
        raise ConfigError(name, f"must be one of {choices}, got {value!r}")


def _bounds_text(minimum: Any, maximum: Any) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


# ---------------------------------------------------------------------------------------------
# Strict conversion of nested dicts into dataclasses.


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, rejecting unknown keys and wrongly typed values.

    Args:
        cls: the dataclass type to build.
        data: a mapping (from YAML/JSON) or an instance of ``cls``.
        path: dotted path of this section, used in error messages.
    """
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(where, f"unknown key (allowed: {sorted(known)})")
    kwargs = {}
    for name, value in data.items():
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _convert(hints[name], value, sub)
    missing = [
        n for n, f in known.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        where = f"{path}.{missing[0]}" if path else missing[0]
        raise ConfigError(where, "is required")
    try:
        return cls(**kwargs)
    except ConfigError as error:
        raise error.prefixed(path) if path else error


def _convert(annotation: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _convert(non_none[0], value, path)
        return value
    if origin is Literal:
        require_choice(path, value, args)
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"must be a list, got {value!r}")
        item_type = args[0] if args else Any
        return [_convert(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {value!r}")
        return dict(value)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    return value


def to_dict(config: Any) -> dict:
    """Plain-dict form of a config dataclass (JSON-serialisable)."""
    return dataclasses.asdict(config)


# ---------------------------------------------------------------------------------------------
# The tree. Model, dataset and algorithm parameters are free-form dicts here; they are resolved
# against the owning component's own Params dataclass by `resolve()` below, so each component
# keeps its defaults and checks next to its code.


@dataclass
class ModelConfig:
    """Which network to train: a registry name from trainers.models and its parameters."""

    name: str = "mlp"
    params: dict = field(default_factory=dict)


@dataclass
class DatasetConfig:
    """Which data, where it lives and how it is split across ranks.

    Args:
        name: digits | fashion_mnist | synthetic | synthetic_tokens | cifar10 | imagefolder.
        path: directory of the files (fashion_mnist, cifar10, imagefolder); None for built-ins.
        shard: iid (equal random shards) or dirichlet (per-class Dirichlet(alpha) proportions).
        alpha: Dirichlet concentration; smaller is more skewed (only for shard=dirichlet).
        test_fraction: fraction held out for evaluation when the dataset has no test split.
        max_test_samples: cap on evaluated samples (None: all), to bound evaluation time.
        params: dataset-specific settings (e.g. synthetic sizes, image_size, seq_len).
    """

    name: str = "digits"
    path: Optional[str] = None
    shard: Literal["iid", "dirichlet"] = "iid"
    alpha: float = 0.5
    test_fraction: float = 0.2
    max_test_samples: Optional[int] = None
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require_float("alpha", self.alpha, minimum=0.0, min_exclusive=True)
        require_float("test_fraction", self.test_fraction, minimum=0.0, maximum=0.9, min_exclusive=True)
        if self.max_test_samples is not None:
            require_int("max_test_samples", self.max_test_samples, minimum=1)


@dataclass
class OptimizerConfig:
    """Local optimizer. sgd uses momentum/nesterov; adamw uses betas; both use weight_decay."""

    name: Literal["sgd", "adamw"] = "sgd"
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])

    def __post_init__(self) -> None:
        require_float("momentum", self.momentum, minimum=0.0, maximum=1.0)
        require_float("weight_decay", self.weight_decay, minimum=0.0)
        if self.nesterov and (self.name != "sgd" or self.momentum == 0.0):
            raise ConfigError("nesterov", "needs name: sgd and momentum > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError("betas", f"must be two numbers in [0, 1), got {self.betas!r}")


@dataclass
class LRScheduleConfig:
    """Learning-rate schedule over ``steps``: linear warm-up, then constant, cosine or step decay.

    Args:
        name: constant | cosine (to min_lr at the last step) | step (x gamma every step_size steps).
        warmup_steps: steps of linear warm-up from lr/warmup_steps to lr.
        min_lr: floor of the cosine schedule.
        step_size: steps between decays (name=step).
        gamma: decay factor (name=step).
    """

    name: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    step_size: int = 1000
    gamma: float = 0.1

    def __post_init__(self) -> None:
        require_int("warmup_steps", self.warmup_steps, minimum=0)
        require_float("min_lr", self.min_lr, minimum=0.0)
        require_int("step_size", self.step_size, minimum=1)
        require_float("gamma", self.gamma, minimum=0.0, maximum=1.0, min_exclusive=True)


@dataclass
class AlgorithmConfig:
    """Distributed algorithm: a registry name from trainers.algorithms and its hyperparameters."""

    name: str = "sync"
    params: dict = field(default_factory=dict)


@dataclass
class CommConfig:
    """Communication backend. gloo works for CPU and CUDA tensors (staged via CPU); nccl needs CUDA;
    tcp (trainers/comm_tcp.py) survives a peer's crash and admits restarted ranks, for the
    crash-tolerant algorithms only."""

    backend: Literal["gloo", "nccl", "tcp"] = "gloo"
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        require_float("timeout_s", self.timeout_s, minimum=0.0, min_exclusive=True)


@dataclass
class Config:
    """One training run on one node (every rank loads the same file).

    Args:
        output_dir: directory for rank<N>.jsonl records and the resolved config.
        seed: seeds model init, data split, sharding and batch order.
        device: cpu | cuda (cuda uses LOCAL_RANK's GPU).
        batch_size: samples per rank per step.
        lr: peak learning rate of the local optimizer.
        steps: maximum number of steps.
        time_budget_s: stop after this many seconds (checked at eval points, agreed by all ranks).
        target_accuracy: stop once held-out accuracy reaches this fraction (checked at eval points).
        eval_every: steps between evaluations of the deployable model (also after the last step).
        save_final_model: write rank<N>_final.pt (state_dict of the trained local model).
    """

    output_dir: str
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    batch_size: int = 32
    lr: float = 0.1
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    steps: int = 100
    time_budget_s: Optional[float] = None
    target_accuracy: Optional[float] = None
    eval_every: int = 50
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    save_final_model: bool = False

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("output_dir", "must be a non-empty path")
        require_int("seed", self.seed, minimum=0)
        require_int("batch_size", self.batch_size, minimum=1)
        require_float("lr", self.lr, minimum=0.0, min_exclusive=True)
        require_int("steps", self.steps, minimum=1)
        require_int("eval_every", self.eval_every, minimum=1)
        if self.time_budget_s is not None:
            require_float("time_budget_s", self.time_budget_s, minimum=0.0, min_exclusive=True)
        if self.target_accuracy is not None:
            require_float("target_accuracy", self.target_accuracy, minimum=0.0, maximum=1.0)
        if self.comm.backend == "nccl" and self.device != "cuda":
            raise ConfigError("comm.backend", "nccl needs device: cuda")


def resolve(config: Config) -> Config:
    """Check model, dataset and algorithm params against their owners' Params and fill defaults.

    Returns the same config with ``params`` dicts replaced by their fully resolved form.
    """
    # Imported here: those modules import this one for ConfigError and the require_* checks.
    from trainers import datasets, models
    from trainers.algorithms import get_algorithm

    algorithm_cls = _lookup("algorithm.name", config.algorithm.name, get_algorithm)
    config.algorithm.params = to_dict(from_dict(algorithm_cls.Params, config.algorithm.params, "algorithm.params"))
    model_entry = _lookup("model.name", config.model.name, models.get_model_entry)
    config.model.params = to_dict(from_dict(model_entry.Params, config.model.params, "model.params"))
    dataset_entry = _lookup("dataset.name", config.dataset.name, datasets.get_dataset_entry)
    config.dataset.params = to_dict(from_dict(dataset_entry.Params, config.dataset.params, "dataset.params"))
    if model_entry.input_kind != dataset_entry.kind:
        raise ConfigError(
            "model.name",
            f"{config.model.name!r} takes {model_entry.input_kind} inputs but dataset "
            f"{config.dataset.name!r} provides {dataset_entry.kind}",
        )
    return config


def _lookup(path: str, name: str, getter: typing.Callable[[str], Any]) -> Any:
    try:
        return getter(name)
    except KeyError as error:
        raise ConfigError(path, str(error.args[0])) from None


def load_config(source: str | Path | dict, overrides: dict | None = None) -> Config:
    """Read a YAML or JSON file (or a dict), apply ``overrides`` and return the resolved Config.

    Args:
        source: path to a .yaml/.yml/.json file, or an already parsed mapping.
        overrides: dotted-key overrides applied before validation, e.g. {"algorithm.params.H": 4}.
    """
    if isinstance(source, dict):
        data = json.loads(json.dumps(source))  # deep copy; also rejects non-JSON values early
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError("", f"config file not found: {path}")
        text = path.read_text()
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return resolve(from_dict(Config, data))
