"""Loading YAML input files safely, and turning validation failures into one-line errors.

Every error a user can cause with a file ends up as `ConfigError`: one line naming the file, the
field path and what is allowed. The CLI prints it and exits 2 before anything privileged runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pydantic
import yaml

# Input files are small hand-written documents; a bigger one is a mistake (or an attack).
MAX_FILE_BYTES = 4 * 1024 * 1024
# YAML aliases let a tiny file expand to gigabytes ("billion laughs"); real files use a handful.
MAX_ALIASES = 100


class ConfigError(Exception):
    """A user's input is wrong; str() is the one-line message shown to the user.

    The same shape as trainers.config.ConfigError: `field` is the path of the offending field
    ("links[2].rate", "" for the whole input), `source` the file (or flag, or variable) it came from.
    """

    def __init__(self, field: str, message: str, source: str = ""):
        # One line, whatever a file's keys or values hold (newlines and control characters escaped).
        field = field if field.isprintable() else field.encode("unicode_escape").decode("ascii")
        message = " ".join(message.split())
        message = message if message.isprintable() else message.encode("unicode_escape").decode("ascii")
        self.source = source
        self.field = field
        self.message = message
        super().__init__(": ".join(part for part in (source, field, message) if part))

    def prefixed(self, prefix: str) -> "ConfigError":
        """The same error with `prefix` put before its field path."""
        return ConfigError(f"{prefix}.{self.field}" if self.field else prefix, self.message, self.source)


class _CountingLoader(yaml.SafeLoader):
    """SafeLoader (never builds Python objects) that also refuses alias bombs."""

    def compose_node(self, parent, index):  # noqa: D401 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self._alias_count = getattr(self, "_alias_count", 0) + 1
            if self._alias_count > MAX_ALIASES:
                raise yaml.YAMLError(f"more than {MAX_ALIASES} YAML aliases")
        return super().compose_node(parent, index)


def load_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; raise ConfigError for anything else."""
    source = str(path)
    file = Path(path)
    try:
        if not file.is_file():
            raise ConfigError("", "no such file" if not file.exists() else "not a regular file", source=source)
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            raise ConfigError("", f"file is {size} bytes, more than the {MAX_FILE_BYTES} allowed", source=source)
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError("", f"cannot read: {exc.strerror or exc}", source=source) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError("", "not a UTF-8 text file (binary?)", source=source) from None
    if "\x00" in text:
        raise ConfigError("", "not a text file (contains NUL bytes)", source=source)
    try:
        data = yaml.load(text, Loader=_CountingLoader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid YAML"
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError("", f"invalid YAML{where}: {first_line}", source=source) from None
    if data is None:
        raise ConfigError("", "file is empty; expected a YAML mapping", source=source)
    if not isinstance(data, dict):
        raise ConfigError("", f"expected a YAML mapping at the top level, got {type(data).__name__}", source=source)
    return data


def field_path(loc: tuple) -> str:
    """Render a pydantic error location as `links[2].rate`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = str(part)
            if not text.isprintable() or not text or any(c in text for c in " .[]:"):
                text = repr(text)  # a key made of control characters must not break the line
            out += ("." if out else "") + text
    return out or "(top level)"


def config_error_from_pydantic(source: str, exc: pydantic.ValidationError) -> ConfigError:
    """The first validation error of `exc` as a ConfigError (one line; others are usually consequences)."""
    err = exc.errors(include_url=False)[0]
    # Skip pydantic's internal tags such as 'function-after[...]' in the location.
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p and p.endswith("]")))
    message = err["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    if err["type"] == "extra_forbidden":
        message = "unknown field"
    count = exc.error_count()
    if count > 1:
        message += f" (and {count - 1} more error{'s' if count > 2 else ''})"
    return ConfigError(field_path(loc), " ".join(message.split()), source=source)
