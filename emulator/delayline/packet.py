"""Header fields the delay line needs from a TUN frame: IPv4 destination and on-the-wire size.

A frame is what a TUN device opened with IFF_VNET_HDR hands over: a virtio-net header, then the IP
packet. With TSO offload on, one frame can be a GSO super-packet of up to 64 KB that the kernel would
have cut into MTU-sized segments; we keep it whole (far fewer packets to handle in Python) but charge
the link for the headers every segment would have carried, as Linux qdiscs do (qdisc_pkt_len_init).
"""

from __future__ import annotations

import struct

# struct virtio_net_hdr: flags u8, gso_type u8, hdr_len u16, gso_size u16, csum_start u16,
# csum_offset u16. We set this size explicitly with TUNSETVNETHDRSZ.
VNET_HDR_BYTES = 10
VNET_GSO_NONE = 0
VNET_GSO_TCPV4 = 1
VNET_GSO_UDP = 3
VNET_GSO_TCPV6 = 4
VNET_GSO_UDP_L4 = 5
VNET_GSO_ECN = 0x80

IPV4_DST_OFFSET = 16
UDP_HEADER_BYTES = 8

# Native byte order: tun uses the host's order for the legacy header unless IFF_VNET_LE is set.
_GSO_SIZE = struct.Struct("=H")


def ipv4_destination(frame: bytes, vnet_bytes: int = VNET_HDR_BYTES) -> bytes | None:
    """The 4-byte IPv4 destination of `frame`, or None for anything that is not IPv4.

    Args:
        frame: vnet header + IP packet, as read from the TUN device.
        vnet_bytes: size of the virtio-net header in front of the packet (bytes).
    """
    if len(frame) < vnet_bytes + 20 or frame[vnet_bytes] >> 4 != 4:
        return None
    start = vnet_bytes + IPV4_DST_OFFSET
    return frame[start:start + 4]


def wire_bytes(frame: bytes, vnet_bytes: int = VNET_HDR_BYTES) -> int:
    """Bytes the link must carry for `frame`: the IP length, plus per-segment headers for GSO frames.

    Args:
        frame: vnet header + IP packet, as read from the TUN device.
        vnet_bytes: size of the virtio-net header in front of the packet (bytes).
    """
    ip_bytes = len(frame) - vnet_bytes
    gso_type = frame[1] & ~VNET_GSO_ECN
    if gso_type == VNET_GSO_NONE:
        return ip_bytes
    gso_size = _GSO_SIZE.unpack_from(frame, 4)[0]
    if gso_size == 0:
        return ip_bytes
    ip_header = (frame[vnet_bytes] & 0x0F) * 4
    if gso_type in (VNET_GSO_TCPV4, VNET_GSO_TCPV6):
        l4_header = (frame[vnet_bytes + ip_header + 12] >> 4) * 4
    else:
        l4_header = UDP_HEADER_BYTES
    headers = ip_header + l4_header
    payload = ip_bytes - headers
    if payload <= gso_size:
        return ip_bytes
    segments = -(-payload // gso_size)
    return ip_bytes + (segments - 1) * headers
