"""Command line: ``python -m trainers CONFIG`` runs one rank (launch one process per node)."""

from __future__ import annotations

import argparse
import json
import os
import sys

EPILOG = """\
Rank and rendezvous come from the torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK. Without them the run is a single process. Examples:

  python -m trainers run.yaml                          # one process
  torchrun --nproc-per-node 4 -m trainers run.yaml     # four ranks on this machine
  python -m trainers run.yaml --set algorithm.params.H=8 --check

Output: <output_dir>/rank<N>.jsonl (records: start, output, step, snapshot, status), snapshots/ (the
output model at eval points; evaluate with python -m trainers.evaluate OUTPUT_DIR) and
<output_dir>/config.resolved.json (the resolved config, rank 0). See trainers/README.md.
"""


def _parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # bare strings such as sync need no quotes
    return key, value


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, load and validate the config, run this rank; returns the exit status."""
    from trainers.algorithms import ALGORITHMS
    from trainers.datasets import DATASETS
    from trainers.models import MODELS

    parser = argparse.ArgumentParser(
        prog="python -m trainers",
        description="Train one rank of a distributed deep-learning job and write JSONL records. "
        f"Algorithms: {', '.join(sorted(ALGORITHMS))}. Models: {', '.join(sorted(MODELS))}. "
        f"Datasets: {', '.join(sorted(DATASETS))}.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="run configuration file (.yaml, .yml or .json)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], type=_parse_override, metavar="KEY=VALUE",
        help="override a config field by dotted path (value parsed as JSON), e.g. --set steps=200",
    )
    parser.add_argument("--check", action="store_true", help="validate the config, print it resolved, and exit")
    args = parser.parse_args(argv)

    from trainers.config import ConfigError, to_dict
    from trainers.loading import load_config

    try:
        config = load_config(args.config, dict(args.overrides))
    except ConfigError as error:
        print(f"config error in {args.config}: {error}", file=sys.stderr)
        return 2
    if args.check:
        print(json.dumps(to_dict(config), indent=2))
        return 0

    from trainers.runner import run

    try:
        run(config)
    except Exception as error:  # the rank's status record holds the traceback
        print(f"training failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def exit_now(code: int) -> None:
    """End the process without Python's finalization (stdout/stderr flushed first).

    Why: the comm layers' daemon threads (tcp readers/senders, background exchanges) may be inside
    a torch call that released the GIL when the interpreter finalizes; CPython then ends them with
    pthread_exit, whose forced unwind through torch's C++ frames calls std::terminate ("terminate
    called without an active exception", exit -6). Seen in 1 of 4 crash/rejoin test runs, after
    the rank had written its final status. Everything the rank writes (records, snapshots, the
    resolved config) is closed or renamed into place before main returns, so nothing is lost.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
