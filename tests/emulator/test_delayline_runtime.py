"""The delay-line loop without root: socket pairs stand in for TUN devices (one message = one frame).

SOCK_SEQPACKET keeps frame boundaries as a TUN fd does, so the real loop runs unchanged: routing by
IPv4 destination, delay, unknown destinations, counters file. Timing bounds here are loose on
purpose (a loaded CI box); the precise numbers come from bench/bench_delayline.py.
"""

import json
import os
import socket
import struct
import threading
import time

import pytest

from emulator.backends import base
from emulator.backends.tun import TunBackend, is_our_delayline
from emulator.delayline.packet import VNET_HDR_BYTES
from emulator.delayline.runtime import DelayLine
from emulator.plan import make_plan
from emulator.topology import topology_from_dict

ONE_WAY_MS = 30.0


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wbtunu")
    return make_plan(topology_from_dict({
        "name": "rt", "address_pool": "10.217.0.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}, "cc": {"nodes": 1}},
        "links": [{"between": ["aa", "bb"], "delay": f"{ONE_WAY_MS}ms", "rate": "100Mbit"},
                  {"between": ["aa", "cc"], "delay": "5ms", "rate": "100Mbit"},
                  {"between": ["bb", "cc"], "delay": "5ms", "rate": "100Mbit"}],
    }))


def frame_to(address: str, payload: bytes = b"x" * 100) -> bytes:
    vnet = b"\0" * VNET_HDR_BYTES
    total = 20 + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 0, 0, 64, 17, 0,
                     socket.inet_aton("10.217.0.1"), socket.inet_aton(address))
    return vnet + ip + payload


def test_loop_routes_delays_and_counts(plan, tmp_path):
    counters = tmp_path / "counters.json"
    line = DelayLine(plan, counters_path=counters, realtime_priority=0, counters_interval_s=0.05)
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in plan.nodes]
    for ours, _ in pairs:
        ours.setblocking(False)
    line.fds = [ours.fileno() for ours, _ in pairs]
    aa, bb = (theirs for _, theirs in pairs[:2])
    received = []
    ready = threading.Event()

    def traffic():
        try:
            assert ready.wait(10)
            bb.settimeout(5)
            sent_ns = time.monotonic_ns()
            aa.send(frame_to(plan.node("bb-0").address))
            data = bb.recv(70_000)
            received.append((data, (time.monotonic_ns() - sent_ns) / 1e6))
            aa.send(frame_to("10.217.0.200"))  # inside the pool, no node: dropped and counted
            time.sleep(0.2)
        finally:
            line.request_stop()

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        line.run(on_ready=ready.set)
    finally:
        worker.join()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()

    (data, elapsed_ms), = received
    assert data == frame_to(plan.node("bb-0").address)  # vnet header and packet unchanged
    assert ONE_WAY_MS <= elapsed_ms < ONE_WAY_MS + 50
    status = json.loads(counters.read_text())
    assert status["unknown_destination"]["aa-0"] == 1
    forward = next(p for p in status["pairs"] if (p["src"], p["dst"]) == ("aa-0", "bb-0"))
    assert (forward["packets"], forward["bytes"]) == (1, 120)
    assert status["lag"]["deliveries"] == 1
    assert status["realtime"] is False


def test_bad_runtime_arguments_fail_at_once(plan):
    with pytest.raises(ValueError, match="read_batch"):
        DelayLine(plan, read_batch=0)
    with pytest.raises(ValueError, match="realtime_priority"):
        DelayLine(plan, realtime_priority=100)


def test_backend_refuses_foreign_pids_and_reads_counters(plan, tmp_path, monkeypatch):
    # Our own pid is alive but is not a delay line: down() must never signal it.
    assert not is_our_delayline(os.getpid(), plan.prefix)
    assert not is_our_delayline(2 ** 22 + 1, plan.prefix)
    monkeypatch.setattr(base, "STATE_ROOT", tmp_path)
    backend = TunBackend(plan)
    argv = backend.delayline_argv(tmp_path / plan.prefix / "delayline-plan.json", ready_fd=5)
    assert "emulator.delayline" in argv and f"/{plan.prefix}/" in " ".join(argv)
    assert backend.counters() == []
    backend.folder.mkdir(parents=True)
    backend.counters_path.write_text(json.dumps({"pairs": [{"src": "aa-0", "dst": "bb-0", "packets": 3}]}))
    assert backend.counters() == [{"src": "aa-0", "dst": "bb-0", "packets": 3}]


def test_two_senders_into_one_node_share_its_nic_in(monkeypatch, tmp_path):
    """cc's NIC is 8 Mbit/s (1 byte per us), each pair 100 Mbit/s: 20 frames of 1,120 bytes from
    aa and 20 from bb all pass cc's NIC, so the last reaches cc no sooner than 40 x 1,120 us after
    the first was sent (alone, each sender's 20 would take 1.8 ms on its pair); the counters file
    shows the NIC's packets. A lower bound only: a loaded machine can only make it later."""
    monkeypatch.setenv("WANBENCH_PREFIX", "wbtunn")
    plan = make_plan(topology_from_dict({
        "name": "rtn", "address_pool": "10.217.1.0/24",
        "regions": {"aa": {"nodes": 1}, "bb": {"nodes": 1}, "cc": {"nodes": 1, "nic": {"rate": "8Mbit"}}},
        "defaults": {"delay": "1ms", "rate": "100Mbit"},
    }))
    counters = tmp_path / "counters.json"
    line = DelayLine(plan, counters_path=counters, realtime_priority=0, counters_interval_s=0.05)
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in plan.nodes]
    for ours, _ in pairs:
        ours.setblocking(False)
    line.fds = [ours.fileno() for ours, _ in pairs]
    aa, bb, cc = (theirs for _, theirs in pairs)
    frames, took_ms = 20, []
    ready = threading.Event()

    def traffic():
        try:
            assert ready.wait(10)
            cc.settimeout(5)
            to_cc = frame_to(plan.node("cc-0").address, b"x" * 1100)
            sent_ns = time.monotonic_ns()
            for _ in range(frames):
                aa.send(to_cc)
                bb.send(to_cc)
            for _ in range(2 * frames):
                cc.recv(70_000)
            took_ms.append((time.monotonic_ns() - sent_ns) / 1e6)
            time.sleep(0.2)
        finally:
            line.request_stop()

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        line.run(on_ready=ready.set)
    finally:
        worker.join()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()

    assert took_ms and took_ms[0] >= 2 * frames * 1120 / 1000 + 1.0   # 44.8 ms of NIC + the delay
    status = json.loads(counters.read_text())
    assert status["nics"]["cc-0"]["in"]["packets"] == 2 * frames
    assert sorted(status["nics"]) == ["cc-0"]   # aa's and bb's 10 Gbit/s NICs cannot bind: not built
