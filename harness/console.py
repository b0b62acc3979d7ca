"""The terminal: progress and messages on stderr, tables on stdout, signals turned into teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import sys


class Interrupted(Exception):
    """SIGINT/SIGTERM/SIGHUP arrived; raised in the main thread so every `finally` tears down."""


def stderr_console():
    """Messages and progress: stderr, so that stdout stays a table or JSON a script can read."""
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def stdout_console():
    """Tables go to stdout; when that is a file or pipe, do not squeeze them into 80 columns."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def print_path(console, what: str, path, note: str = "") -> None:
    """One line `what: path note` that is never wrapped: a path split across lines cannot be
    copied or clicked (no markup either: a path may hold brackets)."""
    console.print(f"{what}: {path}" + (f" {note}" if note else ""), soft_wrap=True, markup=False,
                  highlight=False)


@contextlib.contextmanager
def teardown_on_signals():
    """Turn SIGINT, SIGTERM and SIGHUP into `Interrupted` so every `finally` runs."""

    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() != owner:
            # A forked child (pyroute2 forks to create namespaces and ends the child with SIGTERM)
            # must die as by default, not unwind our stack and tear down the parent's network.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Interrupted(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)
