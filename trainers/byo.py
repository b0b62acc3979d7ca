"""Records for your own training script, in the trainers' format, so `wanbench run` and
`wanbench report` give it the built-in summary (steps/s, loss and accuracy curves, time to target).

Optional: a script runs without it (docs/BYO_SCRIPT.md). Standard library only (no torch import,
no wanbench import beyond this file), so a script can take it with

    try:
        from trainers.byo import Recorder
    except ImportError:
        Recorder = None

and write one `step` record per training step on every rank and `eval` records (held-out
accuracy) on rank 0:

    rec = Recorder()                  # $WANBENCH_OUTPUT_DIR/rank$RANK.jsonl; a no-op outside wanbench
    for step in range(steps):
        ...
        rec.step(step, loss=loss.item())            # step_s: time since the previous call
        if rank == 0 and step % 10 == 9:
            rec.eval(step, accuracy=acc)
    rec.close()

Each line is a JSON object: kind, rank, time_unix (s since the epoch), time_s (s since the
recorder was made), and the fields given; the harness reads `step` (step, loss, step_s, and where
known comm_blocked_s, bytes_sent) and `eval` (step, accuracy) as it reads the trainers' own.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Optional

OUTPUT_DIR_VARIABLE = "WANBENCH_OUTPUT_DIR"


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a tensor or numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class Recorder:
    """Append one rank's records to `<output_dir>/rank<rank>.jsonl`.

    Args:
        output_dir: where to write; default $WANBENCH_OUTPUT_DIR. None and no variable: every call
            is a no-op (the script runs as it would without wanbench).
        rank: default $RANK (0 when unset).
    """

    def __init__(self, output_dir: Optional[str] = None, rank: Optional[int] = None):
        output_dir = output_dir or os.environ.get(OUTPUT_DIR_VARIABLE)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.enabled = bool(output_dir)
        self._start = time.monotonic()
        self._last: Optional[float] = None
        self._file = None
        if self.enabled:
            os.makedirs(output_dir, exist_ok=True)
            # a restarted rank (torchrun's TORCHELASTIC_RESTART_COUNT) appends; the harness aligns clocks
            append = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
            self.path = os.path.join(output_dir, f"rank{self.rank}.jsonl")
            self._file = open(self.path, "a" if append else "w", buffering=1)
            self.write("start", script=True)

    def write(self, kind: str, **fields: Any) -> Optional[dict]:
        """One record of `kind` (flushed at once: a crash keeps what was written)."""
        if not self.enabled:
            return None
        record = {"kind": kind, "rank": self.rank, "time_unix": time.time(),
                  "time_s": time.monotonic() - self._start, **fields}
        self._file.write(json.dumps(_jsonable(record)) + "\n")
        return record

    def step(self, step: int, loss: Any = None, step_s: Optional[float] = None, **fields: Any) -> Optional[dict]:
        """A finished training step (0-based). `step_s`: its seconds; default the time since the
        previous step record (or since the recorder was made, for the first)."""
        now = time.monotonic()
        if step_s is None:
            step_s = now - (self._last if self._last is not None else self._start)
        self._last = now
        return self.write("step", step=step, loss=loss, step_s=step_s, **fields)

    def eval(self, step: int, accuracy: Any, **fields: Any) -> Optional[dict]:
        """Held-out accuracy (0..1) of the model after step `step` (rank 0 writes these)."""
        return self.write("eval", step=step, accuracy=accuracy, **fields)

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
