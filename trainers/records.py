"""What a run writes: JSONL records (one JSON object per line, flushed per line so a crash keeps
what was written) and the resolved config, replaced whole."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from trainers import clock

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


def read_records(path: str | Path) -> list[dict]:
    """Read every record of one JSONL file (used by tests and analysis)."""
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


class RecordTail:
    """The records another process appends to one JSONL file, read a piece at a time.

    Each :meth:`read_new` parses only the bytes added since the last one: it remembers how far it
    got (``offset``, in bytes), so following a file that grows by a record per step costs the new
    records, not the whole file again. A last line without its newline is a record cut mid-write:
    it is left for the next read (unless it already holds a whole record). A complete line that is
    not JSON (a crashed writer's cut line with a restarted writer's record after it) is skipped and
    counted in ``bad_lines``. A file that was replaced (another inode), shrank, or no longer
    starts with the bytes read first (truncated and written again) is read again from the start,
    and ``restarted`` says so until the next read.

    Args:
        path: the JSONL file (it need not exist yet).
    """

    # Bytes of the file's head remembered to recognise a file truncated and refilled in place
    # (RecordWriter without append): its first record's time_unix differs.
    HEAD_BYTES = 256

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.offset = 0  # bytes consumed: every record before it was returned once
        self.restarted = False
        self.lines_parsed = 0  # json.loads calls, over the life of this reader
        self.bad_lines = 0
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the file read so far
        self._head = b""

    def read_new(self) -> list[dict]:
        """Records completed since the last call (all of them the first time, or after a restart)."""
        self.restarted = False
        try:
            handle = open(self.path, "rb")
        except FileNotFoundError:
            if self.offset:
                self._restart()
            return []
        with handle:
            status = os.fstat(handle.fileno())
            if self.offset and ((status.st_dev, status.st_ino) != self._identity or status.st_size < self.offset
                                or os.pread(handle.fileno(), len(self._head), 0) != self._head):
                self._restart()
            self._identity = (status.st_dev, status.st_ino)
            if status.st_size == self.offset:
                return []
            handle.seek(self.offset)
            data = handle.read()  # to the end now: it may have grown since fstat
        if len(self._head) < self.HEAD_BYTES:
            self._head = (self._head + data)[:self.HEAD_BYTES]
        rows, consumed = self._parse(data)
        self.offset += consumed
        if len(self._head) > self.offset:
            self._head = self._head[:self.offset]  # remember only what was consumed
        return rows

    def _parse(self, data: bytes) -> tuple[list[dict], int]:
        """The records in ``data`` and how many of its bytes they used (up to the last whole line)."""
        end = data.rfind(b"\n") + 1
        rows = []
        for line in data[:end].split(b"\n"):
            if line.strip():
                record = self._decode(line)
                if isinstance(record, dict):
                    rows.append(record)
                else:
                    self.bad_lines += 1
        rest = data[end:]
        if rest.strip():
            # No newline yet. A JSON object cut anywhere before its closing brace does not parse,
            # so one that parses is whole (its newline is on the way) and is taken now.
            record = self._decode(rest)
            if isinstance(record, dict):
                rows.append(record)
                end = len(data)
        return rows, end

    def _decode(self, line: bytes):
        self.lines_parsed += 1
        try:
            return json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            return None

    def _restart(self) -> None:
        self.offset, self._identity, self._head, self.restarted = 0, None, b"", True


def read_complete_records(path: str | Path) -> list[dict]:
    """The records of a JSONL file another process may still be appending to, or that a crashed
    writer left a torn line in: a last line cut mid-write and complete lines that are not JSON are
    left out (:class:`RecordTail`, read once); no file: no records."""
    return RecordTail(path).read_new()


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
