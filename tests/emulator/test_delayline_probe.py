"""The UDP echo prober: percentiles, and a real round trip on loopback (no root needed)."""

import math
import socket
import threading
import time

import pytest

from emulator.measure.probe import (
    ANCILLARY_BYTES, HOLD, HOLD_OFFSET, MAX_PROBE_BYTES, enable_kernel_timestamps,
    kernel_timestamp_ns, percentile, probe, serve, summarize,
)


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert math.isnan(percentile([], 0.5))
    summary = summarize([3.0, 1.0, 2.0], sent=5)
    assert (summary["received"], summary["lost"], summary["min_ms"], summary["p50_ms"]) == (3, 2, 1.0, 2.0)


@pytest.mark.parametrize("clock", ["kernel", "user"])
def test_probe_round_trip_on_loopback(clock):
    ready = threading.Event()
    port = 39417 if clock == "kernel" else 39418
    threading.Thread(target=serve, args=(port, "127.0.0.1", ready.set), daemon=True).start()
    assert ready.wait(5)
    result = probe("127.0.0.1", port, count=50, interval_ms=1.0, size_bytes=200, clock=clock)
    assert result["received"] == 50 and result["lost"] == 0
    assert 0 < result["min_ms"] <= result["p50_ms"] <= result["p99_ms"] < 100
    assert len(result["samples_ms"]) == 50


def test_probe_arguments_are_checked():
    with pytest.raises(ValueError, match="size_bytes"):
        probe("127.0.0.1", 1, size_bytes=4)
    with pytest.raises(ValueError, match="count"):
        probe("127.0.0.1", 1, count=0)
    with pytest.raises(ValueError, match="clock"):
        probe("127.0.0.1", 1, clock="tsc")


def _slow_echo(sock, hold_s, stop):
    """An echo server that holds each probe `hold_s` (a prober descheduled on a busy box)."""
    sock.settimeout(0.1)
    while not stop.is_set():
        try:
            data, ancillary, _, peer = sock.recvmsg(MAX_PROBE_BYTES, ANCILLARY_BYTES)
        except TimeoutError:
            continue
        time.sleep(hold_s)
        reply = bytearray(data)
        HOLD.pack_into(reply, HOLD_OFFSET, time.time_ns() - kernel_timestamp_ns(ancillary))
        sock.sendto(bytes(reply), peer)


def test_kernel_clock_subtracts_the_servers_hold_time():
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    enable_kernel_timestamps(server)
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()
    worker = threading.Thread(target=_slow_echo, args=(server, 0.02, stop), daemon=True)
    worker.start()
    try:
        kernel = probe("127.0.0.1", port, count=10, interval_ms=30.0, clock="kernel")
        user = probe("127.0.0.1", port, count=10, interval_ms=30.0, clock="user")
    finally:
        stop.set()
        worker.join()
        server.close()
    assert kernel["received"] == user["received"] == 10
    assert kernel["kernel_stamps"] == kernel["transmit_stamps"] == 10
    assert user["min_ms"] >= 20.0            # the hold counts in user-space stamps
    assert kernel["max_ms"] < 5.0            # and is taken out with kernel stamps
