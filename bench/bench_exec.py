"""Cost of running a command in a node: `ip netns exec` (network namespace only, the old way) vs
`netns.exec_argv` (node_enter.py: cgroups + network, UTS, IPC, PID and mount namespaces).

Builds aws-4region on the tun backend, then runs `true` in london-0 N times per variant,
interleaved (so drift of a shared machine hits both alike), and prints the median and p90 wall time
per run with hardware, versions and date. Nothing is written.

Usage (root; a prefix of its own):
  WANBENCH_PREFIX=wbc .venv/bin/python bench/bench_exec.py --runs 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from emulator import netns  # noqa: E402
from emulator.backends.tun import TunBackend  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from harness.environment import environment  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_exec needs root (namespaces): run with sudo")
    env = environment(loadavg_1min_start=f"{os.getloadavg()[0]:.2f}")
    for key, value in env.items():
        print(f"{key:16} {value}")
    plan = make_plan(load_topology(ROOT / "topologies" / "aws-4region.yaml"))
    node = plan.node("london-0")
    variants = {
        "ip netns exec": ["ip", "netns", "exec", node.namespace, "true"],
        "exec_argv (node_enter)": None,  # built after up: it names the running holder
    }
    backend = TunBackend(plan)
    backend.up()
    try:
        variants["exec_argv (node_enter)"] = netns.exec_argv(node, ["true"])
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, command in variants.items():
                start = time.perf_counter()
                subprocess.run(command, check=True)
                times[name].append(time.perf_counter() - start)
    finally:
        backend.down()
    print(f"\n{args.runs} runs each, interleaved; load average (1 min) {env['loadavg_1min_start']} at start, "
          f"{os.getloadavg()[0]:.2f} at end on {os.cpu_count()} cores")
    print(f"{'variant':24} {'median ms':>10} {'p90 ms':>8}")
    for name, values in times.items():
        values.sort()
        print(f"{name:24} {statistics.median(values) * 1e3:10.1f} {values[int(0.9 * (len(values) - 1))] * 1e3:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
