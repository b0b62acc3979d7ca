"""Parse and format the unit strings used in topology and scenario files.

Every quantity in our YAML carries its unit ("68.1ms", "1Gbit", "0.1%", "16MB") so a reader never has
to guess; internally we use one unit per kind: milliseconds, bits per second, fractions and bytes.
"""

from __future__ import annotations

import re

_NUMBER = r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
_QUANTITY = re.compile(rf"^\s*(?P<num>{_NUMBER})\s*(?P<unit>[A-Za-z%/]*)\s*$")

_TIME_MS = {"us": 1e-3, "µs": 1e-3, "usec": 1e-3, "ms": 1.0, "msec": 1.0, "s": 1000.0, "sec": 1000.0}
# Bits per second. "Mbps" is read as megabits, as people write it (tc(8) reads it as megaBYTES; our
# tc backend always emits "bit" units, so the two meanings never meet).
_RATE_BIT_S = {
    "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
}
_SIZE_BYTES = {
    "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3,
    "k": 1024, "m": 1024**2, "g": 1024**3,
}


class UnitError(ValueError):
    """A quantity string that does not parse; the message says what was expected."""


def _split(text: object, kind: str, examples: str) -> tuple[float, str]:
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise UnitError(f"expected a {kind} string such as {examples}, got {type(text).__name__}")
    match = _QUANTITY.match(str(text))
    if not match:
        raise UnitError(f"expected a {kind} such as {examples}, got {text!r}")
    return float(match.group("num")), match.group("unit")


def parse_time_ms(text: object) -> float:
    """Return a duration in milliseconds from e.g. "68.1ms", "250us", "1.5s"."""
    value, unit = _split(text, "duration", '"68.1ms", "250us" or "1s"')
    if unit == "":
        raise UnitError(f"duration {text!r} needs a unit (us, ms or s)")
    factor = _TIME_MS.get(unit.lower())
    if factor is None:
        raise UnitError(f"unknown duration unit {unit!r} in {text!r}; use us, ms or s")
    return value * factor


def parse_rate_bit_s(text: object) -> float:
    """Return a rate in bits per second from e.g. "1Gbit", "100Mbit" or "100Mbps"."""
    value, unit = _split(text, "rate", '"100Mbit" or "1Gbit"')
    if unit == "":
        raise UnitError(f"rate {text!r} needs a unit (Kbit, Mbit, Gbit)")
    key = unit.lower()
    factor = _RATE_BIT_S.get(key)
    if factor is None:
        raise UnitError(f"unknown rate unit {unit!r} in {text!r}; use bit, Kbit, Mbit, Gbit or Tbit")
    return value * factor


def parse_fraction(text: object) -> float:
    """Return a fraction in [0, 1] from a percentage string such as "0.1%"."""
    value, unit = _split(text, "percentage", '"0.1%"')
    if unit != "%":
        raise UnitError(f"percentage {text!r} must end in %, e.g. \"0.1%\"")
    return value / 100.0


def parse_size_bytes(text: object) -> int:
    """Return a size in bytes from e.g. "16MB", "64KiB", "1500b"."""
    value, unit = _split(text, "size", '"16MB" or "64KiB"')
    if unit == "":
        raise UnitError(f"size {text!r} needs a unit (b, KB, MB, GB, KiB, MiB, GiB)")
    factor = _SIZE_BYTES.get(unit.lower())
    if factor is None:
        raise UnitError(f"unknown size unit {unit!r} in {text!r}; use b, KB, MB, GB, KiB, MiB or GiB")
    return int(round(value * factor))


def format_rate(bit_s: float) -> str:
    """Format bits per second in the tc style ("1Gbit", "250Mbit")."""
    for unit, factor in (("Gbit", 1e9), ("Mbit", 1e6), ("Kbit", 1e3)):
        if bit_s >= factor:
            return f"{bit_s / factor:g}{unit}"
    return f"{bit_s:g}bit"


def format_time_ms(ms: float) -> str:
    """Format milliseconds for tc ("68.1ms", "250us")."""
    if ms and ms < 1.0:
        return f"{ms * 1000:g}us"
    return f"{ms:g}ms"
