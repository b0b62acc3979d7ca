"""The delay line's arrival stamps: the kernel's time for a frame entering a TUN device.

The matching logic runs on a fake tap (no root); the stamp itself on a real TUN device in a
namespace of the test's own, where a datagram left unread for 80 ms must still be stamped with
its send time.
"""

import os
import socket
import struct
import time
from pathlib import Path

import pytest

from emulator.delayline.arrival import MATCH_BYTES, SO_TIMESTAMPNS, ArrivalTap, outgoing_filter, tap_counters
from emulator.delayline.packet import VNET_HDR_BYTES


def test_filter_keeps_outgoing_packets_truncated():
    program = outgoing_filter(48)
    assert len(program) == 4 * 8
    codes = [struct.unpack_from("=HBBI", program, 8 * i) for i in range(4)]
    assert codes[0] == (0x20, 0, 0, (-0x1000 + 4) & 0xFFFFFFFF)   # ld packet type
    assert codes[1] == (0x15, 0, 1, 4)                            # == PACKET_OUTGOING
    assert codes[2] == (0x06, 0, 0, 48) and codes[3] == (0x06, 0, 0, 0)


class _FakeSocket:
    """recvmsg() from a list of (data, realtime_ns) entries; BlockingIOError when empty."""

    def __init__(self, entries):
        self.entries = list(entries)

    def recvmsg(self, size, _ancillary_size):
        if not self.entries:
            raise BlockingIOError
        data, stamp_ns = self.entries.pop(0)
        payload = struct.pack("=qq", stamp_ns // 1_000_000_000, stamp_ns % 1_000_000_000)
        return data[:size], [(socket.SOL_SOCKET, SO_TIMESTAMPNS, payload)], 0, None


def _fake_tap(entries) -> ArrivalTap:
    tap = ArrivalTap.__new__(ArrivalTap)
    tap.sock = _FakeSocket(entries)
    tap.stamped = tap.missed = tap.skipped = 0
    tap._waits, tap._next = [], 0
    return tap


def _frame(payload: bytes) -> bytes:
    return b"\0" * VNET_HDR_BYTES + payload


def test_stamp_skips_frames_the_device_dropped_and_falls_back_when_empty():
    realtime_offset = time.time_ns() - time.monotonic_ns()
    read_ns = time.monotonic_ns()
    dropped, wanted = b"A" * 60, b"B" * 60
    arrival_ns = read_ns - 5_000_000
    tap = _fake_tap([(dropped, arrival_ns - 1000 + realtime_offset), (wanted, arrival_ns + realtime_offset)])
    stamp = tap.stamp(_frame(wanted), read_ns, VNET_HDR_BYTES)
    assert abs(stamp - arrival_ns) < 200_000      # the two clocks are read a few us apart
    assert (tap.stamped, tap.skipped, tap.missed) == (1, 1, 0)
    # nothing left in the tap: the read time, counted as a miss
    assert tap.stamp(_frame(b"C" * 60), read_ns, VNET_HDR_BYTES) == read_ns
    assert tap.missed == 1
    counters = tap_counters([tap])
    assert counters["stamped"] == 1 and counters["kernel_stamps"] is True
    assert 4_000 < counters["wait_p50_us"] < 6_000
    assert tap_counters([tap, None])["kernel_stamps"] is False


def test_a_stamp_is_never_after_the_read_and_one_made_by_recvmsg_is_a_miss():
    read_ns = time.monotonic_ns()
    offset = time.time_ns() - time.monotonic_ns()
    # 3 ms after the read: the kernel had no stamp on arrival (timestamps still being switched
    # on) and recvmsg() stamped it; 300 ns after: the two clocks' reads disagree by a hair
    tap = _fake_tap([(b"D" * 30, read_ns + 3_000_000 + offset), (b"E" * 30, read_ns + 300 + offset)])
    assert tap.stamp(_frame(b"D" * 30), read_ns, VNET_HDR_BYTES) == read_ns
    assert (tap.stamped, tap.missed) == (0, 1)
    assert tap.stamp(_frame(b"E" * 30), read_ns, VNET_HDR_BYTES) == read_ns
    assert (tap.stamped, tap.missed) == (1, 1)


def _until_the_kernel_stamps(fd, tap, sender, timeout_s: float = 3.0) -> None:
    """Send probes until one comes back with a kernel stamp from before its read.

    The first socket that asks for stamps switches them on in the kernel's deferred work
    (`netstamp_work`): until it has run, frames carry none (seen once in a fresh clone's CI: the
    first frame's stamp equalled its read time). Leaves the device empty and the counters at 0.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sender.sendto(b"probe" * 10, ("10.219.0.2", 8999))
        time.sleep(0.005)
        stamped = False
        while True:
            try:
                frame = os.read(fd, 70_000)
            except BlockingIOError:
                break
            read_ns = time.monotonic_ns()
            stamped |= tap.stamp(frame, read_ns, VNET_HDR_BYTES) < read_ns
        if stamped:
            tap.stamped = tap.missed = tap.skipped = 0
            return
    pytest.fail(f"no kernel stamp on the tap within {timeout_s} s")


@pytest.mark.integration
@pytest.mark.skipif(os.geteuid() != 0 or not Path("/dev/net/tun").exists(), reason="needs root and /dev/net/tun")
def test_kernel_stamps_a_frame_when_it_enters_the_device(test_prefix):
    from pyroute2 import IPRoute
    from pyroute2 import netns as pyroute2_netns

    from emulator import netns
    from emulator.delayline.arrival import open_tap
    from emulator.delayline.device import open_tun

    namespace = f"{test_prefix}-arrival"
    device = f"{test_prefix}0"
    pyroute2_netns.create(namespace)
    fd = tap = None
    try:
        with netns.entered(namespace):
            fd = open_tun(device)
            with IPRoute() as ipr:
                index = ipr.link_lookup(ifname=device)[0]
                ipr.addr("add", index=index, address="10.219.0.1", prefixlen=24)
                ipr.link("set", index=index, state="up")
            tap = open_tap(device)
            assert tap is not None
            sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            # what the device saw while it came up (nothing with IPv4 here, but be sure)
            while True:
                try:
                    os.read(fd, 70_000)
                except BlockingIOError:
                    break
            _until_the_kernel_stamps(fd, tap, sender)
            sent = []
            for i in range(3):
                sent.append(time.monotonic_ns())
                sender.sendto(f"datagram {i}".encode() * 4, ("10.219.0.2", 9000 + i))
                time.sleep(0.02)
            time.sleep(0.08)      # the frames wait in the device, as while the loop sleeps
            # The kernel's own IPv6 traffic on the new link (router solicitation, MLD reports, sent
            # after random delays of up to a second) can queue between our datagrams: it is stamped
            # like any frame, as the delay line does, but only our IPv4 datagrams are checked
            # against their send times (reading one such frame as datagram 1 once read "18 ms
            # before its send": the frame left 2 ms after datagram 0).
            received = 0
            while received < len(sent):
                frame = os.read(fd, 70_000)
                read_ns = time.monotonic_ns()
                stamp = tap.stamp(frame, read_ns, VNET_HDR_BYTES)
                assert read_ns - stamp > 70_000_000
                if frame[VNET_HDR_BYTES] >> 4 != 4:
                    continue
                i, sent_ns = received, sent[received]
                assert frame.endswith(f"datagram {i}".encode() * 4)
                assert sent_ns <= stamp + 50_000, (i, stamp - sent_ns)   # clocks read apart by us
                assert stamp - sent_ns < 5_000_000, (i, (stamp - sent_ns) / 1e6)
                received += 1
            assert tap.missed == 0 and tap.stamped >= 3
            assert len(frame) - VNET_HDR_BYTES > MATCH_BYTES   # matched on a prefix, not the whole
        finally:
            sender.close()
    finally:
        if tap is not None:
            tap.close()
        if fd is not None:
            os.close(fd)
        pyroute2_netns.remove(namespace)
