"""The harness's side of time dilation (emulator/dilation.py slows the network) and compute profiles.

A scenario with ``time_dilation: K`` runs its network K times slower; so that the job sees the
same emulated world, every time the harness hands to the trainers or waits for is K times longer
(the time budget, snapshot intervals, the comm timeout, a compute profile's step time, fault
times, the watchdogs: all at one boundary, harness/jobspec.py `dilated`, with the trainer fields
here), and every time it reports is divided by K (harness/results.py, on loading a run). The
records on disk stay in wall-clock seconds; scenario.json says K.

A compute profile names the accelerator a job stands for: ``profiles/*.yaml`` with ``step_s``
(seconds of forward + backward per step on that accelerator, at the workload's batch size) and
the ``source`` of the figure. The trainers pad every step's forward + backward to at least
``min_compute_s`` (trainers/config.py), which the harness sets to ``step_s x K``: at dilation K,
the reported compute time per step is the profile's, whatever this machine's CPU needs (as long
as it needs less than step_s x K; the job records say when it did not). ``time_dilation: auto``
chooses K so that it does: harness/auto_dilation.py times the workload here first.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from emulator.schema import ConfigError, config_error_from_pydantic, load_yaml_mapping

from .paths import PROJECT_ROOT

if TYPE_CHECKING:
    from trainers.config import Config

PROFILES_DIR = PROJECT_ROOT / "profiles"

# trainer config fields that are durations (dotted); those with a default are dilated even when
# the scenario leaves them out
DILATED_TRAINER_FIELDS = ("time_budget_s", "eval_every_s", "comm.timeout_s", "min_compute_s")


def _trainer_default(dotted: str) -> Optional[float]:
    from trainers.config import CommConfig

    return CommConfig().timeout_s if dotted == "comm.timeout_s" else None


class ComputeProfile(BaseModel):
    """One accelerator's step time for one workload, with where the figure comes from."""

    model_config = ConfigDict(extra="forbid")
    name: str
    step_s: float = Field(gt=0, le=3600)
    source: str = Field(min_length=1)
    description: str = ""


def _find_profile(reference: str, scenario_file: Optional[str], names: tuple[str, ...]) -> Optional[Path]:
    """A profile file: `reference` beside the scenario (relative to its folder), as given, or one of
    `names` in profiles/; None if none exists."""
    path = Path(reference)
    candidates = [Path(scenario_file).parent / path] if scenario_file is not None and not path.is_absolute() else []
    candidates += [path, *(PROFILES_DIR / name for name in names)]
    return next((c for c in candidates if c.is_file()), None)


def load_profile(reference: str, scenario_file: Optional[str] = None) -> ComputeProfile:
    """A profile by file path (relative to the scenario's folder) or by name (profiles/NAME.yaml)."""
    found = _find_profile(reference, scenario_file, (reference, f"{reference}.yaml"))
    if found is None:
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))) or "none"
        raise ConfigError("compute_profile", f"{reference!r}: no such file or profile (profiles: {known})",
                          source=scenario_file or "<profile>")
    data = load_yaml_mapping(found)
    try:
        return ComputeProfile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(str(found), exc) from None


class LayerProfile(BaseModel):
    """A scenario's ``layer_profile``: per-layer times measured on an accelerator (a JSON file such
    as profiles/h200-layers-b64.json, written by bench/profile_layers.py's method: CUDA events at
    each layer's forward and each parameter's gradient) and the model in it whose shares every
    job's compute is spread by (trainers/padding.py ``measured_shares``), in place of the spread by
    multiply-accumulates. The step's total stays the compute model's (sim.compute_s) or the
    profile's (compute_profile): the measurement gives the shares, not the seconds."""

    model_config = ConfigDict(extra="forbid")
    file: str = Field(min_length=1)
    model: str = Field(min_length=1)


def load_layer_shares(ref: LayerProfile, scenario_file: Optional[str] = None) -> list[list[float]]:
    """The trainer config's ``layer_shares`` from a measured per-layer profile: per layer, in the
    measured forward order, [parameters, forward share, backward share]. Forward: each layer's
    measured forward time, scaled so that the layers together take the measured forward pass
    (what runs between them, activations and pooling, spread over them in proportion); a layer
    whose forward was not seen by its hook (null) gets none. Backward: each layer's time from the
    previous gradient to its own (what the padding and the simulator charge). Shares of forward +
    backward. ConfigError naming the file and field on anything missing."""
    field = "layer_profile.file"
    where = scenario_file or "<scenario>"
    found = _find_profile(ref.file, scenario_file, (ref.file,))
    if found is None:
        known = ", ".join(sorted(p.name for p in PROFILES_DIR.glob("*.json"))) or "none"
        raise ConfigError(field, f"{ref.file!r}: no such file (measured layer profiles: {known})", source=where)
    try:
        document = json.loads(found.read_text())
        models = {m["model"]: m for m in document["models"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(field, f"{found}: not a layer profile (a JSON object with models: [{{model, "
                          f"forward_ms, backward_ms, layers}}]): {exc}", source=where) from None
    if ref.model not in models:
        raise ConfigError("layer_profile.model", f"{ref.model!r} is not in {found.name} (models: "
                          f"{', '.join(models)})", source=where)
    measured = models[ref.model]
    try:
        layers = measured["layers"]
        forward_ms, backward_ms = float(measured["forward_ms"]), float(measured["backward_ms"])
        seen = [float(layer["forward_ms"] or 0.0) for layer in layers]
        grads = [float(layer["backward_ms"]) for layer in layers]
        parameters = [int(layer["parameters"]) for layer in layers]
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(field, f"{found.name}, model {ref.model}: a layer lacks parameters, forward_ms or "
                          f"backward_ms ({exc})", source=where) from None
    if not layers or sum(seen) <= 0 or sum(grads) <= 0 or forward_ms <= 0 or backward_ms <= 0:
        raise ConfigError(field, f"{found.name}, model {ref.model}: no measured forward or backward time",
                          source=where)
    step = forward_ms + sum(grads)
    scale = forward_ms / sum(seen)
    return [[n, f * scale / step, b / step] for n, f, b in zip(parameters, seen, grads)]


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def dilated_trainer_config(config: dict, k: float) -> dict:
    """`config` (a trainer config in emulated seconds) with every duration x `k`: what the ranks
    must be given on a network dilated by `k` (a copy; `config` is unchanged)."""
    out = copy.deepcopy(config)
    if k == 1.0:
        return out
    for dotted in DILATED_TRAINER_FIELDS:
        value = _get(out, dotted)
        if value is None:
            value = _trainer_default(dotted)
        if value is not None:
            _set(out, dotted, value * k)
    return out


def dilated_trainer(config: "Config", k: float) -> "Config":
    """The trainers' `config` (emulated seconds) with the same durations x `k` as
    `dilated_trainer_config` (a copy; `config` is unchanged)."""
    if k == 1.0:
        return config

    def scaled(node, dotted: str):
        head, _, rest = dotted.partition(".")
        value = getattr(node, head)
        if rest:
            return dataclasses.replace(node, **{head: scaled(value, rest)})
        return node if value is None else dataclasses.replace(node, **{head: value * k})

    for dotted in DILATED_TRAINER_FIELDS:
        config = scaled(config, dotted)
    return config
