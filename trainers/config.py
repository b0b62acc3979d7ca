"""Run configuration: a plain dataclass tree, its checks, and strict conversion from dicts.

Each component owns its config dataclass and checks it in ``__post_init__``. Errors are raised as
:class:`ConfigError` whose message starts with the dotted field path, e.g.
``algorithm.params.H: must be an integer >= 1, got 0``. Unknown keys are errors.

This module imports nothing of the trainers: the components import it for their checks. Reading a
file and resolving the components' params against their registries is ``trainers.loading``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; names the field.

    The same shape as ``emulator.schema.ConfigError`` (the packages do not import each other):
    ``field`` is the dotted path (``algorithm.params.H``), ``message`` says what is wrong, and
    ``source`` the file it came from; str() is ``"source: field: message"`` on one line, parts
    omitted when empty.
    """

    def __init__(self, field: str, message: str, source: str = ""):
        # One line, whatever a file's keys or values hold (newlines and control characters escaped).
        self.field = _escaped(field)
        self.message = _escaped(" ".join(message.split()))
        self.source = source
        super().__init__(": ".join(part for part in (source, self.field, self.message) if part))

    def prefixed(self, prefix: str) -> "ConfigError":
        """Return the same error with ``prefix`` prepended to its field path."""
        field = f"{prefix}.{self.field}" if self.field else prefix
        return ConfigError(field, self.message, self.source)


def _escaped(text: str) -> str:
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


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


def check_warmup(warmup_steps: int, warmup_lr: Optional[float], bucket_cap_mb: float) -> None:
    """Check a Params dataclass's data-parallel warm start (raises ConfigError naming the field)."""
    require_int("warmup_steps", warmup_steps, minimum=0)
    if warmup_lr is not None:
        require_float("warmup_lr", warmup_lr, minimum=0.0, min_exclusive=True)
        if warmup_steps == 0:
            raise ConfigError("warmup_lr", "is set but warmup_steps is 0 (there is no warm-up for it to apply to)")
    require_float("bucket_cap_mb", bucket_cap_mb, minimum=0.0, min_exclusive=True)


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
        kwargs[name] = _convert(known[name].metadata.get(PARSED_AS, hints[name]), value, sub)
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
    """Plain-dict form of a config dataclass (JSON-serialisable); a component's resolved Params
    instance becomes the mapping of its fields, as in the file."""
    return dataclasses.asdict(config)


# A field's metadata key: the type ``from_dict`` reads the field's value as, where the field holds
# something else afterwards (``params``: read as a mapping, resolved to its owner's Params).
PARSED_AS = "parsed_as"


def params_field() -> Any:
    """A component's ``params``: a mapping as read from the file (checked as one by ``from_dict``),
    replaced by its owner's ``Params`` instance when ``trainers.loading.resolve`` runs."""
    return field(default_factory=dict, metadata={PARSED_AS: dict})


# ---------------------------------------------------------------------------------------------
# The tree. Model, dataset and algorithm parameters are read as free-form mappings here; resolving
# (`trainers.loading.resolve()`) replaces each by the owning component's own Params instance, so
# each component keeps its defaults and checks next to its code and the parsed object travels
# with the config (written back out by `to_dict` in the file's form).


@dataclass
class ModelConfig:
    """Which network to train: a registry name from trainers.models and its parameters."""

    name: str = "mlp"
    params: Any = params_field()  # the model's Params once resolved


@dataclass
class DatasetConfig:
    """Which data, where it lives and how it is split across ranks.

    Args:
        name: digits | fashion_mnist | synthetic | synthetic_tokens | text_corpus | cifar10 | synthetic_cifar |
            imagefolder.
        path: directory of the files (fashion_mnist, cifar10, imagefolder; text_corpus: a folder or one
            file, unset: the Python standard library); None for built-ins.
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
    params: Any = params_field()  # the dataset's Params once resolved

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


# What a launcher that places ranks on GPUs (the harness: harness/gpus.py, docs/GPU.md) tells a
# rank besides CUDA_VISIBLE_DEVICES; trainers/runner.py reads them. Here, not in the runner, so that
# the harness can import them without torch.
COMM_BACKEND_VARIABLE = "WANBENCH_COMM_BACKEND"  # the comm backend to run instead of comm.backend
GPU_SHARED_BY_VARIABLE = "WANBENCH_GPU_SHARED_BY"  # how many of the job's ranks share this rank's GPU
GPU_REASON_VARIABLE = "WANBENCH_GPU_REASON"  # why this GPU and this backend, one line

@dataclass
class AlgorithmConfig:
    """Distributed algorithm: a registry name from trainers.algorithms and its hyperparameters."""

    name: str = "sync"
    params: Any = params_field()  # the algorithm's Params once resolved


@dataclass
class CommConfig:
    """Communication backend. gloo works for CPU and CUDA tensors (staged via CPU); nccl needs CUDA;
    tcp (trainers/comm/tcp.py) survives a peer's crash and admits restarted ranks, for the
    crash-tolerant algorithms only."""

    backend: Literal["gloo", "nccl", "tcp"] = "gloo"
    timeout_s: float = 300.0
    # Every algorithm's all-reduce and all-gather (trainers/comm/, Comm.allreduce_async and
    # allgather_async; all-gather: direct or ring, recursive_doubling's is the ring): ours over
    # point-to-point messages on background threads (auto: direct exchange for small payloads,
    # ring for large; ring; direct; recursive_doubling) or gloo, the backend's own collective (the
    # reference). nccl keeps its own collective under auto; tcp is always its crash-tolerant star.
    allreduce: Literal["auto", "ring", "direct", "recursive_doubling", "gloo"] = "auto"
    # Background collectives (all-reduces, all-gathers) in flight at once per rank; more wait and
    # start in launch order. The real comm's threads and the simulator both obey it. The default
    # is trainers.comm.MAX_IN_FLIGHT (a literal here: this module does not import torch).
    max_in_flight: int = 4

    def __post_init__(self) -> None:
        require_float("timeout_s", self.timeout_s, minimum=0.0, min_exclusive=True)
        require_int("max_in_flight", self.max_in_flight, minimum=1)


def check_layer_shares(shares) -> None:
    """``layer_shares`` (see Config): a non-empty list of [parameters, forward, backward], parameters
    a whole number >= 0, shares >= 0 summing to 1 (within 1e-6)."""
    if not isinstance(shares, list) or not shares:
        raise ConfigError("layer_shares", "must be a non-empty list of [parameters, forward share, backward share]")
    total = 0.0
    for index, entry in enumerate(shares):
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in entry)):
            raise ConfigError(f"layer_shares[{index}]", f"must be [parameters, forward share, backward share], got {entry!r}")
        parameters, forward, backward = entry
        if parameters < 0 or parameters != int(parameters) or not forward >= 0 or not backward >= 0:
            raise ConfigError(f"layer_shares[{index}]", f"parameters a whole number >= 0 and shares >= 0, got {entry!r}")
        total += forward + backward
    if abs(total - 1.0) > 1e-6:
        raise ConfigError("layer_shares", f"the shares sum to {total:.6f}, not 1")


@dataclass
class Config:
    """One training run on one node (every rank loads the same file).

    Args:
        output_dir: directory for rank<N>.jsonl records and the resolved config.
        seed: seeds model init, data split, sharding and batch order.
        device: cpu | cuda: cuda:(LOCAL_RANK mod the visible GPUs); the wanbench harness gives
            each rank one GPU through CUDA_VISIBLE_DEVICES (its own when there are enough, else
            shared round robin, and then nccl falls back to gloo; docs/GPU.md).
        batch_size: samples per rank per step.
        lr: peak learning rate of the local optimizer.
        steps: maximum number of steps.
        time_budget_s: training seconds after which the job stops: the harness writes the STOP
            file (trainers/stop.py); without it, rank 0 does when every rank's records are in
            output_dir (one filesystem), else only ``steps`` applies.
        target_accuracy: held-out accuracy at which the watcher of the job (the harness, or
            ``python -m trainers.evaluate --follow --stop-at-target``) writes the STOP file.
        target_loss: the same for held-out loss at or below this value (mean cross-entropy per
            target, nats: a language model's validation loss); at most one of the two targets.
        eval_every: steps between eval points (model snapshots for the evaluator; on the tcp comm
            also the membership exchange); also after the last step.
        eval_every_s: if set, snapshots every this many seconds of each rank's training clock
            instead of every ``eval_every`` steps (the membership exchange stays step-based).
        save_final_model: write rank<N>_final.pt (state_dict of the trained local model).
        min_compute_s: pad every step's forward + backward to at least this many seconds (a
            compute profile: the step time of the accelerator the job stands for; the harness
            multiplies it by the time dilation). Step records give the unpadded time as
            ``compute_unpadded_s``.
        pad_layers: spread ``min_compute_s`` over the model's layers (each layer's forward and
            each parameter's gradient padded to its share by multiply-accumulates,
            trainers/padding.py), so what an algorithm overlaps with the passes (p3) meets the
            profile's timing and the CPU is free while a layer "computes"; without it the whole
            pad comes after backward.
        layer_shares: measured per-layer shares of a step, in place of the spread by
            multiply-accumulates (pad_layers, and the simulator's compute spread): per layer that
            owns parameters, in forward order, [parameters, forward share, backward share], every
            share >= 0 and all of them summing to 1 (the harness fills it from a scenario's
            ``layer_profile``; trainers/padding.py checks it against the model's layers).
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
    target_loss: Optional[float] = None
    eval_every: int = 50
    eval_every_s: Optional[float] = None
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    save_final_model: bool = False
    min_compute_s: Optional[float] = None
    pad_layers: bool = False
    layer_shares: Optional[list] = None

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ConfigError("output_dir", "must be a non-empty path")
        require_int("seed", self.seed, minimum=0)
        require_int("batch_size", self.batch_size, minimum=1)
        require_float("lr", self.lr, minimum=0.0, min_exclusive=True)
        require_int("steps", self.steps, minimum=1)
        require_int("eval_every", self.eval_every, minimum=1)
        if self.eval_every_s is not None:
            require_float("eval_every_s", self.eval_every_s, minimum=0.0, min_exclusive=True)
        if self.time_budget_s is not None:
            require_float("time_budget_s", self.time_budget_s, minimum=0.0, min_exclusive=True)
        if self.min_compute_s is not None:
            require_float("min_compute_s", self.min_compute_s, minimum=0.0)
        if not isinstance(self.pad_layers, bool):
            raise ConfigError("pad_layers", f"must be true or false, got {self.pad_layers!r}")
        if self.pad_layers and not self.min_compute_s:
            raise ConfigError("pad_layers", "spreads min_compute_s over the layers: set min_compute_s (or a "
                              "compute profile) too")
        if self.layer_shares is not None:
            check_layer_shares(self.layer_shares)
        if self.target_accuracy is not None:
            require_float("target_accuracy", self.target_accuracy, minimum=0.0, maximum=1.0)
        if self.target_loss is not None:
            require_float("target_loss", self.target_loss, minimum=0.0, min_exclusive=True)
            if self.target_accuracy is not None:
                raise ConfigError("target_loss", "give one target: target_accuracy or target_loss, not both")
        if self.comm.backend == "nccl" and self.device != "cuda":
            raise ConfigError("comm.backend", "nccl needs device: cuda")
