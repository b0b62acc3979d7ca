"""Fault injection: a scenario's timeline of events, applied while a job runs, each one recorded.

Events (times are seconds after the job's processes start; on backend sim, virtual seconds after
the simulation starts, the actions planned ahead as data: `planned_actions`, and a crash kills
the rank's simulated process, a restart starts a fresh one: trainers.sim):
    link_down / link_up   {between: [a, b]} or {from: a, to: b}: a partition between regions
    link_change           the same, with any of delay/rtt/rate/jitter/loss: the new values
    loss_burst            {between, loss: "30%", duration: "5s"}: loss for a while, then restored
    trace                 {between, file: trace.csv}: rows `time_s,rate,delay` (units as in
                          topologies: 100Mbit, 40ms) applied at `at + time_s`
    node_crash            {node: tokyo-0, restart_after: "10s"?}: SIGKILL the node's process
    straggler             {node, factor: 3, duration?}: the node's CPU limit divided by factor

Policy (docs/SCENARIOS.md, "Faults"): the network keeps every TCP connection (a partition only
holds packets back or drops them, so TCP retransmits and everyone waits until the link is up
again). A crashed rank ends the job for algorithms built on collectives (status `failed`, with the
injected crash named in the reason). Crash-tolerant algorithms (async_ps, dpsgd, adpsgd,
swarmsgd, diloco) run on the elastic tcp comm when a scenario crashes nodes: the others go on and
a restarted rank (TORCHELASTIC_RESTART_COUNT) is admitted back; harness/run.py then does not count
the killed process as a failure. The same on backend sim, on the virtual clock: the elastic
comm's simulated twin (trainers/sim/elastic.py) for the crash-tolerant algorithms, a failed
simulation naming the crash for the others. Every event and what it did goes to the job's
`faults.jsonl`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Literal, Optional, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from emulator.topology import LinkFields, LinkSpec, bounded_time_ms
from emulator.units import UnitError, parse_rate_bit_s, parse_time_ms

MAX_EVENT_TIME_S = 7 * 24 * 3600.0
MAX_TRACE_ROWS = 100_000


def _seconds(value, what: str) -> float:
    return bounded_time_ms(value, what, high=MAX_EVENT_TIME_S * 1000.0) / 1000.0


class FaultEvent(BaseModel):
    """One timeline entry, validated like topology links (units, ranges, known kinds)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    at: float
    kind: Literal["link_down", "link_up", "link_change", "loss_burst", "trace", "node_crash", "straggler"]
    between: Optional[list[str]] = None
    from_: Optional[str] = Field(None, alias="from")
    to: Optional[str] = None
    node: Optional[str] = None
    delay: Optional[str] = None
    rtt: Optional[str] = None
    rate: Optional[str] = None
    jitter: Optional[str] = None
    loss: Optional[str] = None
    duration: Optional[float] = None
    file: Optional[str] = None
    factor: Optional[float] = Field(None, gt=1.0, le=1000.0)
    restart_after: Optional[float] = None
    # Parsed once, when the scenario is loaded (not part of the scenario's saved form):
    # the link fields of link_change/loss_burst, and the rows of a trace file.
    change: Optional[LinkFields] = Field(None, exclude=True, repr=False)
    trace_rows: Optional[list[tuple[float, Optional[float], Optional[float]]]] = Field(None, exclude=True, repr=False)

    @field_validator("at", "duration", "restart_after", mode="before")
    @classmethod
    def _times(cls, value, info):
        return None if value is None else _seconds(value, info.field_name)

    @model_validator(mode="after")
    def _fields_for_kind(self):
        link_kinds = {"link_down", "link_up", "link_change", "loss_burst", "trace"}
        if self.kind in link_kinds:
            if (self.between is None) == (self.from_ is None or self.to is None):
                raise ValueError(f"{self.kind} needs between: [a, b] or from: and to:")
            if self.between is not None and len(self.between) != 2:
                raise ValueError("between needs exactly two regions")
        else:
            if not self.node:
                raise ValueError(f"{self.kind} needs node: <region>-<index>")
        if self.kind == "link_change":
            # the topology's checks for units and ranges; the parsed values are kept
            self.change = LinkFields(delay=self.delay, rtt=self.rtt, rate=self.rate, jitter=self.jitter,
                                     loss=self.loss)
            if not any((self.delay, self.rtt, self.rate, self.jitter, self.loss)):
                raise ValueError("link_change needs at least one of delay, rtt, rate, jitter, loss")
        if self.kind == "loss_burst":
            if self.loss is None or self.duration is None:
                raise ValueError("loss_burst needs loss and duration")
            self.change = LinkFields(loss=self.loss)
        if self.kind == "trace" and not self.file:
            raise ValueError("trace needs file: a CSV with time_s,rate,delay rows")
        if self.kind == "straggler" and self.factor is None:
            raise ValueError("straggler needs factor > 1")
        return self

    def pairs(self) -> list[tuple[str, str]]:
        if self.between is not None:
            a, b = self.between
            return [(a, b), (b, a)]
        return [(self.from_, self.to)]


def read_trace(path: Path) -> list[tuple[float, Optional[float], Optional[float]]]:
    """Rows (time_s, rate_bit_s or None, one_way_delay_ms or None) of a trace CSV."""
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"time_s"} - set(reader.fieldnames or [])
        if missing or not ({"rate", "delay"} & set(reader.fieldnames or [])):
            raise ValueError(f"{path}: needs a header time_s,rate,delay (rate or delay may be omitted)")
        for line, row in enumerate(reader, start=2):
            if len(rows) >= MAX_TRACE_ROWS:
                raise ValueError(f"{path}: more than {MAX_TRACE_ROWS} rows")
            try:
                t = float(row["time_s"])
                rate = parse_rate_bit_s(row["rate"]) if row.get("rate") else None
                delay = parse_time_ms(row["delay"]) if row.get("delay") else None
            except (ValueError, UnitError) as exc:
                raise ValueError(f"{path}: line {line}: {exc}") from None
            if t < 0:
                raise ValueError(f"{path}: line {line}: time_s must be >= 0")
            rows.append((t, rate, delay))
    return rows


@dataclasses.dataclass(order=True)
class _Action:
    due_s: float
    order: int
    what: str = dataclasses.field(compare=False)
    apply: Callable[[], str] = dataclasses.field(compare=False)


class LinkControl(Protocol):
    """What the timeline changes links through: a backend (`emulator.backends.Backend.set_link`)."""

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None: ...


class NodeControl(Protocol):
    """What the timeline crashes, restarts and slows nodes through: the job's processes
    (`harness.jobs.JobProcesses`). Each returns what it did, for the record."""

    def crash(self, node: str) -> str: ...

    def restart(self, node: str) -> str: ...

    def set_cpu_factor(self, node: str, factor: float) -> str: ...


class FaultTimeline:
    """Turns events into timed actions against the network and the job; `poll(elapsed_s)` applies due ones.

    Args:
        events: validated events (trace rows loaded by the scenario loader).
        base_links: region pair -> the topology's LinkSpec (what link_up and ends of bursts restore).
        network: changes a region pair's links (LinkSpec, or None for down).
        nodes: crashes, restarts and slows nodes by name.
        record_path: where each applied action is appended as JSON.
        time_dilation: on a network dilated by K (emulator/dilation.py) the events' times are
            emulated seconds: each is due at K times its time; links are in emulated units
            (`network` dilates them, e.g. emulator.dilation.DilatedLinks).
    """

    def __init__(self, events, base_links: dict, network: LinkControl, nodes: NodeControl, record_path: Path,
                 time_dilation: float = 1.0):
        self.record_path = record_path
        self.current = dict(base_links)
        self.base = dict(base_links)
        self._actions: list[_Action] = []
        self._network = network
        order = 0

        def add(due, what, fn):
            nonlocal order
            self._actions.append(_Action(due * time_dilation, order, what, fn))
            order += 1

        for event in events:
            if event.kind in ("node_crash", "straggler"):
                node = event.node
                if event.kind == "node_crash":
                    add(event.at, f"node_crash {node}", lambda n=node: nodes.crash(n))
                    if event.restart_after is not None:
                        add(event.at + event.restart_after, f"restart {node}", lambda n=node: nodes.restart(n))
                else:
                    add(event.at, f"straggler {node} x{event.factor:g}",
                        lambda n=node, f=event.factor: nodes.set_cpu_factor(n, f))
                    if event.duration is not None:
                        add(event.at + event.duration, f"straggler {node} ends",
                            lambda n=node: nodes.set_cpu_factor(n, 1.0))
                continue
            for pair in event.pairs():
                if event.kind == "link_down":
                    add(event.at, f"link {pair[0]}->{pair[1]} down", lambda p=pair: self._link(p, None))
                elif event.kind == "link_up":
                    add(event.at, f"link {pair[0]}->{pair[1]} up", lambda p=pair: self._link(p, self.base[p]))
                elif event.kind == "link_change":
                    add(event.at, f"link {pair[0]}->{pair[1]} change",
                        lambda p=pair, e=event: self._link(p, self._changed(self.current[p] or self.base[p], e)))
                elif event.kind == "loss_burst":
                    loss = event.change.loss
                    add(event.at, f"loss burst {pair[0]}->{pair[1]} {event.loss}",
                        lambda p=pair, l=loss: self._link(p, dataclasses.replace(self.current[p] or self.base[p], loss_fraction=l)))
                    add(event.at + event.duration, f"loss burst {pair[0]}->{pair[1]} ends",
                        lambda p=pair: self._link(p, dataclasses.replace(
                            self.current[p] or self.base[p], loss_fraction=self.base[p].loss_fraction)))
                elif event.kind == "trace":
                    if event.trace_rows is None:
                        raise ValueError(f"trace {event.file}: rows not loaded (load the scenario with load_scenario)")
                    for t, rate, delay in event.trace_rows:
                        def apply(p=pair, rate=rate, delay=delay):
                            spec = self.current[p] or self.base[p]
                            if rate is not None:
                                spec = dataclasses.replace(spec, rate_bit_s=rate)
                            if delay is not None:
                                spec = dataclasses.replace(spec, one_way_delay_ms=delay)
                            return self._link(p, spec)

                        add(event.at + t, f"trace {pair[0]}->{pair[1]} t={t:g}s", apply)
        self._actions.sort()

    @staticmethod
    def _changed(spec: LinkSpec, event: FaultEvent) -> LinkSpec:
        fields = event.change
        one_way = fields.one_way_ms()
        return dataclasses.replace(
            spec,
            one_way_delay_ms=spec.one_way_delay_ms if one_way is None else one_way,
            rate_bit_s=spec.rate_bit_s if fields.rate is None else fields.rate,
            jitter_ms=spec.jitter_ms if fields.jitter is None else fields.jitter,
            loss_fraction=spec.loss_fraction if fields.loss is None else fields.loss,
        )

    def _link(self, pair, spec: Optional[LinkSpec]) -> str:
        self.current[pair] = spec
        self._network.set_link(pair[0], pair[1], spec)
        if spec is None:
            return "down"
        return (f"delay {spec.one_way_delay_ms:g} ms, rate {spec.rate_bit_s / 1e6:g} Mbit/s, "
                f"loss {spec.loss_fraction * 100:g}%")

    @property
    def pending(self) -> int:
        return len(self._actions)

    def poll(self, elapsed_s: float) -> list[dict]:
        """Apply every action due by `elapsed_s`; return (and record) what was done."""
        done = []
        while self._actions and self._actions[0].due_s <= elapsed_s:
            action = self._actions.pop(0)
            try:
                effect, ok = action.apply(), True
            except Exception as exc:  # noqa: BLE001 - a failed injection is recorded, the run goes on
                effect, ok = f"{type(exc).__name__}: {exc}", False
            done.append(write_fault_record(self.record_path, action.due_s, elapsed_s, action.what, effect, ok))
        return done


def planned_actions(events, base_links: dict) -> list[dict]:
    """Every action of the events' timeline, in order, as data, for a clock the harness does not
    watch (backend sim, harness/sim_job.py): {due_s, what, effect, calls}, `calls` what the
    action asks of the network and the nodes ({"set_link": [src, dst, LinkSpec fields, or None
    for down]}, {"cpu_factor": [node, factor]}, {"crash": node}, {"restart": node}). Exact for
    links and stragglers: an action's effect depends only on the actions before it, never on the
    network. A crash's or restart's effect depends on the job (is the rank still running? can it
    be taken back?): None here, the simulator says what it did. `base_links` as for FaultTimeline."""
    controls = PlannedControls()
    timeline = FaultTimeline(events, base_links, controls, controls, record_path=None)
    out = []
    for action in timeline._actions:
        controls.calls = []
        effect = action.apply()
        out.append({"due_s": action.due_s, "what": action.what, "effect": effect, "calls": controls.calls})
    return out


class PlannedControls:
    """Network and nodes for `planned_actions`: each call is noted as data, nothing changes."""

    def __init__(self):
        self.calls: list[dict] = []

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        self.calls.append({"set_link": [src_region, dst_region, None if spec is None else dataclasses.asdict(spec)]})

    def set_cpu_factor(self, node: str, factor: float) -> str:
        self.calls.append({"cpu_factor": [node, factor]})
        return f"compute x{factor:g}" if factor != 1.0 else "compute restored"

    def crash(self, node: str) -> None:
        self.calls.append({"crash": node})

    def restart(self, node: str) -> None:
        self.calls.append({"restart": node})


def write_fault_record(path: Path, due_s: float, applied_s: float, what: str, effect: str, ok: bool,
                       time_unix: Optional[float] = None) -> dict:
    """Append one applied action to a job's faults.jsonl and return it. `applied_s`: seconds after
    the job's start on the job's clock (virtual on backend sim); `time_unix`: that moment on the
    wall clock (default now; a virtual clock's own reading on sim)."""
    record = {"kind": "fault", "due_s": round(due_s, 3), "applied_s": round(applied_s, 3),
              "time_unix": time.time() if time_unix is None else time_unix, "what": what, "effect": effect,
              "ok": ok}
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    return record
