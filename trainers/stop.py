"""The stop signal without the network: a file ``<output_dir>/STOP`` that every rank polls each step.

Whoever decides the job should end (the harness: target reached, time budget spent; in a run
without the harness, rank 0 for its time budget) writes ``{"stop_step": N, "reason": "..."}``
once, atomically, and never changes it: the first writer wins, so every rank reads the same N.
Each rank checks with one ``os.stat`` per step and ends after step ``N - 1`` (it has then run N
steps, like a step budget of N), so ranks of a collective job end at the same step and the
runner's usual finish/drain runs. N must be above every rank's current step: a rank already past
it when it reads the file ends at once and says so in its status record (a collective job may
then fail on a peer's timeout). :func:`stop_step_from_records` picks a safe N from the records.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainers.jsonl import rank_files, tail_records

STOP_FILE = "STOP"


@dataclass(frozen=True)
class StopRequest:
    """stop_step: ranks run steps 0..stop_step-1; reason: why (target_accuracy, time_budget, ...)."""

    stop_step: int
    reason: str


def write_stop(output_dir: str | Path, stop_step: int, reason: str) -> StopRequest:
    """Create ``<output_dir>/STOP`` atomically unless it exists; returns the request in force.

    The file is written to a temporary name and hard-linked into place, which fails if a STOP file
    is already there: then that one stays and is returned (first writer wins).
    """
    if not isinstance(stop_step, int) or isinstance(stop_step, bool) or stop_step < 1:
        raise ValueError(f"stop_step: must be an integer >= 1, got {stop_step!r}")
    path = Path(output_dir) / STOP_FILE
    tmp = path.with_name(f".{STOP_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"stop_step": stop_step, "reason": reason}) + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return read_stop(output_dir)


def read_stop(output_dir: str | Path) -> Optional[StopRequest]:
    """The request in ``<output_dir>/STOP``, or None if there is none; a malformed file is an error
    naming the file and the field."""
    path = Path(output_dir) / STOP_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    stop_step = data.get("stop_step") if isinstance(data, dict) else None
    if not isinstance(stop_step, int) or isinstance(stop_step, bool) or stop_step < 1:
        raise ValueError(f"{path}: stop_step: must be an integer >= 1, got {stop_step!r}")
    return StopRequest(stop_step, str(data.get("reason", "stop_file")))


class StopWatcher:
    """Polls ``<output_dir>/STOP`` cheaply (one ``os.stat`` while it is absent); reads it once."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir)
        self._path = str(self.output_dir / STOP_FILE)
        self.request: Optional[StopRequest] = None

    def poll(self) -> Optional[StopRequest]:
        """The stop request, once the file exists (cached: the file never changes)."""
        if self.request is None:
            try:
                os.stat(self._path)
            except FileNotFoundError:
                return None
            self.request = read_stop(self.output_dir)
        return self.request


def last_steps(output_dir: str | Path, tail_bytes: int = 16384) -> dict[int, list[tuple[int, float]]]:
    """Per rank, the (step, time_s) of the step records in the tail of ``rank<N>.jsonl``."""
    return {rank: [(int(r["step"]), float(r["time_s"])) for r in tail_records(path, tail_bytes, kinds=("step",))]
            for rank, path in rank_files(output_dir).items()}


def stop_step_from_records(output_dir: str | Path, margin_s: float = 2.0, min_margin_steps: int = 5) -> int:
    """A stop_step no rank is likely to have passed by the time it reads the STOP file.

    The largest step any rank recorded, plus the steps the fastest rank makes in ``margin_s``
    seconds at its recent rate (at least ``min_margin_steps``), plus one.
    """
    furthest, margin = 0, min_margin_steps
    for steps in last_steps(output_dir).values():
        if not steps:
            continue
        furthest = max(furthest, steps[-1][0])
        if len(steps) >= 2 and steps[-1][1] > steps[0][1]:
            rate = (steps[-1][0] - steps[0][0]) / (steps[-1][1] - steps[0][1])
            margin = max(margin, math.ceil(rate * margin_s))
    return furthest + margin + 1
