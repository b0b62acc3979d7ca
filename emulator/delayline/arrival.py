"""When a frame really entered a TUN device: the kernel's stamp, read from a packet socket.

A TUN file descriptor carries no receive timestamp, so a frame read after the loop woke from a
sleep used to be stamped one wake-up late: on this VM a wake-up from an idle sleep takes 0.1-0.2
ms, and a ping crosses the delay line twice per round trip (issue 12: ping at 1 Hz read 0.3-0.4 ms
over the configured RTT). The kernel does stamp what it sends to a device for its packet taps
(`dev_queue_xmit_nit` stamps each clone it hands to an AF_PACKET socket, right before the
device's transmit function queues the packet for us). So every node's TUN device gets an
AF_PACKET socket, opened inside the node's namespace, with

  * a classic BPF filter that keeps only outgoing packets (SKF_AD_PKTTYPE == PACKET_OUTGOING: the
    frames the node sends to the delay line, not the ones we write into it) and truncates each to
    MATCH_BYTES, so a tap entry costs the kernel one small copy;
  * SO_TIMESTAMPNS, so each entry carries the kernel's CLOCK_REALTIME stamp (converted to the
    loop's CLOCK_MONOTONIC by the offset between the two, read at every lookup).

The tap and the TUN queue see the same packets in the same order; a packet the TUN queue dropped
(queue full) is still in the tap. So `ArrivalTap.stamp(frame, read_ns)` reads tap entries until one
carries the frame's first MATCH_BYTES bytes (IP header with its ID and checksum, then the ports
and sequence numbers), discarding the entries before it (frames that never reached us). When no
entry matches (the tap's buffer overflowed, or the filter could not be attached), the frame keeps
its read time, as before, and the miss is counted.

The kernel stamps nothing until the first socket asks for stamps: `net_enable_timestamp()` switches
its static key in deferred work (net/core/dev.c, `netstamp_work`), so a frame sent in the first
moments after the first tap opens carries no stamp, and recvmsg() stamps it then, after our read.
Such a stamp (later than the read by more than the clocks' disagreement) is a miss, not a stamp.
"""

from __future__ import annotations

import ctypes
import socket
import struct
import time
from typing import Optional

from .timing import percentile_ns

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4
SO_ATTACH_FILTER = 26
SO_TIMESTAMPNS = 35      # SO_TIMESTAMPNS_OLD: struct timespec of native longs on 64-bit Linux
SO_RCVBUFFORCE = 33
# Classic BPF (linux/filter.h): load the packet type from the ancillary area, keep outgoing ones.
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_RET_K = 0x06
SKF_AD_OFF = -0x1000
SKF_AD_PKTTYPE = 4
# IPv4 header (20) + the first 28 bytes of TCP/UDP/ICMP: ports, sequence/ack numbers or ICMP id/seq.
MATCH_BYTES = 48
# Up to ~8,000 truncated entries (each costs ~1 KB of socket memory): far more than the TUN queue
# (1,000 frames) can hold, so the tap never overflows while the loop reads it with every frame.
TAP_BUFFER_BYTES = 8 << 20
# Stale entries (packets the TUN queue dropped) skipped per lookup at most, so one lookup is bounded.
MAX_SKIPPED = 256
# A stamp older than this relative to the read is not believed (a clock step): the read time is used.
MAX_AGE_NS = 10_000_000_000
# A stamp later than the read by more than this was made by recvmsg(), not on arrival (see above);
# within it, the realtime -> monotonic conversion (two clock reads) disagrees by a hair.
CLOCK_SLACK_NS = 1_000
_TIMESPEC = struct.Struct("=qq")
_ANCILLARY_BYTES = socket.CMSG_SPACE(_TIMESPEC.size)
SAMPLES = 1024


def outgoing_filter(snap_bytes: int = MATCH_BYTES) -> bytes:
    """The BPF program (4 instructions): outgoing packets truncated to `snap_bytes`, nothing else."""
    instruction = struct.Struct("=HBBI")
    return b"".join((
        instruction.pack(BPF_LD_W_ABS, 0, 0, (SKF_AD_OFF + SKF_AD_PKTTYPE) & 0xFFFFFFFF),
        instruction.pack(BPF_JEQ_K, 0, 1, PACKET_OUTGOING),
        instruction.pack(BPF_RET_K, 0, 0, snap_bytes),
        instruction.pack(BPF_RET_K, 0, 0, 0),
    ))


def attach_filter(sock: socket.socket, program: bytes) -> None:
    """SO_ATTACH_FILTER with a struct sock_fprog pointing at `program` (the kernel copies it)."""
    buffer = ctypes.create_string_buffer(program)
    fprog = struct.pack("=HxxxxxxQ", len(program) // 8, ctypes.addressof(buffer))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)


class ArrivalTap:
    """The kernel's arrival stamps for the frames of one TUN device (see the module doc).

    Create it in the device's network namespace (the socket stays bound to that namespace).

    Args:
        device: the TUN device's name in the current namespace.
    """

    __slots__ = ("sock", "stamped", "missed", "skipped", "_waits", "_next")

    def __init__(self, device: str):
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)  # protocol 0: nothing until bound
        try:
            attach_filter(sock, outgoing_filter())
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            try:
                sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, TAP_BUFFER_BYTES)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, TAP_BUFFER_BYTES)
            sock.bind((device, ETH_P_ALL))
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.stamped = self.missed = self.skipped = 0
        self._waits: list[int] = []   # read time - arrival (ns): how long frames waited for the loop
        self._next = 0

    @property
    def waits(self) -> list[int]:
        """The latest frames' waits for the loop (ns, read time - arrival; up to SAMPLES of them,
        in no order). The list itself, for reading only: the tap keeps writing into it."""
        return self._waits

    def close(self) -> None:
        self.sock.close()

    def stamp(self, frame: bytes, read_ns: int, packet_offset: int) -> int:
        """The CLOCK_MONOTONIC time (ns) at which `frame` entered the device; `read_ns` if unknown.

        Args:
            frame: the frame as read from the TUN device.
            read_ns: when the loop read it (CLOCK_MONOTONIC, ns); never later than the answer.
            packet_offset: where the IP packet starts in `frame` (the virtio-net header's size).
        """
        want = frame[packet_offset:packet_offset + MATCH_BYTES]
        recvmsg = self.sock.recvmsg
        for _ in range(MAX_SKIPPED):
            try:
                data, ancillary, _flags, _address = recvmsg(MATCH_BYTES, _ANCILLARY_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            if data != want:
                self.skipped += 1
                continue
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(payload) >= _TIMESPEC.size:
                    seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
                    # realtime -> monotonic; the two reads sit a few hundred ns apart
                    arrival = seconds * 1_000_000_000 + nanoseconds - (time.time_ns() - time.monotonic_ns())
                    wait = read_ns - arrival
                    if wait < -CLOCK_SLACK_NS or wait > MAX_AGE_NS:
                        break                        # stamped by recvmsg, or a clock step
                    if wait < 0:
                        arrival, wait = read_ns, 0   # stamps and clocks disagree by a hair
                    self.stamped += 1
                    self._store(wait)
                    return arrival
            break
        self.missed += 1
        return read_ns

    def _store(self, wait_ns: int) -> None:
        if len(self._waits) < SAMPLES:
            self._waits.append(wait_ns)
        else:
            self._waits[self._next] = wait_ns
        self._next = (self._next + 1) % SAMPLES


def open_tap(device: str) -> Optional[ArrivalTap]:
    """An ArrivalTap on `device`, or None where packet sockets or filters are not allowed."""
    try:
        return ArrivalTap(device)
    except OSError:
        return None


def tap_counters(taps: list[Optional[ArrivalTap]]) -> dict:
    """The counters file's `arrival` section: how many frames got kernel stamps, and their wait."""
    live = [t for t in taps if t is not None]
    waits = [w for t in live for w in t.waits]
    return {
        "kernel_stamps": len(live) == len(taps) and bool(taps),
        "stamped": sum(t.stamped for t in live),
        "missed": sum(t.missed for t in live),
        "skipped": sum(t.skipped for t in live),
        "wait_p50_us": round(percentile_ns(waits, 0.50) / 1000, 1),
        "wait_p99_us": round(percentile_ns(waits, 0.99) / 1000, 1),
    }
