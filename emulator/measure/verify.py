"""Measure the network that is up: RTT (dense and sparse probing) and steady-state TCP goodput per pair.

Returns plain rows (one dict per ordered pair) that the CLI prints as a table or JSON and the
harness saves before every run. RTT comes from our UDP echo prober (ICMP ping prints whole
milliseconds above 100 ms); throughput from iperf3. Every process is started by us, inside our
namespaces, and ended by PID.

RTT is probed two ways, because the tun backend's delay line times a lone packet differently
from a stream: dense (probes `probe_interval_ms` apart, one pair at a time: the delay line always
has a delivery pending and never sleeps long) and sparse (ping-like, `sparse_interval_ms` apart,
every pair at once with staggered starts: the delay line sleeps between packets, as under light
real traffic).

Throughput is the steady state of one TCP flow: iperf3 runs `omit` seconds that are not counted
(slow start: scaled with the RTT, 20 RTTs by default), then at least `duration` seconds (25 RTTs
or more). The goodput is the receiver's bytes over the receiver's own 1-second intervals after
the omitted ones, without the first and the last (measured_intervals): iperf3's summary counts
slow-start bytes read after the server's omit reset and the drain after the sender stopped,
which is how a 5 s run with -O 2 showed 99.7% of the rate, above the 1448/1500 a TCP flow can
carry. The congestion control is the namespace's default
(iperf3 reports which) unless `congestion` names one; a pair under `min_rate_ratio` of its rate
is flagged (`rate_below_min`) and `rate_warnings` says so in words.
"""

from __future__ import annotations

import json
import math
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..netns import exec_argv
from ..plan import Node, Plan
from ..processes import stop as stop_processes

PROBE_PORT = 47000
IPERF_PORT = 47001
# How long an echo server may take to say it is bound: a node's Python starts in well under a
# second on a quiet machine, but took longer than the 0.3 s once slept here in the netem guest
# (one trapped CPU) on a busy host, and the first probe met a closed port.
SERVER_READY_TIMEOUT_S = 60.0


# The most TCP payload a link can carry: 1448-byte segments (MSS with timestamps) in 1500 bytes.
TCP_PAYLOAD_FRACTION = 1448 / 1500


@dataclass(frozen=True)
class VerifyOptions:
    probes: int = 200              # dense RTT samples per pair
    probe_interval_ms: float = 5.0
    sparse_probes: int = 25        # sparse (ping-like) RTT samples per pair; 0: none
    sparse_interval_ms: float = 200.0  # 5 Hz
    throughput: bool = True
    duration_s: float = 5.0        # iperf3 measured seconds per pair, at least
    duration_rtts: float = 25.0    # ... and at least this many RTTs
    omit_s: Optional[float] = None  # iperf3 seconds left out at the start; None: scaled with the RTT
    omit_rtts: float = 20.0        # omitted RTTs (slow start) when omit_s is None, at least 1 s
    congestion: Optional[str] = None  # iperf3 -C; None: the namespace's default
    min_rate_ratio: float = 0.92   # flag a pair whose goodput is below this fraction of its rate

    def __post_init__(self):
        for name in ("probes", "sparse_probes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("probe_interval_ms", "sparse_interval_ms", "duration_s", "duration_rtts", "omit_rtts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.omit_s is not None and self.omit_s < 0:
            raise ValueError(f"omit_s must be >= 0, got {self.omit_s}")
        if not 0 < self.min_rate_ratio <= 1:
            raise ValueError(f"min_rate_ratio must be in (0, 1], got {self.min_rate_ratio}")

    def throughput_seconds(self, rtt_ms: float) -> tuple[int, int]:
        """(omit, duration) in whole seconds (iperf3 takes integers) for a path of `rtt_ms`."""
        rtt_s = rtt_ms / 1000.0
        omit = self.omit_s if self.omit_s is not None else max(1.0, self.omit_rtts * rtt_s)
        duration = max(self.duration_s, self.duration_rtts * rtt_s)
        return math.ceil(omit), math.ceil(duration)


PROBE_PRIORITY = 5


def _probe_argv(*args: str) -> list[str]:
    # Real-time priority 5 (below the delay line's 10): a prober waiting for a busy CPU would
    # otherwise count its own scheduling delay as network delay (p99 1-10 ms on 2 busy cores).
    # The prober sets it itself and goes on without it where a node's cgroup has no real-time
    # budget (chrt would fail the whole probe there).
    return [sys.executable, "-m", "emulator.measure.probe", *args, "--realtime-priority", str(PROBE_PRIORITY)]


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


def measured_intervals(server_report: dict) -> list[dict]:
    """The receiver's interval sums that count: not omitted, without the first and the last.

    The first one after the omitted ones also holds bytes that arrived during slow start but were
    read after the server reset its counters (measured: 1127 Mbit/s on a 1 Gbit/s path, which is
    how a 5 s run with -O 2 showed 99.7% of the rate); the last one holds what drained after the
    sender stopped. With fewer than three, all that are not omitted are kept.
    """
    intervals = [i["sum"] for i in server_report.get("intervals", []) if not i["sum"].get("omitted")]
    return intervals[1:-1] if len(intervals) >= 3 else intervals


def steady_goodput_bit_s(server_report: dict) -> Optional[float]:
    """Receiver goodput (bit/s) over measured_intervals(); None without intervals."""
    intervals = measured_intervals(server_report)
    seconds = sum(i["seconds"] for i in intervals)
    if not intervals or seconds <= 0:
        return None
    return sum(i["bytes"] for i in intervals) * 8 / seconds


def measure_throughput(src: Node, dst: Node, options: VerifyOptions, rtt_ms: float = 0.0) -> dict:
    """Steady-state single-flow TCP goodput from `src` to `dst` by iperf3 (see the module docstring).

    Returns rate_mbit (steady, from the receiver's intervals), rate_summary_mbit (iperf3's own
    summary line, whole receiver duration), congestion, omit_s, duration_s, retransmits.
    """
    omit, duration = options.throughput_seconds(rtt_ms)
    server = subprocess.Popen(exec_argv(dst, ["iperf3", "-s", "-1", "-J", "-p", str(IPERF_PORT)]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client_argv = ["iperf3", "-c", dst.address, "-p", str(IPERF_PORT), "-J",
                       "-t", str(duration), "-O", str(omit)]
        if options.congestion:
            client_argv += ["-C", options.congestion]
        deadline = time.monotonic() + 5.0
        while True:
            result = subprocess.run(exec_argv(src, client_argv), capture_output=True, text=True,
                                    timeout=duration + omit + 60)
            if result.returncode == 0:
                break
            if "refused" not in result.stdout + result.stderr or time.monotonic() > deadline:
                raise RuntimeError(f"iperf3 {src.name}->{dst.name} failed: "
                                   f"{(result.stdout + result.stderr).strip()[-500:]}")
            time.sleep(0.05)  # the server is still starting
        report = json.loads(result.stdout)
        try:
            server_out, _ = server.communicate(timeout=10)  # -1: it exits after this one test
            server_report = json.loads(server_out)
        except (subprocess.TimeoutExpired, ValueError):
            server_report = {}
    finally:
        stop_processes([server], grace_s=3)
    end = report["end"]
    summary = end["sum_received"]["bits_per_second"]
    steady = steady_goodput_bit_s(server_report)
    return {
        "rate_mbit": (steady if steady is not None else summary) / 1e6,
        "rate_summary_mbit": summary / 1e6,
        "rate_from": "receiver intervals" if steady is not None else "iperf3 summary",
        "rate_intervals_mbit": [round(i["bits_per_second"] / 1e6, 1) for i in measured_intervals(server_report)],
        "congestion": end.get("sender_tcp_congestion") or options.congestion or "default",
        "omit_s": omit, "duration_s": duration,
        "retransmits": end.get("sum_sent", {}).get("retransmits"),
    }


def sparse_rtts(plan: Plan, options: VerifyOptions) -> dict:
    """Ping-like RTT statistics for every ordered pair, all pairs at once (key: (src, dst) names)."""
    pairs = [(src, dst) for src, dst, _ in plan.pairs()]
    interval_ms = options.sparse_interval_ms
    clients = []
    try:
        for src, dst in pairs:
            # Staggered starts: the pairs' probes interleave instead of arriving together.
            time.sleep(interval_ms / 1000 / len(pairs))
            argv = _probe_argv("client", "--host", dst.address, "--port", str(PROBE_PORT),
                               "--count", str(options.sparse_probes), "--interval-ms", f"{interval_ms:g}",
                               "--json")
            clients.append((src, dst, subprocess.Popen(exec_argv(src, argv), stdout=subprocess.PIPE,
                                                       stderr=subprocess.PIPE, text=True)))
        timeout = 30 + options.sparse_probes * interval_ms / 1000
        results = {}
        for src, dst, client in clients:
            out, err = client.communicate(timeout=timeout)
            if client.returncode != 0:
                raise RuntimeError(f"sparse RTT probe {src.name}->{dst.name} failed: {err.strip()[-500:]}")
            results[(src.name, dst.name)] = json.loads(out)
        return results
    finally:
        stop_processes([client for _, _, client in clients], grace_s=1)


def rate_warnings(rows: list[dict], min_ratio: float = VerifyOptions.min_rate_ratio) -> list[str]:
    """One line per pair whose steady goodput is below `min_ratio` of its configured rate."""
    return [f"{r['src']} -> {r['dst']}: {r['rate_mbit']:.1f} Mbit/s is {100 * r['rate_ratio']:.1f}% of "
            f"{r['rate_spec_mbit']:g} Mbit/s (under {100 * min_ratio:.0f}%; TCP can carry at most "
            f"{100 * TCP_PAYLOAD_FRACTION:.1f}%), {r['congestion']}, RTT {r['rtt_spec_ms']:g} ms"
            for r in rows if r.get("rate_mbit") is not None and r["rate_ratio"] < min_ratio]


def _emulated(plan: Plan, src, dst, row: dict) -> dict:
    """On a dilated network (plan.time_dilation = K): the topology's spec and what was measured, in
    emulated units (times / K, rates x K). The rows' other fields are what the network applies and
    what was measured on it (RTT = K x the topology's, rate = its / K)."""
    k = plan.time_dilation
    there, back = plan.emulated_link(src, dst), plan.emulated_link(dst, src)
    out = {"time_dilation": k,
           "rtt_emulated_spec_ms": round(there.one_way_delay_ms + back.one_way_delay_ms, 4),
           "rtt_emulated_p50_ms": (row["rtt_p50_ms"] - row["probe_base_ms"]) / k,
           "rate_emulated_spec_mbit": there.rate_bit_s / 1e6,
           "rate_emulated_mbit": None if row.get("rate_mbit") is None else row["rate_mbit"] * k}
    return out


def wait_until_bound(nodes, servers, timeout_s: float = SERVER_READY_TIMEOUT_S) -> None:
    """Return once every echo server has printed its one line ("probe server on ..."), which it
    does after binding; RuntimeError naming the node when one exits or stays silent."""
    deadline = time.monotonic() + timeout_s
    for node, server in zip(nodes, servers):
        readable, _, _ = select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = server.stdout.readline() if readable else ""
        if "probe server" in line:
            continue
        if readable:  # it closed its output (or wrote something else): it is ending, let it say why
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        why = server.stderr.read().strip()[-500:] if server.poll() is not None else f"silent for {timeout_s:.0f} s"
        raise RuntimeError(f"RTT probe server in {node.name} did not start: {why or line.strip()}")


def verify(plan: Plan, options: VerifyOptions = VerifyOptions(),
           progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Measure every ordered pair; one row per pair with spec and measured values."""
    servers = [subprocess.Popen(exec_argv(node, _probe_argv("server", "--port", str(PROBE_PORT))),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for node in plan.nodes]
    rows = []
    try:
        wait_until_bound(plan.nodes, servers)
        # The prober's own cost: a probe to the node's own address never crosses the delay line.
        base = {node.name: measure_rtt(plan, node, node, options)["p50_ms"] for node in plan.nodes}
        sparse = {}
        if options.sparse_probes:
            if progress:
                progress("every pair, sparse probes")
            sparse = sparse_rtts(plan, options)
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
            lone = sparse.get((src.name, dst.name))
            if lone is not None:
                row.update({
                    "rtt_sparse_p50_ms": lone["p50_ms"], "rtt_sparse_p99_ms": lone["p99_ms"],
                    "rtt_sparse_lost": lone.get("lost", 0),
                    "rtt_sparse_p50_error_ms": lone["p50_ms"] - row["rtt_spec_ms"] - row["probe_base_ms"],
                    "rtt_sparse_p99_error_ms": lone["p99_ms"] - row["rtt_spec_ms"] - row["probe_base_ms"],
                })
            if options.throughput:
                row.update(measure_throughput(src, dst, options, row["rtt_spec_ms"]))
                row["rate_ratio"] = row["rate_mbit"] / row["rate_spec_mbit"]
                row["rate_below_min"] = row["rate_ratio"] < options.min_rate_ratio
            if plan.time_dilation != 1.0:
                row.update(_emulated(plan, src, dst, row))
            rows.append(row)
    finally:
        stop_processes(servers, grace_s=3)
    return rows
