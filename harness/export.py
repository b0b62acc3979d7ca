"""`wanbench export`: a finished run's records where researchers look, TensorBoard or Parquet.

Both read the run once through the one run reader (`results.load_run` -> `RunFrames`, and
`results.summarize` for the summary), so every number is the one the report shows: times in
emulated seconds on a dilated run, training time counted from rank 0's first step.

TensorBoard (`export_tensorboard`): one run (a subfolder named by the job id) per job, event files
written by torch's `SummaryWriter`. Tags, each against the step (`global_step`):

- `eval/accuracy`, `eval/loss`: the evaluator's records of the output model (an eval record's step
  is the index of the last step done before it);
- `train/loss`, `train/train_time_s`: rank 0's step records (training loss; training seconds at the
  end of that step);
- `bytes_sent/rank<N>`, `bytes_recv/rank<N>`, `step_s/rank<N>`, `comm_blocked_s/rank<N>`: every
  rank's step records (bytes its communication layer sent and received in that step, counted from
  tensor sizes; the step's seconds and the part of it blocked on communication). A value a record
  leaves empty is not written.

Each point's `walltime` is its training time (`train_time_s`, seconds since rank 0's first step
began, emulated seconds on a dilated run), not the wall clock: TensorBoard's "Relative" x axis then
reads training time (from the series' first point) and the "Wall" axis 1970-01-01 plus training
time. `train/train_time_s` gives the same against step. The wall clock of every record is in the
Parquet export (`time_unix`). Values are stored as TensorBoard's 32-bit floats.

Parquet (`export_parquet`): `jobs`, `steps`, `evals`, `faults` (the frames of `load_run`, every
rank's records) and `summary` (`summarize`, with its job's `job_id`), one file each, written with
`pandas.to_parquet` (pyarrow). Every row carries its job's scenario fields from scenario.json:
`network` (the network point's key), `network.<field>` (delay_scale, rate, nodes_per_region),
`algorithm`, `label`, `seed`, `params.<name>` and `workload.<key>` (the trainer settings other than
algorithm, seed, output dir and comm, nested keys dotted: `workload.model.name`). A list or mapping
in a cell (a rank list, the jobs' wire bytes per rank, a model's hidden sizes) is stored as its
JSON text.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from emulator.netns import SystemCheckError
from emulator.schema import ConfigError

from .report import open_run
from .results import NOT_WORKLOAD_KEYS, RunFrames, load_run, summarize
from .rundir import RunDir

FORMATS = ("tensorboard", "parquet")
EXPORT_FOLDER = "export"  # the default output: RUN_DIR/export/<format>/

# Step-record fields written per rank (tag `<field>/rank<N>`).
RANK_STEP_FIELDS = ("bytes_sent", "bytes_recv", "step_s", "comm_blocked_s")
EVAL_FIELDS = ("accuracy", "loss")
PARQUET_TABLES = ("jobs", "steps", "evals", "faults", "summary")
# Scenario fields every Parquet row carries as they appear in the frames already (job.json's);
# taken from scenario.json where a job's own file lacks them.
JOB_KEY_COLUMNS = ("algorithm", "label", "seed")


@dataclass
class Exported:
    """What an export wrote: its folder, the files, the seconds it took."""

    out_dir: Path
    files: list[Path]
    seconds: float


def check_format(name: str) -> str:
    """`name` if it is an export format, else ConfigError naming the flag (one line, exit 2)."""
    if name not in FORMATS:
        raise ConfigError("", f"unknown format {name!r}; give one of: {', '.join(FORMATS)}", source="--format")
    return name


def open_finished_run(path) -> RunDir:
    """`path` as a complete run directory, or ConfigError naming it: missing, not a run, or
    without its COMPLETE file (crashed, interrupted or still running: its records are partial)."""
    run = open_run(path)
    if not run.complete:
        why = f"interrupted: {run.interrupted}" if run.interrupted else "crashed, killed or still running"
        raise ConfigError("", f"incomplete run: no COMPLETE file ({why}); export reads finished runs only",
                          source=str(path))
    return run


def default_out_dir(run_dir, fmt: str) -> Path:
    return Path(run_dir) / EXPORT_FOLDER / fmt


def export_run(run_dir, fmt: str, out_dir=None) -> Exported:
    """Export the finished run at `run_dir` as `fmt` ("tensorboard" or "parquet") into `out_dir`
    (default RUN_DIR/export/<fmt>/). ConfigError for a bad format or run directory."""
    fmt = check_format(fmt)
    run = open_finished_run(run_dir)
    out = Path(out_dir) if out_dir is not None else default_out_dir(run.path, fmt)
    started = time.perf_counter()
    frames = load_run(run)
    files = export_tensorboard(frames, out) if fmt == "tensorboard" else export_parquet(frames, out)
    return Exported(out, files, time.perf_counter() - started)


# --- TensorBoard -----------------------------------------------------------------------------------


def _summary_writer():
    """torch's SummaryWriter; SystemCheckError saying how to install it when `tensorboard` is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise SystemCheckError(f"export --format tensorboard needs the tensorboard package ({exc}); "
                               "run scripts/setup.sh (or pip install tensorboard)") from None
    return SummaryWriter


def _number(value) -> Optional[float]:
    """`value` as a float, None when empty, not a number or not finite."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _add_series(writer, tag: str, rows: pd.DataFrame, field: str) -> int:
    """`rows[field]` against `rows["step"]`, walltime their train_time_s (0 where unknown); empty
    values skipped. Returns the points written."""
    if field not in rows:
        return 0
    written = 0
    times = rows["train_time_s"] if "train_time_s" in rows else [None] * len(rows)
    for step, value, train_time_s in zip(rows["step"], rows[field], times):
        value, step_number, walltime = _number(value), _number(step), _number(train_time_s)
        if value is None or step_number is None:
            continue
        writer.add_scalar(tag, value, global_step=int(step_number),
                          walltime=walltime if walltime is not None else 0.0)
        written += 1
    return written


def _clear_event_files(folder: Path) -> None:
    """Remove an earlier export's event files from a job's folder: TensorBoard would read both."""
    for old in folder.glob("events.out.tfevents.*"):
        old.unlink()


def export_tensorboard(frames: RunFrames, out_dir) -> list[Path]:
    """One TensorBoard run per job under `out_dir` (tags and clocks: the module docstring).
    Returns the event files written."""
    summary_writer = _summary_writer()
    out = Path(out_dir)
    files = []
    for job_id in frames.jobs["job_id"] if len(frames.jobs) else []:
        folder = out / str(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        _clear_event_files(folder)
        evals = _rows_of(frames.evals, job_id)
        steps = _rows_of(frames.steps, job_id)
        writer = summary_writer(log_dir=str(folder))
        try:
            for field in EVAL_FIELDS:
                _add_series(writer, f"eval/{field}", evals, field)
            if len(steps):
                for rank in sorted(steps["rank"].dropna().unique()):
                    rank_steps = steps[steps["rank"] == rank]
                    if rank == 0:
                        _add_series(writer, "train/loss", rank_steps, "loss")
                        _add_series(writer, "train/train_time_s", rank_steps, "train_time_s")
                    for field in RANK_STEP_FIELDS:
                        _add_series(writer, f"{field}/rank{int(rank)}", rank_steps, field)
        finally:
            writer.close()
        files += sorted(folder.glob("events.out.tfevents.*"))
    return files


def _rows_of(frame: pd.DataFrame, job_id: str) -> pd.DataFrame:
    """One job's rows of a frame, in step order (a frame without rows as it is)."""
    if not len(frame) or "job_id" not in frame:
        return frame.iloc[0:0]
    rows = frame[frame["job_id"] == job_id]
    return rows.sort_values("step", kind="stable") if "step" in rows else rows


# --- Parquet ---------------------------------------------------------------------------------------


def _flatten(value, prefix: str, out: dict) -> None:
    """Nested mappings as dotted keys under `prefix`; lists as their JSON text."""
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(inner, f"{prefix}.{key}", out)
    elif isinstance(value, (list, tuple)):
        out[prefix] = json.dumps(value)
    else:
        out[prefix] = value


def scenario_columns(run: RunDir) -> pd.DataFrame:
    """One row per job of scenario.json: job_id, algorithm, label, seed, network.<field>,
    params.<name>, workload.<key> (see the module docstring)."""
    rows = []
    for job in run.scenario.get("jobs") or []:
        if not isinstance(job, dict) or "job_id" not in job:
            continue
        row = {"job_id": job["job_id"], **{key: job.get(key) for key in JOB_KEY_COLUMNS}}
        for key, value in (job.get("network") or {}).items():
            _flatten(value, f"network.{key}", row)
        for key, value in (job.get("params") or {}).items():
            _flatten(value, f"params.{key}", row)
        for key, value in (job.get("trainer_config") or {}).items():
            if key not in NOT_WORKLOAD_KEYS:
                _flatten(value, f"workload.{key}", row)
        rows.append(row)
    return pd.DataFrame(rows)


def with_scenario(frame: pd.DataFrame, scenario: pd.DataFrame) -> pd.DataFrame:
    """`frame` with its job's scenario columns added (by job_id); algorithm, label and seed filled
    from the scenario where the frame has none."""
    if not len(scenario) or "job_id" not in frame:
        return frame
    extra = [c for c in scenario.columns if c not in frame.columns or c == "job_id"]
    out = frame.merge(scenario[extra], on="job_id", how="left")
    for key in JOB_KEY_COLUMNS:
        if key in frame.columns and key in scenario.columns:
            stated = out["job_id"].map(scenario.set_index("job_id")[key])
            out[key] = out[key].where(out[key].notna(), stated)
    return out


def parquet_ready(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with cells Parquet can hold: lists and mappings as JSON text, and an object column
    pyarrow cannot type (mixed kinds of value) as text."""
    import pyarrow as pa

    out = frame.copy()
    for column in out.columns:
        if out[column].dtype != object:
            continue
        values = out[column].map(lambda v: json.dumps(v, default=str) if isinstance(v, (dict, list, tuple)) else v)
        try:
            pa.array(values, from_pandas=True)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            values = values.map(lambda v: v if v is None or (isinstance(v, float) and math.isnan(v)) else str(v))
        out[column] = values
    return out


def parquet_tables(frames: RunFrames) -> dict[str, pd.DataFrame]:
    """The frames Parquet export writes (PARQUET_TABLES), each with its scenario columns."""
    summary = summarize(frames)
    # summarize keeps the jobs frame's order, one row per job
    summary.insert(0, "job_id", frames.jobs["job_id"].to_list() if len(frames.jobs) else [])
    scenario = scenario_columns(frames.run) if frames.run is not None else pd.DataFrame()
    tables = {"jobs": frames.jobs, "steps": frames.steps, "evals": frames.evals, "faults": frames.faults,
              "summary": summary}
    return {name: parquet_ready(with_scenario(table, scenario)) for name, table in tables.items()}


def _require_pyarrow() -> None:
    """SystemCheckError saying how to install pyarrow when it is missing (pandas' Parquet engine)."""
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise SystemCheckError(f"export --format parquet needs pyarrow ({exc}); run scripts/setup.sh "
                               "(or pip install pyarrow)") from None


def export_parquet(frames: RunFrames, out_dir) -> list[Path]:
    """`<table>.parquet` under `out_dir` for each of PARQUET_TABLES. Returns the files written."""
    _require_pyarrow()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, table in parquet_tables(frames).items():
        path = out / f"{name}.parquet"
        table.to_parquet(path, index=False, engine="pyarrow")
        files.append(path)
    return files
