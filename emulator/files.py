"""Atomic file writes: a reader (another process, a later `wanbench` command) never sees half a file."""

from __future__ import annotations

import json
from pathlib import Path


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through `<path>.tmp` and a rename (atomic on one filesystem)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: Path, data, indent: int | None = 1) -> None:
    """Write `data` as JSON to `path` atomically; values JSON cannot hold are written with str()."""
    write_text_atomic(path, json.dumps(data, indent=indent, default=str))
