"""Results tables: per-rank JSONL records of a run directory -> pandas DataFrames -> summary.csv.

`load_run(run_dir)` gives tidy frames (one row per step / eval record, with job columns, and one
row per fault event: see `load_faults`), built from the run's files read once (`RunDir`,
harness/rundir.py; the frames keep it as `RunFrames.run` for the report); `summarize(load_run(run_dir))`
gives one row per job with the comparison against `sync` at the same network point, seed and
workload (`sync_reference`, the one lookup of the sync job). Pure functions of files: the plots
and notebooks use the same frames. On a dilated run the durations listed in DILATED_COLUMNS are
divided by K on loading.

Two clocks. `train_time_s` (steps, evals, and fault events for the figures) counts from the moment
a rank began its first step. A fault event's `time_s` counts from the moment the harness started
the job's processes, the zero of a scenario's `faults: at:` times (see `load_faults`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from emulator.files import write_text_atomic

from .budget import STEPS, EqualBudget
from .rundir import JobDir, RunDir

from .byo import congestion_control, has_values

SUMMARY_COLUMNS = [
    "network", "delay_scale", "rate", "nodes", "algorithm", "label", "seed", "status",
    "final_accuracy", "best_accuracy", "time_to_target_s", "output_sync_s", "accuracy_at_step_budget",
    "accuracy_at_time_budget", "steps", "train_time_s", "steps_per_s",
    "speedup_vs_sync", "throughput_speedup_vs_sync", "accuracy_delta_vs_sync", "budget_not_reached",
    "bytes_sent_per_node", "bytes_per_step_per_node", "wire_bytes_per_node", "wire_overhead",
    "comm_blocked_fraction", "mean_staleness",
    "first_sync_step", "first_sync_s", "syncs_before_target",  # evidence that the mechanism acted
    "workers", "servers", "server_bytes_sent_per_node",
    "server_wire_bytes_per_node", "transport", "tuned", "sweep_best", "compute_s_per_step",
    "compute_comm_ratio", "time_dilation", "backend", "workload", "data_source", "wall_s",
    "congestion_control", "compute_utilisation", "mean_bandwidth_per_node_bit_s",
    "peak_bandwidth_per_node_bit_s", "stand_in_parameters", "wire_scale", "workload_without_lr",
]

# The columns people read first: the terminal table and the report's markdown table (every column
# goes to the CSV).
HEADLINE_COLUMNS = [
    "network", "label", "seed", "status", "final_accuracy", "time_to_target_s", "steps_per_s",
    "speedup_vs_sync", "throughput_speedup_vs_sync", "accuracy_delta_vs_sync",
    "bytes_sent_per_node", "wire_bytes_per_node", "comm_blocked_fraction",
]
BYTE_COLUMNS = {"bytes_sent_per_node", "bytes_per_step_per_node", "wire_bytes_per_node"}

# One sentence per metric, for the report (docs/SCENARIOS.md says the same at more length).
METRICS = {
    "final_accuracy": "held-out accuracy of the algorithm's output model (the replicas' mean, the "
                      "centre, the server or rank 0) at the job's last evaluation, computed off the "
                      "emulated network from the ranks' snapshots.",
    "time_to_target_s": "seconds of training (start-up and evaluation excluded) until accuracy first "
                        "reached the target, interpolated between the two evaluations around it, plus "
                        "output_sync_s.",
    "output_sync_s": "for an output that is the mean of the replicas (local SGD, DTS, gossip): one "
                     "all-reduce of the model, measured as sync's median blocked step at the same "
                     "network point (CSV; 0 for other outputs).",
    "steps_per_s": "rank 0's training steps per second of training time (workers only for parameter servers).",
    "speedup_vs_sync": "sync's time to target over this job's, at the same network point and seed (> 1: faster).",
    "throughput_speedup_vs_sync": "this job's steps/s over sync's, at the same network point and seed.",
    "accuracy_delta_vs_sync": "this job's accuracy minus sync's at the run's one equal budget (the "
                              "step budget, or the time budget where only that is stated; the "
                              "budget sentence above says which): the 'no accuracy loss' check; empty "
                              "where this job or its sync did not get there (budget_not_reached says why).",
    "accuracy_at_step_budget": "accuracy of the last evaluation within the step budget (CSV).",
    "accuracy_at_time_budget": "accuracy of the last evaluation within the training-time budget (CSV).",
    "budget_not_reached": "why accuracy_delta_vs_sync is empty: the job (or its sync) failed or ended "
                          "at its limits before the budget (CSV).",
    "bytes_sent_per_node": "bytes each node's communication layer sent, counted from tensor sizes.",
    "wire_bytes_per_node": "bytes each node put on the emulated wire, from the backend's own counters "
                           "(headers, handshakes, retransmissions and control included).",
    "wire_overhead": "wire bytes over tensor bytes, minus one (CSV).",
    "comm_blocked_fraction": "share of the workers' step time spent waiting on communication.",
    "transport": "the all-reduce the job used: gloo's, or ours:<auto|ring|direct|recursive_doubling> (CSV).",
    "compute_comm_ratio": "the workers' median compute time per step over one all-reduce of the model on "
                          "this network (sync's median blocked step at the same point): the papers' "
                          "computation/communication ratio (CSV).",
    "time_dilation": "the run's time dilation K: the network ran K times slower and every time above "
                     "is divided by K (docs/TIME_DILATION.md; CSV).",
    "backend": "what the job ran on: tun, tc or mininet (an emulated network), or sim (simulated: its "
               "times are virtual seconds of the simulator's clock, its compute the run's compute model; CSV).",
    "workload": "a short hash of the job's trainer settings other than its algorithm, seed and comm: "
                "the ratios against sync take the sync job with the same workload (e.g. the same "
                "min_compute_s) where the scenario has several (CSV).",
    "wall_s": "the job's wall-clock seconds, start-up to the last rank's end (CSV).",
    "congestion_control": "the TCP congestion control in force inside the job's nodes, read there "
                          "before the job (job.json's node_stack has the other TCP sysctls; CSV).",
    "first_sync_step": "the step in which a rank first applied a synchronisation (an average, a DTS "
                       "correction, an elastic move, a server's update; sync: step 0); empty if none was "
                       "applied (local_only) or the records do not count them (CSV).",
    "first_sync_s": "the training time at the end of that step (CSV).",
    "syncs_before_target": "synchronisations applied by the step of the first evaluation at or over the "
                           "target (the most any rank applied); 0 marks a speedup as independent training: "
                           "replicas trained apart, averaged only by the evaluator (CSV).",
    "compute_utilisation": "the workers' compute time over their steps' wall time (each step's time less "
                           "its blocked communication, summed, over the steps' time summed; on sim both "
                           "are virtual seconds): 1 = communication never held compute up (CSV).",
    "mean_bandwidth_per_node_bit_s": "bits each worker's communication layer sent over its steps' wall time, "
                                     "averaged over the workers (CSV).",
    "peak_bandwidth_per_node_bit_s": "each worker's highest bits sent in one step over that step's time (the "
                                     "window is one step, not a fixed interval), averaged over the workers; "
                                     "bits count in the step whose call launched them, so an exchange overlapped "
                                     "with later steps (Streaming DiLoCo's tau) counts whole at its launch: for "
                                     "those an upper bound on the link's need (CSV).",
    "stand_in_parameters": "the parameters of the model the job stands for (stand_in:, backend sim): "
                           "bytes, bandwidths and compute above are the stand-in's (CSV).",
    "wire_scale": "what every real message was charged times on the simulated network (the stand-in's "
                  "bytes over the real model's fp32 bytes; bytes_sent_per_node / wire_scale is what the real "
                  "model sent; CSV).",
    "workload_without_lr": "the workload's hash without its learning-rate settings (lr, lr_schedule, the "
                           "optimizer's momentum and weight decay): where no sync job shares a job's "
                           "exact workload (an algorithm at its own lr), the sync sharing this one is "
                           "its reference (CSV).",
    "data_source": "what the job trained on, from its ranks' data records: a dataset's files, or the "
                   "generator and its seed (a cifar10 job that fell back to generated images says so; CSV).",
}

# Trainer settings that do not make a different workload (what is compared, not what it runs on).
NOT_WORKLOAD_KEYS = ("algorithm", "seed", "output_dir", "comm")
# The learning-rate settings: an algorithm's own hyperparameters, tuned per algorithm.
LR_KEYS = ("lr", "lr_schedule", "optimizer.momentum", "optimizer.weight_decay")


def workload_key(config: Optional[dict], tuned: Iterable[str] = ()) -> str:
    """A short, stable hash of a trainer config's workload (NOT_WORKLOAD_KEYS left out); "" if unknown.

    Args:
        tuned: dotted keys a tuning protocol or sweep set for this job (``lr``,
            ``optimizer.momentum``): left out too, so that a job is compared with the sync of its
            workload at sync's own pick, not with whichever sync happens to share its lr.
    """
    if not config:
        return ""
    kept = json.loads(json.dumps({k: v for k, v in config.items() if k not in NOT_WORKLOAD_KEYS}))
    for dotted in tuned:
        *parents, last = dotted.split(".")
        node = kept
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return hashlib.sha1(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:10]


def format_bytes(value: float) -> str:
    """3 significant digits and a decimal unit: 4.81 MB."""
    for factor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value:.0f} B"


# One row per fault event or its effect on the job's membership (see load_faults).
FAULT_COLUMNS = [
    "job_id", "label", "algorithm", "seed", "network", "time_s", "train_time_s", "step", "source",
    "what", "effect", "ok", "rank", "due_s", "time_unix",
]
# Ordering of events at the same time: the cause before what the trainers saw of it.
_SOURCE_ORDER = {"fault": 0, "membership": 1, "rejoin": 2}


@dataclass
class RunFrames:
    jobs: pd.DataFrame    # one row per job (job.json + config)
    steps: pd.DataFrame   # one row per step record, every rank
    evals: pd.DataFrame   # one row per eval record (rank 0)
    target_accuracy: Optional[float]
    complete: bool
    faults: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=FAULT_COLUMNS))
    budget_steps: Optional[int] = None      # accuracy_at_step_budget is read at this step
    budget_time_s: Optional[float] = None   # accuracy_at_time_budget at this much training time
    budget: Optional[EqualBudget] = None    # the one definition both came from (harness/budget.py)
    time_dilation: float = 1.0              # the records' times were divided by this (see load_run)
    target_loss: Optional[float] = None     # time_to_target_s is to a held-out loss <= this (stop.target_loss)
    run: Optional[RunDir] = field(default=None, repr=False)  # the files they were read from


def _writer_offsets(records: list[dict]) -> list[float]:
    """Per record, the seconds to add to its `time_s` to put it on the file's first writer's clock.

    A restarted rank's records follow the crashed process's in the same file, on a clock that
    starts again at 0 (a new writer: a second `start` record, or time going back). Each later
    writer is shifted by the difference of the writers' wall-clock origins (time_unix - time_s).
    """
    offsets, offset, origin, last = [], 0.0, None, None
    for record in records:
        time_s, time_unix = record.get("time_s"), record.get("time_unix")
        if time_s is not None and time_unix is not None:
            if origin is None:
                origin = time_unix - time_s
            elif record.get("kind") == "start" or (last is not None and time_s < last):
                offset = (time_unix - time_s) - origin
            last = time_s
        offsets.append(offset)
    return offsets


def _writer_origin_unix(records: list[dict]) -> Optional[float]:
    """Wall-clock time (s since the epoch) at which the file's first writer was created."""
    return next((r["time_unix"] - r["time_s"] for r in records
                 if r.get("time_s") is not None and r.get("time_unix") is not None), None)


def _train_start_s(records: list[dict], offsets: list[float]) -> float:
    """The `time_s` (first writer's clock) that is training time 0 for this rank."""
    # Time zero is when this rank began its first step: process start-up (importing torch,
    # loading data, the rendezvous) is the same for every algorithm and is not training.
    for record, offset in zip(records, offsets):
        if record.get("kind") == "step":
            return record["time_s"] + offset - (record.get("step_s") or 0.0)
    return next((r["time_s"] + o for r, o in zip(records, offsets) if r.get("kind") == "start"), 0.0)


@dataclass
class _JobClock:
    """What the fault events of one job need from its rank files."""

    records: dict            # rank -> records of rank<rank>.jsonl
    writers_start_unix: Optional[float] = None   # the earliest rank writer's creation
    rank0_train_zero_unix: Optional[float] = None  # rank 0's training time 0, wall clock
    rank0_steps: Optional[pd.DataFrame] = None     # rank 0's step and train_time_s


# Time dilation backed out: the record fields (and the columns load_run derives from them) that are
# durations on the dilated clock, divided by K on loading. Listed, not guessed from a name: a new
# duration is converted only once someone says it runs on the dilated clock (tests/harness/
# test_report.py checks that every `_s` field the trainers write is in one of these two lists).
DILATED_COLUMNS = {
    "steps": ("time_s", "train_time_s", "step_s", "compute_s", "compute_unpadded_s", "comm_blocked_s"),
    "evals": ("time_s", "time_s_min", "train_time_s", "train_time_s_min", "eval_s"),
    "faults": ("time_s", "train_time_s", "due_s"),
}
# `_s` fields of the records that are not converted: the jobs' wall_s stays wall clock (it says
# how long the job took here), the status record's snapshot_s_total and the snapshot record's
# snapshot_s are not in the frames (their kinds are not steps or evals).
UNDILATED_FIELDS = ("wall_s", "snapshot_s", "snapshot_s_total", "applied_s")


def emulated_seconds(frame: pd.DataFrame, k: float, columns=None) -> pd.DataFrame:
    """`frame` with its duration columns (`columns`, default every column of DILATED_COLUMNS)
    divided by `k`: the records of a network dilated by K are in wall-clock seconds, the run's
    figures in emulated ones. Other columns, whatever their name, are left as they are."""
    if k == 1.0 or not len(frame):
        return frame
    listed = columns if columns is not None else {c for names in DILATED_COLUMNS.values() for c in names}
    present = [c for c in frame.columns if c in listed]
    return frame.assign(**{c: pd.to_numeric(frame[c], errors="coerce") / k for c in present})


@dataclass
class _JobRows:
    """What one job adds to the run's frames (see _load_job)."""

    job: dict                    # its row of RunFrames.jobs
    steps: list[dict]
    evals: list[dict]
    faults: list[dict]


def load_run(run_dir) -> RunFrames:
    """Read every job of a run directory into DataFrames. On a dilated run (scenario.json's
    time_dilation K) every duration of the steps, evals and faults is in emulated seconds (wall
    clock / K; DILATED_COLUMNS); the jobs' wall_s stays wall clock. `run_dir`: a path or a RunDir."""
    return run_frames(run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir))


def run_frames(run: RunDir) -> RunFrames:
    """The frames of a run directory read once (`RunDir`); see load_run."""
    k = run.time_dilation
    run_backend = run.environment.get("backend")  # jobs before job.json said it
    stop = run.stop
    jobs, steps, evals, faults = [], [], [], []
    for job_dir in run.jobs:
        rows = _load_job(job_dir, run_backend)
        jobs.append(rows.job)
        steps += rows.steps
        evals += rows.evals
        faults += rows.faults
    evals_frame = emulated_seconds(pd.DataFrame(evals), k, DILATED_COLUMNS["evals"])
    jobs_frame = pd.DataFrame(jobs)
    budget = EqualBudget.from_stop(stop).resolved(_reached_by_jobs_ok(jobs_frame, evals_frame))
    return RunFrames(jobs_frame, emulated_seconds(pd.DataFrame(steps), k, DILATED_COLUMNS["steps"]),
                     evals_frame, stop.get("target_accuracy"),
                     run.complete, emulated_seconds(_faults_frame(faults), k, DILATED_COLUMNS["faults"]),
                     budget_steps=budget.steps, budget_time_s=budget.time_s, budget=budget,
                     time_dilation=k, run=run, target_loss=stop.get("target_loss"))


def frames_of_jobs(frames: RunFrames, job_ids: list[str]) -> RunFrames:
    """`frames` cut down to the jobs `job_ids`, with the equal budget's default resolved over
    them alone (harness/tuning.py scores a network point's tuning candidates among themselves)."""
    def only(frame: pd.DataFrame) -> pd.DataFrame:
        if not len(frame) or "job_id" not in frame:
            return frame
        return frame[frame["job_id"].isin(job_ids)].reset_index(drop=True)

    jobs, evals = only(frames.jobs), only(frames.evals)
    stated = frames.budget if frames.budget is not None else EqualBudget()
    budget = dataclasses.replace(stated, steps=stated.steps if stated.steps_stated else None,
                                 time_s=stated.time_s if stated.time_stated else None)
    budget = budget.resolved(_reached_by_jobs_ok(jobs, evals))
    return dataclasses.replace(frames, jobs=jobs, steps=only(frames.steps), evals=evals, faults=only(frames.faults),
                               budget=budget, budget_steps=budget.steps, budget_time_s=budget.time_s)


def _last_evaluation(evals: pd.DataFrame) -> tuple[Optional[int], Optional[float]]:
    """(steps done, training time) at a job's last evaluation; (None, None) without one."""
    if not len(evals):
        return None, None
    last = evals.sort_values("step").iloc[-1]
    return int(last["step"]) + 1, float(last["train_time_s"])  # an eval's `step`: the last step's index


def _reached_by_jobs_ok(jobs: pd.DataFrame, evals: pd.DataFrame) -> list[tuple[int, float]]:
    """Per job that ended ok with an evaluation, how far it got (the default budget's inputs)."""
    reached = []
    for job in jobs.to_dict("records") if len(jobs) else []:
        if job.get("status") != "ok" or not len(evals):
            continue
        steps_done, train_time_s = _last_evaluation(evals[evals["job_id"] == job["job_id"]])
        if steps_done is not None:
            reached.append((steps_done, train_time_s))
    return reached


def _load_job(job_dir: JobDir, run_backend: Optional[str]) -> _JobRows:
    """One job's row of the jobs frame, its step and eval rows, and its fault events."""
    info = job_dir.info
    network = info.get("network", {})
    base = {"job_id": job_dir.job_id, "label": info.get("label", job_dir.job_id),
            "algorithm": info.get("algorithm"), "seed": info.get("seed"),
            "delay_scale": network.get("delay_scale"), "rate": network.get("rate"),
            "nodes": info.get("nodes")}
    base["network"] = job_dir.network_key
    base["workload"] = workload_key(job_dir.config, tuned=(info.get("tuned") or {}).keys())
    base["workload_without_lr"] = workload_key(job_dir.config, tuned=LR_KEYS)
    job = {**base, "status": info.get("status"), "wall_s": info.get("wall_s"),
           "reason": info.get("reason", ""), "wire": job_dir.wire_bytes_by_rank,
           "server_ranks": list((info.get("params") or {}).get("server_ranks") or []),
           "base_label": info.get("base_label") or base["label"], "tuned": info.get("tuned") or {},
           "phase": info.get("phase") or "",
           "backend": info.get("backend") or run_backend, "congestion_control": congestion_control(info),
           "stand_in": info.get("stand_in")}
    steps, evals = [], []
    clock = _JobClock(records={})
    for _, records in job_dir.rank_records:
        offsets = _writer_offsets(records)
        start = _train_start_s(records, offsets)
        origin = _writer_origin_unix(records)
        rank_rows = []
        for record, offset in zip(records, offsets):
            kind = record.get("kind")
            # Evaluation stays in: it is the same protocol for every algorithm, and its
            # communication (averaging a deployable model) overlaps the algorithm's own, so
            # subtracting it would credit an algorithm with the evaluation's network time.
            # Other kinds (start, status, membership, rejoin, ...) are not steps or evals.
            row = {**base, **record, "train_time_s": record.get("time_s", 0.0) + offset - start}
            if kind == "step":
                steps.append(row)
                rank_rows.append(row)
            elif kind == "eval":
                evals.append(row)
        rank = records[0].get("rank") if records else None
        clock.records[rank] = records
        if rank == 0:  # why rank 0 ended (steps, time_budget, target_accuracy): for budget_not_reached
            job["stop_reason"] = next((r.get("stop_reason") for r in reversed(records)
                                       if r.get("kind") == "status" and r.get("stop_reason")), None)
        # the all-reduce the job used, from the ranks' start records ("gloo", "ours:auto", ...)
        transports = {r["transport"] for r in records if r.get("kind") == "start" and r.get("transport")}
        if transports:
            known = job.get("transport")
            job["transport"] = "/".join(sorted(transports | ({known} if known else set())))
        # the data it trained on, from the ranks' data records (one source, unless ranks disagree)
        sources = {r["source"] for r in records if r.get("kind") == "data" and r.get("source")}
        if sources:
            known = job.get("data_source")
            job["data_source"] = " / ".join(sorted(sources | ({known} if known else set())))
        if origin is not None:
            earliest = clock.writers_start_unix
            clock.writers_start_unix = origin if earliest is None else min(origin, earliest)
            if rank == 0:
                clock.rank0_train_zero_unix = origin + start
                clock.rank0_steps = pd.DataFrame(rank_rows, columns=["step", "train_time_s"])
    # Evaluations of the output model: the evaluator's eval.jsonl (off the wire and off the
    # training clock; its train_time_s is the ranks' training clock), or, in runs made before
    # it, rank 0's in-band eval records read above.
    if job_dir.evals:
        evals = [{**base, **record, "rank": 0} for record in job_dir.evals]
    return _JobRows(job, steps, evals, _job_faults(job_dir, base, clock))


def _mean(values) -> Optional[float]:
    values = list(values)
    return float(sum(values) / len(values)) if values else None


def _membership_text(record: dict) -> tuple[str, str]:
    """(what, effect) of a trainer's membership record: who was lost or joined, who is live."""

    def ranks(values) -> str:
        values = list(values or [])
        return ("rank " if len(values) == 1 else "ranks ") + ", ".join(str(v) for v in values)

    parts = [f"{ranks(record.get('lost'))} lost"] if record.get("lost") else []
    parts += [f"{ranks(record.get('joined'))} joined"] if record.get("joined") else []
    live = record.get("live")
    effect = "live: " + (", ".join(str(v) for v in live) if live else "none") if live is not None else ""
    return ("; ".join(parts) or "membership unchanged"), effect


def _job_faults(job_dir: JobDir, base: dict, clock: _JobClock) -> list[dict]:
    """The fault events of one job (faults.jsonl) and the trainers' records of their effect.

    `time_s` counts from the job's start: the harness's own zero for `faults.jsonl`
    (`time_unix - applied_s`, the smallest over its rows, is that zero on the wall clock), or,
    without a `faults.jsonl`, the earliest rank writer's creation (a rank's first record's
    `time_unix - time_s`: about the process start plus Python's imports). Trainer records are
    placed by their `time_unix` against that zero. `train_time_s` is the same moment on rank 0's
    training clock (the x axis of the training curves). A fault's `step` is the last step rank 0
    had finished by then; a membership or rejoin record carries its own.
    """
    harness = job_dir.faults
    zeros = [r["time_unix"] - r["applied_s"] for r in harness
             if r.get("time_unix") is not None and r.get("applied_s") is not None]
    job_start_unix = min(zeros) if zeros else clock.writers_start_unix
    to_train = (None if job_start_unix is None or clock.rank0_train_zero_unix is None
                else job_start_unix - clock.rank0_train_zero_unix)
    job = {key: base.get(key) for key in ("job_id", "label", "algorithm", "seed", "network")}
    rows = []
    for record in harness:
        time_s = record.get("applied_s", record.get("due_s"))
        rows.append({**job, "time_s": time_s, "source": "fault", "what": record.get("what", ""),
                     "effect": record.get("effect", ""), "ok": record.get("ok"), "rank": None,
                     "due_s": record.get("due_s"), "time_unix": record.get("time_unix")})
    for rank, records in sorted(clock.records.items(), key=lambda item: str(item[0])):
        for record in records:
            kind = record.get("kind")
            if kind not in ("membership", "rejoin") or job_start_unix is None or record.get("time_unix") is None:
                continue
            if kind == "membership":
                what, effect = _membership_text(record)
            else:
                what = f"rank {record.get('rank', rank)} rejoined"
                effect = f"admitted after {record.get('restarts', '?')} restart(s)"
                if record.get("live") is not None:
                    effect += "; live: " + ", ".join(str(v) for v in record["live"])
            rows.append({**job, "time_s": record["time_unix"] - job_start_unix, "source": kind,
                         "what": what, "effect": effect, "ok": None, "rank": record.get("rank", rank),
                         "step": record.get("step"), "due_s": None, "time_unix": record["time_unix"]})
    for row in rows:
        row["train_time_s"] = None if to_train is None or row["time_s"] is None else row["time_s"] + to_train
        if row["source"] == "fault":
            row["step"] = _last_step_by(clock.rank0_steps, row["train_time_s"])
    return rows


def _last_step_by(rank0_steps: Optional[pd.DataFrame], train_time_s: Optional[float]) -> Optional[int]:
    """The highest step rank 0 had finished at `train_time_s` (None before its first)."""
    if rank0_steps is None or not len(rank0_steps) or train_time_s is None:
        return None
    done = rank0_steps[rank0_steps["train_time_s"] <= train_time_s + 1e-9]
    return int(done["step"].max()) if len(done) else None


def _faults_frame(rows: list[dict]) -> pd.DataFrame:
    """Rows of `_job_faults` as a frame in FAULT_COLUMNS order, each job's events in time order."""
    frame = pd.DataFrame(rows, columns=FAULT_COLUMNS)
    if not len(frame):
        return frame
    for column in ("time_s", "train_time_s"):  # differences of wall-clock times: microseconds are all there is
        frame[column] = frame[column].astype(float).round(6)
    frame["step"] = frame["step"].astype("Int64")
    frame["rank"] = frame["rank"].astype("Int64")
    order = frame["source"].map(_SOURCE_ORDER).fillna(len(_SOURCE_ORDER))
    frame = frame.assign(_order=order).sort_values(["job_id", "time_s", "_order"], kind="stable")
    return frame.drop(columns="_order").reset_index(drop=True)


def injection_failed(ok) -> bool:
    """True for a fault row whose injection failed (`ok` False); False for ok or empty (trainer rows)."""
    return ok is not None and not pd.isna(ok) and not bool(ok)


def load_faults(run_dir) -> pd.DataFrame:
    """Every job's fault events (its `faults.jsonl`) and the trainers' membership and rejoin
    records, one row each, in time order per job (columns: FAULT_COLUMNS; see `_job_faults`).

    source: "fault" (the harness applied it: `what`, `effect`, `ok`, `due_s`), "membership"
    (rank 0 saw the set of live ranks change: `what` names who was lost or joined, `effect` the
    live ranks) or "rejoin" (a restarted rank was admitted back). `ok` is False for an injection
    that failed (its `effect` is the error) and empty for trainer records.
    """
    return load_run(run_dir).faults


def time_to_target(evals: pd.DataFrame, target: float) -> Optional[float]:
    """Training time (s) at which accuracy first reaches `target`, interpolated linearly between the
    evaluation before and the one at or after the crossing (evals sorted by step); None if never."""
    times, accuracies = evals["train_time_s"].to_list(), evals["accuracy"].to_list()
    for index, accuracy in enumerate(accuracies):
        if accuracy >= target:
            if index == 0 or accuracies[index - 1] >= accuracy:
                return float(times[index])
            before_t, before_a = times[index - 1], accuracies[index - 1]
            return float(before_t + (target - before_a) / (accuracy - before_a) * (times[index] - before_t))
    return None


def time_to_loss_target(evals: pd.DataFrame, target_loss: float) -> Optional[float]:
    """Training time (s) at which the held-out loss first falls to `target_loss` or below: as
    `time_to_target` on the negated loss (interpolated between evaluations); None if never."""
    if "loss" not in evals:
        return None
    return time_to_target(pd.DataFrame({"train_time_s": evals["train_time_s"].to_list(),
                                        "accuracy": (-pd.to_numeric(evals["loss"])).to_list()}), -target_loss)


def accuracy_at(evals: pd.DataFrame, progress: pd.Series, budget: Optional[float]) -> Optional[float]:
    """Accuracy of the last evaluation whose `progress` (steps done, or training time) is at or
    before `budget`, if the job got that far (an evaluation at or past the budget); else None."""
    if budget is None or not len(evals) or progress.max() < budget:
        return None
    within = evals[progress <= budget]
    return float(within["accuracy"].iloc[-1]) if len(within) else None


def _mark_sweep_best(table: pd.DataFrame, jobs: pd.DataFrame) -> None:
    """sweep_best: among the variants of one algorithm entry that a tuning sweep (sweep.workload)
    made, at the same network point and seed, True for the best by accuracy at the step budget
    (then at the time budget, then final accuracy); empty for jobs of no tuning sweep."""
    if not len(table) or "base_label" not in jobs:
        return
    table["sweep_best"] = table["sweep_best"].astype(object)
    base = jobs["base_label"].to_list()
    # a tuning protocol's jobs (tuning: ...) are picked on the tuning seed (tuning.json), not here
    phases = jobs["phase"].to_list() if "phase" in jobs else [""] * len(jobs)
    tuned = [bool(t) and not phase for t, phase in zip(jobs["tuned"].to_list(), phases)]
    groups: dict = {}
    for index, row in table.iterrows():
        if tuned[index]:
            groups.setdefault((row["network"], base[index], row["seed"]), []).append(index)
    for members in groups.values():
        for column in ("accuracy_at_step_budget", "accuracy_at_time_budget", "final_accuracy"):
            scores = table.loc[members, column].astype(float)
            if scores.notna().any():
                best = scores.idxmax()
                for index in members:
                    table.at[index, "sweep_best"] = index == best
                break


def _has_phases(jobs: pd.DataFrame) -> bool:
    return len(jobs) > 0 and "phase" in jobs and any(jobs["phase"].fillna("").astype(str) != "")


def summarize(frames: RunFrames, target_accuracy: Optional[float] = None) -> pd.DataFrame:
    """One row per job of a loaded run (`load_run`): accuracy, time to target, throughput, bytes,
    and ratios against sync."""
    target = target_accuracy if target_accuracy is not None else frames.target_accuracy
    rows = []
    replica_output: list[bool] = []          # per row: the output model is the mean of the replicas
    median_blocked: list[Optional[float]] = []  # per row: median blocked time of a worker step
    for job in frames.jobs.to_dict("records"):
        ev = frames.evals[frames.evals["job_id"] == job["job_id"]] if len(frames.evals) else frames.evals
        st = frames.steps[frames.steps["job_id"] == job["job_id"]] if len(frames.steps) else frames.steps
        row, blocked = _job_row(job, ev, st, frames, target)
        replica_output.append(_mean_of_replicas(ev))
        median_blocked.append(blocked)
        rows.append(row)
    table = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    if _has_phases(frames.jobs):  # a run with a tuning protocol (only then: older summaries keep their columns)
        table.insert(SUMMARY_COLUMNS.index("seed") + 1, "phase", frames.jobs["phase"].to_list())
    _mark_sweep_best(table, frames.jobs)
    _add_output_sync(table, replica_output, median_blocked)
    _add_compute_comm_ratio(table, median_blocked)
    _add_ratios_vs_sync(table, _budget(frames), _budget_missed(frames))
    return table


def _budget(frames: RunFrames) -> EqualBudget:
    """The run's equal budget (frames made by hand may give only the two numbers: stated then)."""
    if frames.budget is not None:
        return frames.budget
    return EqualBudget(frames.budget_steps, frames.budget_time_s, frames.budget_steps is not None,
                       frames.budget_time_s is not None)


def _budget_missed(frames: RunFrames) -> list[str]:
    """Per job (frames.jobs' order), why it has no accuracy at the run's budget ("" if it has)."""
    budget, missed = _budget(frames), []
    for job in frames.jobs.to_dict("records") if len(frames.jobs) else []:
        ev = frames.evals[frames.evals["job_id"] == job["job_id"]] if len(frames.evals) else frames.evals
        steps_done, train_time_s = _last_evaluation(ev)
        missed.append(budget.missed(steps_done, train_time_s, job.get("status"), job.get("stop_reason")))
    return missed


def _job_row(job: dict, ev: pd.DataFrame, st: pd.DataFrame, frames: RunFrames,
             target: Optional[float]) -> tuple[dict, Optional[float]]:
    """One job's summary row (before the comparisons with sync), and the median blocked time of
    its workers' steps (None when not measured): what the comparisons of other jobs with it need."""
    row = {key: job.get(key) for key in ("network", "delay_scale", "rate", "nodes", "algorithm",
                                         "label", "seed", "status", "workload", "workload_without_lr",
                                         "backend", "wall_s", "congestion_control")}
    median_blocked = None
    if len(ev):
        ev = ev.sort_values("step")
        row["final_accuracy"] = float(ev["accuracy"].iloc[-1])
        row["best_accuracy"] = float(ev["accuracy"].max())
        if target is not None:
            row["time_to_target_s"] = time_to_target(ev, target)
        elif frames.target_loss is not None:
            row["time_to_target_s"] = time_to_loss_target(ev, frames.target_loss)
        # an eval record's `step` is the index of the last step done
        row["accuracy_at_step_budget"] = accuracy_at(ev, ev["step"] + 1, frames.budget_steps)
        row["accuracy_at_time_budget"] = accuracy_at(ev, ev["train_time_s"], frames.budget_time_s)
    # Roles: a parameter server's ranks (job params server_ranks) serve; the others train.
    # Throughput, blocked time and bytes per node are the workers'; the servers' bytes apart.
    servers = set(job.get("server_ranks") or [])
    row["servers"] = len(servers)
    if len(st):
        workers = st[~st["rank"].isin(servers)] if servers else st
        row["workers"] = int(workers["rank"].nunique())
        first = workers[workers["rank"] == workers["rank"].min()] if len(workers) else workers
        row["steps"] = int(first["step"].max()) + 1 if len(first) else None
        row["train_time_s"] = float(first["train_time_s"].max()) if len(first) else None
        if row.get("steps") and row.get("train_time_s"):
            row["steps_per_s"] = row["steps"] / row["train_time_s"]
        # Sum of the per-step counts, not the last running total: a restarted rank's total
        # starts again from 0 in its new process.
        if has_values(workers, "bytes_sent"):  # a user's script may not count its bytes
            row["bytes_sent_per_node"] = float(workers.groupby("rank")["bytes_sent"].sum().mean())
        if servers and has_values(st, "bytes_sent"):
            served = st[st["rank"].isin(servers)]
            row["server_bytes_sent_per_node"] = float(served.groupby("rank")["bytes_sent"].sum().mean())
        if row.get("steps") and row.get("bytes_sent_per_node") is not None:
            row["bytes_per_step_per_node"] = row["bytes_sent_per_node"] / row["steps"]
        if "compute_s" in workers and workers["compute_s"].notna().any():
            row["compute_s_per_step"] = float(workers["compute_s"].dropna().median())
        blocked = workers["comm_blocked_s"].dropna() if has_values(workers, "comm_blocked_s") else []
        if len(blocked) and has_values(workers, "step_s"):
            median_blocked = float(blocked.median())
            row["comm_blocked_fraction"] = float(blocked.sum() / workers.loc[blocked.index, "step_s"].sum())
        row.update(utilisation_and_bandwidth(workers))
        if "staleness" in workers and workers["staleness"].notna().any():
            row["mean_staleness"] = float(workers["staleness"].dropna().mean())
        row.update(sync_evidence(st, ev, target))
    wire = job.get("wire") or {}
    row["wire_bytes_per_node"] = _mean(sent for rank, sent in wire.items() if rank not in servers)
    if servers:
        row["server_wire_bytes_per_node"] = _mean(sent for rank, sent in wire.items() if rank in servers)
    stand_in = job.get("stand_in")
    if isinstance(stand_in, dict):
        row["stand_in_parameters"] = stand_in.get("parameters")
        row["wire_scale"] = stand_in.get("wire_scale")
    transport = job.get("transport")
    if isinstance(transport, str):
        row["transport"] = transport
    data_source = job.get("data_source")
    if isinstance(data_source, str):
        row["data_source"] = data_source
    if job.get("tuned"):
        row["tuned"] = " ".join(f"{k}={v}" for k, v in job["tuned"].items())
    if row.get("wire_bytes_per_node") is not None and row.get("bytes_sent_per_node"):
        # what the wire carried beyond the tensors the trainers counted: headers, handshakes,
        # retransmissions, control messages
        row["wire_overhead"] = row["wire_bytes_per_node"] / row["bytes_sent_per_node"] - 1.0
    row["time_dilation"] = frames.time_dilation
    return row, median_blocked


def utilisation_and_bandwidth(workers: pd.DataFrame) -> dict:
    """compute_utilisation, mean_bandwidth_per_node_bit_s and peak_bandwidth_per_node_bit_s of
    one job from its workers' step records (METRICS says how each is defined); a metric whose
    fields are not recorded is left out."""
    metrics: dict = {}
    if not has_values(workers, "step_s"):
        return metrics
    timed = workers[workers["step_s"].notna() & (workers["step_s"] > 0)]
    if has_values(timed, "compute_s"):
        measured = timed[timed["compute_s"].notna()]
        metrics["compute_utilisation"] = float(measured["compute_s"].sum() / measured["step_s"].sum())
    if has_values(timed, "bytes_sent"):
        by_rank = timed.groupby("rank")
        mean = by_rank["bytes_sent"].sum() * 8 / by_rank["step_s"].sum()
        peak = (timed["bytes_sent"] * 8 / timed["step_s"]).groupby(timed["rank"]).max()
        metrics["mean_bandwidth_per_node_bit_s"] = float(mean.mean())
        metrics["peak_bandwidth_per_node_bit_s"] = float(peak.mean())
    return metrics


def sync_evidence(steps: pd.DataFrame, evals: pd.DataFrame, target: Optional[float]) -> dict:
    """first_sync_step, first_sync_s and syncs_before_target of one job from its step records'
    per-step ``syncs_applied`` (every rank, servers too: a server applies the updates) and its
    evaluations; {} when the records do not count synchronisations (older runs, a user's script).

    The first synchronisation is the earliest in training time on any rank. Synchronisations
    before the target are counted per rank up to the step of the first evaluation at or over the
    target (the model that reached it), summed per step (a restarted rank's counts start again),
    and the largest rank's count is given; none when the target was not reached.
    """
    if not len(steps) or not has_values(steps, "syncs_applied"):
        return {}
    counts = pd.to_numeric(steps["syncs_applied"], errors="coerce").fillna(0)
    applied = steps[counts > 0]
    out: dict = {"first_sync_step": None, "first_sync_s": None, "syncs_before_target": None}
    if len(applied):
        first = applied.loc[applied["train_time_s"].idxmin()]
        out["first_sync_step"], out["first_sync_s"] = int(first["step"]), float(first["train_time_s"])
    if target is not None and len(evals):
        reached = evals.sort_values("step")
        reached = reached[reached["accuracy"] >= target]
        if len(reached):
            by_target = steps["step"] <= reached["step"].iloc[0]
            out["syncs_before_target"] = int(counts[by_target].groupby(steps.loc[by_target, "rank"]).sum().max()
                                             if by_target.any() else 0)
    return out


def independent_training(row) -> bool:
    """Whether a job reached the target before any synchronisation was applied (syncs_before_target
    0): its speedup is the replicas' own, averaged once by the evaluator, not the mechanism's."""
    count = row.get("syncs_before_target")
    reached = row.get("time_to_target_s")
    return count is not None and pd.notna(count) and int(count) == 0 and reached is not None and pd.notna(reached)


def sync_reference(table: pd.DataFrame, row, among: Optional[pd.Series] = None) -> Optional[pd.Series]:
    """The sync job `row` is compared with: same network point and seed, and the same workload
    where sync ran on several (else the same workload but for the learning-rate settings, as for
    an algorithm at its own lr beside sync at sync's; else the first, as for sync variants of one
    workload); None when
    there is no sync job there. Every comparison with sync goes through here. Under a tuning
    protocol (a `phase` column), within the row's phase: a reported job against the reported
    sync (at sync's pick), a tuning candidate against sync's candidate of the same workload.

    Args:
        table: summary rows (`algorithm`, `network`, `seed`, `workload` columns).
        row: the row to compare (a Series or a dict).
        among: a boolean Series over `table`'s index: only these rows may be the reference (the
            sync jobs that measured what the comparison needs).
    """
    chosen = (table["algorithm"] == "sync") & (table["network"] == row["network"]) & (table["seed"] == row["seed"])
    if "phase" in table:  # under tuning: a reported job against the reported sync (at sync's pick)
        chosen &= table["phase"].fillna("") == (row.get("phase") if isinstance(row.get("phase"), str) else "")
    if among is not None:
        chosen &= among
    candidates = table[chosen]
    for key in ("workload", "workload_without_lr"):
        if len(candidates) > 1 and key in table:
            same = candidates[candidates[key] == row.get(key)]
            if len(same):
                candidates = same
                break
    return candidates.iloc[0] if len(candidates) else None


def _add_ratios_vs_sync(table: pd.DataFrame, budget: EqualBudget, missed: list[str]) -> None:
    """Ratios against sync (sync_reference): >1 means faster than sync. Where the scenario runs
    sync on several workloads (e.g. compute padded or not), the sync job of the same workload.
    The accuracy delta is taken at the run's one budget (`budget.compared_on`), never at another
    point for some jobs: where this job or its sync did not get there it stays empty, and
    budget_not_reached (`missed`, per row) says why."""
    compared = "accuracy_at_step_budget" if budget.compared_on == STEPS else "accuracy_at_time_budget"
    table["budget_not_reached"] = table["budget_not_reached"].astype(object)
    for index, row in table.iterrows():
        ref = sync_reference(table, row)
        if ref is None:
            continue
        if pd.notna(ref["time_to_target_s"]) and pd.notna(row["time_to_target_s"]):
            table.at[index, "speedup_vs_sync"] = ref["time_to_target_s"] / row["time_to_target_s"]
        if pd.notna(ref["steps_per_s"]) and pd.notna(row["steps_per_s"]):
            table.at[index, "throughput_speedup_vs_sync"] = row["steps_per_s"] / ref["steps_per_s"]
        if missed[index]:
            table.at[index, "budget_not_reached"] = missed[index]
        elif missed[ref.name]:
            table.at[index, "budget_not_reached"] = f"its sync ({ref['label']}): {missed[ref.name]}"
        elif pd.notna(ref[compared]) and pd.notna(row[compared]):
            table.at[index, "accuracy_delta_vs_sync"] = row[compared] - ref[compared]
        else:  # got past the budget, but its first evaluation came after it
            whose = "its" if pd.isna(row[compared]) else f"its sync's ({ref['label']})"
            table.at[index, "budget_not_reached"] = (f"{whose} first evaluation came after the budget of "
                                                     f"{budget.describe_compared()}")


def _mean_of_replicas(evals: pd.DataFrame) -> bool:
    """Whether the evaluator's output model was the mean of several ranks' replicas."""
    if not len(evals) or "role" not in evals or "ranks" not in evals:
        return False
    ranks = evals["ranks"].iloc[-1]
    return evals["role"].iloc[-1] == "replica" and isinstance(ranks, list) and len(ranks) > 1


def _add_output_sync(table: pd.DataFrame, replica_output: list[bool], median_blocked: list[Optional[float]]) -> None:
    """The output model of local SGD, DTS and gossip is the mean of the replicas: evaluated off
    the wire it costs nothing, but a user who wants it must average the replicas once, one
    all-reduce of the model on this network. Without that cost a job whose replicas, averaged,
    reach the target before they ever synchronised would show a time to target of a few steps of
    compute. So output_sync_s = sync's median blocked time per step (sync_reference: same network
    point, seed and workload; one all-reduce of the same model on the same transport, measured),
    and time_to_target_s includes it. Jobs whose output needs no averaging (rank 0, centre,
    server) get 0; without a sync job to measure it, output_sync_s stays empty and
    time_to_target_s without it."""
    table["output_sync_s"] = table["output_sync_s"].astype(float)
    measured = pd.Series([value is not None for value in median_blocked], index=table.index, dtype=bool)
    for index, row in table.iterrows():
        if not replica_output[index]:
            table.at[index, "output_sync_s"] = 0.0
            continue
        ref = sync_reference(table, row, among=measured)
        if ref is None:
            continue
        cost = median_blocked[ref.name]
        table.at[index, "output_sync_s"] = cost
        if pd.notna(row["time_to_target_s"]):
            table.at[index, "time_to_target_s"] = row["time_to_target_s"] + cost


def charge_output_sync_from(rows: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """`rows` (summary rows of runs that had no sync: output_sync_s empty where the output is the
    mean of replicas) charged the output's average that `reference` (a finished run's summary, with
    sync) charged at the same network point and seed: the same all-reduce of the same model on the
    same network, measured there (_add_output_sync), added to time_to_target_s. A run made later to
    step one past a grid's edge has no sync of its own; its labels are only comparable with the
    reference's once they pay what the reference's labels paid. `output_sync_charged` marks the
    rows charged; a (network, seed) the reference never charged is left as it was."""
    rows = rows.copy()
    rows["output_sync_charged"] = False
    if "output_sync_s" not in rows or "output_sync_s" not in reference:
        return rows
    paid = reference[pd.to_numeric(reference["output_sync_s"], errors="coerce") > 0]
    charges = paid.groupby(["network", "seed"])["output_sync_s"].median()
    for index, row in rows[rows["output_sync_s"].isna()].iterrows():
        key = (row["network"], row["seed"])
        if key in charges.index:
            rows.at[index, "output_sync_s"] = charges[key]
            rows.at[index, "time_to_target_s"] = row["time_to_target_s"] + charges[key]
            rows.at[index, "output_sync_charged"] = True
    return rows


def _add_compute_comm_ratio(table: pd.DataFrame, median_blocked: list[Optional[float]]) -> None:
    """compute_comm_ratio: a job's median compute per step over one all-reduce of the model on its
    network (sync's median blocked step: sync_reference; none without a sync job that blocked)."""
    table["compute_comm_ratio"] = table["compute_comm_ratio"].astype(float)
    blocked = pd.Series([bool(value) for value in median_blocked], index=table.index, dtype=bool)
    for index, row in table.iterrows():
        ref = sync_reference(table, row, among=blocked)
        if ref is not None and pd.notna(row["compute_s_per_step"]):
            table.at[index, "compute_comm_ratio"] = row["compute_s_per_step"] / median_blocked[ref.name]


def write_summary(run_dir, table: pd.DataFrame) -> Path:
    path = Path(run_dir) / "summary.csv"
    write_text_atomic(path, table.to_csv(index=False))
    return path


# The terminal table (`wanbench run` and `report` without --wide): the columns a user reads first,
# with short headers, fitted to TERMINAL_WIDTH. (column, header, how to write a value).
TERMINAL_WIDTH = 100
TERMINAL_COLUMNS = [
    ("network", "network", str),
    ("label", "label", str),
    ("seed", "seed", lambda v: f"{v:.0f}" if isinstance(v, float) else str(v)),  # 0.0 read back from CSV
    ("phase", "phase", str),  # only under a tuning protocol
    ("status", "status", str),
    ("final_accuracy", "acc", lambda v: f"{v:.3f}"),
    ("time_to_target_s", "to target s", lambda v: _compact(v)),
    ("steps_per_s", "steps/s", lambda v: _compact(v)),
    ("speedup_vs_sync", "speedup", lambda v: f"{_compact(v)}x"),
    ("accuracy_delta_vs_sync", "acc Δ", lambda v: f"{v:+.3f}"),
]
# Which columns give way, first to last, when a long label (or network name) needs the width (a
# tuning run's phase says which rows are candidates: it stays longer than steps/s);
# then status where every job is ok and network where there is one (the caption says which);
# the label always stays.
TERMINAL_DROP_ORDER = ["steps_per_s", "phase", "seed", "accuracy_delta_vs_sync", "time_to_target_s",
                       "final_accuracy", "speedup_vs_sync", "status", "network"]
TERMINAL_CAPTION = ("acc: final accuracy; speedup, acc Δ: against sync (same network, seed); "
                    "--wide: more columns")


def _compact(value: float) -> str:
    """A number in a few characters, never an exponent: 0.0123, 0.702, 4.22, 18.0, 326, 12345."""
    size = abs(value)
    if size < 1:
        return f"{value:.3g}"
    return f"{value:.2f}" if size < 10 else f"{value:.1f}" if size < 100 else f"{value:.0f}"


def _missing(value) -> bool:
    # "" too: a job that never wrote job.json has no network (a CSV read back says NaN)
    return value is None or value == "" or (isinstance(value, float) and pd.isna(value))


def summary_table(table: pd.DataFrame, title: str, wide: bool = False, width: int = TERMINAL_WIDTH):
    """A rich Table of a run's summary for the terminal.

    Args:
        wide: HEADLINE_COLUMNS under their full names, as wide as they come (`--wide`).
        width: without `wide`, the table fits this many columns: short headers, compact numbers,
            and where a long label needs the room, columns leave in TERMINAL_DROP_ORDER (the
            caption names them); a label or network is never cut.
    """
    return _wide_table(table, title) if wide else _terminal_table(table, title, width)


def _terminal_table(table: pd.DataFrame, title: str, width: int):
    from rich import box
    from rich.cells import cell_len
    from rich.table import Table

    records = table.to_dict("records")
    columns = [c for c in TERMINAL_COLUMNS if c[0] != "phase" or "phase" in table]
    cells = {name: [("-" if _missing(r.get(name)) else write(r.get(name))) for r in records]
             for name, _, write in columns}
    needed = {name: max([cell_len(header)] + [cell_len(c) for c in cells[name]]) for name, header, _ in columns}

    def table_width(kept):  # box.SIMPLE_HEAD without edges: a space of padding each side of a
        return sum(needed[name] + 2 for name, _, _ in kept) + len(kept) - 1  # cell, a rule between two

    dropped = []
    for name in TERMINAL_DROP_ORDER:
        if table_width(columns) <= width:
            break
        if not any(c[0] == name for c in columns):
            continue
        values = set(cells[name])
        if name in ("status", "network") and len(values) > 1:
            continue  # a failed job, or which network a row is at, must show
        if name == "status" and values != {"ok"}:
            continue
        columns = [c for c in columns if c[0] != name]
        header = next(header for n, header, _ in TERMINAL_COLUMNS if n == name)
        dropped.append(f"{header} (all {values.pop()})" if name in ("status", "network") else header)
    caption = TERMINAL_CAPTION + (f"; left out for width: {', '.join(dropped)}" if dropped else "")
    out = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False,
                caption_justify="left")
    for name, header, _ in columns:
        text = name in ("network", "label", "status", "phase")
        out.add_column(header, justify="left" if text else "right", no_wrap=True, min_width=needed[name])
    for index in range(len(records)):
        out.add_row(*(cells[name][index] for name, _, _ in columns))
    return out


def _wide_table(table: pd.DataFrame, title: str):
    from rich.table import Table

    shown = list(HEADLINE_COLUMNS)
    if "phase" in table:  # a tuning protocol's run: tuning or reported
        shown.insert(shown.index("seed") + 1, "phase")
    out = Table(title=title)
    for column in shown:
        out.add_column(column.replace("_", " "), justify="right")

    def fmt(value, column):
        if _missing(value):
            return "-"
        if column in BYTE_COLUMNS:
            return format_bytes(value)
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    for row in table.to_dict("records"):
        out.add_row(*(fmt(row.get(c), c) for c in shown))
    return out


# --- across seeds (issue 21 §10) ---------------------------------------------------------------------

# The headline columns aggregated over seeds. The ratios against sync (speedup_vs_sync,
# throughput_speedup_vs_sync) and accuracy_delta_vs_sync are each seed's own, against the sync job
# of the same seed (sync_reference), and are aggregated as they stand: the median of the per-seed
# ratios, never the ratio of two medians.
SEED_COLUMNS = ("time_to_target_s", "speedup_vs_sync", "throughput_speedup_vs_sync", "steps_per_s",
                "accuracy_delta_vs_sync", "final_accuracy", "first_sync_step", "syncs_before_target")
# One group: a network point, an algorithm's label, its workload (a variant of the same label:
# compute padded or not) and its tuned values (a tuning candidate's or a sweep variant's lr), in
# one run where summaries of several runs are combined; under a tuning protocol, its phase (a
# candidate on the tuning seed is never pooled with the reported seeds at the pick, though both
# run the same lr).
SEED_GROUP_KEYS = ("run", "network", "label", "workload", "tuned", "phase")
# A headline needs this many seeds (issue 21 §10); fewer is said next to it.
MIN_SEEDS = 3
SEED_STATS = ("n", "median", "min", "max")


def seed_stats(values) -> dict:
    """n, median, min and max of the non-empty `values` (one per seed); n 0 and the rest None when
    none has a value."""
    clean = pd.to_numeric(pd.Series(list(values), dtype=object), errors="coerce").dropna()
    if not len(clean):
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": int(len(clean)), "median": float(clean.median()), "min": float(clean.min()),
            "max": float(clean.max())}


def across_seeds(summary: pd.DataFrame, columns=SEED_COLUMNS, min_seeds: int = MIN_SEEDS) -> pd.DataFrame:
    """One row per (run, network point, label, workload) of summary rows (`summarize`; a report's
    combined summary), aggregated over its seeds: `seeds` (how many jobs, whatever their status),
    `seed_list`, `few_seeds` (True when seeds < min_seeds), `independent_seeds` (seeds whose target
    was reached before any synchronisation: `independent_training`), and for each of `columns`
    `<column>_n` (seeds with a value), `_median`, `_min`, `_max`. Group keys absent from `summary`
    are left out. Rows keep the summary's order of first appearance."""
    keys = [key for key in SEED_GROUP_KEYS if key in summary.columns]
    stat_columns = [f"{column}_{stat}" for column in columns for stat in SEED_STATS]
    out_columns = [*keys, "algorithm", "seeds", "seed_list", "few_seeds", "independent_seeds", *stat_columns]
    if not len(summary):
        return pd.DataFrame(columns=out_columns)
    rows = []
    for group_key, group in summary.groupby(keys, sort=False, dropna=False):
        group_key = group_key if isinstance(group_key, tuple) else (group_key,)
        row = dict(zip(keys, group_key))
        row["algorithm"] = group["algorithm"].iloc[0] if "algorithm" in group else None
        seeds = sorted(group["seed"].dropna().unique().tolist()) if "seed" in group else []
        row["seeds"] = int(len(group))
        row["seed_list"] = " ".join(str(int(s)) if float(s).is_integer() else str(s) for s in seeds)
        row["few_seeds"] = row["seeds"] < min_seeds
        row["independent_seeds"] = int(sum(independent_training(r) for r in group.to_dict("records")))
        for column in columns:
            stats = seed_stats(group[column] if column in group else [])
            row.update({f"{column}_{stat}": value for stat, value in stats.items()})
        rows.append(row)
    return pd.DataFrame(rows, columns=out_columns)


def format_seed_cell(row, column: str, digits: int = 3) -> str:
    """`median [min..max] (n)` of one aggregated column (across_seeds), "-" without a value;
    n only where it differs from the group's seeds."""
    n = row.get(f"{column}_n")
    if not n or pd.isna(n):
        return "-"

    def number(value) -> str:
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"

    text = number(row[f"{column}_median"])
    if row[f"{column}_min"] != row[f"{column}_max"]:
        text += f" [{number(row[f'{column}_min'])}..{number(row[f'{column}_max'])}]"
    if int(n) != int(row.get("seeds") or n):
        text += f" (n={int(n)})"
    return text
