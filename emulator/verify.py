"""Measure the network that is up: RTT (many probes) and single-flow TCP throughput for every pair.

Returns plain rows (one dict per ordered pair) that the CLI prints as a table or JSON and the
harness saves before every run. RTT comes from our UDP echo prober (ICMP ping prints whole
milliseconds above 100 ms); throughput from iperf3. Every process is started by us, inside our
namespaces, and ended by PID.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .netns import exec_argv
from .plan import Node, Plan
from .processes import stop as stop_processes

PROBE_PORT = 47000
IPERF_PORT = 47001


@dataclass(frozen=True)
class VerifyOptions:
    probes: int = 200              # RTT samples per pair
    probe_interval_ms: float = 5.0
    throughput: bool = True
    duration_s: float = 5.0        # iperf3 measured seconds per pair
    omit_s: float = 0.0            # iperf3 seconds left out at the start (slow start on long paths)


def _probe_argv(*args: str) -> list[str]:
    # Real-time priority 5 (below the delay line's 10): a prober waiting for a busy CPU would
    # otherwise count its own scheduling delay as network delay (p99 1-10 ms on 2 busy cores).
    chrt = ["chrt", "-f", "5"] if shutil.which("chrt") else []
    return [*chrt, sys.executable, "-m", "emulator.delayline.probe", *args]


def measure_rtt(plan: Plan, src: Node, dst: Node, options: VerifyOptions) -> dict:
    """RTT statistics (ms) from `src` to `dst` with the UDP echo prober (server must run on dst)."""
    argv = _probe_argv("client", "--host", dst.address, "--port", str(PROBE_PORT),
                       "--count", str(options.probes), "--interval-ms", str(options.probe_interval_ms),
                       "--json")
    timeout = 30 + options.probes * (options.probe_interval_ms / 1000 + 1)
    out = subprocess.run(exec_argv(src, argv), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"RTT probe {src.name}->{dst.name} failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def measure_throughput(src: Node, dst: Node, options: VerifyOptions) -> float:
    """Single-flow TCP goodput from `src` to `dst` in Mbit/s, by iperf3."""
    server = subprocess.Popen(exec_argv(dst, ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client_argv = ["iperf3", "-c", dst.address, "-p", str(IPERF_PORT), "-J",
                       "-t", f"{options.duration_s:g}", "-O", f"{options.omit_s:g}"]
        deadline = time.monotonic() + 5.0
        while True:
            result = subprocess.run(exec_argv(src, client_argv), capture_output=True, text=True,
                                    timeout=options.duration_s + options.omit_s + 60)
            if result.returncode == 0:
                break
            if "refused" not in result.stdout + result.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 {src.name}->{dst.name} failed: "
                                   f"{(result.stdout + result.stderr).strip()[-500:]}")
            time.sleep(0.05)  # the server is still starting
        report = json.loads(result.stdout)
        return report["end"]["sum_received"]["bits_per_second"] / 1e6
    finally:
        stop_processes([server], grace_s=3)


def verify(plan: Plan, options: VerifyOptions = VerifyOptions(),
           progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Measure every ordered pair; one row per pair with spec and measured values."""
    servers = [subprocess.Popen(exec_argv(node, _probe_argv("server", "--port", str(PROBE_PORT))),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for node in plan.nodes]
    rows = []
    try:
        time.sleep(0.3)  # let the echo servers bind
        # The prober's own cost: a probe to the node's own address never crosses the delay line.
        base = {node.name: measure_rtt(plan, node, node, options)["p50_ms"] for node in plan.nodes}
        for src, dst, spec in plan.pairs():
            if progress:
                progress(f"{src.name} -> {dst.name}")
            back = plan.link(dst, src)
            rtt = measure_rtt(plan, src, dst, options)
            row = {
                "src": src.name, "dst": dst.name,
                "rtt_spec_ms": round(spec.one_way_delay_ms + back.one_way_delay_ms, 4),
                "rtt_p50_ms": rtt["p50_ms"], "rtt_p99_ms": rtt["p99_ms"],
                "probe_base_ms": base[src.name],
                "rtt_lost": rtt.get("lost", 0),
                "rate_spec_mbit": spec.rate_bit_s / 1e6,
                "rate_mbit": None,
            }
            row["rtt_p50_error_ms"] = row["rtt_p50_ms"] - row["rtt_spec_ms"] - row["probe_base_ms"]
            row["rtt_p99_error_ms"] = row["rtt_p99_ms"] - row["rtt_spec_ms"] - row["probe_base_ms"]
            if options.throughput:
                row["rate_mbit"] = measure_throughput(src, dst, options)
                row["rate_ratio"] = row["rate_mbit"] / row["rate_spec_mbit"]
            rows.append(row)
    finally:
        stop_processes(servers, grace_s=3)
    return rows
