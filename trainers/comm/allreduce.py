"""The all-reduce algorithms of :meth:`Comm.allreduce_async <trainers.comm.base.Comm.allreduce_async>`,
over point-to-point messages: ring, direct exchange, recursive doubling, and ``auto``'s choice
between the first two by size (:data:`DIRECT_MAX_BYTES`); and the all-gathers of
:meth:`Comm.allgather_async <trainers.comm.base.Comm.allgather_async>` on the same exchange
(direct: every rank sends its tensor to every other; ring: n-1 steps around the ring).

Each algorithm is a function of the flat tensor, the reduce op, this rank, the world size and an
``exchange(sends, receives)`` that posts every receive and send of one round and waits for all of
them (the comm binds it to the all-reduce's message tag); it runs on a background thread.
Results are bitwise equal on every rank: chunks and parts are combined in a fixed order.
"""

from __future__ import annotations

from typing import Callable, Literal, Protocol

import torch

ReduceOp = Literal["sum", "avg", "max", "min"]
AllReduceAlgorithm = Literal["auto", "ring", "direct", "recursive_doubling", "gloo"]
ALLREDUCE_ALGORITHMS = ("auto", "ring", "direct", "recursive_doubling", "gloo")
# ``auto`` uses the direct exchange while (world - 1) x tensor bytes (what one rank sends) is at
# most this, and the ring above it. Direct costs about one one-way delay L plus (n-1) S / B of
# sending, the ring 2(n-1) L plus 2(n-1)/n S / B: direct wins while (n-1)(1 - 2/n) S < (2n-3) L B.
# With L = 100 ms, B = 1 Gbit/s, n = 4 that is S < 42 MB, i.e. (n-1) S < 125 MB. Measured on the
# emulated aws-4region WAN (one-way 34-108 ms, 1 Gbit/s per pair, 4 ranks; docs/RESULTS.md,
# bench/bench_allreduce.py): direct is faster than the ring up to 16 MB tensors (0.62x), a tie at
# 32 MB (0.80x and 1.07x in two runs), slower at 64 MB (1.67x): the crossover is ~32 MB per tensor,
# (n-1) S ~ 96 MB (the delay line's CPU makes extra bytes dearer than the model says). 64 MiB
# switches to the ring at ~22 MB per tensor for 4 ranks, on the safe side of the tie.
DIRECT_MAX_BYTES = 64 * 2**20
# Background collectives (all-reduces and all-gathers of allreduce_async / allgather_async) in
# flight at once per rank: more wait, started in launch order, as each running one finishes. The
# default of ``comm.max_in_flight``; the real comm's thread pool and the simulator's launch
# (trainers/sim/comm.py, queueing in virtual time) both obey the comm's setting.
MAX_IN_FLIGHT = 4
BACKGROUND_THREADS = MAX_IN_FLIGHT  # its former name
# The number of distinct message tags background collectives cycle through (far more than can be
# in flight).
BACKGROUND_TAGS = 1024

# One round of messages: (tensor, peer) to send, (tensor, peer) to receive into; returns when all are done.
Exchange = Callable[[list[tuple[torch.Tensor, int]], list[tuple[torch.Tensor, int]]], None]


def _max_(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.maximum(target, other, out=target)


def _min_(target: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return torch.minimum(target, other, out=target)


# In-place combination of a received chunk into the local one, per reduce op ("avg": sum, then divide).
COMBINE = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "max": _max_, "min": _min_}


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s elements: what sending it puts on the wire (payload, no framing)."""
    return tensor.numel() * tensor.element_size()


def resolve_algorithm(requested: str, tensor: torch.Tensor, op: str, world_size: int) -> str:
    """The all-reduce to run for ``tensor``: ``requested``, with ``auto`` resolved by size (see
    :data:`DIRECT_MAX_BYTES`). Checks the arguments."""
    if requested not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"algorithm: {requested!r} is not one of {ALLREDUCE_ALGORITHMS}")
    if op not in COMBINE:
        raise ValueError(f"op: {op!r} is not one of {tuple(COMBINE)}")
    if requested == "gloo":
        return requested
    if not tensor.is_contiguous():
        raise ValueError("allreduce_async: tensor must be contiguous")
    if requested == "auto":
        return "direct" if (world_size - 1) * tensor_nbytes(tensor) <= DIRECT_MAX_BYTES else "ring"
    return requested


def resolve_allgather(requested: str, tensor: torch.Tensor, world_size: int) -> str:
    """The all-gather to run for ``tensor`` under the all-reduce setting ``requested``: gloo (the
    backend's own), direct, or ring; ``auto`` picks direct while (n-1) x bytes <= DIRECT_MAX_BYTES
    (what one rank sends, as for the all-reduce), and recursive_doubling, which has no all-gather
    here, takes the ring. Checks the arguments."""
    if requested not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"algorithm: {requested!r} is not one of {ALLREDUCE_ALGORITHMS}")
    if requested == "gloo":
        return requested
    if not tensor.is_contiguous():
        raise ValueError("allgather_async: tensor must be contiguous")
    if requested == "auto":
        return "direct" if (world_size - 1) * tensor_nbytes(tensor) <= DIRECT_MAX_BYTES else "ring"
    return "direct" if requested == "direct" else "ring"


def allgather_bytes(algorithm: str, n: int, flat: torch.Tensor) -> tuple[int, int]:
    """(bytes sent, bytes received) by any rank in one all-gather of ``flat`` (direct or ring):
    each rank's tensor reaches the n-1 others, once each way."""
    whole = tensor_nbytes(flat)
    return (n - 1) * whole, (n - 1) * whole


def allreduce_bytes(algorithm: str, rank: int, n: int, flat: torch.Tensor) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` in one background all-reduce of ``flat``: exactly
    the tensors it puts on and takes off the transport."""
    size = flat.element_size()
    if algorithm == "ring":
        chunk = [c.numel() * size for c in torch.tensor_split(flat, n)]
        sent = sum(chunk[(rank - step) % n] + chunk[(rank - step + 1) % n] for step in range(n - 1))
        recv = sum(chunk[(rank - step - 1) % n] + chunk[(rank - step) % n] for step in range(n - 1))
        return sent, recv
    whole = flat.numel() * size
    if algorithm == "direct":
        return (n - 1) * whole, (n - 1) * whole
    power = 1 << (n.bit_length() - 1)
    if rank >= power:
        return whole, whole
    rounds = power.bit_length() - 1
    folded = 1 if rank < n - power else 0
    return (rounds + folded) * whole, (rounds + folded) * whole


def ring(flat: torch.Tensor, op: ReduceOp, rank: int, n: int, exchange: Exchange) -> None:
    """Reduce-scatter then all-gather around the ring: each rank sends 2(n-1)/n of the tensor in
    2(n-1) steps (bandwidth-optimal)."""
    chunks = list(torch.tensor_split(flat, n))
    right, left = (rank + 1) % n, (rank - 1) % n
    combine = COMBINE[op]
    scratch = torch.empty_like(chunks[0])
    for step in range(n - 1):  # reduce-scatter: rank r ends owning the reduced chunk r+1
        send_index, recv_index = (rank - step) % n, (rank - step - 1) % n
        incoming = scratch[: chunks[recv_index].numel()]
        exchange([(chunks[send_index], right)], [(incoming, left)])
        combine(chunks[recv_index], incoming)
    for step in range(n - 1):  # all-gather: pass the reduced chunks around the ring
        send_index, recv_index = (rank - step + 1) % n, (rank - step) % n
        exchange([(chunks[send_index], right)], [(chunks[recv_index], left)])
    if op == "avg":
        flat.div_(n)


def direct(flat: torch.Tensor, op: ReduceOp, rank: int, n: int, exchange: Exchange) -> None:
    """Every rank sends its tensor to every other and sums all n in rank order: one one-way delay,
    (n-1) tensors sent."""
    peers = [r for r in range(n) if r != rank]
    parts = {r: torch.empty_like(flat) for r in peers}
    parts[rank] = flat.clone()
    exchange([(parts[rank], r) for r in peers], [(parts[r], r) for r in peers])
    flat.copy_(parts[0])
    for r in range(1, n):  # in rank order: the same bits on every rank
        COMBINE[op](flat, parts[r])
    if op == "avg":
        flat.div_(n)


def recursive_doubling(flat: torch.Tensor, op: ReduceOp, rank: int, n: int, exchange: Exchange) -> None:
    """log2(n) rounds of whole-tensor exchange; the extra ranks of a non-power-of-two world fold
    into the lower ones first and get the result back at the end."""
    power = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    extra = n - power
    combine = COMBINE[op]
    incoming = torch.empty_like(flat)
    if rank >= power:  # fold into rank - power, get the result back at the end
        exchange([(flat, rank - power)], [])
        exchange([], [(flat, rank - power)])
    else:
        if rank < extra:
            exchange([], [(incoming, rank + power)])
            combine(flat, incoming)
        distance = 1
        while distance < power:
            partner = rank ^ distance
            exchange([(flat, partner)], [(incoming, partner)])
            combine(flat, incoming)  # IEEE a + b == b + a: both partners get the same bits
            distance <<= 1
        if rank < extra:
            exchange([(flat, rank + power)], [])
    if op == "avg":
        flat.div_(n)


class Codec(Protocol):
    """What :func:`ring_coded` needs of a code (trainers.compression's compressors are ones): a
    payload of fixed size for a given number of elements, and its decoding."""

    name: str

    def payload_bytes(self, numel: int) -> int: ...

    def encode(self, flat: torch.Tensor) -> torch.Tensor: ...

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor: ...


CODED_OPS = ("sum", "avg")


def coded_payload_templates(codec: Codec, flat: torch.Tensor, n: int) -> list[torch.Tensor]:
    """An empty receive buffer per ring chunk of ``flat`` (n chunks, as :func:`ring` splits it),
    shaped and typed as ``codec``'s payload of that chunk."""
    sizes = [chunk.numel() for chunk in torch.tensor_split(flat, n)]
    shapes: dict[int, torch.Tensor] = {}
    for size in set(sizes):
        shapes[size] = codec.encode(torch.zeros(size, dtype=torch.float32, device=flat.device))
    return [torch.empty_like(shapes[size]) for size in sizes]


def coded_chunk_bytes(codec: Codec, flat: torch.Tensor, n: int) -> list[int]:
    """The payload bytes of each of the n ring chunks of ``flat`` (the codec's size rule: nothing
    is encoded)."""
    return [codec.payload_bytes(chunk.numel()) for chunk in torch.tensor_split(flat, n)]


def ring_coded_bytes(rank: int, n: int, flat: torch.Tensor, codec: Codec) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` in one :func:`ring_coded` of ``flat``: the payloads
    of the chunks it sends and receives, 2(n-1) of each."""
    payload = coded_chunk_bytes(codec, flat, n)
    sent = sum(payload[(rank - step) % n] + payload[(rank - step + 1) % n] for step in range(n - 1))
    recv = sum(payload[(rank - step - 1) % n] + payload[(rank - step) % n] for step in range(n - 1))
    return sent, recv


def ring_coded(flat: torch.Tensor, codec: Codec, op: str, rank: int, n: int, exchange: Exchange) -> None:
    """:func:`ring` with every message encoded by ``codec`` (INTELLECT-1's int8 ring all-reduce):
    each rank sends 2(n-1)/n of the tensor in the code's size, in 2(n-1) steps.

    Reduce-scatter: at each step a rank encodes its partial sum of one chunk and sends it on; the
    receiver adds the decoded payload to its own float32 chunk (so the sum is kept in float32 and
    re-encoded at every hop: n-1 roundings on the way). Then the chunk's owner divides by n (avg)
    and encodes the result once; the all-gather passes these payloads around unchanged and every
    rank, the owner too, decodes the same payloads: the result is the same bits on every rank.
    :func:`ring_coded_reference` computes the same numbers from all ranks' inputs in one place.

    Args:
        flat: 1-D float tensor, overwritten with the result (float32 arithmetic, cast back).
        codec: the code of every message (encode / decode; payload size fixed by the length).
        op: sum | avg.
    """
    chunks = list(torch.tensor_split(flat, n))
    work = [chunk.to(torch.float32) for chunk in chunks]
    right, left = (rank + 1) % n, (rank - 1) % n
    incoming = coded_payload_templates(codec, flat, n)
    for step in range(n - 1):  # reduce-scatter: rank r ends owning the reduced chunk r+1
        send_index, recv_index = (rank - step) % n, (rank - step - 1) % n
        exchange([(codec.encode(work[send_index]), right)], [(incoming[recv_index], left)])
        work[recv_index] = work[recv_index] + codec.decode(incoming[recv_index], work[recv_index].numel(),
                                                           torch.float32)
    owned = (rank + 1) % n
    payloads = incoming
    payloads[owned] = codec.encode(work[owned] / n if op == "avg" else work[owned])
    for step in range(n - 1):  # all-gather: pass the owners' payloads around the ring
        send_index, recv_index = (rank - step + 1) % n, (rank - step) % n
        exchange([(payloads[send_index], right)], [(payloads[recv_index], left)])
    for chunk, payload in zip(chunks, payloads):
        chunk.copy_(codec.decode(payload, chunk.numel(), torch.float32))


def ring_coded_reference(inputs: list[torch.Tensor], codec: Codec, op: str) -> torch.Tensor:
    """What :func:`ring_coded` leaves on every rank, from every rank's 1-D ``inputs`` (in rank
    order), computed in one place with the same operations in the same order (the simulator's
    result, and the tests' reference)."""
    n = len(inputs)
    parts = [list(torch.tensor_split(x.to(torch.float32), n)) for x in inputs]
    result = []
    for c in range(n):  # chunk c starts at rank c and is added to at ranks c+1, ..., c+n-1
        partial = parts[c][c]
        for k in range(1, n):
            holder = (c + k) % n
            partial = parts[holder][c] + codec.decode(codec.encode(partial), partial.numel(), torch.float32)
        final = codec.encode(partial / n if op == "avg" else partial)
        result.append(codec.decode(final, partial.numel(), torch.float32))
    return torch.cat(result).to(inputs[0].dtype)


def allgather_direct(parts: list[torch.Tensor], rank: int, n: int, exchange: Exchange) -> None:
    """Every rank sends its part (``parts[rank]``) to every other at once: one one-way delay,
    (n-1) parts sent."""
    peers = [r for r in range(n) if r != rank]
    exchange([(parts[rank], r) for r in peers], [(parts[r], r) for r in peers])


def allgather_ring(parts: list[torch.Tensor], rank: int, n: int, exchange: Exchange) -> None:
    """n-1 steps around the ring: at step s, pass part (rank - s) on to the right and take part
    (rank - s - 1) from the left; (n-1) parts sent, bandwidth-optimal, (n-1) one-way delays."""
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(n - 1):
        exchange([(parts[(rank - step) % n], right)], [(parts[(rank - step - 1) % n], left)])


# The background all-gathers by name (the setting's "gloo" is the backend's own all_gather).
ALLGATHER_ALGORITHMS: dict[str, Callable[[list[torch.Tensor], int, int, Exchange], None]] = {
    "direct": allgather_direct, "ring": allgather_ring}


# The background algorithms by name ("gloo" is the backend's own collective, not one of these;
# ring_coded, the ring with encoded messages, is Comm.allreduce_coded_async's).
ALGORITHMS: dict[str, Callable[[torch.Tensor, ReduceOp, int, int, Exchange], None]] = {
    "ring": ring, "direct": direct, "recursive_doubling": recursive_doubling}
