"""The per-pair link model of the delay line: drop-tail queue, serialization, delay, jitter, loss.

Pure logic with no I/O and no clock of its own: the caller injects the time as `now_ns` on every
call (the runtime passes time.monotonic_ns(), tests pass chosen values), so behaviour is exact and
repeatable. One `PairLink` per ordered (src node, dst node) pair; one delivery heap for all of them.

Model of one direction of a link, in the order a packet meets it:
  1. random loss with probability `loss_fraction` (seeded RNG), before the queue, as netem does —
     a lost packet uses no bandwidth;
  2. a drop-tail FIFO of `queue_bytes` in front of a serializer running at `rate_bit_s`: a packet
     departs at max(now, previous departure) + wire_bytes * 8 / rate. The bytes in the queue are the
     bytes not yet serialized, (previous departure - now) * rate / 8, so no per-packet queue is kept;
  3. propagation delay `one_way_delay_ms`, plus jitter drawn uniformly (or normally, sigma = jitter/2,
     clipped) within +-jitter_ms. A packet is never delivered before the one ahead of it on the same
     pair (its delivery time is raised to the previous one): jitter never reorders a pair, as on a
     single real path; the price is that large jitter on a busy pair skews the distribution upwards.

Each node may have a NIC (`add_nic`): one serializer out, shared by every pair the node sends on,
and one in, shared by every pair it receives on, each a drop-tail FIFO of its own. A packet meets
the sender's NIC out before its pair's queue, and the receiver's NIC in when it arrives (after the
pair's delay, in the order packets arrive: the delivery heap holds it until then). The NIC and the
pair are rate limits on the same bits, cut-through: a packet alone leaves at the pace of the
slower of the two, never serialized twice; only a NIC busy with other pairs' packets delays it.
"""

from __future__ import annotations

import heapq
import random
from typing import Any, Hashable, Optional

from ..linkspec import LinkSpec

NS_PER_S = 1_000_000_000
NS_PER_MS = 1_000_000
JITTER_DISTRIBUTIONS = ("uniform", "normal")


class PairLink:
    """State and counters of one ordered pair's link (times in ns, sizes in bytes)."""

    __slots__ = (
        "spec", "ns_per_byte", "delay_ns", "jitter_ns", "queue_limit_bytes", "loss_fraction",
        "busy_until_ns", "last_delivery_ns", "nic_out", "nic_in",
        "packets", "bytes", "drops_queue", "drops_loss", "dropped_bytes", "peak_backlog_bytes",
    )

    def __init__(self, spec: LinkSpec):
        if spec.queue_bytes is None:
            raise ValueError("spec.queue_bytes is None: resolve queues with make_plan first")
        self.set_spec(spec)
        self.nic_out: Optional[NicStage] = None  # the sender's NIC out, when it has one
        self.nic_in: Optional[NicStage] = None   # the receiver's NIC in, when it has one
        self.busy_until_ns = 0.0      # when the serializer has sent everything accepted so far
        self.last_delivery_ns = 0.0   # FIFO floor for the next delivery on this pair
        self.packets = 0              # accepted onto the link
        self.bytes = 0                # accepted onto the link (wire bytes)
        self.drops_queue = 0
        self.drops_loss = 0
        self.dropped_bytes = 0
        self.peak_backlog_bytes = 0

    def set_spec(self, spec: LinkSpec) -> None:
        """Take new link parameters (fault injection); packets already accepted keep their times."""
        if spec.queue_bytes is None:
            raise ValueError("spec.queue_bytes is None: resolve queues with make_plan first")
        self.spec = spec
        self.ns_per_byte = 8.0 * NS_PER_S / spec.rate_bit_s
        self.delay_ns = spec.one_way_delay_ms * NS_PER_MS
        self.jitter_ns = spec.jitter_ms * NS_PER_MS
        self.queue_limit_bytes = spec.queue_bytes
        self.loss_fraction = spec.loss_fraction

    def backlog_bytes(self, now_ns: float) -> float:
        """Bytes accepted but not yet serialized at `now_ns` (ns)."""
        waiting_ns = self.busy_until_ns - now_ns
        return waiting_ns / self.ns_per_byte if waiting_ns > 0 else 0.0

    def counters(self) -> dict:
        return {
            "packets": self.packets,
            "bytes": self.bytes,
            "drops_queue": self.drops_queue,
            "drops_loss": self.drops_loss,
            "dropped_bytes": self.dropped_bytes,
            "peak_backlog_bytes": int(self.peak_backlog_bytes),
        }


class NicStage:
    """One direction of a node's NIC: a serializer at `rate_bit_s` with a drop-tail queue of
    `queue_bytes`, shared by every pair through it (times in ns, sizes in bytes)."""

    __slots__ = ("rate_bit_s", "ns_per_byte", "queue_limit_bytes", "busy_until_ns",
                 "packets", "bytes", "drops_queue", "dropped_bytes", "peak_backlog_bytes")

    def __init__(self, rate_bit_s: float, queue_bytes: int):
        if not rate_bit_s > 0:
            raise ValueError(f"NIC rate_bit_s must be > 0, got {rate_bit_s!r}")
        self.rate_bit_s = rate_bit_s
        self.ns_per_byte = 8.0 * NS_PER_S / rate_bit_s
        self.queue_limit_bytes = queue_bytes
        self.busy_until_ns = 0.0
        self.packets = 0
        self.bytes = 0
        self.drops_queue = 0
        self.dropped_bytes = 0
        self.peak_backlog_bytes = 0

    def admit(self, first_bit_ns: float, wire_bytes: int) -> Optional[float]:
        """When this NIC can start the packet whose first bit reaches it at `first_bit_ns`; None
        (counted) when its queue has no room. The caller sets busy_until_ns to the packet's end."""
        busy_until = self.busy_until_ns
        if busy_until > first_bit_ns:
            backlog = (busy_until - first_bit_ns) / self.ns_per_byte
            if backlog + wire_bytes > self.queue_limit_bytes:  # an idle NIC always takes one
                self.drops_queue += 1
                self.dropped_bytes += wire_bytes
                return None
            if backlog + wire_bytes > self.peak_backlog_bytes:
                self.peak_backlog_bytes = backlog + wire_bytes
            return busy_until
        return first_bit_ns

    def counters(self) -> dict:
        return {"packets": self.packets, "bytes": self.bytes, "drops_queue": self.drops_queue,
                "dropped_bytes": self.dropped_bytes, "peak_backlog_bytes": int(self.peak_backlog_bytes)}


class NodeNic:
    """A node's NIC: `out` for what it sends, `into` for what it receives, each at `rate_bit_s`."""

    __slots__ = ("out", "into")

    def __init__(self, rate_bit_s: float, queue_bytes: int):
        self.out = NicStage(rate_bit_s, queue_bytes)
        self.into = NicStage(rate_bit_s, queue_bytes)


class Scheduler:
    """All pairs' links and one heap of pending deliveries ordered by delivery time.

    Args:
        seed: seed of the RNG used for loss and jitter (same seed, same drops and delays).
        jitter_distribution: "uniform" or "normal" (sigma = jitter/2, clipped to +-jitter).
    """

    def __init__(self, seed: int = 0, jitter_distribution: str = "uniform"):
        if jitter_distribution not in JITTER_DISTRIBUTIONS:
            raise ValueError(f"jitter_distribution {jitter_distribution!r}: use one of {JITTER_DISTRIBUTIONS}")
        self.pairs: dict[Hashable, PairLink] = {}
        self.nics: dict[Hashable, NodeNic] = {}
        self.jitter_distribution = jitter_distribution
        self._rng = random.Random(seed)
        self._heap: list = []
        self._sequence = 0  # tie-break for equal delivery times: keeps insertion order, never compares payloads

    def add_nic(self, node: Hashable, rate_bit_s: float, queue_bytes: int) -> NodeNic:
        """Give `node` a NIC of `rate_bit_s` each way, with a queue of `queue_bytes` each way; add
        it before the pairs that cross it."""
        if node in self.nics:
            raise ValueError(f"NIC of node {node!r} added twice")
        nic = NodeNic(rate_bit_s, queue_bytes)
        self.nics[node] = nic
        return nic

    def add_pair(self, key: Hashable, spec: LinkSpec, src: Hashable = None, dst: Hashable = None) -> PairLink:
        """Create the link for one ordered pair, identified by `key` in later `offer` calls; it
        crosses `src`'s NIC out and `dst`'s NIC in where those nodes have one (`add_nic`)."""
        if key in self.pairs:
            raise ValueError(f"pair {key!r} added twice")
        link = PairLink(spec)
        if src in self.nics:
            link.nic_out = self.nics[src].out
        if dst in self.nics:
            link.nic_in = self.nics[dst].into
        self.pairs[key] = link
        return link

    def offer(self, key: Hashable, packet: Any, destination: Any, wire_bytes: int, now_ns: float) -> bool:
        """Put one packet on a pair's link; False when it is dropped (loss or full queue).

        Args:
            key: the pair, as given to add_pair.
            packet: opaque payload handed back by pop_due.
            destination: opaque destination handed back by pop_due (the runtime uses a TUN fd).
            wire_bytes: bytes the link must serialize for this packet.
            now_ns: current time (ns), from the caller's clock.
        """
        link = self.pairs[key]
        if link.loss_fraction and self._rng.random() < link.loss_fraction:
            link.drops_loss += 1
            link.dropped_bytes += wire_bytes
            return False
        nic = link.nic_out
        if nic is not None:
            # the sender's NIC first: the packet reaches its pair's queue when the NIC starts it
            nic_start = nic.admit(now_ns, wire_bytes)
            if nic_start is None:
                return False
            nic_done = nic_start + wire_bytes * nic.ns_per_byte
            nic.busy_until_ns = nic_done
            nic.packets += 1
            nic.bytes += wire_bytes
            now_ns = nic_start
        busy_until = link.busy_until_ns
        if busy_until > now_ns:
            backlog = (busy_until - now_ns) / link.ns_per_byte
            # An idle link always takes one packet, even a GSO super-packet larger than the whole
            # queue; otherwise a small queue would starve TSO flows forever.
            if backlog + wire_bytes > link.queue_limit_bytes:
                link.drops_queue += 1
                link.dropped_bytes += wire_bytes
                return False
            start = busy_until
            if backlog + wire_bytes > link.peak_backlog_bytes:
                link.peak_backlog_bytes = backlog + wire_bytes
        else:
            start = now_ns
        departure = start + wire_bytes * link.ns_per_byte
        if nic is not None and nic_done > departure:
            departure = nic_done  # cut-through: the slower of the NIC and the pair sets the pace
        link.busy_until_ns = departure
        delivery = departure + link.delay_ns
        if link.jitter_ns:
            delivery += self._jitter(link.jitter_ns)
        if delivery < link.last_delivery_ns:
            # No reordering within a pair: jitter, or a delay lowered by set_spec while packets
            # with the old delay are still in flight.
            delivery = link.last_delivery_ns
        link.last_delivery_ns = delivery
        link.packets += 1
        link.bytes += wire_bytes
        self._sequence += 1
        if link.nic_in is None:
            heapq.heappush(self._heap, (delivery, self._sequence, destination, packet))
        else:
            # held until it arrives at the receiver's NIC: that NIC takes packets in arrival order
            heapq.heappush(self._heap, (delivery, self._sequence, destination, packet, link.nic_in,
                                        wire_bytes, departure - start))
        return True

    def _jitter(self, jitter_ns: float) -> float:
        if self.jitter_distribution == "uniform":
            return self._rng.uniform(-jitter_ns, jitter_ns)
        value = self._rng.gauss(0.0, jitter_ns / 2.0)
        return max(-jitter_ns, min(jitter_ns, value))

    def next_due_ns(self) -> Optional[float]:
        """Delivery time (ns) of the earliest pending packet, or None when nothing is pending."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ns: float) -> list[tuple[float, Any, Any]]:
        """Remove and return (delivery_ns, destination, packet) for every packet due at `now_ns`, in order."""
        heap = self._heap
        due = []
        while heap and heap[0][0] <= now_ns:
            entry = heapq.heappop(heap)
            if len(entry) == 4:
                delivery, _, destination, packet = entry
                due.append((delivery, destination, packet))
                continue
            # arrived at the receiver's NIC in: its first bit came `serialized` ns before its last
            arrived, _, destination, packet, nic, wire_bytes, serialized = entry
            start = nic.admit(arrived - serialized, wire_bytes)
            if start is None:
                continue
            done = max(arrived, start + wire_bytes * nic.ns_per_byte)
            nic.busy_until_ns = done
            nic.packets += 1
            nic.bytes += wire_bytes
            self._sequence += 1
            heapq.heappush(heap, (done, self._sequence, destination, packet))
        return due

    @property
    def deliveries(self) -> list:
        """The pending deliveries, a heap of (delivery_ns, sequence, destination, packet) (and, for
        a packet still to pass its receiver's NIC in, (arrival_ns, sequence, destination, packet,
        nic, wire_bytes, serialized_ns), which pop_due turns into a delivery): the list
        itself, for a hot loop's read-only peeks at ``deliveries[0][0]`` without a call per
        packet; only :meth:`offer` and :meth:`pop_due` change it."""
        return self._heap

    def pending(self) -> int:
        """Packets on their way (accepted, not yet popped)."""
        return len(self._heap)

    def counters(self) -> dict:
        """Counters of every pair, keyed by str(key)."""
        return {str(key): link.counters() for key, link in self.pairs.items()}

    def nic_counters(self) -> dict:
        """Counters of every node's NIC, keyed by str(node): {"out": {...}, "in": {...}}."""
        return {str(node): {"out": nic.out.counters(), "in": nic.into.counters()} for node, nic in self.nics.items()}
