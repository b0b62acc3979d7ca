"""What a run writes: JSONL records (one JSON object per line, flushed per line so a crash keeps
what was written) and the resolved config, replaced whole. Reading the records back is
trainers/jsonl.py's (its readers are importable from here too)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from trainers import clock
from trainers.jsonl import RecordTail, read_complete_records, read_records  # noqa: F401 - this module's readers before trainers/jsonl.py

# Rank 0 writes the resolved config (every default filled in) here, in the run's output_dir. Runs
# made before it existed have it in config.json (rank 0 overwrote the file the ranks started from).
RESOLVED_CONFIG_FILE = "config.resolved.json"
OLD_RESOLVED_CONFIG_FILE = "config.json"


class RecordWriter:
    """Append records for one rank to ``<directory>/rank<rank>.jsonl``.

    Every record is stamped with ``kind``, ``rank``, ``time_unix`` (s since the epoch) and
    ``time_s``, the training clock: s since this writer was created (since the rank started) less
    the time handed to :meth:`exclude` (snapshot writing, which is not training).

    Args:
        directory: output directory (created if missing).
        rank: global rank of this process.
        append: add to an existing file (a restarted rank) instead of starting it afresh.
    """

    def __init__(self, directory: str | Path, rank: int, append: bool = False):
        self.path = Path(directory) / f"rank{rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.start_unix = clock.wall_time()
        self._start_monotonic = clock.monotonic()
        self.excluded_s = 0.0  # off the training clock so far (s)
        # Line buffering plus an explicit flush: each record reaches the OS before write() returns.
        self._file = open(self.path, "a" if append else "w", buffering=1)

    def write(self, kind: str, **fields: Any) -> dict:
        """Write one record of ``kind`` with ``fields``; returns the record as written."""
        record = {
            "kind": kind,
            "rank": self.rank,
            "time_unix": clock.wall_time(),
            "time_s": self.clock(),
            **fields,
        }
        self._file.write(json.dumps(_jsonable(record)) + "\n")
        self._file.flush()
        return record

    def clock(self) -> float:
        """The training clock now: s since the rank started, less the excluded time."""
        return clock.monotonic() - self._start_monotonic - self.excluded_s

    def exclude(self, seconds: float) -> None:
        """Take ``seconds`` (just spent on something that is not training) off the training clock."""
        self.excluded_s += seconds

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


def resolved_config_path(output_dir: str | Path) -> Path | None:
    """The file holding a run's resolved config: ``config.resolved.json``, else ``config.json``
    (older runs; in a run directory it is also the config the ranks were started from, which
    resolves to the same), else None (rank 0 has not started yet)."""
    for name in (RESOLVED_CONFIG_FILE, OLD_RESOLVED_CONFIG_FILE):
        if (Path(output_dir) / name).is_file():
            return Path(output_dir) / name
    return None


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` whole or not at all (a temporary file in the
    same directory, flushed to disk, then renamed over ``path``): a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # created with the usual mode (umask)
    try:
        with open(tmp, "w") as handle:
            handle.write(json.dumps(data, indent=2) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
