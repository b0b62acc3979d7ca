"""Traffic between two readings of a backend's per-pair counters (`Backend.counters(fresh=True)`).

What the emulated wire carried, measured by the shaper itself: IP packets with their headers,
retransmissions, connection set-up and control messages included. Compare with the bytes a trainer
counts from tensor sizes to see what the wire adds.
"""

from __future__ import annotations

COUNTED = ("packets", "bytes", "drops_queue", "drops_loss", "dropped_bytes")


def pair_deltas(before: list[dict], after: list[dict]) -> list[dict]:
    """Per ordered pair, `after - before` of every counter in COUNTED (pairs missing before count from 0)."""
    start = {(row["src"], row["dst"]): row for row in before}
    deltas = []
    for row in after:
        base = start.get((row["src"], row["dst"]), {})
        deltas.append({"src": row["src"], "dst": row["dst"],
                       **{k: row.get(k, 0) - base.get(k, 0) for k in COUNTED if k in row}})
    return deltas


def traffic_by_node(before: list[dict], after: list[dict]) -> dict[str, dict]:
    """Per node: packets and bytes it put on the wire, and took from it (what its peers' links
    accepted towards it), between the two readings, and the drops of what it sent."""
    nodes: dict[str, dict] = {}

    def entry(name: str) -> dict:
        return nodes.setdefault(name, {"bytes_sent": 0, "packets_sent": 0, "bytes_received": 0,
                                       "packets_received": 0, "drops_sent": 0})

    for delta in pair_deltas(before, after):
        sender, receiver = entry(delta["src"]), entry(delta["dst"])
        sender["bytes_sent"] += delta.get("bytes", 0)
        sender["packets_sent"] += delta.get("packets", 0)
        sender["drops_sent"] += delta.get("drops_queue", 0) + delta.get("drops_loss", 0)
        receiver["bytes_received"] += delta.get("bytes", 0)
        receiver["packets_received"] += delta.get("packets", 0)
    return nodes
