"""Run the delay line: `python -m emulator.delayline --plan plan.json [--ready-fd N | --ready-file F]`.

Started by the tun backend in its own session; it writes "ready" to the fd (or creates the file)
once every node's TUN device is up, then runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..files import write_bytes_atomic
from .runtime import (
    DEFAULT_BUSY_POLL_US, DEFAULT_EARLY_WAKE_US, DEFAULT_READ_BATCH, DEFAULT_REALTIME_PRIORITY,
    run_from_plan_file,
)
from .scheduler import JITTER_DISTRIBUTIONS

READY_MESSAGE = b"ready\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.delayline", description=__doc__)
    parser.add_argument("--plan", required=True, type=Path, help="plan JSON (Plan.to_json)")
    parser.add_argument("--counters", type=Path, help="counters JSON, rewritten every second")
    parser.add_argument("--ready-fd", type=int, help="write 'ready' to this inherited fd when up")
    parser.add_argument("--ready-file", type=Path, help="create this file when up")
    parser.add_argument("--go-fd", type=int,
                        help="wait for a byte on this inherited fd before opening devices (the "
                             "backend starts us while it still creates the namespaces)")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed for loss and jitter")
    parser.add_argument("--jitter-distribution", choices=JITTER_DISTRIBUTIONS, default="uniform")
    parser.add_argument("--early-wake-us", type=float, default=DEFAULT_EARLY_WAKE_US,
                        help="stop sleeping this long (us) before a delivery and poll (default: "
                             "sized from the measured overshoot of the loop's own sleeps)")
    parser.add_argument("--single-sleep", action="store_true",
                        help="sleep once until the spin window instead of long + short stages")
    parser.add_argument("--busy-poll-us", type=float, default=DEFAULT_BUSY_POLL_US,
                        help="keep polling this long (us) after a frame was read or delivered")
    parser.add_argument("--read-batch", type=int, default=DEFAULT_READ_BATCH,
                        help="frames read from one device per loop turn")
    parser.add_argument("--realtime-priority", type=int, default=DEFAULT_REALTIME_PRIORITY,
                        help="SCHED_FIFO priority of the loop (0: normal scheduling)")
    parser.add_argument("--max-sleep-us", type=float, default=None,
                        help="never sleep longer than this (us), also when idle: faster wake-ups for "
                             "sparse traffic at the price of idle CPU (default: no cap)")
    parser.add_argument("--keep-gso", action="store_true",
                        help="keep GSO frames whole on lossy links too (loss then drops whole "
                             "frames; for before/after comparisons only)")
    parser.add_argument("--read-stamps", action="store_true",
                        help="stamp frames when the loop reads them instead of with the kernel's "
                             "arrival stamp (the policy before; for before/after comparisons only)")
    args = parser.parse_args(argv)

    def ready() -> None:
        if args.ready_fd is not None:
            os.write(args.ready_fd, READY_MESSAGE)
            os.close(args.ready_fd)
        if args.ready_file is not None:
            write_bytes_atomic(args.ready_file, READY_MESSAGE)
        print(f"delayline: ready, pid {os.getpid()}", file=sys.stderr, flush=True)

    if args.go_fd is not None:
        go = os.read(args.go_fd, 1)
        os.close(args.go_fd)
        if not go:  # the backend gave up before the namespaces were there
            print("delayline: no go signal; exiting", file=sys.stderr, flush=True)
            return 1
    run_from_plan_file(args.plan, args.counters, ready, seed=args.seed,
                       jitter_distribution=args.jitter_distribution,
                       early_wake_us=args.early_wake_us, staged_sleep=not args.single_sleep,
                       busy_poll_us=args.busy_poll_us, segment_lossy=not args.keep_gso,
                       max_sleep_us=args.max_sleep_us,
                       read_batch=args.read_batch, kernel_stamps=not args.read_stamps,
                       realtime_priority=args.realtime_priority)
    print("delayline: stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
