"""Whole-backend checks, run where the backend's kernel is: inside the netem guest for tc and
mininet (`scripts/netem-vm.sh`), on the host for tun. Writes one JSON file per run that the tests
(tests/emulator/test_netem_guest.py) assert on; nothing here asserts.

    python tests/emulator/netem_checks.py run --backend tc --topology topologies/asym-lossy.yaml \
        --out results.json [--rate 50Mbit] [--verify]
    python tests/emulator/netem_checks.py suite tc --out DIR    # what a guest of the test runs

A run: `wanbench up`; the applied qdiscs/classes/filters read back with `tc -j` (tc, mininet);
`wanbench exec`; iputils ping and our UDP prober side by side on every ordered pair; iperf3 on
every pair at once (TCP where the pair is loss-free, UDP below the rate for the loss and above it
for the rate where it is lossy); `wanbench status` (counters); `wanbench down`; what is left;
`wanbench clean`; optionally `wanbench verify --no-throughput`. Pairs run concurrently: each pair
has its own bottleneck, and the guest has one CPU, so sequential pairs would take minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from emulator.backends.base import read_state  # noqa: E402
from emulator.plan import Plan  # noqa: E402

WANBENCH = str(Path(sys.executable).with_name("wanbench"))
PING_COUNT = 10
PING_INTERVAL_S = 0.2
PROBE_COUNT = 50
PROBE_INTERVAL_MS = 20.0
PROBE_PORT = 47100
IPERF_BASE_PORT = 47200
UDP_DATAGRAM_BYTES = 1400
UDP_HIGH_FRACTION = 1.5      # rate: offered above the rate, the bottleneck sets what arrives
UDP_HIGH_SECONDS = 2.5
RATE_SNAPSHOT_AT_S = (1.0, 2.4)  # counters inside the flow (it starts ~0.3 s after the client)
UDP_LOW_FRACTION = 0.5       # loss: offered at half the rate, nothing queues
UDP_LOW_SECONDS = 6
TCP_SECONDS = 5
TCP_OMIT_SECONDS = 3         # slow start at 215 ms RTT
VERIFY_PROBES = 50
PING_RTT = re.compile(r"= ([\d.]+)/([\d.]+)/([\d.]+)/([\d.]+) ms")
PING_COUNTS = re.compile(r"(\d+) packets transmitted, (\d+) received")

SUITES = {  # name -> (prefix, backend, topology, extra up arguments, rate checks, verify); one guest each
    # aws-4region: every pair's RTT and the read-back; rate and loss pair by pair on asym-lossy
    # (the guest is one CPU whose every syscall is trapped: all of it on both would take minutes).
    "tc": [("wag1", "tc", "topologies/aws-4region.yaml", ["--rate", "10Mbit"], False, False),
           ("wag2", "tc", "topologies/asym-lossy.yaml", [], True, True)],
    "mininet": [("wag3", "mininet", "topologies/aws-4region.yaml", ["--rate", "10Mbit"], False, False),
                ("wag4", "mininet", "topologies/asym-lossy.yaml", [], True, True)],
}


def run(argv: list[str], timeout: float = 120, **kwargs) -> dict:
    started = time.monotonic()
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)
        rc, stdout, stderr = out.returncode, out.stdout, out.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = 124, str(exc.stdout or ""), f"timeout after {timeout} s"
    return {"argv": argv, "rc": rc, "seconds": round(time.monotonic() - started, 2),
            "stdout": stdout[-20000:], "stderr": stderr[-2000:]}


def ns_argv(namespace: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


def readback(plan: Plan, backend: str) -> dict:
    """`tc -j` qdiscs, classes and filters of every shaped device, keyed by device label."""
    from emulator.backends import mininet, tc

    devices = [(f"{node.name}/eth0", node.namespace, "eth0") for node in plan.nodes]
    for node in plan.nodes:
        if backend == "tc":
            devices.append((f"core/{node.name}", tc.core_namespace(plan), tc.veth_core_name(plan, node)))
        else:
            devices.append((f"port/{node.name}", None, mininet.port_name(plan, node)))
    found = {}
    for label, namespace, dev in devices:
        head = ["tc", "-j"] + (["-n", namespace] if namespace else [])
        entry = {}
        for kind in ("qdisc", "class", "filter"):
            out = subprocess.run([*head, kind, "show", "dev", dev], capture_output=True, text=True)
            if out.returncode != 0:
                entry[kind] = {"error": out.stderr}
                continue
            try:
                entry[kind] = json.loads(out.stdout or "[]")
            except ValueError:  # iproute2 6.1 prints htb classes as text even with -j
                entry[kind] = {"text": out.stdout}
        found[label] = entry
    return found


def parse_ping(stdout: str) -> dict:
    counts, rtt = PING_COUNTS.search(stdout), PING_RTT.search(stdout)
    return {"sent": int(counts.group(1)) if counts else 0, "received": int(counts.group(2)) if counts else 0,
            "min_ms": float(rtt.group(1)) if rtt else None, "avg_ms": float(rtt.group(2)) if rtt else None,
            "max_ms": float(rtt.group(3)) if rtt else None}


def rtt_checks(plan: Plan) -> dict:
    """iputils ping and our prober, side by side, on every ordered pair at once."""
    servers = [subprocess.Popen(ns_argv(n.namespace, [sys.executable, "-m", "emulator.measure.probe", "server",
                                                      "--port", str(PROBE_PORT)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in plan.nodes]
    for node in plan.nodes:
        if not wait_listening(node, PROBE_PORT, udp=True):
            raise RuntimeError(f"the probe server on {node.name}:{PROBE_PORT} is not listening after 60 s")
    running = []
    for src, dst, _ in plan.pairs():
        ping = subprocess.Popen(ns_argv(src.namespace, ["ping", "-n", "-q", "-c", str(PING_COUNT), "-i",
                                                        str(PING_INTERVAL_S), "-w", "30", dst.address]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        probe = subprocess.Popen(ns_argv(src.namespace, [
            sys.executable, "-m", "emulator.measure.probe", "client", "--host", dst.address, "--port",
            str(PROBE_PORT), "--count", str(PROBE_COUNT), "--interval-ms", str(PROBE_INTERVAL_MS), "--json"]),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        running.append((src, dst, ping, probe))
    pairs = {}
    for src, dst, ping, probe in running:
        ping_out, _ = ping.communicate(timeout=60)
        probe_out, probe_err = probe.communicate(timeout=60)
        try:
            prober = json.loads(probe_out)
            prober.pop("samples_ms", None)
        except ValueError:
            prober = {"error": probe_err[-500:]}
        pairs[f"{src.name}>{dst.name}"] = {"ping": parse_ping(ping_out), "prober": prober}
    for server in servers:
        server.terminate()
        server.wait(timeout=10)
    return pairs


def wait_listening(node, port: int, timeout_s: float = 60.0, udp: bool = False) -> bool:
    """Wait until a server listens on `port` in `node` (a starved guest starts servers late).
    Returns whether it does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(ns_argv(node.namespace, ["ss", "-Huln" if udp else "-Htln", f"sport = :{port}"]),
                             capture_output=True, text=True)
        if out.stdout.strip():
            return True
        time.sleep(0.2)
    return False


def timed(snapshot) -> dict:
    """The snapshot with the monotonic times just before and after it: the counters were read at
    some moment in between (in the guest, starting `tc` can take a good part of a second)."""
    before = time.monotonic()
    pairs = snapshot()
    return {"t": before, "t_after": time.monotonic(), "pairs": pairs}


_next_port = IPERF_BASE_PORT


def _fresh_port() -> int:
    """A port no earlier flow of this guest used: a server never meets its predecessor's socket."""
    global _next_port
    _next_port += 1
    return _next_port


# iperf3 errors of a flow's set-up, not of the link under test: the phase runs once more
SETUP_FAILURES = ("refused", "unable to read from stream socket")


def iperf_phase(plan: Plan, clients: list[tuple], snapshot=None, snapshot_at=()) -> dict:
    """Run (src, dst, client args) iperf3 flows at once, one server per flow; JSON per pair.

    snapshot: called with no arguments at each of `snapshot_at` (seconds after the clients
    started; None: after they ended); what it returns is kept under "snapshots" with the time.
    A client refused by its server (seen once in CI, in a guest starved by a loaded host), or a UDP
    flow whose set-up datagram was lost (iperf3's UDP handshake is one datagram each way, and the
    lossy topologies drop it now and then: "unable to read from stream socket: Resource
    temporarily unavailable", seen once in a fresh clone's CI run) makes the whole phase run
    again, once, so that the snapshots still frame the flows; "attempts" says how many runs it took.
    """
    for attempt in (1, 2):
        results = _iperf_phase_once(plan, clients, snapshot, snapshot_at)
        retried = [k for k, v in results.items() if isinstance(v, dict)
                   and any(why in str(v.get("error", "")) for why in SETUP_FAILURES)]
        if not retried:
            break
    results["attempts"] = attempt
    return results


def _iperf_phase_once(plan: Plan, clients: list[tuple], snapshot, snapshot_at) -> dict:
    servers, running = [], []
    ports = [_fresh_port() for _ in clients]
    for (src, dst, _), port in zip(clients, ports):
        servers.append(subprocess.Popen(ns_argv(dst.namespace, ["iperf3", "-s", "-1", "-p", str(port)]),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for (src, dst, _), port, server in zip(clients, ports, servers):
        if not wait_listening(dst, port):
            stderr = server.communicate(timeout=10)[1] if server.poll() is not None else "(still running)"
            raise RuntimeError(f"iperf3 server on {dst.name}:{port} not listening after 60 s: {stderr[-300:]}")
    snapshots = []
    if snapshot is not None and 0.0 in snapshot_at:
        snapshots.append(timed(snapshot))
    for (src, dst, extra), port in zip(clients, ports):
        argv = ns_argv(src.namespace, ["iperf3", "-c", dst.address, "-p", str(port), "-J", *extra])
        running.append((src, dst, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True)))
    started = time.monotonic()
    if snapshot is not None:
        for at in snapshot_at:
            if at:
                time.sleep(max(0.0, started + at - time.monotonic()))
                snapshots.append(timed(snapshot))
    results = {}
    for src, dst, proc in running:
        out, err = proc.communicate(timeout=60)
        try:
            report = json.loads(out)
        except ValueError:
            report = {"error": err[-500:] or out[-500:]}
        results[f"{src.name}>{dst.name}"] = summarize_iperf(report)
    if snapshot is not None and None in snapshot_at:
        snapshots.append(timed(snapshot))
    for server in servers:
        if server.poll() is None:
            server.terminate()
        server.communicate(timeout=10)
    if snapshots:
        results["snapshots"] = snapshots
    return results


def summarize_iperf(report: dict) -> dict:
    if "error" in report:
        return {"error": report["error"]}
    end = report.get("end", {})
    start = report.get("start", {})
    if start.get("test_start", {}).get("protocol") == "TCP":
        return {"protocol": "tcp", "mbit": end["sum_received"]["bits_per_second"] / 1e6,
                "congestion": end.get("receiver_tcp_congestion") or end.get("sender_tcp_congestion"),
                "retransmits": end.get("sum_sent", {}).get("retransmits")}
    total = end.get("sum", {})
    seconds = total.get("seconds") or UDP_HIGH_SECONDS
    packets, lost = total.get("packets", 0), total.get("lost_packets", 0)
    size = start.get("test_start", {}).get("blksize", UDP_DATAGRAM_BYTES)
    return {"protocol": "udp", "packets": packets, "lost": lost,
            "lost_fraction": lost / packets if packets else None,
            "received_mbit": (packets - lost) * size * 8 / seconds / 1e6}


def counters_now(plan: Plan, backend: str, pairs: list[tuple]):
    """A function that reads `pairs`' counters from the kernel now (tc, mininet): only the devices
    they cross, so that a snapshot takes two `tc` runs, not 2N."""
    if backend not in ("tc", "mininet"):
        return None
    from emulator.backends import mininet, tc

    def bottleneck(dst):
        if backend == "tc":
            return ["-n", tc.core_namespace(plan), "qdisc", "show", "dev", tc.veth_core_name(plan, dst)]
        return ["qdisc", "show", "dev", mininet.port_name(plan, dst)]

    def read():
        core, delay = {}, {}
        for src, dst, _ in pairs:
            core[dst.name] = tc.read_json(["tc", "-s", "-j", *bottleneck(dst)])
            delay[src.name] = tc.read_json(["tc", "-s", "-j", "-n", src.namespace, "qdisc", "show", "dev", "eth0"])
        wanted = {(s.name, d.name) for s, d, _ in pairs}
        return {f"{c['src']}>{c['dst']}": c for c in tc.pair_counters(plan, core, delay)
                if (c["src"], c["dst"]) in wanted}
    return read


def rate_checks(plan: Plan, backend: str) -> dict:
    """1. Pair by pair, UDP above the rate: what the bottleneck delivers (iperf3) and its own
    output rate (counter deltas inside the flow); 2. the lossy pairs at once, UDP below the rate:
    the loss, end to end and counted; 3. one TCP flow alone on the largest-BDP loss-free pair.
    Pair by pair because the guest's one CPU cannot drive every pair's flow at once."""
    udp = ["-u", "-l", str(UDP_DATAGRAM_BYTES)]
    results = {"udp_high": {}, "attempts": {}}  # attempts: runs each iperf phase took
    for src, dst, spec in plan.pairs():
        one = [(src, dst, spec)]
        flow = iperf_phase(plan, [(src, dst, [*udp, "-t", str(UDP_HIGH_SECONDS),
                                               "-b", f"{spec.rate_bit_s * UDP_HIGH_FRACTION:.0f}"])],
                           counters_now(plan, backend, one), RATE_SNAPSHOT_AT_S)
        results["attempts"][f"udp_high {src.name}>{dst.name}"] = flow.pop("attempts")
        results["udp_high"].update({k: v for k, v in flow.items() if k != "snapshots"})
        if "snapshots" in flow:
            results["udp_high"].setdefault("snapshots", {})[f"{src.name}>{dst.name}"] = flow["snapshots"]
    lossy = [(src, dst, spec) for src, dst, spec in plan.pairs() if spec.loss_fraction]
    if lossy:
        results["udp_low"] = iperf_phase(
            plan, [(src, dst, [*udp, "-t", str(UDP_LOW_SECONDS), "-b", f"{spec.rate_bit_s * UDP_LOW_FRACTION:.0f}"])
                   for src, dst, spec in lossy],
            counters_now(plan, backend, lossy), (0.0, None))
        results["attempts"]["udp_low"] = results["udp_low"].pop("attempts")
    clean = [(src, dst, spec) for src, dst, spec in plan.pairs() if not spec.loss_fraction]
    if clean:
        src, dst, spec = max(clean, key=lambda p: p[2].rate_bit_s * p[2].one_way_delay_ms)
        results["tcp"] = iperf_phase(plan, [(src, dst, ["-t", str(TCP_SECONDS), "-O", str(TCP_OMIT_SECONDS)])])
        results["attempts"]["tcp"] = results["tcp"].pop("attempts")
    return results


def leftovers(prefix: str) -> list[str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [f"netns {line.split()[0]}" for line in netns.splitlines() if line.startswith(prefix + "-")]
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    found += [f"link {line.split()[0]}" for line in links.splitlines() if line.startswith(prefix)]
    return found


def run_one(backend: str, topology: str, up_args: list[str], do_rates: bool, do_verify: bool) -> dict:
    prefix = os.environ["WANBENCH_PREFIX"]
    result = {"backend": backend, "topology": topology, "up_args": up_args, "prefix": prefix,
              "kernel": os.uname().release}
    result["up"] = run([WANBENCH, "up", topology, "--backend", backend, *up_args])
    if result["up"]["rc"] != 0:
        result["clean"] = run([WANBENCH, "clean"])
        return result
    try:
        _, plan = read_state(prefix)
        result["plan"] = json.loads(plan.to_json())
        if backend in ("tc", "mininet"):
            result["readback"] = readback(plan, backend)
        first = plan.nodes[0]
        result["exec"] = run([WANBENCH, "exec", first.name, "--", "ip", "-j", "-4", "addr", "show"])
        result["rtt"] = rtt_checks(plan)
        if do_rates:
            result["rate"] = rate_checks(plan, backend)
        status = run([WANBENCH, "status"])
        result["status"] = status
        try:
            result["counters"] = json.loads(status["stdout"][status["stdout"].index("["):])
        except ValueError:
            result["counters"] = []
    finally:
        result["down"] = run([WANBENCH, "down"])
        result["left_after_down"] = leftovers(prefix)
        result["clean"] = run([WANBENCH, "clean"])
    if do_verify:
        result["verify"] = run([WANBENCH, "verify", topology, "--backend", backend, *up_args, "--json",
                                "--no-throughput", "--probes", str(VERIFY_PROBES)], timeout=300)
        result["left_after_verify"] = leftovers(prefix)
    return result


FAKE_TC = """#!/bin/sh
# A tc whose batches fail on their third line, as tc does (message, then the line number).
case "$*" in *-batch*) cat >/dev/null; echo "Error: injected failure" >&2; echo "Command failed -:3" >&2; exit 1;; esac
exec {real} "$@"
"""


def failing_tc_check(topology: str) -> dict:
    """`wanbench up --backend tc` with a tc that fails: what it prints, its exit code, what is left."""
    import shutil
    import tempfile

    prefix = os.environ["WANBENCH_PREFIX"]
    folder = Path(tempfile.mkdtemp(prefix="fake-tc-"))
    fake = folder / "tc"
    fake.write_text(FAKE_TC.format(real=shutil.which("tc")))
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}
    result = run([WANBENCH, "up", topology, "--backend", "tc"], env=env)
    result["left"] = leftovers(prefix)
    result["clean"] = run([WANBENCH, "clean"])
    shutil.rmtree(folder, ignore_errors=True)
    return result


HOSTS_FILE = """topology: {topology}
hosts:
{hosts}
"""
# three "hosts" (namespaces on a bridge) standing in for real machines in three regions
HOST_STANDINS = [("h-london", "london", "10.251.0.1"), ("h-tokyo", "tokyo", "10.251.0.2"),
                 ("h-ohio", "ohio", "10.251.0.3")]


def hosts_check(out: Path) -> dict:
    """`wanbench shape/unshape` on real interfaces: namespaces with a veth each on one bridge stand
    in for hosts; every host shapes its own eth0, then iputils ping between every pair, the
    read-back of eth0's qdiscs, unshape, and a foreign root qdisc that shape must refuse."""
    bridge_ns, bridge = "wbh-br", "wbhbr0"
    hosts_file = out / "hosts.yaml"
    hosts_file.write_text(HOSTS_FILE.format(
        topology=ROOT / "topologies" / "aws-4region.yaml",
        hosts="\n".join(f"  {name}: {{region: {region}, address: {address}}}" for name, region, address in HOST_STANDINS)))
    result: dict = {"hosts": HOST_STANDINS, "setup": [], "shape": {}, "ping": {}, "qdiscs": {}}
    setup = [["ip", "netns", "add", bridge_ns], ["ip", "-n", bridge_ns, "link", "add", bridge, "type", "bridge"],
             ["ip", "-n", bridge_ns, "link", "set", bridge, "up"]]
    for index, (name, _, address) in enumerate(HOST_STANDINS):
        setup += [["ip", "netns", "add", name],
                  ["ip", "-n", bridge_ns, "link", "add", f"wbhv{index}", "type", "veth", "peer", "name", "eth0",
                   "netns", name],
                  ["ip", "-n", bridge_ns, "link", "set", f"wbhv{index}", "master", bridge, "up"],
                  ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0"],
                  ["ip", "-n", name, "link", "set", "eth0", "up"], ["ip", "-n", name, "link", "set", "lo", "up"]]
    try:
        for argv in setup:
            step = run(argv)
            result["setup"].append(step["rc"])
            if step["rc"]:
                result["setup_error"] = step
                return result
        for name, _, _ in HOST_STANDINS:
            result["shape"][name] = run(ns_argv(name, [WANBENCH, "shape", str(hosts_file), "--host", name, "--dev", "eth0"]))
            result["qdiscs"][name] = run(ns_argv(name, ["tc", "-j", "qdisc", "show", "dev", "eth0"]))["stdout"]
        for src, _, _ in HOST_STANDINS:
            for dst, _, address in HOST_STANDINS:
                if src != dst:
                    result["ping"][f"{src}>{dst}"] = run(ns_argv(src, ["ping", "-n", "-q", "-c", "5", "-i", "0.2", address]))["stdout"]
        name = HOST_STANDINS[0][0]
        result["dry_run"] = run([WANBENCH, "shape", str(hosts_file), "--host", name, "--dev", "eth0", "--dry-run"])
        result["unshape"] = run(ns_argv(name, [WANBENCH, "unshape", "--dev", "eth0"]))
        result["unshape_again"] = run(ns_argv(name, [WANBENCH, "unshape", "--dev", "eth0"]))
        result["after_unshape"] = run(ns_argv(name, ["tc", "-j", "qdisc", "show", "dev", "eth0"]))["stdout"]
        run(ns_argv(name, ["tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb"]))
        result["foreign"] = run(ns_argv(name, [WANBENCH, "shape", str(hosts_file), "--host", name, "--dev", "eth0"]))
    finally:
        for name, _, _ in HOST_STANDINS:
            run(["ip", "netns", "del", name])
        run(["ip", "netns", "del", bridge_ns])
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    one = sub.add_parser("run")
    one.add_argument("--backend", required=True)
    one.add_argument("--topology", required=True)
    one.add_argument("--rate")
    one.add_argument("--verify", action="store_true")
    one.add_argument("--out", required=True)
    suite = sub.add_parser("suite")
    suite.add_argument("name", choices=sorted(SUITES))
    suite.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    if args.mode == "run":
        up_args = ["--rate", args.rate] if args.rate else []
        Path(args.out).write_text(json.dumps(run_one(args.backend, args.topology, up_args, True, args.verify),
                                             indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for prefix, backend, topology, up_args, do_rates, do_verify in SUITES[args.name]:
        os.environ["WANBENCH_PREFIX"] = prefix
        started = time.monotonic()
        result = run_one(backend, topology, up_args, do_rates, do_verify)
        result["verify_args"] = ["--no-throughput", "--probes", str(VERIFY_PROBES)]
        result["total_seconds"] = round(time.monotonic() - started, 1)
        (out / f"{backend}-{Path(topology).stem}.json").write_text(json.dumps(result, indent=1))
        print(f"{backend} {topology}: {result['total_seconds']} s", flush=True)
    if args.name == "tc":
        os.environ["WANBENCH_PREFIX"] = "wag5"
        (out / "failing-tc.json").write_text(json.dumps(failing_tc_check("topologies/asym-lossy.yaml"), indent=1))
        (out / "hosts-tc.json").write_text(json.dumps(hosts_check(out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
