"""A UDP echo prober for precise round-trip times (ping prints whole ms above 100 ms; this does not).

    python -m emulator.delayline.probe server --port 9000
    python -m emulator.delayline.probe client --host 10.201.0.2 --port 9000 --count 200 --interval-ms 10 --json

The client sends `count` probes `interval_ms` apart without waiting for answers (so a 200 ms path
does not take count x 200 ms), stamps send and receive with time.perf_counter_ns in user space, and
reports min/p50/p90/p99/max. Those include the prober's own overhead (two wake-ups and four Python
system calls, tens of microseconds): measure it on loopback and subtract it when judging a path.
Standard library only, so anything can run it in any namespace.
"""

from __future__ import annotations

import argparse
import json
import math
import select
import socket
import struct
import sys
import time

# seq u32, send time u64 (ns), then padding up to the probe size.
HEADER = struct.Struct("!IQ")
MIN_PROBE_BYTES = HEADER.size
MAX_PROBE_BYTES = 1472  # one unfragmented datagram at MTU 1500


def percentile(sorted_values: list[float], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values (fraction in [0, 1])."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]


def summarize(rtts_ms: list[float], sent: int) -> dict:
    """Statistics (ms) of the received round-trip times out of `sent` probes."""
    values = sorted(rtts_ms)
    return {
        "sent": sent,
        "received": len(values),
        "lost": sent - len(values),
        "min_ms": values[0] if values else math.nan,
        "p50_ms": percentile(values, 0.50),
        "p90_ms": percentile(values, 0.90),
        "p99_ms": percentile(values, 0.99),
        "max_ms": values[-1] if values else math.nan,
        "mean_ms": sum(values) / len(values) if values else math.nan,
    }


def serve(port: int, bind: str = "0.0.0.0", ready=None) -> None:
    """Echo every datagram back to its sender until interrupted.

    Args:
        port: UDP port to listen on.
        bind: local address to bind.
        ready: called once the socket is bound (tests use it instead of sleeping).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        if ready is not None:
            ready()
        while True:
            data, peer = sock.recvfrom(MAX_PROBE_BYTES)
            sock.sendto(data, peer)


def probe(host: str, port: int, count: int = 100, interval_ms: float = 10.0, size_bytes: int = 64,
          timeout_ms: float = 2000.0) -> dict:
    """Send `count` probes and return summarize() of their round-trip times, plus the samples.

    Args:
        host: echo server address.
        port: echo server UDP port.
        count: number of probes.
        interval_ms: time between sends (ms); sends do not wait for answers.
        size_bytes: UDP payload per probe (bytes), 12 to 1472.
        timeout_ms: how long (ms) to wait for answers after the last send.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if interval_ms < 0:
        raise ValueError(f"interval_ms must be >= 0, got {interval_ms}")
    if not MIN_PROBE_BYTES <= size_bytes <= MAX_PROBE_BYTES:
        raise ValueError(f"size_bytes must be in [{MIN_PROBE_BYTES}, {MAX_PROBE_BYTES}], got {size_bytes}")
    padding = b"\0" * (size_bytes - HEADER.size)
    clock = time.perf_counter_ns
    interval_ns = int(interval_ms * 1e6)
    rtts_ms: list[float] = []
    seen: set[int] = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        sock.setblocking(False)
        start = clock()
        sent = 0
        deadline = None
        while True:
            now = clock()
            if sent < count and now >= start + sent * interval_ns:
                sock.send(HEADER.pack(sent, clock()) + padding)
                sent += 1
                if sent == count:
                    deadline = clock() + int(timeout_ms * 1e6)
                continue
            if deadline is not None and (now >= deadline or len(seen) == count):
                break
            wake_at = deadline if sent == count else start + sent * interval_ns
            readable, _, _ = select.select([sock], [], [], max(0.0, (wake_at - now) / 1e9))
            if not readable:
                continue
            while True:
                try:
                    data = sock.recv(MAX_PROBE_BYTES)
                except BlockingIOError:
                    break
                except ConnectionRefusedError:
                    continue  # an ICMP unreachable from before the server was up; keep listening
                received = clock()
                if len(data) < HEADER.size:
                    continue
                seq, sent_ns = HEADER.unpack_from(data)
                if seq in seen or seq >= count:
                    continue
                seen.add(seq)
                rtts_ms.append((received - sent_ns) / 1e6)
    result = summarize(rtts_ms, count)
    result.update(host=host, port=port, interval_ms=interval_ms, size_bytes=size_bytes,
                  samples_ms=rtts_ms)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator.delayline.probe",
                                     description="UDP echo round-trip prober")
    sub = parser.add_subparsers(dest="role", required=True)
    server = sub.add_parser("server", help="echo datagrams back")
    server.add_argument("--port", type=int, required=True)
    server.add_argument("--bind", default="0.0.0.0")
    client = sub.add_parser("client", help="send probes and report round-trip times")
    client.add_argument("--host", required=True)
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--count", type=int, default=100)
    client.add_argument("--interval-ms", type=float, default=10.0)
    client.add_argument("--size", type=int, default=64, help="UDP payload bytes per probe")
    client.add_argument("--timeout-ms", type=float, default=2000.0, help="wait after the last send")
    client.add_argument("--json", action="store_true", help="print one JSON object (with samples)")
    args = parser.parse_args(argv)

    if args.role == "server":
        try:
            serve(args.port, args.bind, ready=lambda: print(f"probe server on {args.bind}:{args.port}",
                                                            flush=True))
        except KeyboardInterrupt:
            pass
        return 0
    result = probe(args.host, args.port, args.count, args.interval_ms, args.size, args.timeout_ms)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['received']}/{result['sent']} answered; rtt ms min {result['min_ms']:.3f} "
              f"p50 {result['p50_ms']:.3f} p90 {result['p90_ms']:.3f} p99 {result['p99_ms']:.3f} "
              f"max {result['max_ms']:.3f}")
    return 0 if result["received"] else 1


if __name__ == "__main__":
    sys.exit(main())
