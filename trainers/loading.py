"""Loading a run configuration: read the file, apply overrides, check it against the registries.

``trainers.config`` holds the plain dataclass tree and its checks, and imports no component;
this module resolves the free-form ``params`` of the model, dataset and algorithm against their
owners' ``Params`` dataclasses, once: the resolved Config carries the Params instances (so it
imports the registries, which import ``config``: imports run one way).

The comm backend is decided here and nowhere else: which one a scenario's job gets
(:func:`comm_backend_for`, asked by the harness), whether a config may have it
(:func:`check_comm_backend`), which one a rank runs (:func:`comm_backend_to_run`, with the
launcher's ``WANBENCH_COMM_BACKEND``), and whether that is the elastic comm
(:func:`uses_elastic_comm`, which picks the comm class in the runner and the simulator).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from trainers import datasets, models
from trainers.algorithms import ALGORITHMS, get_algorithm
from trainers.config import COMM_BACKEND_VARIABLE, Config, ConfigError, from_dict, require_choice

# The comm backend that survives a peer's crash and admits restarted ranks (trainers/comm/tcp.py).
ELASTIC_COMM_BACKEND = "tcp"
# The backends a launcher may impose: the torch.distributed ones (tcp is the config's own choice,
# tied to the algorithm's crash tolerance).
LAUNCHER_BACKENDS = ("gloo", "nccl")


def tolerates_crash(algorithm: str) -> bool:
    """Whether the registered algorithm ``algorithm`` goes on without a crashed rank (False if unknown)."""
    return algorithm in ALGORITHMS and ALGORITHMS[algorithm].tolerates_crash


def comm_backend_for(algorithm: str, nodes_crash: bool) -> Optional[str]:
    """The comm backend a job of ``algorithm`` should get, or None for the config's own choice.

    Policy: when the scenario crashes nodes, an algorithm that can go on without a crashed rank
    runs on the elastic comm (the others keep their collectives and fail clearly).
    """
    return ELASTIC_COMM_BACKEND if nodes_crash and tolerates_crash(algorithm) else None


def cannot_take_back(algorithm: str) -> str:
    """Why a crashed rank of a job of ``algorithm`` (not on the elastic comm) is not restarted."""
    return (f"{algorithm} needs every rank in every collective and cannot take a rank back "
            "(the job fails)")


def uses_elastic_comm(config: Config | Mapping[str, Any]) -> bool:
    """Whether a run (a Config, or its dict form) is on the elastic comm: it goes on without a
    crashed rank and takes a restarted one back."""
    if isinstance(config, Config):
        backend = config.comm.backend
    else:
        backend = (config.get("comm") or {}).get("backend")
    return backend == ELASTIC_COMM_BACKEND


def check_comm_backend(config: Config) -> None:
    """ConfigError unless the elastic comm, if asked for, carries a crash-tolerant algorithm."""
    if uses_elastic_comm(config) and not tolerates_crash(config.algorithm.name):
        tolerant = sorted(name for name, cls in ALGORITHMS.items() if cls.tolerates_crash)
        raise ConfigError("comm.backend", f"{ELASTIC_COMM_BACKEND} is for the crash-tolerant algorithms {tolerant}; "
                          f"{config.algorithm.name} needs every rank in every collective (use gloo or nccl)")


def comm_backend_to_run(config: Config, env: Mapping[str, str]) -> str:
    """The comm backend a rank of ``config`` runs: ``comm.backend``, or the one a launcher imposed
    through ``WANBENCH_COMM_BACKEND`` in ``env`` (gloo or nccl; it never replaces tcp, which is
    the algorithm's crash tolerance, not a transport to swap). The wanbench harness sets it to
    gloo when a job that asked for nccl has more ranks than GPUs: NCCL needs a GPU per rank, gloo
    takes CUDA tensors (staged through the CPU by the comm layer). The config's own choice is
    checked when it is resolved (:func:`check_comm_backend`)."""
    backend = env.get(COMM_BACKEND_VARIABLE)
    if not backend or backend == config.comm.backend:
        return config.comm.backend
    require_choice(COMM_BACKEND_VARIABLE, backend, LAUNCHER_BACKENDS)
    if uses_elastic_comm(config):
        raise RuntimeError(f"{COMM_BACKEND_VARIABLE}={backend} cannot replace comm.backend {ELASTIC_COMM_BACKEND}")
    return backend


def with_launcher_backend(config: Config, env: Mapping[str, str]) -> Config:
    """``config`` with the comm backend its rank runs (:func:`comm_backend_to_run`), else itself,
    so that the resolved config a rank writes names the backend that ran."""
    backend = comm_backend_to_run(config, env)
    if backend == config.comm.backend:
        return config
    return dataclasses.replace(config, comm=dataclasses.replace(config.comm, backend=backend))


def resolve(config: Config) -> Config:
    """Check model, dataset and algorithm params against their owners' Params and fill defaults.

    Returns a config whose ``params`` are their owners' Params instances (``config`` itself is
    left as it was; params that already are instances pass through unchanged).
    """
    algorithm_cls = _lookup("algorithm.name", config.algorithm.name, get_algorithm)
    algorithm_params = from_dict(algorithm_cls.Params, config.algorithm.params, "algorithm.params")
    model_entry = _lookup("model.name", config.model.name, models.get_model_entry)
    model_params = from_dict(model_entry.Params, config.model.params, "model.params")
    dataset_entry = _lookup("dataset.name", config.dataset.name, datasets.get_dataset_entry)
    dataset_params = from_dict(dataset_entry.Params, config.dataset.params, "dataset.params")
    if model_entry.input_kind != dataset_entry.kind:
        raise ConfigError(
            "model.name",
            f"{config.model.name!r} takes {model_entry.input_kind} inputs but dataset "
            f"{config.dataset.name!r} provides {dataset_entry.kind}",
        )
    check_comm_backend(config)
    return dataclasses.replace(
        config,
        algorithm=dataclasses.replace(config.algorithm, params=algorithm_params),
        model=dataclasses.replace(config.model, params=model_params),
        dataset=dataclasses.replace(config.dataset, params=dataset_params),
    )


def _lookup(field: str, name: str, getter: Callable[[str], Any]) -> Any:
    try:
        return getter(name)
    except KeyError as error:
        raise ConfigError(field, str(error.args[0])) from None


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
