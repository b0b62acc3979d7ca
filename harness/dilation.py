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
    # Reserved for measured per-layer shares of step_s (one per module that owns parameters, in
    # forward order, summing to 1), to replace the spread by multiply-accumulates
    # (trainers/padding.py) once such a profile exists; refused until it is applied.
    layer_fractions: Optional[list[float]] = None

    @pydantic.field_validator("layer_fractions")
    @classmethod
    def _layer_fractions_not_applied_yet(cls, value):
        if value is not None:
            raise ValueError("reserved for measured per-layer shares of step_s and not applied yet (step_s is "
                             "spread over the layers by multiply-accumulates, trainers/padding.py): remove it")
        return value


def load_profile(reference: str, scenario_file: Optional[str] = None) -> ComputeProfile:
    """A profile by file path (relative to the scenario's folder) or by name (profiles/NAME.yaml)."""
    candidates = []
    path = Path(reference)
    if scenario_file is not None and not path.is_absolute():
        candidates.append(Path(scenario_file).parent / path)
    candidates += [path, PROFILES_DIR / reference, PROFILES_DIR / f"{reference}.yaml"]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))) or "none"
        raise ConfigError("compute_profile", f"{reference!r}: no such file or profile (profiles: {known})",
                          source=scenario_file or "<profile>")
    data = load_yaml_mapping(found)
    try:
        return ComputeProfile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(str(found), exc) from None


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
