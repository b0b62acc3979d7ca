"""Results tables: per-rank JSONL records of a run directory -> pandas DataFrames -> summary.csv.

`load_run(run_dir)` gives tidy frames (one row per step / eval record, with job columns);
`summarize(run_dir)` gives one row per job with the comparison against `sync` at the same network
point and seed. Pure functions of files: the plots and notebooks use the same frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

SUMMARY_COLUMNS = [
    "network", "delay_scale", "rate", "nodes", "algorithm", "label", "seed", "status",
    "final_accuracy", "best_accuracy", "time_to_target_s", "steps", "train_time_s", "steps_per_s",
    "speedup_vs_sync", "throughput_speedup_vs_sync", "accuracy_delta_vs_sync",
    "bytes_sent_per_node", "bytes_per_step_per_node", "comm_blocked_fraction", "mean_staleness",
]


@dataclass
class RunFrames:
    jobs: pd.DataFrame    # one row per job (job.json + config)
    steps: pd.DataFrame   # one row per step record, every rank
    evals: pd.DataFrame   # one row per eval record (rank 0)
    target_accuracy: Optional[float]
    complete: bool


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # a torn last line of a crashed rank: keep what came before it
    return rows


def load_run(run_dir) -> RunFrames:
    """Read every job of a run directory into DataFrames."""
    run_dir = Path(run_dir)
    scenario = json.loads((run_dir / "scenario.json").read_text())
    target = (scenario.get("spec", {}).get("stop") or {}).get("target_accuracy")
    jobs, steps, evals = [], [], []
    for job_dir in sorted((run_dir / "jobs").glob("*")) if (run_dir / "jobs").is_dir() else []:
        info_path = job_dir / "job.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {"status": "incomplete"}
        network = info.get("network", {})
        base = {"job_id": job_dir.name, "label": info.get("label", job_dir.name),
                "algorithm": info.get("algorithm"), "seed": info.get("seed"),
                "delay_scale": network.get("delay_scale"), "rate": network.get("rate"),
                "nodes": info.get("nodes")}
        base["network"] = info.get("network_key", "")
        jobs.append({**base, "status": info.get("status"), "wall_s": info.get("wall_s"),
                     "reason": info.get("reason", "")})
        for rank_file in sorted(job_dir.glob("rank*.jsonl")):
            records = _read_jsonl(rank_file)
            # Time zero is when this rank began its first step: process start-up (importing torch,
            # loading data, the rendezvous) is the same for every algorithm and is not training.
            first = next((r for r in records if r.get("kind") == "step"), None)
            if first is not None:
                start = first["time_s"] - (first.get("step_s") or 0.0)
            else:
                start = next((r["time_s"] for r in records if r.get("kind") == "start"), 0.0)
            for record in records:
                kind = record.get("kind")
                # Evaluation stays in: it is the same protocol for every algorithm, and its
                # communication (averaging a deployable model) overlaps the algorithm's own, so
                # subtracting it would credit an algorithm with the evaluation's network time.
                row = {**base, **record, "train_time_s": record.get("time_s", 0.0) - start}
                if kind == "step":
                    steps.append(row)
                elif kind == "eval":
                    evals.append(row)
    return RunFrames(pd.DataFrame(jobs), pd.DataFrame(steps), pd.DataFrame(evals), target,
                     (run_dir / "COMPLETE").exists())


def summarize(run_dir, target_accuracy: Optional[float] = None) -> pd.DataFrame:
    """One row per job: accuracy, time to target, throughput, bytes, and ratios against sync."""
    frames = load_run(run_dir)
    target = target_accuracy if target_accuracy is not None else frames.target_accuracy
    rows = []
    for job in frames.jobs.to_dict("records"):
        row = {key: job.get(key) for key in ("network", "delay_scale", "rate", "nodes", "algorithm",
                                                 "label", "seed", "status")}
        ev = frames.evals[frames.evals["job_id"] == job["job_id"]] if len(frames.evals) else frames.evals
        st = frames.steps[frames.steps["job_id"] == job["job_id"]] if len(frames.steps) else frames.steps
        if len(ev):
            ev = ev.sort_values("step")
            row["final_accuracy"] = float(ev["accuracy"].iloc[-1])
            row["best_accuracy"] = float(ev["accuracy"].max())
            if target is not None:
                hit = ev[ev["accuracy"] >= target]
                row["time_to_target_s"] = float(hit["train_time_s"].iloc[0]) if len(hit) else None
        if len(st):
            rank0 = st[st["rank"] == 0]
            row["steps"] = int(rank0["step"].max()) + 1 if len(rank0) else None
            row["train_time_s"] = float(rank0["train_time_s"].max()) if len(rank0) else None
            if row.get("steps") and row.get("train_time_s"):
                row["steps_per_s"] = row["steps"] / row["train_time_s"]
            last = st.sort_values("step").groupby("rank").tail(1)
            row["bytes_sent_per_node"] = float(last["bytes_sent_total"].mean())
            if row.get("steps"):
                row["bytes_per_step_per_node"] = row["bytes_sent_per_node"] / row["steps"]
            blocked = st["comm_blocked_s"].dropna()
            if len(blocked):
                row["comm_blocked_fraction"] = float(blocked.sum() / st.loc[blocked.index, "step_s"].sum())
            if "staleness" in st and st["staleness"].notna().any():
                row["mean_staleness"] = float(st["staleness"].dropna().mean())
        rows.append(row)
    table = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    # Ratios against sync at the same network point and seed: >1 means faster than sync.
    for index, row in table.iterrows():
        ref = table[(table["algorithm"] == "sync") & (table["network"] == row["network"])
                    & (table["seed"] == row["seed"])]
        if not len(ref):
            continue
        ref = ref.iloc[0]
        if pd.notna(ref["time_to_target_s"]) and pd.notna(row["time_to_target_s"]):
            table.at[index, "speedup_vs_sync"] = ref["time_to_target_s"] / row["time_to_target_s"]
        if pd.notna(ref["steps_per_s"]) and pd.notna(row["steps_per_s"]):
            table.at[index, "throughput_speedup_vs_sync"] = row["steps_per_s"] / ref["steps_per_s"]
        if pd.notna(ref["final_accuracy"]) and pd.notna(row["final_accuracy"]):
            table.at[index, "accuracy_delta_vs_sync"] = row["final_accuracy"] - ref["final_accuracy"]
    return table


def write_summary(run_dir, table: pd.DataFrame) -> Path:
    path = Path(run_dir) / "summary.csv"
    tmp = path.with_suffix(".csv.tmp")
    table.to_csv(tmp, index=False)
    tmp.replace(path)
    return path


def summary_table(table: pd.DataFrame, title: str):
    """A rich Table of the comparison columns people read first."""
    from rich.table import Table

    shown = ["network", "label", "seed", "status", "final_accuracy", "time_to_target_s", "steps_per_s",
             "speedup_vs_sync", "throughput_speedup_vs_sync", "accuracy_delta_vs_sync",
             "bytes_sent_per_node", "comm_blocked_fraction"]
    out = Table(title=title)
    for column in shown:
        out.add_column(column.replace("_", " "), justify="right")

    def fmt(value, column):
        if value is None or (isinstance(value, float) and pd.isna(value)):
            return "-"
        if column == "bytes_sent_per_node":
            return f"{value / 1e6:.1f} MB"
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
        return str(value)

    for row in table.to_dict("records"):
        out.add_row(*(fmt(row.get(c), c) for c in shown))
    return out
