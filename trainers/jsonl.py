"""Reading JSONL records (one JSON object per line): the one reader of every record file.

The files are written a line at a time by processes that may still be running or may have been
killed mid-line (trainers/records.py's RecordWriter, the evaluator's eval.jsonl, the harness's
faults.jsonl), so every reader here follows the same rules:

- a last line without its newline is a record cut mid-write, and is left out, unless it parses
  as a whole object (its newline is on the way: a JSON object cut before its closing brace never
  parses);
- a complete line that is not a JSON object (a crashed writer's torn line with a restarted
  writer's record after it) is skipped;
- a missing file has no records.

`read_complete_records` reads a file whole (optionally only some kinds), `RecordTail` follows a
growing file from a byte offset, `last_records` finds the last record of each kind from the
end, `first_record` the first of a kind from the start, and `rank_files` lists a job's
``rank<N>.jsonl`` files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

# Bytes read per look backwards from the end of a file (last_records).
TAIL_CHUNK_BYTES = 16384


def _decode(line: bytes) -> Optional[dict]:
    """The object on one line, or None for a line that is not a JSON object."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        return None
    return record if isinstance(record, dict) else None


def _kept(record: dict, kinds: Optional[Iterable[str]]) -> bool:
    return kinds is None or record.get("kind") in kinds


def parse_lines(data: bytes) -> tuple[list[dict], int, int, int]:
    """The records in ``data`` (bytes of a JSONL file from a line's start): (records, bytes they
    used up to the last whole line, lines parsed, complete lines that were not a JSON object)."""
    end = data.rfind(b"\n") + 1
    rows, parsed, bad = [], 0, 0
    for line in data[:end].split(b"\n"):
        if line.strip():
            parsed += 1
            record = _decode(line)
            if record is not None:
                rows.append(record)
            else:
                bad += 1
    rest = data[end:]
    if rest.strip():
        # No newline yet. A JSON object cut anywhere before its closing brace does not parse,
        # so one that parses is whole (its newline is on the way) and is taken now.
        parsed += 1
        record = _decode(rest)
        if record is not None:
            rows.append(record)
            end = len(data)
    return rows, end, parsed, bad


def read_records(path: str | Path) -> list[dict]:
    """Every record of one JSONL file that must be whole (a bad line is an error; tests, analysis)."""
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
        rows, end, parsed, bad = parse_lines(data)
        self.lines_parsed += parsed
        self.bad_lines += bad
        return rows, end

    def _restart(self) -> None:
        self.offset, self._identity, self._head, self.restarted = 0, None, b"", True


def read_complete_records(path: str | Path, kinds: Optional[Iterable[str]] = None) -> list[dict]:
    """The records of a JSONL file another process may still be appending to, or that a crashed
    writer left a torn line in (the rules of the module docstring; :class:`RecordTail`, read
    once); only those whose ``kind`` is in ``kinds`` when given; no file: no records."""
    kinds = None if kinds is None else set(kinds)
    return [record for record in RecordTail(path).read_new() if _kept(record, kinds)]


def last_records(path: str | Path, kinds: Iterable[str]) -> dict[str, dict]:
    """The last record of each of ``kinds`` in a JSONL file, read backwards from its end a chunk at
    a time until every kind is found (or the file's start): kind -> record, kinds never written
    left out; no file: {}."""
    wanted = set(kinds)
    found: dict[str, dict] = {}
    try:
        handle = open(path, "rb")
    except OSError:
        return found
    with handle:
        end = handle.seek(0, os.SEEK_END)
        carry = b""  # the start of a line whose beginning lies in the next chunk back
        while end > 0 and len(found) < len(wanted):
            start = max(0, end - TAIL_CHUNK_BYTES)
            handle.seek(start)
            data = handle.read(end - start) + carry
            end = start
            lines = data.split(b"\n")
            carry = lines.pop(0) if start > 0 else b""  # maybe part of a line: its start comes next
            # a last line cut mid-write does not parse (module docstring): it is left out here
            for line in reversed(lines):
                record = _decode(line) if line.strip() else None
                if record is not None and record.get("kind") in wanted and record["kind"] not in found:
                    found[record["kind"]] = record
    return found


def first_record(path: str | Path, kind: str) -> Optional[dict]:
    """The first record of ``kind`` in a JSONL file, read from its start up to it; None if it has none."""
    marker = json.dumps(kind).encode()
    try:
        handle = open(path, "rb")
    except OSError:
        return None
    with handle:
        for line in handle:
            if marker in line:  # only lines that can hold it are parsed
                record = _decode(line)
                if record is not None and record.get("kind") == kind:
                    return record
    return None


def tail_records(path: str | Path, tail_bytes: int, kinds: Optional[Iterable[str]] = None) -> list[dict]:
    """The records that lie whole in the last ``tail_bytes`` of a JSONL file (a line cut by that
    boundary left out), in file order; only those of ``kinds`` when given; no file: []."""
    kinds = None if kinds is None else set(kinds)
    try:
        with open(path, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - tail_bytes)
            handle.seek(start)
            data = handle.read()
    except OSError:
        return []
    if start > 0:
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""  # the first line may be cut
    rows = parse_lines(data)[0]
    return [row for row in rows if _kept(row, kinds)]


def written_bytes(path: str | Path) -> int:
    """How many bytes a writer has put in the file so far (0 if there is none yet): it grows with
    every record, so a change says the writer made progress without reading a record."""
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def rank_files(directory: str | Path) -> dict[int, Path]:
    """A job's ``rank<N>.jsonl`` files, rank -> path, by rank."""
    found = {}
    for path in Path(directory).glob("rank*.jsonl"):
        name = path.name[len("rank"):-len(".jsonl")]
        if name.isdigit():
            found[int(name)] = path
    return dict(sorted(found.items()))
