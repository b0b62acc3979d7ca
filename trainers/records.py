"""JSONL record writer: one JSON object per line, flushed per line so a crash keeps what was written."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


class RecordWriter:
    """Append records for one rank to ``<directory>/rank<rank>.jsonl``.

    Every record is stamped with ``kind``, ``rank``, ``time_unix`` (s since the epoch) and
    ``time_s`` (s since this writer was created, i.e. since the rank started).

    Args:
        directory: output directory (created if missing).
        rank: global rank of this process.
        append: add to an existing file (a restarted rank) instead of starting it afresh.
    """

    def __init__(self, directory: str | Path, rank: int, append: bool = False):
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.start_unix = time.time()
        self._start_monotonic = time.monotonic()
        # Line buffering plus an explicit flush: each record reaches the OS before write() returns.
        self._file = open(self.path, "a" if append else "w", buffering=1)

    def write(self, kind: str, **fields: Any) -> dict:
        """Write one record of ``kind`` with ``fields``; returns the record as written."""
        record = {
            "kind": kind,
            "rank": self.rank,
            "time_unix": time.time(),
            "time_s": time.monotonic() - self._start_monotonic,
            **fields,
        }
        self._file.write(json.dumps(_jsonable(record)) + "\n")
        self._file.flush()
        return record

    def close(self) -> None:
        """Flush to disk and close (idempotent)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _jsonable(value: Any) -> Any:
    """Make NaN/inf explicit nulls (JSON has no NaN) and tensors/numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_records(path: str | Path) -> list[dict]:
    """Read every record of one JSONL file (used by tests and analysis)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]
