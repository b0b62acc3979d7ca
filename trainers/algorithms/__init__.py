"""Distributed training algorithms: one file each, registered by name below.

Add an algorithm with one file (a subclass of :class:`~trainers.algorithms.base.Algorithm`) and
one line in ``ALGORITHMS``. Tests may add their own with :func:`register_algorithm`.
"""

from __future__ import annotations

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.ddp import DDP
from trainers.algorithms.diloco import DiLoCo
from trainers.algorithms.dts import DTS
from trainers.algorithms.local_sgd import LocalSGD
from trainers.algorithms.sync import Sync

ALGORITHMS: dict[str, type[Algorithm]] = {
    Sync.name: Sync,
    DDP.name: DDP,
    LocalSGD.name: LocalSGD,
    DTS.name: DTS,
    DiLoCo.name: DiLoCo,
}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Add ``cls`` to the registry under ``cls.name`` (usable as a class decorator)."""
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"algorithm name {cls.name!r} is already registered to {ALGORITHMS[cls.name].__name__}")
    ALGORITHMS[cls.name] = cls
    return cls


def get_algorithm(name: str) -> type[Algorithm]:
    """Registry lookup; KeyError names the known algorithms."""
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r} (known: {sorted(ALGORITHMS)})")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmContext", "StepResult", "get_algorithm", "register_algorithm"]
