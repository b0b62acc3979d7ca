"""The simulated network of ``--backend sim``: a fluid model of the plan's links, no kernel.

The same plan the tun and tc backends build (per-pair one-way delay, rate, jitter, loss; the
TCP buffer limit) becomes matrices over the nodes, indexed by rank. A message is a *flow*: it
starts when the sender posts it, shares bandwidth with the flows in flight while its bytes are
sent, and is delivered one one-way delay (plus jitter) after its last byte left. Sharing is
max-min fair (progressive filling, :func:`max_min_rates`) over these resources:

* each ordered pair's path (its ``rate``): flows between the same two nodes share it, as they
  share one delay-line link on tun or one netem class on tc;
* each node's NIC, one way out and one way in (the plan's ``Node.nic_rate_bit_s``, from the
  topology's ``nic:``, or one rate for every node given to :meth:`FluidNetwork.from_plan`): a
  node's flows to many peers share its NIC out, the flows from many peers share its NIC in.

Each flow is also capped by what one TCP connection can do on its path: a window of at most the
plan's TCP buffer per round trip, and with loss the Mathis et al. response function
``MSS / RTT x 1.22 / sqrt(p)``. Each ordered pair is one long-lived connection with a congestion
window: a message needs as many round trips of slow start as its segments take from the window
it finds (:meth:`FluidNetwork.slow_start_s`), and a connection's window halves for every RTO
(RTT + 200 ms) it was idle, down to the initial 10 segments, as Linux's tcp_cwnd_restart does
with net.ipv4.tcp_slow_start_after_idle = 1 (the default); with the plan's ``node_sysctls``
setting it to 0 the window is kept across idleness (``slow_start_after_idle``). The pacing of a
window after a round trip idle is kept either way (it is not slow start). The congestion control
is not modelled, except that BBR in the plan's ``node_sysctls`` turns the restart after idle off
(Linux skips it for BBR: docs/SCENARIOS.md). Queues are
not modelled: delay is the link's, never a standing queue's.

Pure: numpy arrays in, times out. The event loop that drives it (``trainers.sim``) asks for the
next completion with :meth:`FluidNetwork.next_completion` and advances with :meth:`advance`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .linkspec import LinkSpec
from .plan import Plan

MSS_BYTES = 1448          # TCP payload per segment on a 1500-byte MTU (timestamps on)
INITIAL_WINDOW_SEGMENTS = 10  # Linux's initial congestion window (RFC 6928)
RTO_MIN_S = 0.2           # Linux's tcp_rto_min: the RTO of a steady path is about RTT + 200 ms
MATHIS_C = math.sqrt(1.5)  # ~1.22, the constant of the Mathis response function (periodic loss)
INFINITE = float("inf")


@dataclass
class Flow:
    """One message in flight."""

    flow_id: int
    src: int
    dst: int
    size: float            # bytes
    started: float         # virtual s
    remaining: float       # bytes not yet sent
    rate: float = 0.0      # bytes/s now
    token: object = None   # the caller's, handed back on completion


@dataclass
class Delivery:
    """A flow whose last byte left at ``sent_at`` and that arrives at ``arrives_at``."""

    flow_id: int
    src: int
    dst: int
    size: float
    started: float
    sent_at: float
    arrives_at: float
    token: object = None


def max_min_rates(resource_of: list[np.ndarray], capacity: np.ndarray, flow_cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates by progressive filling.

    Args:
        resource_of: per resource kind, an int array (one entry per flow) naming the resource the
            flow crosses (index into ``capacity``), or -1 where it crosses none of that kind.
        capacity: every resource's capacity (bytes/s); 0 stalls its flows.
        flow_cap: each flow's own ceiling (bytes/s; inf: none).

    Returns each flow's rate. Each round freezes, at their fair share, the flows of every resource
    whose share is no larger than any other constraint of those flows (and the flows whose own cap
    is their tightest constraint); at least one resource or flow freezes per round.
    """
    flows = len(flow_cap)
    rates = np.zeros(flows)
    if flows == 0:
        return rates
    frozen = np.zeros(flows, dtype=bool)
    remaining = capacity.astype(float).copy()
    while not frozen.all():
        live = ~frozen
        counts = np.zeros(len(capacity))
        for res in resource_of:
            used = live & (res >= 0)
            counts += np.bincount(res[used], minlength=len(capacity))
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(counts > 0, np.maximum(remaining, 0.0) / np.maximum(counts, 1), INFINITE)
        level = flow_cap.astype(float).copy()
        for res in resource_of:
            crossing = res >= 0
            level[crossing] = np.minimum(level[crossing], share[res[crossing]])
        level[frozen] = INFINITE
        # A resource is settled when every live flow on it has its share as level; a flow is
        # settled when its level is set by a settled resource or by its own cap.
        settle = np.zeros(flows, dtype=bool)
        capped = live & (flow_cap <= level)
        settle |= capped
        for res in resource_of:
            crossing = live & (res >= 0)
            at_share = crossing & (level >= share[np.where(res >= 0, res, 0)] * (1 - 1e-12))
            # resources where some live flow has a lower level than the share are not settled
            below = np.zeros(len(capacity), dtype=bool)
            below[res[crossing & ~at_share]] = True
            settle |= at_share & ~below[np.where(res >= 0, res, 0)]
        if not settle.any():  # numerical corner: freeze the global minimum
            settle = live & (level <= level[live].min() * (1 + 1e-12))
        rates[settle] = level[settle]
        frozen |= settle
        for res in resource_of:
            used = settle & (res >= 0)
            np.subtract.at(remaining, res[used], rates[used])
    return rates


@dataclass
class FluidNetwork:
    """The plan's links as matrices over ranks, and the flows in flight (see the module docstring).

    Args:
        latency_s: one-way delay, [src, dst] (s).
        rate: path rate, [src, dst] (bytes/s).
        jitter_s: one-way jitter, [src, dst] (s): each message's delay is drawn uniformly within
            +-jitter (netem's default distribution), never below zero, never overtaking the
            previous message of its pair (TCP delivers in order).
        loss: loss fraction, [src, dst]; 1.0: the path is down (its flows stall).
        tcp_window: bytes one connection may have in flight (the plan's TCP buffer limit).
        nic: each node's NIC rate each way (bytes/s): an array over ranks, one number for every
            node, or None (no NIC limit).
        region_of: each rank's region (for :meth:`set_link`).
    """

    latency_s: np.ndarray
    rate: np.ndarray
    jitter_s: np.ndarray
    loss: np.ndarray
    tcp_window: float
    nic: Optional[np.ndarray] = None
    region_of: tuple = ()
    seed: int = 0
    tcp: bool = True  # slow start and pacing per connection (False: the fluid alone, for tests of it)
    # net.ipv4.tcp_slow_start_after_idle: a connection idle for an RTO restarts from a smaller window
    slow_start_after_idle: bool = True
    _base: dict = field(default_factory=dict, repr=False)
    _flows: dict = field(default_factory=dict, repr=False)
    _next_id: int = 0
    _now: float = 0.0
    _last_arrival: dict = field(default_factory=dict, repr=False)
    _rng: Optional[np.random.Generator] = field(default=None, repr=False)
    _cap: Optional[np.ndarray] = field(default=None, repr=False)  # connection_cap(), until a link changes

    def __post_init__(self) -> None:
        n = len(self.latency_s)
        if self.nic is not None:
            self.nic = np.broadcast_to(np.asarray(self.nic, dtype=float), (n,)).copy()
        self._cwnd = np.full((n, n), float(INITIAL_WINDOW_SEGMENTS))  # segments, per connection
        self._last_send = np.full((n, n), -np.inf)                     # when each last sent data
        # the busy period each connection is in (messages queued on one byte stream): when it
        # began, the window it began from, the segments queued since, whether it began after a
        # round trip idle (its first window paced)
        self._busy_from = np.full((n, n), -np.inf)
        self._busy_window = np.full((n, n), float(INITIAL_WINDOW_SEGMENTS))
        self._busy_segments = np.zeros((n, n))
        self._busy_after_idle = np.zeros((n, n), dtype=bool)
        self._rng = np.random.default_rng(self.seed)
        self._base = {"latency_s": self.latency_s.copy(), "rate": self.rate.copy(),
                      "jitter_s": self.jitter_s.copy(), "loss": self.loss.copy()}

    @property
    def size(self) -> int:
        return len(self.latency_s)

    @classmethod
    def from_plan(cls, plan: Plan, nic_rate_bit_s: Optional[float] = None, seed: int = 0) -> "FluidNetwork":
        """The network of ``plan`` (ranks in plan order) with each node's NIC from the plan;
        ``nic_rate_bit_s``: every node's NIC instead (a scenario's ``sim.nic``). A plan written
        before nodes had NICs (its nodes' ``nic_rate_bit_s`` None) has no NIC limit."""
        regions = sorted({node.region for node in plan.nodes})
        index = {name: i for i, name in enumerate(regions)}
        r = len(regions)
        lat, rate, jit, loss = (np.zeros((r, r)) for _ in range(4))
        for (src, dst), spec in plan.region_links.items():
            i, j = index[src], index[dst]
            lat[i, j] = spec.one_way_delay_ms / 1000.0
            rate[i, j] = spec.rate_bit_s / 8.0
            jit[i, j] = spec.jitter_ms / 1000.0
            loss[i, j] = spec.loss_fraction
        of = np.array([index[node.region] for node in sorted(plan.nodes, key=lambda n: n.rank)])
        grid = np.ix_(of, of)
        latency_s = lat[grid]  # a copy (fancy indexing): two ranks of one region are 0 apart
        np.fill_diagonal(latency_s, 0.0)
        ranked = sorted(plan.nodes, key=lambda n: n.rank)
        if nic_rate_bit_s:
            nic = np.full(len(ranked), nic_rate_bit_s / 8.0)
        elif all(node.nic_rate_bit_s is not None for node in ranked):
            nic = np.array([node.nic_rate_bit_s / 8.0 for node in ranked])
        else:
            nic = None
        net = cls(latency_s=latency_s, rate=rate[grid], jitter_s=jit[grid], loss=loss[grid],
                  tcp_window=float(plan.tcp_buffer_max_bytes), nic=nic,
                  region_of=tuple(regions[i] for i in of), seed=seed,
                  slow_start_after_idle=plan.slow_start_after_idle())
        return net

    # -- the path's properties ----------------------------------------------------------------

    def rtt_s(self) -> np.ndarray:
        """Round-trip time per pair: the delay there plus back."""
        return self.latency_s + self.latency_s.T

    def connection_cap(self) -> np.ndarray:
        """What one TCP connection can carry per pair (bytes/s): window per RTT, Mathis with loss.
        Cached until a link changes (do not modify the array returned)."""
        if self._cap is None:
            self._cap = self._connection_cap()
        return self._cap

    def _connection_cap(self) -> np.ndarray:
        rtt = np.maximum(self.rtt_s(), 1e-6)
        cap = np.minimum(self.rate, self.tcp_window / rtt)
        lossy = (self.loss > 0) & (self.loss < 1)
        if lossy.any():
            mathis = MSS_BYTES / rtt * MATHIS_C / np.sqrt(np.where(lossy, self.loss, 1.0))
            cap = np.where(lossy, np.minimum(cap, mathis), cap)
        return np.where(self.loss >= 1.0, 0.0, cap)

    def nic_transfer(self, src, dst, start, nbytes: float) -> tuple[np.ndarray, np.ndarray]:
        """When the messages of one collective step, ``nbytes`` each, that ``src`` starts sending
        to ``dst`` at ``start`` (arrays over messages) have left their senders, and when each
        message's receiver has taken in all of them (the collectives' NIC model; needs ``nic``).

        Each NIC is a work-conserving server each way, shared by the messages in it as the delay
        line's NIC stage interleaves their packets: a sender's NIC is processor-shared by its
        messages from each one's start (:meth:`_processor_sharing`), and no message leaves sooner
        than its connection alone could send it (``nbytes / connection_cap``); each message's
        bytes reach the receiver's NIC from one delay after it began to leave, and the receiver's
        NIC is done at the end of its busy period (``max_k (a_k + bytes of the messages whose first
        byte arrives from a_k on / NIC)``, and no earlier than the last byte's arrival). Two
        approximations: the busy period leaves out the tails of earlier, slower messages still
        arriving after a_k (a lower bound), and a sender's share that a slower connection cannot
        use is not given to its other messages (not fully work-conserving). So a node's copies to near peers leave
        before the far peers' "ready" notices arrive, as on tun (issue 21: sync's step at 16 nodes
        with 20 Mbit/s NICs; docs/RESULTS.md section 10). Only this call's messages share the
        NICs: collectives in flight at once, and the fluid network's point-to-point flows, are
        each charged as if they had the NICs to themselves."""
        src, dst = np.atleast_1d(src).astype(int), np.atleast_1d(dst).astype(int)
        start = np.broadcast_to(start, src.shape).astype(float)
        with np.errstate(divide="ignore"):
            alone = nbytes / self.connection_cap()[src, dst]
            out_s = nbytes / self.nic  # per node
        left = np.maximum(self._processor_sharing(src, start, out_s), start + alone)
        lat = self.latency_s[src, dst]
        first, last = start + lat, left + lat  # its first and last byte at the receiver's NIC
        # the receiver's busy period: from each message's first byte, the bytes of the messages
        # whose first byte comes at or after it
        done = np.full(self.size, -np.inf)
        order = np.lexsort((-first, dst))                 # per receiver, latest first
        sorted_dst = dst[order]
        group = np.r_[0, np.flatnonzero(np.diff(sorted_dst)) + 1]
        behind = np.arange(len(order)) - np.repeat(group, np.diff(np.r_[group, len(order)])) + 1
        np.maximum.at(done, sorted_dst, first[order] + behind * nbytes / self.nic[sorted_dst])
        np.maximum.at(done, dst, last)
        return left, done[dst]

    @staticmethod
    def _processor_sharing(node: np.ndarray, start: np.ndarray, service: np.ndarray) -> np.ndarray:
        """When each job ends on its node's processor-shared server: jobs of one node all need
        ``service[node]`` seconds alone and each gets 1/N of the server while N are in it (so
        they end in the order they start). Vectorised over nodes: one pass per event (a start
        or an end) of the busiest node's queue, with each node's virtual time (service
        seconds each job in it has had)."""
        if not len(node):
            return np.empty(0)
        order = np.lexsort((start, node))
        sorted_node, sorted_start = node[order], start[order]
        first = np.r_[0, np.flatnonzero(np.diff(sorted_node)) + 1]
        sizes = np.diff(np.r_[first, len(order)])
        nodes, m = sorted_node[first], int(sizes.max())
        starts = np.full((len(nodes), m + 1), np.inf)     # per node, its jobs' starts in order
        position = np.arange(len(order)) - np.repeat(first, sizes)
        row = np.repeat(np.arange(len(nodes)), sizes)
        starts[row, position] = sorted_start
        tau = service[nodes]
        ends = np.full((len(nodes), m), np.inf)
        target = np.full((len(nodes), m + 1), np.inf)     # virtual time at which each job ends
        t = starts[:, 0].copy()
        v = np.zeros(len(nodes))
        active = np.zeros(len(nodes))
        head = np.zeros(len(nodes), dtype=int)            # the oldest job still in
        nxt = np.zeros(len(nodes), dtype=int)             # the next job to start
        rows = np.arange(len(nodes))
        for _ in range(2 * m):
            arrival = starts[rows, nxt]
            with np.errstate(invalid="ignore"):
                ending = np.where(active > 0, t + (target[rows, head] - v) * active, np.inf)
            event = np.minimum(arrival, ending)
            live = np.isfinite(event)
            if not live.any():
                break
            dt = np.where(live, event - t, 0.0)
            v = v + np.where(active > 0, dt / np.maximum(active, 1), 0.0)
            t = np.where(live, event, t)
            ends_now = live & (ending <= arrival)
            starts_now = live & ~ends_now
            ends[rows[ends_now], head[ends_now]] = t[ends_now]
            active[ends_now] -= 1
            head[ends_now] += 1
            target[rows[starts_now], nxt[starts_now]] = v[starts_now] + tau[starts_now]
            active[starts_now] += 1
            nxt[starts_now] += 1
        out = np.empty(len(order))
        out[order] = ends[row, position]
        return out

    def slow_start_s(self, src, dst, size, start) -> np.ndarray:
        """Extra seconds slow start adds to messages of ``size`` bytes that ``src`` starts sending
        to ``dst`` at ``start`` (arrays, or numbers; call in the order of ``start`` per pair), and
        the connections' windows after them.

        A connection's window halves per RTO of idleness, down to the initial one (not at all
        where ``slow_start_after_idle`` is off). A message of S
        segments sent from window W needs k = ceil(log2(S / W + 1)) flights (slow start doubles
        the window each round trip), i.e. k - 1 round trips more than one flight, counted only
        until the window covers the path's bandwidth-delay product (from then the rate limits).

        Each ordered pair is one connection, one byte stream: a message posted while the
        connection is still sending an earlier one's flights (its *busy period*) queues behind
        it, and its last segment leaves in the flight that the busy period's cumulative segments
        need from the window the period began with. Eight 14-segment messages posted at once on
        a fresh connection leave in flights 2, 2, 3, 3, 3, 4, 4, 4, not all in flight 2 (DTS with
        8 all-reduces in flight: measured on tun, their completions spread over two more RTTs).
        """
        src, dst = np.atleast_1d(src).astype(int), np.atleast_1d(dst).astype(int)
        size, start = np.broadcast_to(size, src.shape).astype(float), np.broadcast_to(start, src.shape).astype(float)
        if not self.tcp:
            return np.zeros(len(src))
        if np.bincount(src * self.size + dst, minlength=self.size * self.size).max(initial=0) > 1:
            raise ValueError("slow_start_s: one call takes each (src, dst) pair once (call again for the next message)")
        rtt = self.latency_s[src, dst] + self.latency_s[dst, src]
        bdp = np.maximum(1.0, np.ceil(self.rate[src, dst] * rtt / MSS_BYTES))
        segments = np.maximum(1.0, np.ceil(size / MSS_BYTES))
        queued = start <= self._last_send[src, dst]

        # a new busy period: the window the connection has after its idleness
        cwnd = self._cwnd[src, dst]
        idle = start - self._last_send[src, dst]
        # tcp_cwnd_restart: the window halves for every RTO the connection was idle, down to 10
        rto = rtt + RTO_MIN_S
        halvings = np.floor(np.clip(idle / rto, 0.0, 60.0)) if self.slow_start_after_idle else np.zeros(len(src))
        cwnd = np.where(halvings >= 1, np.maximum(INITIAL_WINDOW_SEGMENTS, cwnd / 2.0 ** halvings), cwnd)
        began = np.where(queued, self._busy_from[src, dst], start)
        window = np.where(queued, self._busy_window[src, dst], cwnd)
        after_idle = np.where(queued, self._busy_after_idle[src, dst], idle > rtt)
        total = np.where(queued, self._busy_segments[src, dst], 0.0) + segments
        # Linux paces TCP itself where the qdisc is not fq: 2 x cwnd x MSS per srtt in slow start.
        # A connection that sent nothing for a round trip paces its next window as from the
        # initial one (measured on tun, london-tokyo, 215.7 ms: a 14-segment message takes 0.154 s
        # more than a 1-segment one, where (14 - 1) / (2 x 10) RTT = 0.140 s), up to one window:
        # the busy period's first window, whichever message filled it.
        paced = np.where(after_idle, (np.minimum(np.minimum(total, bdp), 2 * INITIAL_WINDOW_SEGMENTS) - 1.0)
                         * rtt / (2 * INITIAL_WINDOW_SEGMENTS), 0.0)

        # the flight its last segment leaves in, counted only until the window covers the BDP
        # (less a hair: a power of two's log must not round up to one flight more)
        flights = np.maximum(1.0, np.ceil(np.log2(np.minimum(total, bdp) / window + 1.0) - 1e-9))
        leaves = began + paced + (flights - 1.0) * rtt
        extra = np.maximum(0.0, leaves - start)
        self._busy_from[src, dst] = began
        self._busy_window[src, dst] = window
        self._busy_segments[src, dst] = total
        self._busy_after_idle[src, dst] = after_idle
        # (the window is credited once the last flight leaves, before its ACKs return: at most
        # one round trip early, and only for a message posted in that round trip)
        self._cwnd[src, dst] = np.maximum(cwnd, np.minimum(window * 2.0 ** flights, 4 * bdp))
        self._last_send[src, dst] = np.maximum(self._last_send[src, dst], start + extra)
        return extra

    # -- link changes (faults) ----------------------------------------------------------------

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        """Change every pair from ``src_region`` to ``dst_region`` now (None: back to the plan's)."""
        src = np.array([r == src_region for r in self.region_of])
        dst = np.array([r == dst_region for r in self.region_of])
        mask = np.outer(src, dst)
        np.fill_diagonal(mask, False)
        if not mask.any():
            raise ValueError(f"no pair from {src_region!r} to {dst_region!r}")
        if spec is None:
            for name in ("latency_s", "rate", "jitter_s", "loss"):
                getattr(self, name)[mask] = self._base[name][mask]
        else:
            self.latency_s[mask] = spec.one_way_delay_ms / 1000.0
            self.rate[mask] = spec.rate_bit_s / 8.0
            self.jitter_s[mask] = spec.jitter_ms / 1000.0
            self.loss[mask] = spec.loss_fraction
        self._cap = None
        self._rerate()

    # -- flows --------------------------------------------------------------------------------

    def start_flow(self, src: int, dst: int, size: float, now: float, token: object = None) -> int:
        """Post ``size`` bytes from ``src`` to ``dst`` at ``now``; returns the flow's id."""
        self.advance(now)
        flow_id = self._next_id
        self._next_id += 1
        self._flows[flow_id] = Flow(flow_id, src, dst, float(size), now, float(size), token=token)
        self._rerate()
        return flow_id

    def cancel_flows(self, now: float, which) -> list[Flow]:
        """Stop the flows in flight for which ``which(flow)`` is true (a crashed node's, or those a
        sender gave up on): their bytes stop at ``now``, nothing of them is delivered; returns them."""
        self.advance(now)
        stopped = [flow for flow in self._flows.values() if which(flow)]
        for flow in stopped:
            del self._flows[flow.flow_id]
        if stopped:
            self._rerate()
        return stopped

    def new_connections(self, node: int) -> None:
        """``node``'s TCP connections start afresh (a restarted process connects again): the
        initial window, nothing sent yet."""
        for index in (np.s_[node, :], np.s_[:, node]):
            self._cwnd[index] = float(INITIAL_WINDOW_SEGMENTS)
            self._last_send[index] = -np.inf
            self._busy_from[index] = -np.inf
            self._busy_segments[index] = 0.0

    def next_completion(self) -> float:
        """When the next flow in flight sends its last byte (inf: none will)."""
        best = INFINITE
        for flow in self._flows.values():
            if flow.remaining <= 0:
                return self._now
            if flow.rate > 0:
                best = min(best, self._now + flow.remaining / flow.rate)
        return best

    def advance(self, now: float) -> list[Delivery]:
        """Move the fluid to ``now``; returns the flows whose last byte left by then (in order),
        each with its arrival time."""
        if now < self._now - 1e-12:
            raise ValueError(f"time goes back: {now} < {self._now}")
        done: list[Delivery] = []
        while True:
            upcoming = self.next_completion()
            step_to = min(upcoming, now)
            dt = step_to - self._now
            if dt > 0:
                for flow in self._flows.values():
                    flow.remaining -= flow.rate * dt
                self._now = step_to
            # done: no byte left to speak of, or too few for the clock to tell (a flow on a fast
            # path whose last bytes would take less than a float's resolution of the time)
            finished = [f for f in self._flows.values() if f.remaining <= max(1e-9 * f.size, 1e-6)
                        or (f.rate > 0 and self._now + f.remaining / f.rate <= self._now)]
            if not finished:
                break
            for flow in sorted(finished, key=lambda f: f.flow_id):
                del self._flows[flow.flow_id]
                done.append(self._deliver(flow))
            self._rerate()
            if upcoming >= now:
                break
        self._now = max(self._now, now)
        return done

    def _deliver(self, flow: Flow) -> Delivery:
        delay = float(self.latency_s[flow.src, flow.dst])
        jitter = float(self.jitter_s[flow.src, flow.dst])
        if jitter > 0:
            delay = max(0.0, delay + float(self._rng.uniform(-jitter, jitter)))
        key = (flow.src, flow.dst)
        arrives = max(self._now + delay, self._last_arrival.get(key, 0.0))
        self._last_arrival[key] = arrives
        return Delivery(flow.flow_id, flow.src, flow.dst, flow.size, flow.started, self._now, arrives, flow.token)

    def _rerate(self) -> None:
        """Max-min rates of the flows in flight over pair paths (and NICs): only the resources
        some flow crosses take part, so the cost grows with the flows, not with the nodes."""
        flows = list(self._flows.values())
        if not flows:
            return
        src = np.array([f.src for f in flows])
        dst = np.array([f.dst for f in flows])
        pairs, pair_index = np.unique(src * self.size + dst, return_inverse=True)
        path = self.rate.reshape(-1)[pairs].copy()
        path[self.loss.reshape(-1)[pairs] >= 1.0] = 0.0
        kinds, capacity = [pair_index], [path]
        if self.nic is not None:
            for ends in (src, dst):
                used, index = np.unique(ends, return_inverse=True)
                kinds.append(index + sum(len(c) for c in capacity))
                capacity.append(self.nic[used])
        rates = max_min_rates(kinds, np.concatenate(capacity), self.connection_cap()[src, dst])
        for flow, rate in zip(flows, rates):
            flow.rate = float(rate)

    def in_flight(self) -> int:
        return len(self._flows)
