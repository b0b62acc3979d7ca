"""Snapshots of the model an algorithm outputs, written to local storage with no communication.

At each evaluation point every rank that holds part of the algorithm's output model writes

    <output_dir>/snapshots/rank<R>/<eval_index:06d>.pt

with ``torch.save({"step", "time_s", "train_time_s", "rank", "eval_index", "role", "state",
"param_range"})`` (``time_s``: the rank's training clock, as in its records; ``train_time_s``: the
same clock counted from the start of the rank's first step),
atomically (a temporary file in the same folder, then a rename), and goes on at once. The
evaluator (``python -m trainers.evaluate``) reads them outside the training processes.

Roles (what ``Algorithm.output_state`` returns, and how the evaluator combines one eval_index):

* ``replica``: every rank writes its replica; the output model is their mean (local SGD, DTS,
  D-PSGD, AD-PSGD, SwarmSGD, quantized over local SGD).
* ``rank0``: replicas are identical (sync, DDP, P3, quantized over sync); rank 0 writes its own.
* ``centre`` / ``global``: one copy (EASGD's centre, DiLoCo's outer model), written by rank 0.
* ``server`` / ``centre`` with ``param_range``: a parameter server (async PS, EA-wild) writes its
  range [start, stop) of the flattened trainable parameters; the evaluator joins the ranges.

Eval points (:class:`SnapshotSchedule`) fall on the same steps on every rank when they are set by
step count (``eval_every``), so replicas of one eval_index are from the same step. With
``eval_every_s`` they are set by each rank's own training clock instead: eval_index k is the first
step end at or after (k + 1) * eval_every_s, so replicas of one index are from the same training
time (within a step), not necessarily the same step. A step that spans several slots writes one
snapshot under the last of them; the evaluator takes, per rank, the latest snapshot at or before
an index. The last step always writes a snapshot, under an index larger than any before it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

SNAPSHOT_DIR = "snapshots"
_NAME = re.compile(r"^(\d{6,})\.pt$")


@dataclass
class OutputState:
    """What one rank contributes to the output model at an eval point.

    Args:
        role: replica | rank0 | centre | global | server (see the module docstring).
        state: a model ``state_dict`` (tensors may be the live ones: they are saved at once).
        param_range: for a sharded copy, [start, stop) of the flattened trainable parameters this
            rank holds (the rest of ``state`` is ignored for trainable parameters); None: all.
    """

    role: str
    state: dict
    param_range: Optional[tuple[int, int]] = None


def rank_dir(output_dir: str | Path, rank: int) -> Path:
    """The folder holding rank ``rank``'s snapshots."""
    return Path(output_dir) / SNAPSHOT_DIR / f"rank{rank}"


def snapshot_path(output_dir: str | Path, rank: int, eval_index: int) -> Path:
    """Where rank ``rank`` writes the snapshot of ``eval_index``."""
    return rank_dir(output_dir, rank) / f"{eval_index:06d}.pt"


def write_snapshot(output_dir: str | Path, rank: int, eval_index: int, step: int, time_s: float,
                   train_time_s: float, output: OutputState) -> int:
    """Save one snapshot atomically (tmp + rename, so a reader never sees half a file); returns its bytes.

    Args:
        output_dir: the job's output folder.
        rank: this rank.
        eval_index: index of the eval point (file name).
        step: 0-based step just completed.
        time_s: the training clock at the eval point (s since the rank started, snapshot time excluded).
        train_time_s: the same clock from the start of the rank's first step.
        output: what this rank contributes.
    """
    path = snapshot_path(output_dir, rank, eval_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = {
        "step": step, "time_s": time_s, "train_time_s": train_time_s, "rank": rank, "eval_index": eval_index, "role": output.role,
        "state": output.state, "param_range": list(output.param_range) if output.param_range else None,
    }
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def list_snapshots(output_dir: str | Path) -> dict[int, dict[int, Path]]:
    """Every complete snapshot: {rank: {eval_index: path}} (temporary files are skipped)."""
    return SnapshotLister(output_dir).list()


class SnapshotLister:
    """The snapshots of a job, for a reader that looks again every fraction of a second.

    Every call lists the folders anew (the same answer as :func:`list_snapshots` at that moment,
    no guessing from timestamps), but the names are compared as sets and only the new ones are
    parsed and made into paths, so a call costs little more than the directory listing itself.

    Args:
        output_dir: the job's output folder.
    """

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir) / SNAPSHOT_DIR
        self._names: dict[int, frozenset[str]] = {}  # rank -> the folder's names at the last call
        self._found: dict[int, dict[int, Path]] = {}  # rank -> {eval_index: path} of those names

    def list(self) -> dict[int, dict[int, Path]]:
        """Every complete snapshot now: {rank: {eval_index: path}} (a fresh dict; temporary files skipped)."""
        try:
            entries = [(entry.name, entry.path) for entry in os.scandir(self.root)
                       if entry.name.startswith("rank") and entry.name[4:].isdigit() and entry.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            entries = []
        found: dict[int, dict[int, Path]] = {}
        seen = set()
        for name, path in entries:
            rank = int(name[4:])
            seen.add(rank)
            try:
                names = frozenset(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            if names != self._names.get(rank):
                self._update(rank, Path(path), names)
            if self._found[rank]:
                found[rank] = dict(self._found[rank])
        for rank in set(self._names) - seen:
            del self._names[rank], self._found[rank]
        return found

    def _update(self, rank: int, folder: Path, names: frozenset[str]) -> None:
        before = self._names.get(rank, frozenset())
        # Temporary files come and go; a snapshot going away (our writers never do that): parse all again.
        if any(_NAME.match(name) for name in before - names):
            files, new_names = {}, names
        else:
            files, new_names = self._found.get(rank, {}), names - before
        for name in new_names:
            match = _NAME.match(name)
            if match:
                files[int(match.group(1))] = folder / name
        self._names[rank], self._found[rank] = names, files


def load_snapshot(path: str | Path) -> dict:
    """Read one snapshot written by :func:`write_snapshot` (on CPU)."""
    return torch.load(path, map_location="cpu", weights_only=True)


class SnapshotSchedule:
    """Which step ends are eval points, and their eval_index; the same on every rank for step counts.

    Args:
        eval_every: steps between eval points (index = (step + 1) // eval_every - 1), used when
            ``eval_every_s`` is None.
        eval_every_s: seconds of training clock between eval points (index k at the first step
            end at or after (k + 1) * eval_every_s), or None.
    """

    def __init__(self, eval_every: int, eval_every_s: Optional[float] = None):
        self.eval_every = eval_every
        self.eval_every_s = eval_every_s
        self.last_index = -1

    def index_at(self, step: int, clock_s: float, last: bool) -> Optional[int]:
        """The eval_index of the end of ``step`` (at training clock ``clock_s``), or None if it is
        not an eval point. The last step is always one, under an index above every earlier one."""
        if self.eval_every_s is None:
            index = (step + 1) // self.eval_every - 1
            due = (step + 1) % self.eval_every == 0
        else:
            index = int(clock_s // self.eval_every_s) - 1
            due = index > self.last_index
        if last and not due:
            index, due = max(index, self.last_index) + 1, True
        if not due:
            return None
        self.last_index = index
        return index
