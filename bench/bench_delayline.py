"""Benchmark of the tun delay line: TCP throughput vs the configured rate, RTT error, CPU per Gbit/s.

    sudo WANBENCH_PREFIX=wbtun .venv/bin/python bench/bench_delayline.py [--quick]

Prints a table and writes results/bench/bench_delayline-<UTC time>.csv (plus a .json with the
machine, versions and every raw number). Targets (from the issue): RTT p50 error <= 0.1 ms and p99
<= 0.5 ms beyond the prober's own base on every aws-4region pair; one TCP flow >= 95% of the rate at
1 Gbit/s with 200 ms RTT and >= 90% at 5 Gbit/s with 50 ms RTT.

Definitions:
- goodput: iperf3's receiver bytes over the measured seconds; "steady" omits the first `omit`
  seconds (slow start at 200 ms RTT takes several), "whole" counts every second.
- ceiling: the most TCP can carry, 1448/1500 of the rate: the link charges IP and TCP headers of
  every 1500-byte segment (as htb/netem do), iperf3 counts payload only.
- RTT error p50 = measured p50 - configured RTT - prober's own p50 on loopback (same for p99);
  "hop" errors subtract instead the excess of an intra-region pair (prober + one delay-line hop each
  way), i.e. they show what the configured delay adds beyond a zero-delay emulated path.
- CPU: delay-line utime+stime over the transfer (/proc/<pid>/stat), per Gbit/s of goodput.
- probes: emulator.measure.probe with kernel transmit/arrival stamps and the server's hold time
  subtracted (--probe-clock kernel), run as SCHED_FIFO 5 (below the delay line's 10; opt out with
  --normal-probes) so that, on a machine whose cores other jobs saturate, a prober waiting for a
  CPU does not count as emulator error.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANBENCH_PREFIX", "wbdl")

from emulator import netns  # noqa: E402
from emulator.backends.base import read_state  # noqa: E402
from emulator.backends.tun import TunBackend  # noqa: E402
from emulator.delayline.device import device_name  # noqa: E402
from emulator.measure.probe import percentile  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.processes import stop as stop_processes  # noqa: E402
from emulator.topology import load_topology, topology_from_dict  # noqa: E402
from harness.environment import environment  # noqa: E402

RESULTS = REPO / "results" / "bench"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TCP_PAYLOAD_FRACTION = 1448 / 1500  # MSS with timestamps over the IP packet size
PROBE_PORT = 9311
IPERF_PORT = 5311
PROBE_PAYLOAD_BYTES = 64
PROBE_REALTIME_PRIORITY = 5  # below the delay line's 10: the emulator must never wait for a prober


# Delay-line timing policies compared side by side by the sparse cases (--timing-variants).
TIMING_VARIANTS = {
    # before issue 12: one select() sleep until 30 us before a delivery, no polling after traffic
    "single-sleep": ("--early-wake-us", "30", "--single-sleep", "--busy-poll-us", "0"),
    # now: long + short sleeps, spin window from measured overshoot, 200 us polling after traffic
    "staged": (),
    # the same, never sleeping more than 0.5 ms even when idle: faster wake-ups, idle CPU
    "staged-short": ("--max-sleep-us", "500"),
    # the same, sleeping at most 50 us: close to polling, to show what waking faster would buy
    "staged-poll": ("--max-sleep-us", "50"),
    # staged, but frames stamped when read (before the kernel's arrival stamps, arrival.py)
    "read-stamps": ("--read-stamps",),
    # staged, and pairs with a round trip <= 0.2 ms carried by the kernel (tun_shortcut.py): the
    # backend's default. Every other variant sends every pair through the delay line.
    "shortcut": (),
}
SHORTCUT_VARIANTS = {"shortcut"}


@contextlib.contextmanager
def network(topology, delayline_options: tuple = (), shortcut: bool = False):
    """A tun network for `topology`, torn down whatever happens. `shortcut`: the kernel carries
    short pairs (the backend's default); off, every pair goes through the delay line, which is
    what this bench measures (the RTT cases use an intra-region pair as one delay-line hop)."""
    backend = TunBackend(make_plan(topology))
    backend.delayline_options = tuple(delayline_options)
    if not shortcut:
        backend.shortcut_max_rtt_ms = None
    backend.down()  # leftovers of an interrupted run under the same prefix
    try:
        backend.up()
        yield backend
    finally:
        backend.down()


def two_region_topology(rate: str, rtt: str):
    return topology_from_dict({
        "name": f"bench-{rate}-{rtt}", "address_pool": "10.215.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}},
        "links": [{"between": ["aa", "bb"], "rtt": rtt, "rate": rate}],
    }, source="<bench>")


def device_tx_dropped(node, prefix: str) -> int:
    """Frames the node's TUN device dropped because the delay line did not read them in time."""
    out = subprocess.run(netns.exec_argv(node, ["ip", "-s", "-j", "link", "show", "dev", device_name(prefix)]),
                         capture_output=True, text=True)
    return json.loads(out.stdout)[0]["stats64"]["tx"]["dropped"]


def udp_receive_buffer_errors(node) -> int:
    """Datagrams the node's kernel dropped because a UDP socket's buffer was full (per namespace)."""
    out = subprocess.run(netns.exec_argv(node, ["cat", "/proc/net/snmp"]), capture_output=True, text=True).stdout
    header, values = [line.split() for line in out.splitlines() if line.startswith("Udp:")][:2]
    return int(values[header.index("RcvbufErrors")])


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (s); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def delayline_status(backend) -> dict:
    """The counters file after its next rewrite (about 1 s)."""
    path = backend.counters_path
    before = path.stat().st_mtime_ns if path.exists() else 0
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_mtime_ns == before):
        time.sleep(0.05)
    return json.loads(path.read_text())


class Background:
    """A server inside a node's namespace, stopped by its pid."""

    def __init__(self, node, argv):
        self.process = subprocess.Popen(netns.exec_argv(node, argv), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, cwd=REPO)

    def stop(self):
        stop_processes([self.process])


def iperf(client, server, seconds: int, omit: int, congestion: str, port: int = IPERF_PORT) -> dict:
    """One TCP flow client -> server with this congestion control; returns iperf3's JSON report."""
    srv = Background(server, ["iperf3", "-s", "-1", "-p", str(port)])
    try:
        time.sleep(0.3)
        out = subprocess.run(netns.exec_argv(client, [
            "iperf3", "-c", server.address, "-p", str(port), "-t", str(seconds), "-O", str(omit), "-C", congestion, "-J"]),
            capture_output=True, text=True, timeout=seconds + omit + 60)
    finally:
        srv.stop()
    return json.loads(out.stdout)


def throughput_case(rate: str, rtt: str, seconds: int, omit: int, congestion: str,
                    variant: str = "staged") -> dict:
    """One TCP flow over a two-node network with this rate, RTT and congestion control, the delay
    line running with TIMING_VARIANTS[variant]."""
    with network(two_region_topology(rate, rtt), TIMING_VARIANTS[variant], variant in SHORTCUT_VARIANTS) as backend:
        plan = backend.plan
        client, server = plan.nodes
        spec = plan.link(client, server)
        pid = read_state(plan.prefix)[0]["delayline_pid"]
        lag_before = delayline_status(backend)["lag"]
        cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
        report = iperf(client, server, seconds, omit, congestion)
        cpu_used, wall = cpu_seconds(pid) - cpu_before, time.monotonic() - wall_before
        status = delayline_status(backend)
        tun_drops = device_tx_dropped(client, plan.prefix) + device_tx_dropped(server, plan.prefix)
    steady_bit_s = report["end"]["sum_received"]["bits_per_second"]
    intervals = report["intervals"]
    whole_bytes = sum(i["sum"]["bytes"] for i in intervals)
    whole_s = sum(i["sum"]["seconds"] for i in intervals)
    deliveries = status["lag"]["deliveries"] - lag_before["deliveries"]
    late = status["lag"]["late_over_1ms"] - lag_before["late_over_1ms"]
    pair = next(p for p in status["pairs"] if p["src"] == client.name and p["dst"] == server.name)
    return {
        "case": f"tcp {rate} rtt {rtt} {congestion}",
        "variant": variant,
        "congestion": congestion,
        "rate_bit_s": spec.rate_bit_s,
        "rtt_ms": 2 * spec.one_way_delay_ms,
        "seconds": seconds, "omit_s": omit,
        "steady_goodput_bit_s": steady_bit_s,
        "whole_goodput_bit_s": whole_bytes * 8 / whole_s if whole_s else 0.0,
        "steady_pct_of_rate": 100 * steady_bit_s / spec.rate_bit_s,
        "steady_pct_of_ceiling": 100 * steady_bit_s / (spec.rate_bit_s * TCP_PAYLOAD_FRACTION),
        "whole_pct_of_rate": 100 * whole_bytes * 8 / whole_s / spec.rate_bit_s if whole_s else 0.0,
        "retransmits": report["end"]["sum_sent"].get("retransmits"),
        "queue_drops": pair["drops_queue"],
        "tun_ring_drops": tun_drops,
        "read_batches_full": status["read_batches_full"],
        "delayline_cpu_pct": 100 * cpu_used / wall,
        "cpu_pct_per_gbit_s": 100 * cpu_used / wall / (whole_bytes * 8 / whole_s / 1e9) if whole_bytes else 0.0,
        "late_deliveries_pct": 100 * late / deliveries if deliveries else 0.0,
        "lag_max_us": status["lag"]["max_us"],
    }


def realtime_prefix(enabled: bool) -> list[str]:
    """Run a prober as SCHED_FIFO, below the delay line's priority (unless --normal-probes)."""
    return ["chrt", "-f", str(PROBE_REALTIME_PRIORITY)] if enabled else []


def run_probe(src, dst_address: str, count: int, interval_ms: float, realtime: bool, clock: str) -> dict:
    out = subprocess.run(netns.exec_argv(src, [
        *realtime_prefix(realtime), sys.executable, "-m", "emulator.measure.probe", "client",
        "--host", dst_address, "--port", str(PROBE_PORT), "--count", str(count),
        "--interval-ms", str(interval_ms), "--size", str(PROBE_PAYLOAD_BYTES), "--clock", clock,
        "--json"]), capture_output=True, text=True, cwd=REPO, timeout=120)
    return json.loads(out.stdout)


def expected_rtt_ms(plan, src, dst, payload_bytes: int = PROBE_PAYLOAD_BYTES) -> float:
    """Configured RTT of a probe between two nodes (ms): both delays plus both serializations."""
    forward, back = plan.link(src, dst), plan.link(dst, src)
    wire_bits = (payload_bytes + 28) * 8  # UDP (or ICMP) and IPv4 headers
    return (forward.one_way_delay_ms + back.one_way_delay_ms
            + 1000 * wire_bits / forward.rate_bit_s + 1000 * wire_bits / back.rate_bit_s)


LOADS = ("idle", "wan", "intra")


def rtt_cases(topology_path: Path, count: int, interval_ms: float, load_kind: str,
              realtime: bool, clock: str) -> list[dict]:
    """RTT error on every inter-region pair, idle or while one TCP flow saturates another pair.

    load_kind: "idle"; "wan": a flow between the first two regions (rate-capped by the link);
    "intra": a flow between the two nodes of the first region (10 Gbit/s: more than the delay line
    can move, so it shows whether one overloading flow spills onto the other pairs).

    Two bases are measured: the prober on loopback (its own overhead only) and a second node in the
    first region (intra-region pair: the prober plus one delay-line hop each way, minus the
    configured intra-region RTT). Errors are reported against both.
    """
    topology = load_topology(topology_path)
    first_region = next(iter(topology.regions))
    topology = topology.with_nodes({first_region: topology.regions[first_region] + 1})
    rows = []
    with network(topology) as backend:
        plan = backend.plan
        servers = [Background(n, [*realtime_prefix(realtime), sys.executable, "-m", "emulator.measure.probe",
                                  "server", "--port", str(PROBE_PORT)]) for n in plan.nodes]
        load = load_client = None
        try:
            time.sleep(0.5)
            first = [n for n in plan.nodes if n.region == first_region]
            others = [n for n in plan.nodes if n.region != first_region]
            loopback = run_probe(first[0], "127.0.0.1", count, interval_ms, realtime, clock)
            rows.append({"case": "base: prober on loopback", "pair": "lo", "rtt_ms": 0.0,
                         "p50_ms": loopback["p50_ms"], "p99_ms": loopback["p99_ms"], "lost": loopback["lost"]})
            intra_expected = expected_rtt_ms(plan, first[0], first[-1])
            intra = run_probe(first[0], first[-1].address, count, interval_ms, realtime, clock)
            rows.append({"case": "base: intra-region pair", "pair": f"{first[0].name}<->{first[-1].name}",
                         "rtt_ms": intra_expected, "p50_ms": intra["p50_ms"], "p99_ms": intra["p99_ms"],
                         "lost": intra["lost"]})
            hop = {"p50_ms": intra["p50_ms"] - intra_expected, "p99_ms": intra["p99_ms"] - intra_expected}
            load_pair = set()
            if load_kind != "idle":
                a, b = (first[0], others[0]) if load_kind == "wan" else (first[-1], first[0])
                load_pair = {a.name, b.name}
                load = Background(b, ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)])
                time.sleep(0.3)
                load_client = subprocess.Popen(netns.exec_argv(a, [
                    "iperf3", "-c", b.address, "-p", str(IPERF_PORT), "-t", "600"]),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(3)  # past slow start
            wan_nodes = first[:1] + others
            for i, src in enumerate(wan_nodes):
                for dst in wan_nodes[i + 1:]:
                    if {src.name, dst.name} == load_pair:
                        continue
                    expected_ms = expected_rtt_ms(plan, src, dst)
                    result = run_probe(src, dst.address, count, interval_ms, realtime, clock)
                    rows.append({
                        "case": f"rtt {load_kind}" if load_kind == "idle" else f"rtt, {load_kind} flow",
                        "pair": f"{src.name}<->{dst.name}", "rtt_ms": expected_ms,
                        "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "lost": result["lost"],
                        "p50_error_ms": result["p50_ms"] - expected_ms - loopback["p50_ms"],
                        "p99_error_ms": result["p99_ms"] - expected_ms - loopback["p99_ms"],
                        "p50_error_vs_hop_ms": result["p50_ms"] - expected_ms - hop["p50_ms"],
                        "p99_error_vs_hop_ms": result["p99_ms"] - expected_ms - hop["p99_ms"],
                    })
            status = delayline_status(backend)
            rows.append({"case": f"delay line lag ({load_kind})", "pair": "all",
                         "lag_mean_us": status["lag"]["mean_us"], "lag_max_us": status["lag"]["max_us"],
                         "late_over_1ms": status["lag"]["late_over_1ms"],
                         "deliveries": status["lag"]["deliveries"]})
        finally:
            if load_client is not None:
                load_client.terminate()
                load_client.wait()
            if load is not None:
                load.stop()
            for server in servers:
                server.stop()
    return rows


SPARSE_RATES_HZ = (1, 5, 100)
PING_TIME = re.compile(r"time=([0-9.]+) ms")
PING_SUMMARY = re.compile(r"rtt min/avg/max/mdev = [0-9.]+/([0-9.]+)/")
PING_PAYLOAD_BYTES = 56  # iputils default: 64 bytes of ICMP, 84 on the wire
PING_RESOLUTION_LIMIT_MS = 99.0  # iputils prints whole ms from 100 ms up, 10 us below


def ping_rtts_ms(src, dst_address: str, rate_hz: float, count: int) -> subprocess.Popen:
    """Start iputils ping from `src` at `rate_hz` (normal priority, as a user would run it)."""
    return subprocess.Popen(netns.exec_argv(src, [
        "ping", "-n", "-i", f"{1 / rate_hz:g}", "-c", str(count), "-W", "2", dst_address]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ping_mean_ms(text: str) -> Optional[float]:
    """The average RTT (ms) from ping's summary line (printed to the microsecond at any RTT)."""
    match = PING_SUMMARY.search(text)
    return float(match.group(1)) if match else None


def ping_summary(samples: list[float], expected_ms: float, base: Optional[dict]) -> dict:
    """p50/p99 of ping samples and their errors over the configured RTT (and over ping's own base)."""
    values = sorted(samples)
    p50, p99 = percentile(values, 0.50), percentile(values, 0.99)
    row = {"p50_ms": p50, "p99_ms": p99, "samples": len(values),
           "p50_error_ms": p50 - expected_ms, "p99_error_ms": p99 - expected_ms}
    if base is not None:
        row["p50_error_vs_base_ms"] = p50 - expected_ms - base["p50_ms"]
        row["p99_error_vs_base_ms"] = p99 - expected_ms - base["p99_ms"]
    return row


def sparse_cases(topology_path: Path, rates_hz: tuple, seconds_per_rate: float,
                 variants: tuple = ("staged",), nodes_per_region: int = 3) -> list[dict]:
    """Sparse cases for every timing variant, interleaved: each rate runs on each variant in turn."""
    rows = []
    for rate in rates_hz:
        for variant in variants:
            for row in sparse_case(topology_path, rate, seconds_per_rate, variant, nodes_per_region):
                rows.append({"variant": variant, **row})
    return rows


def sparse_case(topology_path: Path, rate: float, seconds_per_rate: float, variant: str,
                nodes_per_region: int = 3) -> list[dict]:
    """RTT error for light traffic: iputils ping at each rate, the delay line otherwise idle.

    The topology gets `nodes_per_region` nodes per region (12 on aws-4region, as in issue 12); the
    delay line runs with TIMING_VARIANTS[variant].
    Pairs: one intra-region pair and every node-0 inter-region pair whose RTT is under 99 ms (ping
    prints whole milliseconds from 100 ms up). All pairs are pinged at once, starts staggered, so
    the delay line sees `len(pairs) * rate` requests per second, still far apart at 1 and 5 Hz.
    Also the delay line's CPU use (utime+stime per wall second) in each phase and idle.
    """
    topology = load_topology(topology_path)
    topology = topology.with_nodes({r: nodes_per_region for r in topology.regions})
    rows = []
    with network(topology, TIMING_VARIANTS[variant], variant in SHORTCUT_VARIANTS) as backend:
        plan = backend.plan
        pid = read_state(plan.prefix)[0]["delayline_pid"]
        by_region: dict = {}
        for node in plan.nodes:
            by_region.setdefault(node.region, []).append(node)
        heads = [nodes[0] for nodes in by_region.values()]
        first = heads[0]
        pairs = [(first, by_region[first.region][1])]
        pairs += [(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]
                  if expected_rtt_ms(plan, a, b, PING_PAYLOAD_BYTES) < PING_RESOLUTION_LIMIT_MS]
        cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
        time.sleep(5.0)
        rows.append({"case": "delay line idle", "pair": "-",
                     "delayline_cpu_pct": 100 * (cpu_seconds(pid) - cpu_before) / (time.monotonic() - wall_before)})
        count = max(20, int(rate * seconds_per_rate))
        probe_pairs = [(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]]
        servers = [Background(n, [sys.executable, "-m", "emulator.measure.probe", "server",
                                  "--port", str(PROBE_PORT)]) for n in heads]
        try:
            time.sleep(0.5)
            base_run = ping_rtts_ms(first, "127.0.0.1", rate, count)
            runs = []
            for src, dst in pairs:
                time.sleep(1 / rate / (len(pairs) + 1))
                runs.append((src, dst, ping_rtts_ms(src, dst.address, rate, count)))
            probes = []
            for src, dst in [(first, first), *probe_pairs]:
                time.sleep(1 / rate / (len(probe_pairs) + 2))
                probes.append((src, dst, subprocess.Popen(netns.exec_argv(src, [
                    sys.executable, "-m", "emulator.measure.probe", "client", "--host",
                    "127.0.0.1" if src is dst else dst.address, "--port", str(PROBE_PORT),
                    "--count", str(count), "--interval-ms", f"{1000 / rate:g}", "--json"]),
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)))
            cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
            outputs = [(src, dst, run.communicate(timeout=count / rate + 60)[0]) for src, dst, run in runs]
            probe_outputs = [(src, dst, json.loads(run.communicate(timeout=count / rate + 60)[0]))
                             for src, dst, run in probes]
            cpu_pct = 100 * (cpu_seconds(pid) - cpu_before) / (time.monotonic() - wall_before)
        finally:
            for server in servers:
                server.stop()
        base_text = base_run.communicate(timeout=60)[0]
        base_samples = [float(v) for v in PING_TIME.findall(base_text)]
        base = ping_summary(base_samples, 0.0, None)
        rows.append({"case": f"ping {rate:g} Hz", "pair": "lo (ping's own base)", "rtt_ms": 0.0, **base,
                     "mean_ms": ping_mean_ms(base_text), "lost": count - len(base_samples)})
        for src, dst, text in outputs:
            samples = [float(v) for v in PING_TIME.findall(text)]
            expected = expected_rtt_ms(plan, src, dst, PING_PAYLOAD_BYTES)
            mean = ping_mean_ms(text)
            rows.append({"case": f"ping {rate:g} Hz", "pair": f"{src.name}<->{dst.name}",
                         "rtt_ms": expected, **ping_summary(samples, expected, base),
                         "mean_ms": mean, "mean_error_ms": None if mean is None else mean - expected,
                         "lost": count - len(samples), "delayline_cpu_pct": cpu_pct})
        probe_base = probe_outputs[0][2]
        for src, dst, result in probe_outputs:
            expected = 0.0 if src is dst else expected_rtt_ms(plan, src, dst)
            rows.append({"case": f"prober {rate:g} Hz", "pair": "lo (prober's own base)" if src is dst
                         else f"{src.name}<->{dst.name}", "rtt_ms": expected,
                         "p50_ms": result["p50_ms"], "p99_ms": result["p99_ms"], "samples": result["received"],
                         "p50_error_ms": result["p50_ms"] - expected, "p99_error_ms": result["p99_ms"] - expected,
                         "p50_error_vs_base_ms": result["p50_ms"] - expected - probe_base["p50_ms"],
                         "p99_error_vs_base_ms": result["p99_ms"] - expected - probe_base["p99_ms"],
                         "mean_ms": result["mean_ms"], "mean_error_ms": result["mean_ms"] - expected,
                         "lost": result["lost"], "delayline_cpu_pct": cpu_pct})
        status = delayline_status(backend)
        rows.append({"case": f"delay line lag ({rate:g} Hz)", "pair": "all",
                     "lag_mean_us": status["lag"]["mean_us"], "lag_max_us": status["lag"]["max_us"],
                     "late_over_1ms": status["lag"]["late_over_1ms"],
                     "deliveries": status["lag"]["deliveries"], **status.get("sleep", {})})
    return rows


LOSS_VARIANTS = {"per-frame (GSO kept)": ("--keep-gso",), "per-packet": ()}
MSS_BYTES = 1448


def response_function_range_bit_s(rtt_s: float, loss: float) -> tuple[float, float]:
    """Steady TCP rate (bit/s) by Mathis et al. (C = sqrt(3/2)) and by CUBIC (RFC 8312, C 0.4, beta 0.7)."""
    mathis = MSS_BYTES * 8 / rtt_s * (1.5 / loss) ** 0.5
    cubic = (0.4 * 3.7 / 1.2) ** 0.25 * rtt_s ** 0.75 / loss ** 0.75 * MSS_BYTES * 8 / rtt_s
    return min(mathis, cubic), max(mathis, cubic)


def loss_cases(repeats: int, tcp_seconds: int) -> list[dict]:
    """Loss per GSO frame vs per wire packet, interleaved: UDP at 1% and TCP cubic at 0.2%, 327 ms.

    The TCP case is issue 12's: a pair with 0.2% loss each way at 327 ms RTT, 1 Gbit/s.
    """
    rows = []
    udp_topology = topology_from_dict({
        "name": "bench-loss-udp", "address_pool": "10.215.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}},
        "links": [{"between": ["aa", "bb"], "rtt": "20ms", "rate": "100Mbit", "loss": "1%", "queue": "4MB"}]},
        source="<bench>")
    tcp_topology = topology_from_dict({
        "name": "bench-loss-tcp", "address_pool": "10.215.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}},
        "links": [{"between": ["aa", "bb"], "rtt": "327ms", "rate": "1Gbit", "loss": "0.2%"}]}, source="<bench>")
    cpu_topology = topology_from_dict({
        "name": "bench-loss-cpu", "address_pool": "10.215.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}},
        "links": [{"between": ["aa", "bb"], "rtt": "50ms", "rate": "1Gbit", "loss": "0.001%"}]}, source="<bench>")
    low, high = response_function_range_bit_s(0.327, 0.002)
    for repeat in range(repeats):
        for variant, options in LOSS_VARIANTS.items():
            # What segmenting costs: a fast flow on a barely lossy pair, GSO frames vs wire packets.
            with network(cpu_topology, options) as backend:
                client, server = backend.plan.nodes
                pid = read_state(backend.plan.prefix)[0]["delayline_pid"]
                cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
                report = iperf(client, server, 10, 3, "cubic")
                cpu_pct = 100 * (cpu_seconds(pid) - cpu_before) / (time.monotonic() - wall_before)
            rows.append({"case": "tcp cubic 1 Gbit/s, 50 ms, 0.001% loss", "variant": variant, "repeat": repeat,
                         "goodput_mbit": report["end"]["sum_received"]["bits_per_second"] / 1e6,
                         "delayline_cpu_pct": cpu_pct})
            print(rows[-1], flush=True)
            with network(udp_topology, options) as backend:
                client, server = backend.plan.nodes
                ring_before = device_tx_dropped(client, backend.plan.prefix)
                socket_before = udp_receive_buffer_errors(server)
                srv = Background(server, ["iperf3", "-s", "-1", "-p", str(IPERF_PORT)])
                try:
                    time.sleep(0.3)
                    out = subprocess.run(netns.exec_argv(client, [
                        "iperf3", "-c", server.address, "-p", str(IPERF_PORT), "-u", "-b", "20M", "-l", "1000",
                        "-t", "10", "-J"]), capture_output=True, text=True, timeout=80)
                finally:
                    srv.stop()
                status = delayline_status(backend)
                ring = device_tx_dropped(client, backend.plan.prefix) - ring_before
                socket = udp_receive_buffer_errors(server) - socket_before
            pair = next(p for p in status["pairs"] if p["src"] == client.name and p["dst"] == server.name)
            end = json.loads(out.stdout)["end"]["sum"]
            # Queue, TUN-ring and receive-buffer drops (iperf3 bursts, a delay line or receiver held
            # off a busy CPU) are not the link's loss; counted apart, as tests/emulator/test_tun_loss.py does.
            overload = pair["drops_queue"] + ring + socket
            rows.append({"case": "udp 20 Mbit/s, 1% loss", "variant": variant, "repeat": repeat,
                         "datagrams": end["packets"], "lost_pct": end["lost_percent"], "overload_drops": overload,
                         "lost_net_of_overload_pct": 100 * (end["lost_packets"] - overload) / end["packets"]})
            with network(tcp_topology, options) as backend:
                client, server = backend.plan.nodes
                report = iperf(client, server, tcp_seconds, 5, "cubic")
                status = delayline_status(backend)
            pair = next(p for p in status["pairs"] if p["src"] == client.name and p["dst"] == server.name)
            rows.append({"case": "tcp cubic, 0.2% loss, 327 ms", "variant": variant, "repeat": repeat,
                         "goodput_mbit": report["end"]["sum_received"]["bits_per_second"] / 1e6,
                         "mathis_cubic_mbit": f"{low / 1e6:.2f}-{high / 1e6:.2f}",
                         "retransmits": report["end"]["sum_sent"].get("retransmits"),
                         "wire_bytes_per_frame": pair["bytes"] / pair["packets"] if pair["packets"] else 0.0,
                         "frame_loss_pct": 100 * pair["drops_loss"] / max(1, pair["packets"] + pair["drops_loss"])})
            print(rows[-2], rows[-1], flush=True)
    return rows


def bench_environment() -> dict:
    import pyroute2
    iperf_version = subprocess.run(["iperf3", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return environment("tun", pyroute2=pyroute2.__version__, iperf3=iperf_version,
                       prefix=os.environ["WANBENCH_PREFIX"], argv=sys.argv)


def fmt(value, spec=".2f"):
    return "" if value is None or value == "" else (format(value, spec) if isinstance(value, float) else str(value))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke test, not for reports)")
    parser.add_argument("--skip-tcp", action="store_true")
    parser.add_argument("--skip-rtt", action="store_true", help="skip dense probing (back-to-back prober)")
    parser.add_argument("--skip-sparse", action="store_true", help="skip sparse probing (iputils ping)")
    parser.add_argument("--loss", action="store_true",
                        help="also compare loss per GSO frame with loss per wire packet (UDP 1%%, TCP 0.2%% at 327 ms)")
    parser.add_argument("--loss-repeats", type=int, default=2)
    parser.add_argument("--sparse-rates", default=",".join(f"{r:g}" for r in SPARSE_RATES_HZ),
                        help="ping rates (Hz) for sparse probing, comma-separated")
    parser.add_argument("--sparse-seconds", type=float, default=60.0,
                        help="seconds of ping per rate (at least 20 pings)")
    parser.add_argument("--timing-variants", default="single-sleep,staged",
                        help=f"delay-line timing policies for the sparse cases, from {tuple(TIMING_VARIANTS)}")
    parser.add_argument("--tcp-variants", default="staged",
                        help=f"delay-line policies for the TCP cases, from {tuple(TIMING_VARIANTS)}")
    parser.add_argument("--congestion", default="cubic,bbr",
                        help="TCP congestion controls to run each flow with (iperf3 -C), comma-separated")
    parser.add_argument("--loads", default=",".join(LOADS),
                        help=f"RTT cases to run, comma-separated from {LOADS}")
    parser.add_argument("--normal-probes", action="store_true",
                        help="run the probers as normal tasks instead of SCHED_FIFO 5")
    parser.add_argument("--probe-clock", choices=("kernel", "user"), default="kernel",
                        help="prober time stamps (see emulator/measure/probe.py)")
    parser.add_argument("--topology", type=Path, default=REPO / "topologies" / "aws-4region.yaml")
    args = parser.parse_args(argv)
    unknown = set(args.loads.split(",")) - set(LOADS)
    if unknown:
        parser.error(f"--loads: unknown {sorted(unknown)}; choose from {LOADS}")
    for option, value in (("--timing-variants", args.timing_variants), ("--tcp-variants", args.tcp_variants)):
        unknown = set(value.split(",")) - set(TIMING_VARIANTS)
        if unknown:
            parser.error(f"{option}: unknown {sorted(unknown)}; choose from {tuple(TIMING_VARIANTS)}")
    netns.check_root()

    env = bench_environment()
    print("# delay line benchmark", json.dumps(env))
    tcp_rows, rtt_rows = [], []
    if not args.skip_tcp:
        cases = [("100Mbit", "50ms", 10, 2), ("1Gbit", "200ms", 20, 8), ("5Gbit", "50ms", 15, 5)]
        if args.quick:
            cases = [(r, t, max(3, s // 3), max(1, o // 3)) for r, t, s, o in cases]
        runs = [(c, cc, v) for c in cases for cc in args.congestion.split(",")
                for v in args.tcp_variants.split(",")]
        for (rate, rtt, seconds, omit), congestion, variant in runs:
            row = throughput_case(rate, rtt, seconds, omit, congestion, variant)
            tcp_rows.append(row)
            print(f"{variant:<12} {row['case']:<30} steady {row['steady_goodput_bit_s'] / 1e6:8.1f} Mbit/s "
                  f"({row['steady_pct_of_rate']:5.1f}% of rate, {row['steady_pct_of_ceiling']:5.1f}% of "
                  f"ceiling)  whole {row['whole_pct_of_rate']:5.1f}%  retr {row['retransmits']}  "
                  f"cpu {row['delayline_cpu_pct']:5.1f}% ({row['cpu_pct_per_gbit_s']:5.1f}%/Gbit/s)  "
                  f"late {row['late_deliveries_pct']:.2f}%  ring drops {row['tun_ring_drops']}", flush=True)
    if not args.skip_rtt:
        count, interval_ms = (200, 5.0) if args.quick else (1000, 2.0)
        for load_kind in args.loads.split(","):
            rows = rtt_cases(args.topology, count, interval_ms, load_kind, not args.normal_probes,
                             args.probe_clock)
            for row in rows:
                row.update(probe_clock=args.probe_clock, realtime_probes=not args.normal_probes)
            rtt_rows += rows
        print(f"\n{'case':<25} {'pair':<22} {'rtt_ms':>9} {'p50_ms':>9} {'p99_ms':>9} "
              f"{'p50_err':>8} {'p99_err':>8} {'p50_hop':>8} {'p99_hop':>8} lost   (err: vs loopback base; "
              f"hop: vs intra-region pair)")
        for row in rtt_rows:
            if "p50_ms" in row:
                print(f"{row['case']:<25} {row['pair']:<22} {row['rtt_ms']:9.3f} {row['p50_ms']:9.3f} "
                      f"{row['p99_ms']:9.3f} {fmt(row.get('p50_error_ms'), '8.3f'):>8} "
                      f"{fmt(row.get('p99_error_ms'), '8.3f'):>8} {fmt(row.get('p50_error_vs_hop_ms'), '8.3f'):>8} "
                      f"{fmt(row.get('p99_error_vs_hop_ms'), '8.3f'):>8} {row['lost']}")
            else:
                print(f"{row['case']:<25} lag mean {row['lag_mean_us']} us, max {row['lag_max_us']} us, "
                      f"{row['late_over_1ms']} of {row['deliveries']} deliveries over 1 ms late")

    sparse_rows = []
    if not args.skip_sparse:
        rates = tuple(float(r) for r in args.sparse_rates.split(","))
        variants = tuple(args.timing_variants.split(","))
        sparse_rows = sparse_cases(args.topology, rates, 10.0 if args.quick else args.sparse_seconds, variants)
        print(f"\n{'variant':<13} {'sparse: case':<25} {'pair':<22} {'rtt_ms':>9} {'p50_ms':>9} {'p99_ms':>9} "
              f"{'p50_err':>8} {'p99_err':>8} {'mean_err':>8} {'n':>5} lost  cpu%   (err: vs configured RTT)")
        for row in sparse_rows:
            print(f"{row['variant']:<13} ", end="")
            if "p50_ms" in row:
                print(f"{row['case']:<25} {row['pair']:<22} {row['rtt_ms']:9.3f} {row['p50_ms']:9.3f} "
                      f"{row['p99_ms']:9.3f} {fmt(row.get('p50_error_ms'), '8.3f'):>8} "
                      f"{fmt(row.get('p99_error_ms'), '8.3f'):>8} {fmt(row.get('mean_error_ms'), '8.3f'):>8} "
                      f"{row['samples']:>5} {row['lost']:>4} "
                      f"{fmt(row.get('delayline_cpu_pct'), '5.2f'):>5}")
            elif "lag_mean_us" in row:
                print(f"{row['case']:<25} lag mean {row['lag_mean_us']} us, max {row['lag_max_us']} us, "
                      f"{row['late_over_1ms']} of {row['deliveries']} deliveries over 1 ms late; "
                      f"spin {row.get('spin_us')} us, short-sleep overshoot p50/p99 "
                      f"{row.get('short_overshoot_p50_us')}/{row.get('short_overshoot_p99_us')} us, long "
                      f"{row.get('long_overshoot_p50_us')}/{row.get('long_overshoot_p99_us')} us")
            else:
                print(f"{row['case']:<25} delay-line CPU {row['delayline_cpu_pct']:.2f}% of a core")

    loss_rows = loss_cases(args.loss_repeats, 10 if args.quick else 25) if args.loss else []
    for row in loss_rows:
        print("loss:", json.dumps(row))

    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rows = ([{"kind": "tcp", **r} for r in tcp_rows] + [{"kind": "rtt", **r} for r in rtt_rows]
            + [{"kind": "sparse", **r} for r in sparse_rows] + [{"kind": "loss", **r} for r in loss_rows])
    fields = sorted({key for row in rows for key in row}, key=lambda k: (k not in ("kind", "case", "pair"), k))
    csv_path = RESULTS / f"bench_delayline-{stamp}.csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (RESULTS / f"bench_delayline-{stamp}.json").write_text(json.dumps(
        {"environment": env, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    print(f"\nwrote {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
