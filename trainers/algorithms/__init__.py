"""Distributed training algorithms: one file each, registered by name below.

Add an algorithm with one file (a subclass of :class:`~trainers.algorithms.base.Algorithm`) and
one line in ``ALGORITHMS``. Tests may add their own with :func:`register_algorithm`.
"""

from __future__ import annotations

from trainers.algorithms.async_ps import AsyncPS
from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.algorithms.adpsgd import ADPSGD
from trainers.algorithms.ddp import DDP
from trainers.algorithms.diloco import DiLoCo
from trainers.algorithms.dts import DTS
from trainers.algorithms.easgd import EASGD
from trainers.algorithms.eawild import EAWild
from trainers.algorithms.hierarchical_diloco import HierarchicalDiLoCo
from trainers.algorithms.dpsgd import DPSGD
from trainers.algorithms.local_only import LocalOnly
from trainers.algorithms.local_sgd import LocalSGD
from trainers.algorithms.p3 import P3
from trainers.algorithms.ps_sync import PSSync
from trainers.algorithms.quantized import Quantized
from trainers.algorithms.sparseloco import SparseLoCo
from trainers.algorithms.streaming_diloco import StreamingDiLoCo
from trainers.algorithms.sync import Sync
from trainers.algorithms.swarmsgd import SwarmSGD

ALGORITHMS: dict[str, type[Algorithm]] = {
    Sync.name: Sync,
    DDP.name: DDP,
    LocalSGD.name: LocalSGD,
    DTS.name: DTS,
    DiLoCo.name: DiLoCo,
    StreamingDiLoCo.name: StreamingDiLoCo,
    P3.name: P3,
    PSSync.name: PSSync,
    AsyncPS.name: AsyncPS,
    EASGD.name: EASGD,
    EAWild.name: EAWild,
    Quantized.name: Quantized,
    DPSGD.name: DPSGD,
    ADPSGD.name: ADPSGD,
    SwarmSGD.name: SwarmSGD,
    LocalOnly.name: LocalOnly,
    SparseLoCo.name: SparseLoCo,
    HierarchicalDiLoCo.name: HierarchicalDiLoCo,
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
