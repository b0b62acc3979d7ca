"""When each rank finishes a collective, from when each entered it: closed-form models over the
network's per-pair one-way delay ``lat[src, dst]`` (s) and single-flow rate ``rate[src, dst]``
(bytes/s), following the message pattern of the comm layer's own algorithms (trainers/comm/allreduce.py).

Every message moves as gloo's transport moves it (see ``trainers.sim.comm.Exchange``): once the
sender has both posted it and heard that the receiver posted its receive, i.e. from
``max(sender ready, receiver ready + delay(receiver -> sender))``, then one delay and its bytes.

Each model walks the algorithm's steps with vectors over ranks (a step of rank r can start when r
finished its previous one and its peer's message of this step has arrived), so its cost is
O(steps x ranks) numpy work, not one event per message: a ring all-reduce over 1,024 ranks is
2,046 vector steps.

Each node's NIC (the network's ``nic``, each way) is a work-conserving server of a collective
step's messages (:meth:`FluidNetwork.nic_transfer`): a sender's NIC is shared by its messages
from each one's start (processor sharing, as the delay line interleaves their packets), a
receiver's NIC is done at the end of its busy period, and no message moves faster than its
connection alone. So a direct exchange of n ranks puts n - 1 copies of the tensor through every
NIC each way, but the copies to near peers (whose "ready" notices arrive first) leave before the
far peers' begin, as on tun; a ring sends one chunk at a time. Without NICs (``nic`` None) a
message moves at its pair's single-flow rate. What is not shared: the NICs between collectives
in flight at the same time (DTS with several all-reduces in flight: each is charged as if it had
the NICs to itself, which under-charges only where the NICs bind), and between a collective and
the fluid network's point-to-point flows (no algorithm keeps both in flight past its start-up
broadcast).
"""

from __future__ import annotations

import numpy as np


def _nics(network, nbytes: float) -> bool:
    """Whether the messages go through the nodes' NICs (a network with NICs, a message with bytes)."""
    return getattr(network, "nic", None) is not None and nbytes > 0


def _ring(entered: np.ndarray, network, chunk_bytes: float, steps: int) -> np.ndarray:
    n = len(entered)
    lat, rate = network.latency_s, network.connection_cap()  # without NICs (with them: nic_transfer)
    ranks = np.arange(n)
    left, right = (ranks - 1) % n, (ranks + 1) % n
    with np.errstate(divide="ignore"):
        send_in = chunk_bytes / rate[left, ranks]        # left neighbour -> me
        send_out = chunk_bytes / rate[ranks, right]
    lat_in, back_from_right = lat[left, ranks], lat[right, ranks]
    done = entered.astype(float).copy()
    for _ in range(steps):
        # my send to the right starts once I am ready and have heard the right is
        start = np.maximum(done, done[right] + back_from_right)
        start = start + network.slow_start_s(ranks, right, chunk_bytes, start)
        if _nics(network, chunk_bytes):
            sent, reached = network.nic_transfer(ranks, right, start, chunk_bytes)
            done = np.maximum(sent, reached[left])
            continue
        arrived = start[left] + lat_in + send_in
        done = np.maximum(start + send_out, arrived)
    return done


def ring_allreduce(entered: np.ndarray, network, nbytes: float) -> np.ndarray:
    """Reduce-scatter then all-gather around the ring: 2(n-1) steps of nbytes / n."""
    n = len(entered)
    return entered.copy() if n == 1 else _ring(entered, network, nbytes / n, 2 * (n - 1))


def ring_allgather(entered: np.ndarray, network, nbytes: float) -> np.ndarray:
    """n-1 steps, each passing one rank's whole tensor to the right (trainers/comm/allreduce.py
    ``allgather_ring``; gloo's own all_gather is modelled by it too)."""
    n = len(entered)
    return entered.copy() if n == 1 else _ring(entered, network, nbytes, n - 1)


def direct_allgather(entered: np.ndarray, network, nbytes: float) -> np.ndarray:
    """Every rank sends its tensor to every other at once (trainers/comm/allreduce.py
    ``allgather_direct``): the direct all-reduce's messages exactly (it only sums what arrived),
    so its time is :func:`direct`'s."""
    return direct(entered, network, nbytes)


def direct(entered: np.ndarray, network, nbytes: float) -> np.ndarray:
    """Every rank sends its tensor to every other at once (the direct exchange; with 0 bytes, a
    barrier): a rank is done when its sends are out and every peer's tensor has arrived."""
    n = len(entered)
    if n == 1:
        return entered.copy()
    lat = network.latency_s
    start = np.maximum(entered[:, None], entered[None, :] + lat.T)   # [src, dst]: dst's notice reached src
    src, dst = np.nonzero(~np.eye(n, dtype=bool))
    start[src, dst] += network.slow_start_s(src, dst, nbytes, start[src, dst])
    if _nics(network, nbytes):
        left, reached = network.nic_transfer(src, dst, start[src, dst], nbytes)
        sent, arrived = np.full(n, -np.inf), np.full(n, -np.inf)
        np.maximum.at(sent, src, left)
        np.maximum.at(arrived, dst, reached)
        return np.maximum(np.maximum(entered, sent), arrived)
    with np.errstate(divide="ignore", invalid="ignore"):  # without NICs: each pair's connection alone
        transfer = np.where(nbytes > 0, nbytes / network.connection_cap(), 0.0)
    np.fill_diagonal(transfer, 0.0)
    arrive = start + lat + transfer
    np.fill_diagonal(arrive, -np.inf)
    np.fill_diagonal(start, -np.inf)
    sent = (start + transfer).max(axis=1)
    return np.maximum(np.maximum(entered, sent), arrive.max(axis=0))


def recursive_doubling(entered: np.ndarray, network, nbytes: float) -> np.ndarray:
    """log2(n) rounds of whole-tensor exchange with rank ^ 2^k; extra ranks fold in first and get
    the result back at the end (trainers/comm/allreduce.py ``recursive_doubling``)."""
    n = len(entered)
    lat, rate = network.latency_s, network.connection_cap()  # without NICs (with them: nic_transfer)
    done = entered.astype(float).copy()
    if n == 1:
        return done
    with np.errstate(divide="ignore"):
        cost = lat + nbytes / rate
    power = 1 << (n.bit_length() - 1)
    extra = n - power
    def message(src_ready, dst_ready, src, dst):
        start = np.maximum(src_ready, dst_ready + lat[dst, src])
        start = start + network.slow_start_s(src, dst, nbytes, start)
        if _nics(network, nbytes):
            return network.nic_transfer(src, dst, start, nbytes)[1]
        return start + cost[src, dst]

    for r in range(power, n):  # fold: r sends to r - power
        done[r - power] = max(done[r - power], float(message(done[r], done[r - power], r, r - power)))
    distance = 1
    while distance < power:
        ranks = np.arange(power)
        partner = ranks ^ distance
        arrived = message(done[partner], done[:power], partner, ranks)
        done[:power] = np.maximum(done[:power], arrived)
        distance <<= 1
    for r in range(power, power + extra):  # the result back to the folded ranks
        done[r] = max(done[r], float(message(done[r - power], done[r], r - power, r)))
    return done


def broadcast(entered: np.ndarray, network, nbytes: float, src: int) -> np.ndarray:
    """A flat root: ``src`` sends the tensor to every other rank at once."""
    n = len(entered)
    if n == 1:
        return entered.copy()
    lat = network.latency_s
    start = np.maximum(entered[src], entered + lat[:, src])
    others = np.arange(n) != src
    start[others] += network.slow_start_s(np.full(n - 1, src), np.arange(n)[others], nbytes, start[others])
    if _nics(network, nbytes):
        sent, reached = network.nic_transfer(np.full(n - 1, src), np.arange(n)[others], start[others], nbytes)
        done = entered.astype(float).copy()
        done[others] = np.maximum(entered[others], reached)
        done[src] = max(entered[src], float(sent.max()))
        return done
    with np.errstate(divide="ignore", invalid="ignore"):  # without NICs: each connection alone
        transfer = np.where(nbytes > 0, nbytes / network.connection_cap()[src], 0.0)
    transfer[src] = 0.0
    arrive = start + lat[src] + transfer
    done = np.maximum(entered, arrive)
    done[src] = max(entered[src], float((start + transfer)[others].max()))
    return done
