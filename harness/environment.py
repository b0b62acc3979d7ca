"""The hardware and software record every run and every benchmark saves beside its numbers."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

from .paths import PROJECT_ROOT


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("" when unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_id() -> str:
    """"family F model M stepping S" from /proc/cpuinfo ("" when unreadable): a VM's model name can
    be generic ("AMD EPYC") while two generations round floats differently, so that one seed's
    training is bit-identical only on one of them."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("cpu family", "model", "stepping") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
            if not line.strip() and fields:
                break
    except OSError:
        return ""
    return " ".join(f"{name} {fields[key]}" for key, name in (("cpu family", "family"), ("model", "model"),
                                                                ("stepping", "stepping")) if key in fields)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                              timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def memory_gib() -> Optional[float]:
    """The machine's memory (GiB) from /proc/meminfo (None when unreadable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def environment(backend: Optional[str] = None, **extra) -> dict:
    """What a benchmark number depends on: versions, machine, load, backend, commit, date.

    `extra` adds the caller's own entries (a bench's tool versions, its prefix, its argv).
    """
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "host": platform.node(),
        "memory_gib": memory_gib(),
        # a shared machine (colleagues' tests) moves timings: the load says how much to trust them
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        # the vector kernels torch picked (AVX2, AVX512, ...): floats differ between them
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git_commit": _git("rev-parse", "HEAD"),
        **git_changes(),
        **extra,
    }


def git_changes(limit: int = 20) -> dict:
    """``git_dirty`` (whether the work tree differs from the commit) and ``git_changed``: the first
    ``limit`` lines of ``git status --porcelain`` (what differs), so that a run's record says whether
    the code it ran was the commit's or an untracked file beside it."""
    lines = _git("status", "--porcelain").splitlines()
    return {"git_dirty": bool(lines), "git_changed": lines[:limit]}
