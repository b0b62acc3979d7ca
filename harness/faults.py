"""Fault injection: a scenario's timeline of events, applied while a job runs, each one recorded.

Events (times are seconds after the job's processes start; on backend sim, virtual seconds after
the simulation starts, and a crash kills the rank's simulated process, a restart starts a fresh
one: trainers.sim):
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

Faults are data: the scenario's events (with each trace's rows, read once: `FaultProgram`) are
compiled per network point into `FaultAction`s (`compile_actions`: due time, op, args, the new
LinkSpec of a link action resolved ahead), which the job spec carries. One executor interface
(`FaultExecutor`) applies them: `NetworkAndNodes` on a built network (the backend's set_link,
`harness.jobs.JobProcesses`), driven by `FaultSchedule.poll` on the harness's clock;
`harness.sim_job.SimFaults` inside the simulation, at the virtual times. `run_action` applies one
and records it, the same way for both.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path
from typing import Literal, Optional, Protocol

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
    # Parsed with the event (not part of the scenario's saved form): the link fields of
    # link_change/loss_burst. A trace's rows are read once into the scenario's FaultProgram.
    change: Optional[LinkFields] = Field(None, exclude=True, repr=False)

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


@dataclasses.dataclass(frozen=True)
class FaultProgram:
    """A scenario's fault events with what they read from files (each trace's rows, read once when
    the scenario is loaded): everything a network point's actions are compiled from.

    Args:
        events: the validated events, in the scenario's order (never changed here).
        traces: event index -> rows (time_s, rate_bit_s or None, one_way_delay_ms or None) of a
            trace event's file.
    """

    events: tuple[FaultEvent, ...] = ()
    traces: dict = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.events)


# What an action asks of the network or the job's nodes; its args, in order.
SET_LINK = "set_link"      # (src_region, dst_region, LinkSpec or None for down)
CRASH = "crash"            # (node,)
RESTART = "restart"        # (node,)
CPU_FACTOR = "cpu_factor"  # (node, factor): the node's compute `factor` times slower; 1 restores it
FAULT_OPS = (SET_LINK, CRASH, RESTART, CPU_FACTOR)


@dataclasses.dataclass(frozen=True)
class FaultAction:
    """One timed action of a job's fault timeline, as data.

    Args:
        due_s: when it is due, seconds after the job's start (emulated seconds until the job
            spec is dilated: harness/jobspec.py `dilated`).
        op: one of FAULT_OPS; args: its arguments (see FAULT_OPS).
        what: what it is, for the record ("link a->b down", "straggler a-0 x3").
        effect: what it does, where that is known ahead: a link's new values, in the topology's
            units (also on a dilated network, like the scenario that asked for them). None: the
            executor says (a crash's effect depends on the job).
    """

    due_s: float
    op: str
    args: tuple
    what: str
    effect: Optional[str] = None

    @property
    def node(self) -> Optional[str]:
        return None if self.op == SET_LINK else self.args[0]


def link_effect(spec: Optional[LinkSpec]) -> str:
    """A link's new values, as faults.jsonl says them."""
    if spec is None:
        return "down"
    return (f"delay {spec.one_way_delay_ms:g} ms, rate {spec.rate_bit_s / 1e6:g} Mbit/s, "
            f"loss {spec.loss_fraction * 100:g}%")


def _changed(spec: LinkSpec, fields: LinkFields) -> LinkSpec:
    one_way = fields.one_way_ms()
    return dataclasses.replace(
        spec,
        one_way_delay_ms=spec.one_way_delay_ms if one_way is None else one_way,
        rate_bit_s=spec.rate_bit_s if fields.rate is None else fields.rate,
        jitter_ms=spec.jitter_ms if fields.jitter is None else fields.jitter,
        loss_fraction=spec.loss_fraction if fields.loss is None else fields.loss,
    )


def compile_actions(program: FaultProgram, base_links: dict) -> tuple[FaultAction, ...]:
    """Every action of the program's timeline on a network whose region pairs have `base_links`
    (region pair -> the topology's LinkSpec: what link_up and the end of a burst restore), in the
    order they are due (ties: the scenario's order). Exact for links: a link action's new spec
    depends only on the link actions before it, never on the job."""
    pending = []  # (due_s, order, what, op, args or link rule)

    def add(due, what, op, args):
        pending.append((due, len(pending), what, op, args))

    for index, event in enumerate(program.events):
        if event.kind == "node_crash":
            add(event.at, f"node_crash {event.node}", CRASH, (event.node,))
            if event.restart_after is not None:
                add(event.at + event.restart_after, f"restart {event.node}", RESTART, (event.node,))
            continue
        if event.kind == "straggler":
            add(event.at, f"straggler {event.node} x{event.factor:g}", CPU_FACTOR, (event.node, event.factor))
            if event.duration is not None:
                add(event.at + event.duration, f"straggler {event.node} ends", CPU_FACTOR, (event.node, 1.0))
            continue
        for pair in event.pairs():
            name = f"{pair[0]}->{pair[1]}"
            # a rule: (the pair's spec now, its base spec) -> its new spec (None: down)
            if event.kind == "link_down":
                add(event.at, f"link {name} down", SET_LINK, (pair, lambda now, base: None))
            elif event.kind == "link_up":
                add(event.at, f"link {name} up", SET_LINK, (pair, lambda now, base: base))
            elif event.kind == "link_change":
                add(event.at, f"link {name} change", SET_LINK,
                    (pair, lambda now, base, f=event.change: _changed(now or base, f)))
            elif event.kind == "loss_burst":
                add(event.at, f"loss burst {name} {event.loss}", SET_LINK,
                    (pair, lambda now, base, l=event.change.loss: dataclasses.replace(now or base, loss_fraction=l)))
                add(event.at + event.duration, f"loss burst {name} ends", SET_LINK,
                    (pair, lambda now, base: dataclasses.replace(now or base, loss_fraction=base.loss_fraction)))
            elif event.kind == "trace":
                if index not in program.traces:
                    raise ValueError(f"trace {event.file}: rows not read (load the scenario with load_scenario)")
                for t, rate, delay in program.traces[index]:
                    def row(now, base, rate=rate, delay=delay):
                        spec = now or base
                        if rate is not None:
                            spec = dataclasses.replace(spec, rate_bit_s=rate)
                        if delay is not None:
                            spec = dataclasses.replace(spec, one_way_delay_ms=delay)
                        return spec

                    add(event.at + t, f"trace {name} t={t:g}s", SET_LINK, (pair, row))
    current = dict(base_links)
    actions = []
    for due, _, what, op, args in sorted(pending, key=lambda entry: (entry[0], entry[1])):
        if op == SET_LINK:
            pair, rule = args
            spec = rule(current[pair], base_links[pair])
            current[pair] = spec
            actions.append(FaultAction(due, op, (pair[0], pair[1], spec), what, link_effect(spec)))
        else:
            actions.append(FaultAction(due, op, args, what))
    return tuple(actions)


def simulated_compute_effect(factor: float) -> str:
    """A straggler's effect on backend sim: its compute `factor` times slower (1: restored)."""
    return f"compute x{factor:g}" if factor != 1.0 else "compute restored"


def action_record(action: FaultAction) -> dict:
    """`action` as sim.json holds it: {due_s, what, effect, calls}, `calls` what it asks of the
    network and the nodes ({"set_link": [src, dst, LinkSpec fields, or None for down]},
    {"cpu_factor": [node, factor]}, {"crash": node}, {"restart": node}); effect: a link's, a
    straggler's on sim, None for a crash or restart (the simulator says what it did)."""
    if action.op == SET_LINK:
        src, dst, spec = action.args
        call = {SET_LINK: [src, dst, None if spec is None else dataclasses.asdict(spec)]}
        effect = action.effect
    elif action.op == CPU_FACTOR:
        call, effect = {CPU_FACTOR: list(action.args)}, simulated_compute_effect(action.args[1])
    else:
        call, effect = {action.op: action.args[0]}, None
    return {"due_s": action.due_s, "what": action.what, "effect": effect, "calls": [call]}


def action_from_record(record: dict) -> FaultAction:
    """The action `action_record` wrote."""
    (call,) = record["calls"]
    ((op, args),) = call.items()
    if op == SET_LINK:
        src, dst, spec = args
        return FaultAction(record["due_s"], op, (src, dst, None if spec is None else LinkSpec(**spec)),
                           record["what"], record["effect"])
    if op == CPU_FACTOR:
        return FaultAction(record["due_s"], op, (args[0], float(args[1])), record["what"])
    if op not in FAULT_OPS:
        raise ValueError(f"unknown fault action {op!r} (known: {', '.join(FAULT_OPS)})")
    return FaultAction(record["due_s"], op, (args,), record["what"])


class LinkControl(Protocol):
    """What link actions change links through: a backend (`emulator.backends.Backend.set_link`)."""

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None: ...


class NodeControl(Protocol):
    """What node actions crash, restart and slow nodes through: the job's processes
    (`harness.jobs.JobProcesses`). Each returns what it did, for the record."""

    def crash(self, node: str) -> str: ...

    def restart(self, node: str) -> str: ...

    def set_cpu_factor(self, node: str, factor: float) -> str: ...


class FaultExecutor(Protocol):
    """Applies actions to a job: `LinkControl` and `NodeControl` in one. A link action's effect is
    the action's own (known ahead); a node action's is what the executor returns."""

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None: ...

    def crash(self, node: str) -> str: ...

    def restart(self, node: str) -> str: ...

    def set_cpu_factor(self, node: str, factor: float) -> str: ...


def apply_action(action: FaultAction, executor: FaultExecutor) -> Optional[str]:
    """Do `action` through `executor`; return its effect."""
    if action.op == SET_LINK:
        executor.set_link(*action.args)
        return action.effect
    if action.op == CRASH:
        return executor.crash(*action.args)
    if action.op == RESTART:
        return executor.restart(*action.args)
    if action.op == CPU_FACTOR:
        return executor.set_cpu_factor(*action.args)
    raise ValueError(f"unknown fault action {action.op!r} (known: {', '.join(FAULT_OPS)})")


def run_action(action: FaultAction, executor: FaultExecutor, record_path: Path, applied_s: float,
               time_unix: Optional[float] = None) -> dict:
    """Apply `action` and append what it did to `record_path` (faults.jsonl); a failed injection is
    recorded, not raised. `applied_s`, `time_unix`: as for write_fault_record."""
    try:
        effect, ok = apply_action(action, executor), True
    except Exception as exc:  # noqa: BLE001 - a failed injection is recorded, the run goes on
        effect, ok = f"{type(exc).__name__}: {exc}", False
    return write_fault_record(record_path, action.due_s, applied_s, action.what, effect, ok, time_unix)


class NetworkAndNodes:
    """The executor of a job on a built network: links through the backend, nodes through the
    job's processes. Keeps each region pair's link as last set, so that `restore` puts back only
    what the job changed."""

    def __init__(self, network: Optional[LinkControl], nodes: Optional[NodeControl]):
        self.network = network
        self.nodes = nodes
        self.current: dict = {}  # region pair -> the spec last set (None: down)

    def set_link(self, src_region: str, dst_region: str, spec: Optional[LinkSpec]) -> None:
        self.current[(src_region, dst_region)] = spec
        self.network.set_link(src_region, dst_region, spec)

    def crash(self, node: str) -> str:
        return self.nodes.crash(node)

    def restart(self, node: str) -> str:
        return self.nodes.restart(node)

    def set_cpu_factor(self, node: str, factor: float) -> str:
        return self.nodes.set_cpu_factor(node, factor)

    def restore(self, links: dict) -> None:
        """Set every pair the job changed back to `links` (region pair -> spec as the backend
        applies it): the next job starts on the topology's links."""
        for pair, spec in self.current.items():
            if spec != links[pair]:
                self.network.set_link(pair[0], pair[1], links[pair])
                self.current[pair] = links[pair]


class FaultSchedule:
    """A job's actions on the clock the harness watches: `poll(elapsed_s)` applies the due ones
    through `executor` and records each in `record_path` (faults.jsonl)."""

    def __init__(self, actions, executor: FaultExecutor, record_path: Path):
        self._due = sorted(actions, key=lambda action: action.due_s)  # stable: ties keep their order
        self.executor = executor
        self.record_path = record_path

    @property
    def pending(self) -> int:
        return len(self._due)

    def poll(self, elapsed_s: float) -> list[dict]:
        """Apply every action due by `elapsed_s`; return (and record) what was done."""
        done = []
        while self._due and self._due[0].due_s <= elapsed_s:
            done.append(run_action(self._due.pop(0), self.executor, self.record_path, elapsed_s))
        return done


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
