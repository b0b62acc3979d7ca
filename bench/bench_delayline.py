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
- probes: emulator.delayline.probe with kernel transmit/arrival stamps and the server's hold time
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
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("WANBENCH_PREFIX", "wbdl")

from emulator import netns  # noqa: E402
from emulator.backends.base import read_state  # noqa: E402
from emulator.backends.tun import TunBackend  # noqa: E402
from emulator.delayline.device import device_name  # noqa: E402
from emulator.plan import make_plan  # noqa: E402
from emulator.processes import stop as stop_processes  # noqa: E402
from emulator.topology import load_topology, topology_from_dict  # noqa: E402

RESULTS = REPO / "results" / "bench"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
TCP_PAYLOAD_FRACTION = 1448 / 1500  # MSS with timestamps over the IP packet size
PROBE_PORT = 9311
IPERF_PORT = 5311
PROBE_PAYLOAD_BYTES = 64
PROBE_REALTIME_PRIORITY = 5  # below the delay line's 10: the emulator must never wait for a prober


@contextlib.contextmanager
def network(topology):
    """A tun network for `topology`, torn down whatever happens."""
    backend = TunBackend(make_plan(topology))
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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


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


def throughput_case(rate: str, rtt: str, seconds: int, omit: int, congestion: str) -> dict:
    """One TCP flow over a two-node network with this rate, RTT and congestion control."""
    with network(two_region_topology(rate, rtt)) as backend:
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
        *realtime_prefix(realtime), sys.executable, "-m", "emulator.delayline.probe", "client",
        "--host", dst_address, "--port", str(PROBE_PORT), "--count", str(count),
        "--interval-ms", str(interval_ms), "--size", str(PROBE_PAYLOAD_BYTES), "--clock", clock,
        "--json"]), capture_output=True, text=True, cwd=REPO, timeout=120)
    return json.loads(out.stdout)


def expected_rtt_ms(plan, src, dst) -> float:
    """Configured RTT of a probe between two nodes (ms): both delays plus both serializations."""
    forward, back = plan.link(src, dst), plan.link(dst, src)
    wire_bits = (PROBE_PAYLOAD_BYTES + 28) * 8  # UDP and IPv4 headers
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
        servers = [Background(n, [*realtime_prefix(realtime), sys.executable, "-m", "emulator.delayline.probe",
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


def environment() -> dict:
    import pyroute2
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    iperf_version = subprocess.run(["iperf3", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    return {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(),
        "python": platform.python_version(), "pyroute2": pyroute2.__version__, "iperf3": iperf_version,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO).stdout.strip(),
        "prefix": os.environ["WANBENCH_PREFIX"],
        "load_average": os.getloadavg(),
        "argv": sys.argv,
    }


def fmt(value, spec=".2f"):
    return "" if value is None or value == "" else (format(value, spec) if isinstance(value, float) else str(value))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (smoke test, not for reports)")
    parser.add_argument("--skip-tcp", action="store_true")
    parser.add_argument("--skip-rtt", action="store_true")
    parser.add_argument("--congestion", default="cubic,bbr",
                        help="TCP congestion controls to run each flow with (iperf3 -C), comma-separated")
    parser.add_argument("--loads", default=",".join(LOADS),
                        help=f"RTT cases to run, comma-separated from {LOADS}")
    parser.add_argument("--normal-probes", action="store_true",
                        help="run the probers as normal tasks instead of SCHED_FIFO 5")
    parser.add_argument("--probe-clock", choices=("kernel", "user"), default="kernel",
                        help="prober time stamps (see emulator/delayline/probe.py)")
    parser.add_argument("--topology", type=Path, default=REPO / "topologies" / "aws-4region.yaml")
    args = parser.parse_args(argv)
    unknown = set(args.loads.split(",")) - set(LOADS)
    if unknown:
        parser.error(f"--loads: unknown {sorted(unknown)}; choose from {LOADS}")
    netns.check_root()

    env = environment()
    print("# delay line benchmark", json.dumps(env))
    tcp_rows, rtt_rows = [], []
    if not args.skip_tcp:
        cases = [("100Mbit", "50ms", 10, 2), ("1Gbit", "200ms", 20, 8), ("5Gbit", "50ms", 15, 5)]
        if args.quick:
            cases = [(r, t, max(3, s // 3), max(1, o // 3)) for r, t, s, o in cases]
        for (rate, rtt, seconds, omit), congestion in [(c, cc) for c in cases for cc in args.congestion.split(",")]:
            row = throughput_case(rate, rtt, seconds, omit, congestion)
            tcp_rows.append(row)
            print(f"{row['case']:<30} steady {row['steady_goodput_bit_s'] / 1e6:8.1f} Mbit/s "
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

    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rows = [{"kind": "tcp", **r} for r in tcp_rows] + [{"kind": "rtt", **r} for r in rtt_rows]
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
