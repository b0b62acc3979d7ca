"""The delay-line process: owns one TUN device per node and moves every packet through its pair's link.

Loop: read ready TUN devices in bounded batches, look up the destination node by IPv4 address, offer
the frame to the pair's link in `Scheduler`, write due frames (virtio-net header included, so GSO and
checksum-offload flags carry over) to the destination node's TUN device.

Timing: plain timers overshoot (epoll has 1 ms resolution; asyncio measured +1.25 ms mean here), so
the loop sleeps in select() on the epoll fd (microsecond timeout, timer slack 1 ns, SCHED_FIFO) and
polls for the last stretch before a delivery. How long it may sleep comes from timing.SleepPlanner:
a wait is cut into one long sleep, short 0.5 ms sleeps and a spin, each stage's margin sized from
the measured overshoot of the loop's own earlier sleeps (a 20 ms sleep overshot 110 us p50 / 1.5 ms
p99 here, a 0.5 ms one 17 / 92 us). A single sleep until 30 us before the delivery (the policy
before issue 12) left ping at 1 Hz 0.26-0.43 ms over the configured RTT. After dense traffic (a
frame within `busy_poll_us` of the previous one) it keeps polling for `busy_poll_us` instead of
sleeping. A frame that arrives while the loop sleeps is stamped with the time the kernel handed
it to the TUN device (a packet-socket tap per device, arrival.py: a TUN fd has no SO_TIMESTAMP),
not when the woken loop read it, so the wake-up is not charged to the link; the counters'
`sleep` and `arrival` sections show the overshoots and the waits the loop measures.

Overload is made visible, never hidden: every delivery's lateness is recorded (lag), a line goes to
stderr when more than 1% of deliveries are over 1 ms late for two intervals in a row, and the
counters file says how often a read batch came back full (the TUN queue had more waiting).
"""

from __future__ import annotations

import ctypes
import gc
import json
from dataclasses import replace
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from .. import netns
from ..files import write_text_atomic
from ..plan import Plan
from . import control
from .arrival import ArrivalTap, open_tap, tap_counters
from .device import device_name, open_node_device, set_segmentation
from .packet import IPV4_DST_OFFSET, VNET_HDR_BYTES, wire_bytes
from .scheduler import Scheduler
from .timing import SHORT_SLEEP_NS, SleepPlanner

# A GSO frame is at most 64 KB of IP packet plus the virtio-net header.
MAX_FRAME_BYTES = 65_536 + VNET_HDR_BYTES
# None: the spin window before a delivery follows the measured wake-up overshoot (timing.py).
DEFAULT_EARLY_WAKE_US = None
# Adaptive busy-polling: when a frame is read or delivered less than this long after the previous
# one (traffic is dense), the loop keeps polling this long before it sleeps, so the next frame of a
# burst is read at once instead of after a wake-up. Sparse traffic (ping) never pays for it:
# measured with ping at 100 Hz on 9 pairs, polling 200 us after every frame cost 21% of a core.
DEFAULT_BUSY_POLL_US = 200
CALIBRATION_SLEEPS = 24           # short sleeps measured at start, before the first delivery
# Frames read from one device per loop turn. Small, so that a device with a backlog cannot delay
# the frames of the others: with 64, one 10 Gbit/s intra-region flow (more than this process can
# move) raised other pairs' RTT p99 to ~1 ms; with 8, to 0.2-0.3 ms on most pairs.
DEFAULT_READ_BATCH = 8
DEFAULT_COUNTERS_INTERVAL_S = 1.0
LATE_THRESHOLD_NS = 1_000_000     # a delivery later than this counts as "late"
LATE_WARN_FRACTION = 0.01         # ... and more than this share of late deliveries is overload
PR_SET_TIMERSLACK = 29
COUNTERS_CHUNK_PAIRS = 32         # pairs encoded per GIL hold by the counters thread
COUNTERS_CHUNK_PAUSE_S = 50e-6    # ... then it sleeps: a real pause frees the CPU, not just the GIL
GIL_SWITCH_INTERVAL_S = 0.0005    # Python's default 5 ms would let a busy helper thread delay the loop
# SCHED_FIFO priority of the delay line. Measured here (1 Gbit/s, 86.6 ms RTT, iperf3 on the same
# 2 cores): as a normal task (even at nice -10) 8% of deliveries were over 1 ms late, up to 16 ms,
# because a write into a namespace wakes the receiver, which preempts us; with SCHED_FIFO 10,
# 5 of 35,000 were, mean lag 2 us. The loop sleeps whenever nothing is due, and the kernel's RT
# throttling (sched_rt_runtime_us) still leaves other tasks 5% of each core if it ever spins.
DEFAULT_REALTIME_PRIORITY = 10


def set_timer_slack_ns(slack_ns: int) -> bool:
    """Ask the kernel to fire this thread's timers within `slack_ns` (default slack is 50 us)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_TIMERSLACK, slack_ns, 0, 0, 0) == 0
    except OSError:
        return False


def set_realtime_priority(priority: int) -> Optional[str]:
    """Make this process SCHED_FIFO at `priority` (1-99); return why not, or None on success."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as exc:
        return str(exc)
    return None


class CountersWriter:
    """Writes the counters file from a helper thread, a few pairs at a time.

    Building the file in the loop stalled it: 30-60 ms every second with 64 nodes (4032 pairs),
    every delivery in that window late. The helper encodes COUNTERS_CHUNK_PAIRS pairs, then sleeps
    briefly, so the loop never waits for it much longer than one chunk (~0.05 ms). It runs at the
    loop's SCHED_FIFO priority on purpose: a normal thread preempted while holding the GIL would
    stall the loop for a whole scheduler time slice.
    """

    def __init__(self, line: "DelayLine", path: Path):
        self.line = line
        self.path = path
        self._wanted = threading.Event()
        self._header: Optional[dict] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="delayline-counters", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def request(self, header: dict) -> None:
        """Write the file soon, with this header (taken in the loop, so interval stats match)."""
        self._header = header
        self._wanted.set()

    def stop(self) -> None:
        self._stopping = True
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            if self._stopping:
                return
            try:
                write_text_atomic(self.path, self.line.counters_json(self._header, yield_gil=True))
            except Exception as exc:  # a full disk must not end the emulation; say so and go on
                print(f"delayline: WARNING could not write {self.path}: {exc}", file=self.line.log,
                      flush=True)


class LagStats:
    """How late deliveries were (ns), over the whole run and over the current interval."""

    __slots__ = ("deliveries", "late", "total_ns", "max_ns",
                 "interval_deliveries", "interval_late", "interval_max_ns", "overloaded_intervals")

    def __init__(self):
        self.deliveries = self.late = self.total_ns = self.max_ns = 0
        self.interval_deliveries = self.interval_late = self.interval_max_ns = 0
        self.overloaded_intervals = 0  # consecutive intervals over LATE_WARN_FRACTION

    def as_dict(self) -> dict:
        return {
            "deliveries": self.deliveries,
            "late_over_1ms": self.late,
            "mean_us": round(self.total_ns / self.deliveries / 1000, 2) if self.deliveries else 0.0,
            "max_us": round(self.max_ns / 1000, 1),
            "interval_max_us": round(self.interval_max_ns / 1000, 1),
        }


class DelayLine:
    """One process's worth of emulated links: TUN devices, scheduler, counters.

    Args:
        plan: the network to emulate (its namespaces must exist).
        counters_path: JSON file rewritten every `counters_interval_s` (s) and on SIGUSR1.
        seed: RNG seed for loss and jitter.
        jitter_distribution: "uniform" or "normal".
        early_wake_us: how long (us) before a delivery the loop stops sleeping and starts polling;
            None: sized from the measured overshoot of its own sleeps (timing.SleepPlanner).
        staged_sleep: cut long waits into a long sleep, short sleeps and a spin (timing.py);
            False sleeps once until the spin window.
        busy_poll_us: keep polling this long (us) after a frame was read or delivered within
            this long of the previous one (0: never).
        max_sleep_us: never sleep longer than this (us), also when idle (timing.SleepPlanner);
            None: sleep until the next delivery or counters interval.
        segment_lossy: refuse TSO on devices of nodes with a lossy outgoing link, so loss applies
            per wire packet (False keeps GSO frames whole, as before issue 12: for comparisons).
        read_batch: frames read from one device per loop turn, so one busy sender cannot starve
            the deliveries of all others.
        counters_interval_s: period (s) of counter writes and of the overload check.
        kernel_stamps: stamp each frame with the time the kernel handed it to the TUN device (a
            packet-socket tap per device, arrival.py) instead of the time the loop read it.
        realtime_priority: SCHED_FIFO priority (1-99) for the loop, 0 to stay a normal task.
        log: where warnings go (the backend points stderr at a log file in the state folder).
    """

    def __init__(self, plan: Plan, counters_path: Optional[Path] = None, seed: int = 0,
                 jitter_distribution: str = "uniform",
                 early_wake_us: Optional[float] = DEFAULT_EARLY_WAKE_US,
                 staged_sleep: bool = True, busy_poll_us: float = DEFAULT_BUSY_POLL_US,
                 segment_lossy: bool = True, max_sleep_us: Optional[float] = None,
                 read_batch: int = DEFAULT_READ_BATCH,
                 counters_interval_s: float = DEFAULT_COUNTERS_INTERVAL_S,
                 kernel_stamps: bool = True,
                 realtime_priority: int = DEFAULT_REALTIME_PRIORITY, log: TextIO = sys.stderr,
                 links_path: Optional[Path] = None):
        if early_wake_us is not None and early_wake_us < 0:
            raise ValueError(f"early_wake_us must be >= 0, got {early_wake_us}")
        if busy_poll_us < 0:
            raise ValueError(f"busy_poll_us must be >= 0, got {busy_poll_us}")
        if read_batch < 1:
            raise ValueError(f"read_batch must be >= 1, got {read_batch}")
        if counters_interval_s <= 0:
            raise ValueError(f"counters_interval_s must be > 0, got {counters_interval_s}")
        if not 0 <= realtime_priority <= 99:
            raise ValueError(f"realtime_priority must be in [0, 99], got {realtime_priority}")
        self.realtime_priority = realtime_priority
        self.realtime = False
        self.plan = plan
        self.counters_path = counters_path
        self.sleeps = SleepPlanner(
            fixed_spin_ns=None if early_wake_us is None else int(early_wake_us * 1000),
            staged=staged_sleep, max_sleep_ns=None if max_sleep_us is None else int(max_sleep_us * 1000))
        self.busy_poll_ns = int(busy_poll_us * 1000)
        self.segment_lossy = segment_lossy
        self.read_batch = read_batch
        self.counters_interval_ns = int(counters_interval_s * 1e9)
        self.log = log
        self.node_count = len(plan.nodes)
        self.scheduler = Scheduler(seed=seed, jitter_distribution=jitter_distribution)
        # each node's NIC each way, shared by its pairs (scheduler.py); only where it can bind, so
        # a network whose NICs never bind costs the loop nothing more per packet
        for node in plan.nodes:
            if plan.nic_can_bind(node):
                self.scheduler.add_nic(node.rank, node.nic_rate_bit_s, plan.nic_queue_bytes(node))
        for src, dst, spec in plan.pairs():
            self.scheduler.add_pair(src.rank * self.node_count + dst.rank, spec, src.rank, dst.rank)
        self.rank_by_address = {bytes(map(int, n.address.split("."))): n.rank for n in plan.nodes}
        self.fds: list[int] = []
        self.kernel_stamps = kernel_stamps
        self.taps: list[Optional[ArrivalTap]] = []  # per node, when kernel_stamps (None: no tap)
        self.segmenting: list[bool] = []  # per node: TSO refused, frames are wire packets
        self.unknown_destination = [0] * self.node_count   # per source node
        self.read_batches_full = 0
        self.write_errors = 0
        self.lag = LagStats()
        self.started_ns = time.monotonic_ns()
        self._stop = False
        self._dump_now = False
        self.links_path = links_path
        self._reload_links = False

    def open_devices(self) -> None:
        """Create every node's TUN device (in node order) and keep the fds."""
        self.segmenting = [self.segment_lossy and self.plan.segments_egress(node) for node in self.plan.nodes]
        for node, segment in zip(self.plan.nodes, self.segmenting):
            self.fds.append(open_node_device(self.plan, node, segment=segment))
            if self.kernel_stamps:
                with netns.entered(node.namespace):
                    self.taps.append(open_tap(device_name(self.plan.prefix)))
        if self.kernel_stamps and not all(self.taps):
            print("delayline: WARNING no packet-socket tap on some devices; their frames are stamped "
                  "when read (one wake-up late after a sleep)", file=self.log, flush=True)

    def update_segmentation(self) -> None:
        """Turn TSO off on the devices of nodes that now have a lossy outgoing link, on elsewhere.

        Loss is drawn per frame, so it must see wire packets (see Plan.segments_egress); a link
        change (fault injection) can make a node lossy or loss-free while flows are running.
        """
        node_count = self.node_count
        lossy = [False] * node_count
        for key, link in self.scheduler.pairs.items():
            if self.segment_lossy and 0.0 < link.loss_fraction < 1.0:
                lossy[key // node_count] = True
        for rank, fd in enumerate(self.fds):
            if rank < len(self.segmenting) and lossy[rank] != self.segmenting[rank]:
                try:
                    set_segmentation(fd, lossy[rank])
                    self.segmenting[rank] = lossy[rank]
                except OSError as exc:
                    print(f"delayline: WARNING could not set segmentation on node {rank}: {exc}",
                          file=self.log, flush=True)

    def close(self) -> None:
        """Close the TUN fds: the kernel removes the devices."""
        for tap in self.taps:
            if tap is not None:
                tap.close()
        self.taps = []
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    # Counters -------------------------------------------------------------------------------------
    def counters(self) -> dict:
        """Everything the counters file holds: per pair, per node, lag and queue health."""
        return json.loads(self.counters_json(self.counters_header()))

    def counters_json(self, header: dict, yield_gil: bool = False) -> str:
        """The counters file's text: `header` plus every pair's counters.

        Args:
            header: counters_header() taken at the moment the file describes.
            yield_gil: release the GIL after every COUNTERS_CHUNK_PAIRS pairs (helper thread).
        """
        names = [n.name for n in self.plan.nodes]
        node_count = self.node_count
        links = list(self.scheduler.pairs.items())
        chunks = []
        for start in range(0, len(links), COUNTERS_CHUNK_PAIRS):
            rows = []
            for key, link in links[start:start + COUNTERS_CHUNK_PAIRS]:
                src, dst = divmod(key, node_count)
                rows.append({"src": names[src], "dst": names[dst], **link.counters()})
            chunks.append(json.dumps(rows)[1:-1])
            if yield_gil:
                time.sleep(COUNTERS_CHUNK_PAUSE_S)
        return json.dumps(header)[:-1] + ', "pairs": [' + ", ".join(chunks) + "]}"

    def counters_header(self) -> dict:
        """The counters file without the pairs: process, lag, drops of unknown destinations."""
        names = [n.name for n in self.plan.nodes]
        return {
            "prefix": self.plan.prefix,
            "pid": os.getpid(),
            "time_unix_s": round(time.time(), 3),
            "uptime_s": round((time.monotonic_ns() - self.started_ns) / 1e9, 3),
            "device": device_name(self.plan.prefix),
            "realtime": self.realtime,
            "pending_packets": self.scheduler.pending(),
            "lag": self.lag.as_dict(),
            "sleep": self.sleeps.as_dict(),
            "arrival": tap_counters(self.taps),
            "read_batches_full": self.read_batches_full,
            "write_errors": self.write_errors,
            "segmenting": [n.name for n, on in zip(self.plan.nodes, self.segmenting) if on],
            "unknown_destination": dict(zip(names, self.unknown_destination)),
            "nics": {names[int(rank)]: nic for rank, nic in self.scheduler.nic_counters().items()},
        }

    def _end_interval(self, writer: Optional[CountersWriter]) -> None:
        """Close one counters interval: overload check, counters file, interval stats reset."""
        lag = self.lag
        if lag.interval_deliveries and lag.interval_late > LATE_WARN_FRACTION * lag.interval_deliveries:
            lag.overloaded_intervals += 1
            if lag.overloaded_intervals >= 2:
                print(f"delayline: WARNING overloaded: {lag.interval_late} of {lag.interval_deliveries} "
                      f"deliveries over 1 ms late in the last interval (max "
                      f"{lag.interval_max_ns / 1e6:.2f} ms); shaping is no longer faithful",
                      file=self.log, flush=True)
        else:
            lag.overloaded_intervals = 0
        self.sleeps.adapt()
        if writer is not None:
            writer.request(self.counters_header())
        lag.interval_deliveries = lag.interval_late = lag.interval_max_ns = 0

    # Signals --------------------------------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        self._stop = True

    def request_dump(self, *_args) -> None:
        self._dump_now = True

    def request_link_reload(self, *_args) -> None:
        self._reload_links = True

    def apply_links_file(self) -> None:
        """Apply the link changes in `links_path` (fault injection), then acknowledge them.

        The file holds {"sequence": n, "links": [{"src_region", "dst_region", "spec": {...} | null}]}
        with every change in force (null: the link is down, every packet dropped). Pairs the file
        does not name keep the plan's spec. The acknowledgement is `<links_path>.applied`, holding
        the sequence number, written once the changes are in force.
        """
        self._reload_links = False
        if self.links_path is None:
            return
        try:
            data = json.loads(self.links_path.read_text())
        except (OSError, ValueError) as exc:
            print(f"delayline: WARNING could not read {self.links_path}: {exc}", file=self.log, flush=True)
            return
        changes = {(c["src_region"], c["dst_region"]): c["spec"] for c in data.get("links", [])}
        nodes = self.plan.nodes
        for key, link in self.scheduler.pairs.items():
            src, dst = divmod(key, self.node_count)
            base = self.plan.link(nodes[src], nodes[dst])
            change = changes.get((nodes[src].region, nodes[dst].region), "keep")
            if change == "keep":
                spec = base
            elif change is None:
                spec = replace(base, loss_fraction=1.0)
            else:
                spec = replace(base, **{k: v for k, v in change.items() if k != "queue_bytes"})
            if spec != link.spec:
                link.set_spec(spec)
        self.update_segmentation()
        write_text_atomic(control.applied_path(self.links_path),
                              str(data.get("sequence", 0)))

    # The loop -------------------------------------------------------------------------------------
    def run(self, on_ready: Callable[[], None] = lambda: None) -> None:
        """Move packets until SIGTERM/SIGINT (or request_stop); call `on_ready` once devices are up."""
        if not self.fds:
            self.open_devices()
        set_timer_slack_ns(1)
        if self.realtime_priority:
            why_not = set_realtime_priority(self.realtime_priority)
            self.realtime = why_not is None
            if why_not is not None:
                print(f"delayline: WARNING could not get SCHED_FIFO {self.realtime_priority} "
                      f"({why_not}); deliveries will be late whenever the CPUs are busy",
                      file=self.log, flush=True)
        wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
        handlers = {sig: signal.signal(sig, handler) for sig, handler in (
            (signal.SIGTERM, self.request_stop), (signal.SIGINT, self.request_stop),
            (signal.SIGUSR1, self.request_dump), (signal.SIGHUP, self.request_link_reload))}
        poller = select.epoll()
        writer = CountersWriter(self, self.counters_path) if self.counters_path is not None else None
        previous_switch_interval = sys.getswitchinterval()
        # How long the loop may wait for the GIL before the counters thread must hand it over.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        try:
            if writer is not None:
                writer.start()
            for fd in self.fds:
                poller.register(fd, select.EPOLLIN)
            poller.register(wake_read, select.EPOLLIN)
            # Everything allocated so far lives for the whole run, and the loop makes no reference
            # cycles (frames and heap entries are freed by reference counting), so the cyclic
            # collector would only add pauses.
            gc.collect()
            gc.freeze()
            gc.disable()
            self.calibrate_sleeps()
            on_ready()
            self._loop(poller, wake_read, writer)
        finally:
            if writer is not None:
                writer.stop()
            sys.setswitchinterval(previous_switch_interval)
            gc.unfreeze()
            gc.enable()
            poller.close()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            signal.set_wakeup_fd(previous_wakeup)
            os.close(wake_read)
            os.close(wake_write)
            if self.counters_path is not None:
                write_text_atomic(self.counters_path, self.counters_json(self.counters_header()))

    def calibrate_sleeps(self, count: int = CALIBRATION_SLEEPS) -> None:
        """Measure `count` short sleeps (~12 ms in all) so the first deliveries get a fitted spin window."""
        for _ in range(count):
            start = time.monotonic_ns()
            select.select([], [], [], SHORT_SLEEP_NS / 1e9)
            self.sleeps.record(SHORT_SLEEP_NS, time.monotonic_ns() - start - SHORT_SLEEP_NS)
        self.sleeps.adapt()

    def _deliver_due(self) -> None:
        """Write every frame that is due now to its destination device; record how late each was."""
        now = time.monotonic_ns()
        lag = self.lag
        late_count = total = 0
        worst = lag.interval_max_ns
        write = os.write
        due = self.scheduler.pop_due(now)
        for delivery, fd, frame in due:
            try:
                write(fd, frame)
            except OSError:
                # A full or vanished device: the frame is lost, as on a real link; counted.
                self.write_errors += 1
            late = now - delivery
            total += late
            if late > worst:
                worst = late
            if late > LATE_THRESHOLD_NS:
                late_count += 1
        lag.deliveries += len(due)
        lag.interval_deliveries += len(due)
        lag.late += late_count
        lag.interval_late += late_count
        lag.total_ns += total
        lag.interval_max_ns = int(worst)
        if worst > lag.max_ns:
            lag.max_ns = int(worst)

    def _loop(self, poller, wake_read: int, writer: Optional[CountersWriter]) -> None:
        # Locals: attribute and global lookups are a measurable share of a per-packet budget of a
        # few microseconds.
        monotonic_ns = time.monotonic_ns
        read = os.read
        poll = poller.poll
        epoll_fd = [poller.fileno()]
        wait = select.select
        scheduler = self.scheduler
        offer = scheduler.offer
        heap = scheduler.deliveries  # read-only peeks at the earliest delivery; pop_due does the popping
        deliver_due = self._deliver_due
        fds = self.fds
        taps = self.taps if any(self.taps) else None
        rank_of_fd = {fd: rank for rank, fd in enumerate(fds)}
        rank_by_address = self.rank_by_address
        node_count = self.node_count
        unknown = self.unknown_destination
        batch = self.read_batch
        planner = self.sleeps
        plan_sleep = planner.sleep_ns
        record_sleep = planner.record
        duty = planner.duty
        slept = planner.slept
        busy_poll_ns = self.busy_poll_ns
        busy_until = last_activity = 0
        interval_ns = self.counters_interval_ns
        vnet = VNET_HDR_BYTES
        dst_start = VNET_HDR_BYTES + IPV4_DST_OFFSET
        dst_end = dst_start + 4
        max_frame = MAX_FRAME_BYTES
        next_interval_ns = monotonic_ns() + interval_ns

        while not self._stop:
            now = monotonic_ns()
            # 1. Deliveries that are due.
            if heap and heap[0][0] <= now:
                deliver_due()
                if now - last_activity < busy_poll_ns:
                    busy_until = now + busy_poll_ns
                last_activity = now
            # 2. Frames waiting in the devices, at most `batch` per device per turn so that one
            #    busy sender cannot starve the others; deliveries that fall due meanwhile go out
            #    at once, so reading never makes a delivery late.
            events = poll(0)
            for fd, _ in events:
                src = rank_of_fd.get(fd)
                if src is None:  # the signal wake-up pipe
                    try:
                        read(wake_read, 512)
                    except BlockingIOError:
                        pass
                    continue
                base = src * node_count
                tap = taps[src] if taps is not None else None
                for _ in range(batch):
                    try:
                        frame = read(fd, max_frame)
                    except BlockingIOError:
                        break
                    # Stamp every frame as it is read: a stamp per batch made later frames of a
                    # batch leave early (measured: RTT 67 us below the configured minimum).
                    now = monotonic_ns()
                    dst = rank_by_address.get(frame[dst_start:dst_end]) if frame[vnet] >> 4 == 4 else None
                    if dst is None or dst == src:
                        unknown[src] += 1
                        continue
                    size = len(frame) - vnet if frame[1] == 0 else wire_bytes(frame)
                    # the kernel's stamp: a frame that arrived while the loop slept is not
                    # charged the wake-up (arrival.py)
                    offer(base + dst, frame, fds[dst], size,
                          now if tap is None else tap.stamp(frame, now, vnet))
                    if heap and heap[0][0] <= now:
                        deliver_due()
                else:
                    self.read_batches_full += 1
            # 3. Housekeeping once per interval, and on SIGUSR1.
            now = monotonic_ns()
            if now >= next_interval_ns:
                next_interval_ns = now + interval_ns
                self._end_interval(writer)
            elif self._dump_now and writer is not None:
                writer.request(self.counters_header())
            self._dump_now = False
            if self._reload_links:
                self.apply_links_file()
            if events:
                if now - last_activity < busy_poll_ns:
                    busy_until = now + busy_poll_ns
                last_activity = now
                continue  # more may be waiting; sleep only when the devices are drained
            if duty(now):
                busy_until = 0  # saturated: polling would get the loop throttled (timing.py)
            elif now < busy_until:
                continue  # just after traffic: keep polling for the rest of a burst
            # 4. Sleep until shortly before the next delivery (or the next interval), in stages,
            #    then poll (timing.SleepPlanner); every timer wake-up's overshoot is recorded.
            target = heap[0][0] if heap else next_interval_ns
            if target > next_interval_ns:
                target = next_interval_ns
            sleep_ns = plan_sleep(target - now)
            if sleep_ns > 0:
                woken = wait(epoll_fd, (), (), sleep_ns / 1e9)[0]
                actual = monotonic_ns() - now
                slept(actual)
                if not woken:
                    record_sleep(sleep_ns, actual - sleep_ns)


def run_from_plan_file(plan_path: Path, counters_path: Optional[Path], ready: Callable[[], None],
                       **options) -> None:
    """Load a plan saved with Plan.to_json and run the delay line for it until signalled."""
    plan = Plan.from_json(Path(plan_path).read_text())
    if counters_path is not None and "links_path" not in options:
        options["links_path"] = control.links_path(Path(counters_path).parent)
    line = DelayLine(plan, counters_path=counters_path, **options)
    try:
        line.open_devices()
        line.run(on_ready=ready)
    finally:
        line.close()
