"""Open one node's TUN device inside its namespace and give it the node's address.

The device is not persistent: it disappears when the delay line's file descriptor closes (exit,
crash, SIGKILL), so a dead delay line never leaves links behind. TSO/checksum offload is on, so the
kernel hands over GSO super-packets of up to 64 KB with a virtio-net header in front; on a node
with a lossy outgoing link TSO is off (`set_segmentation`), so the kernel cuts every GSO packet
into wire-sized ones before the delay line reads them and loss applies per packet.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from pyroute2 import IPRoute

from .. import netns
from ..plan import Node, Plan
from .packet import VNET_HDR_BYTES

TUN_PATH = "/dev/net/tun"
# ioctl numbers from <linux/if_tun.h> (_IOW('T', n, int)).
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
TUNSETVNETHDRSZ = 0x400454D8
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM = 0x01
TUN_F_TSO4 = 0x02
TUN_F_TSO6 = 0x04

# 1500 keeps TCP's segment size (and so its window growth in packets) that of a real WAN path;
# GSO already lets the kernel hand us 64 KB at a time, so a larger MTU would buy no speed.
DEVICE_MTU = 1500
# Packets wait here when the delay line is slower than the senders; 1000 GSO frames is far more
# than any cwnd burst we have seen, and the runtime's lag counters show when it is ever used.
DEVICE_TXQUEUELEN = 1000


def device_name(prefix: str) -> str:
    """The TUN device's name inside every node's namespace (e.g. "wanb0")."""
    return f"{prefix}0"


def offload_flags(segment: bool) -> int:
    """TUNSETOFFLOAD flags: checksum offload always; TSO only when the kernel need not segment."""
    return TUN_F_CSUM if segment else TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6


def set_segmentation(fd: int, segment: bool) -> None:
    """Make the kernel hand this TUN device wire-sized packets (`segment`) or GSO frames.

    Takes effect for the next packet sent, also on open connections: the kernel segments a GSO
    packet in software when the device does not accept TSO (validate_xmit_skb).
    """
    fcntl.ioctl(fd, TUNSETOFFLOAD, offload_flags(segment))


def open_tun(name: str, segment: bool = False) -> int:
    """Create a TUN device named `name` in the calling thread's namespace; return its fd (non-blocking).

    Args:
        name: device name.
        segment: refuse TSO, so every frame read is one wire packet (nodes with lossy links).
    """
    fd = os.open(TUN_PATH, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifreq = struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR)
        fcntl.ioctl(fd, TUNSETIFF, ifreq)
        fcntl.ioctl(fd, TUNSETVNETHDRSZ, struct.pack("i", VNET_HDR_BYTES))
        set_segmentation(fd, segment)
    except OSError:
        os.close(fd)
        raise
    return fd


def open_node_device(plan: Plan, node: Node, segment: bool = False) -> int:
    """Create, address and bring up `node`'s TUN device in its namespace; return the fd.

    `segment`: refuse TSO (see open_tun); the delay line sets it for Plan.segments_egress nodes.

    IPv6 is disabled on the device first, so the kernel sends no router solicitations or MLD
    reports that the delay line would only have to drop.
    """
    name = device_name(plan.prefix)
    with netns.entered(node.namespace):
        fd = open_tun(name, segment=segment)
        try:
            ipv6 = Path("/proc/sys/net/ipv6/conf") / name / "disable_ipv6"
            if ipv6.exists():
                ipv6.write_text("1")
            # The netlink socket is opened while this thread is inside the namespace, so it talks
            # to that namespace's kernel tables without NetNS's helper process.
            with IPRoute() as ipr:
                index = ipr.link_lookup(ifname=name)[0]
                ipr.link("set", index=index, mtu=DEVICE_MTU, txqlen=DEVICE_TXQUEUELEN)
                ipr.addr("add", index=index, address=node.address, prefixlen=plan.prefix_length)
                ipr.link("set", index=index, state="up")
        except BaseException:
            os.close(fd)
            raise
    return fd
