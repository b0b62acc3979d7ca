"""`wanbench report RUN_DIR...`: summary tables as CSV and markdown, figures as PNG and SVG.

Reads run directories (see harness/run.py for the layout) with the same functions as the
notebooks: `load_results` gives the combined frames (each run read once: harness/rundir.py's
`RunDir`), `harness.plots` draws them, and `write_report` is the only place that writes files
(`write_csvs`, `write_figures`, `report_markdown`). A run without its `COMPLETE` file is flagged
in every output and left out of the comparison figures (its curves are drawn, titled INCOMPLETE).
Fault events (`harness.results.load_faults`) get their own section, `faults.csv`, and dashed
marks on the training curves.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

import pandas as pd

from emulator.schema import ConfigError

from . import plots
from .paths import REPORTS_ROOT
from . import byo
from .results import (BYTE_COLUMNS, FAULT_COLUMNS, HEADLINE_COLUMNS, METRICS, MIN_SEEDS, SEED_COLUMNS,
                      SUMMARY_COLUMNS, RunFrames, across_seeds, format_bytes, format_seed_cell,
                      independent_training, injection_failed, run_frames, summarize)
from .budget import EqualBudget
from .rundir import RunDir
from .tuning import RULE_KEYS, is_tuning

# Per run, at most this many loss/accuracy figures (one per network point); the rest are listed.
MAX_PROGRESS_FIGURES_PER_RUN = 12
FIGURE_FORMATS = ("png", "svg")
# Columns of faults.csv (every row of Results.faults).
FAULT_CSV_COLUMNS = ["run", "run_complete", *FAULT_COLUMNS]
# In report.md, one job's ok trace rows of a link beyond this many are shown as one line.
TRACE_ROWS_LISTED = 3
# The across-seeds table of report.md (across_seeds.csv has every SEED_COLUMNS aggregate).
SEED_TABLE_COLUMNS = ["time_to_target_s", "speedup_vs_sync", "throughput_speedup_vs_sync", "steps_per_s",
                      "accuracy_delta_vs_sync", "first_sync_step", "syncs_before_target"]
SEEDS_INTRO = (f"Each cell: median [min..max] over the seeds of one label at one network point, "
               f"(n=k) where only k seeds have a value; ratios and deltas against sync are taken per "
               f"seed against the sync job of the same seed, then aggregated. A headline needs "
               f"{MIN_SEEDS} seeds or more. Every aggregate is in `across_seeds.csv`.")


@dataclass
class RunInfo:
    path: Path
    name: str                 # "<scenario>/<run-id>", what tables call it
    complete: bool
    target_accuracy: Optional[float]
    environment: dict = field(default_factory=dict)
    interrupted: str = ""     # the INTERRUPTED file's reason, when a signal or an error ended the run
    budget_steps: Optional[int] = None     # where accuracy_at_step_budget was read
    budget_time_s: Optional[float] = None  # where accuracy_at_time_budget was read
    time_dilation: float = 1.0
    time_dilation_auto: Optional[dict] = None  # how time_dilation: auto chose K (scenario.json)
    sim: Optional[dict] = None  # backend sim: the compute model and NIC (scenario.json's `sim`)
    tuning: Optional[dict] = None  # tuning.json: the grid, the rule and each label's pick (None: no tuning)
    jobs: list = field(default_factory=list)  # the run's job folders (harness/rundir.py JobDir), read once
    budget: Optional[EqualBudget] = None  # the run's equal budget, resolved (harness/budget.py)
    target_loss: Optional[float] = None   # stop.target_loss: time to target is to a held-out loss <= this


@dataclass
class Results:
    """Every run's frames, concatenated, with `run` and `run_complete` columns."""

    runs: list[RunInfo]
    summary: pd.DataFrame
    steps: pd.DataFrame
    evals: pd.DataFrame
    faults: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=FAULT_CSV_COLUMNS))

    @property
    def seeds(self) -> pd.DataFrame:
        """The summary aggregated over seeds (results.across_seeds), one row per run, network
        point, label and workload."""
        return across_seeds(self.summary)

    @property
    def incomplete(self) -> list[RunInfo]:
        return [run for run in self.runs if not run.complete]

    def comparable(self) -> pd.DataFrame:
        """Summary rows fit for the comparison figures: complete runs, jobs that ended ok, and
        under a tuning protocol the reported seeds only."""
        if not len(self.summary):
            return self.summary
        return self.summary[self.summary["run_complete"] & (self.summary["status"] == "ok")
                            & ~reported_only_mask(self.summary)]


def reported_only_mask(summary: pd.DataFrame) -> pd.Series:
    """True for the rows of a tuning protocol's tuning phase (the tables and figures leave them out)."""
    if "phase" not in summary:
        return pd.Series(False, index=summary.index)
    return summary["phase"].map(is_tuning).astype(bool)


def open_run(path) -> RunDir:
    """`path` as a run directory with its scenario.json read, or ConfigError naming it (the CLI
    prints one line, exit 2)."""
    run_dir = Path(path)
    if not run_dir.exists():
        raise ConfigError("", "no such run directory", source=str(path))
    if not run_dir.is_dir():
        raise ConfigError("", "not a run directory (a file); give results/runs/<scenario>/<run-id>", source=str(path))
    run = RunDir(run_dir)
    run.scenario  # noqa: B018 - read (once) now: a missing or bad scenario.json is the caller's error
    return run


def check_run_dir(path) -> Path:
    """`path` as a run directory, or ConfigError naming it (the CLI prints one line, exit 2)."""
    return open_run(path).path


def find_run_dirs(path) -> list[Path]:
    """`path` itself if it is a run directory, else every run directory below it (sorted)."""
    root = Path(path)
    if (root / "scenario.json").is_file():
        return [root]
    return sorted(p.parent for p in root.rglob("scenario.json"))


def network_axes(run_dir) -> pd.DataFrame:
    """Per network point of a run: mean inter-region RTT (ms) and mean inter-region rate (bit/s),
    from the plan saved with it (so a topology's own, unswept rate still has a number).
    `run_dir`: a path or a RunDir."""
    run = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    rows = []
    for folder, plan in run.plans.items():
        links = plan.get("region_links", [])
        one_way = {(l["src"], l["dst"]): l for l in links if l.get("src") != l.get("dst")}
        rtts = [spec["one_way_delay_ms"] + one_way[(dst, src)]["one_way_delay_ms"]
                for (src, dst), spec in one_way.items() if (dst, src) in one_way]
        rates = [spec["rate_bit_s"] for spec in one_way.values() if spec.get("rate_bit_s")]
        # a parameter server's extra node ("-ps1") is built apart but compared at the same point
        rows.append({"network": run.network_key_of_folder(folder),
                     "mean_rtt_ms": sum(rtts) / len(rtts) if rtts else None,
                     "rate_bit_s": sum(rates) / len(rates) if rates else None})
    return pd.DataFrame(rows, columns=["network", "mean_rtt_ms", "rate_bit_s"]).drop_duplicates("network")


def _run_name(run_dir: Path) -> str:
    return f"{run_dir.parent.name}/{run_dir.name}"


def _run_info(run: RunDir, path: Path, name: str, frames: RunFrames) -> RunInfo:
    return RunInfo(path, name, frames.complete, frames.target_accuracy, run.environment, run.interrupted,
                   frames.budget_steps, frames.budget_time_s, frames.time_dilation, run.time_dilation_auto, run.sim,
                   run.tuning, run.jobs, frames.budget, frames.target_loss)


def load_results(run_dirs: Iterable, loaded: Optional[dict] = None, summaries: Optional[dict] = None) -> Results:
    """Load and summarize every run directory (ConfigError for one that is not a run directory).

    `loaded` maps a run directory to its already loaded `RunFrames` and `summaries` to its summary
    (`wanbench run` has just read and summarized it), so that its files are not read again nor
    its summary computed twice.
    """
    loaded = {Path(k).resolve(): v for k, v in (loaded or {}).items()}
    summaries = {Path(k).resolve(): v for k, v in (summaries or {}).items()}
    runs, tables, steps, evals, faults = [], [], [], [], []
    seen: dict = {}
    for path in run_dirs:
        key = Path(path).resolve()
        frames = loaded.get(key)
        run = frames.run if frames is not None and frames.run is not None else open_run(path)
        name = _run_name(key)
        if name in seen:  # the same run given twice, or two folders with equal names
            seen[name] += 1
            name = f"{name}#{seen[name]}"
        else:
            seen[name] = 1
        frames = frames or run_frames(run)
        runs.append(_run_info(run, Path(path), name, frames))
        summary = summaries.get(key)
        summary = summarize(frames) if summary is None else summary
        axes = network_axes(run)
        summary = summary.merge(axes, on="network", how="left") if len(axes) else \
            summary.assign(mean_rtt_ms=None, rate_bit_s=None)
        extra = {"run": name, "run_complete": frames.complete}
        tables.append(summary.assign(**extra))
        # the training curves of a tuning protocol's reported seeds only (its tuning jobs: tuning.json)
        tuned_ids = set(frames.jobs.loc[frames.jobs["phase"].map(is_tuning).astype(bool), "job_id"]) \
            if "phase" in frames.jobs else set()
        if len(frames.steps):
            steps.append(frames.steps[~frames.steps["job_id"].isin(tuned_ids)].assign(**extra))
        if len(frames.evals):
            evals.append(frames.evals[~frames.evals["job_id"].isin(tuned_ids)].assign(**extra))
        if len(frames.faults):
            faults.append(frames.faults.assign(**extra))
    columns = ["run", "run_complete", *SUMMARY_COLUMNS, "mean_rtt_ms", "rate_bit_s"]
    if any("phase" in table for table in tables):  # a run with a tuning protocol
        columns.insert(columns.index("seed") + 1, "phase")
    summary = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame(columns=columns)
    summary = summary[columns]
    faults = pd.concat(faults, ignore_index=True)[FAULT_CSV_COLUMNS] if faults else \
        pd.DataFrame(columns=FAULT_CSV_COLUMNS)
    return Results(runs, summary, pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(),
                   pd.concat(evals, ignore_index=True) if evals else pd.DataFrame(), faults)



EVIDENCE_MARKER = "MANIFEST.json"   # harness/evidence.py writes it into every evidence folder


def committed_summary(run_dir) -> Optional[pd.DataFrame]:
    """An evidence folder's (results/papers/<figure>/<run-id>/, `wanbench evidence`) committed
    summary.csv, with the columns summaries have now (an older one lacks a few: left empty); None
    for a run directory that is not evidence. Evidence keeps thinned evaluations and no step
    records, so its summary cannot be recomputed from its files: the committed one is the record
    (tests/harness/test_papers.py checks it against the evaluations it keeps)."""
    run_dir = Path(run_dir)
    if not (run_dir / EVIDENCE_MARKER).is_file() or not (run_dir / "summary.csv").is_file():
        return None
    summary = pd.read_csv(run_dir / "summary.csv")
    columns = list(SUMMARY_COLUMNS)
    if "phase" in summary:
        columns.insert(columns.index("seed") + 1, "phase")
    return summary.reindex(columns=columns)


def load_folder(path) -> Optional[Results]:
    """Every run below `path` (a run directory, a folder of them, or an evidence folder) that has
    jobs, loaded as `load_results` does, evidence with its committed summary; None when there is
    none (a tuning protocol's record folder holds no jobs)."""
    root = Path(path)
    run_dirs = [d for d in (find_run_dirs(root) if root.is_dir() else []) if (d / "jobs").is_dir()]
    if not run_dirs:
        return None
    summaries = {d: s for d in run_dirs if (s := committed_summary(d)) is not None}
    results = load_results(run_dirs, summaries=summaries)
    # `wanbench evidence` copies complete runs only (it refuses a partial one) and leaves the
    # COMPLETE marker behind: an evidence folder is complete by construction
    evidence = {run.name for run in results.runs if run.path in summaries}
    for run in results.runs:
        run.complete = run.complete or run.name in evidence
    for frame in (results.summary, results.steps, results.evals):
        if len(frame) and "run" in frame:
            frame.loc[frame["run"].isin(evidence), "run_complete"] = True
    return results

# --- markdown ---------------------------------------------------------------------------------------


def _fmt(value, column: str) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    if column in BYTE_COLUMNS:
        return format_bytes(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value).replace("|", "\\|")


def markdown_table(table: pd.DataFrame, columns: list[str]) -> str:
    """A GitHub-flavoured markdown table of `columns` (absent columns are skipped)."""
    columns = [c for c in columns if c in table.columns]
    header = "| " + " | ".join(c.replace("_", " ") for c in columns) + " |"
    rule = "|" + "|".join("---" if c in ("network", "label", "status", "run") else "---:" for c in columns) + "|"
    body = ["| " + " | ".join(_fmt(row.get(c), c) for c in columns) + " |" for row in table.to_dict("records")]
    return "\n".join([header, rule, *body])


def data_source_lines(rows: pd.DataFrame) -> list[str]:
    """Markdown lines saying what one run's jobs trained on (the summary's data_source): one line
    when every job says the same, else one per job."""
    if not len(rows):
        return []
    unknown = "not recorded (no rank wrote a data record: it never began training, or the run predates them)"
    column = rows["data_source"] if "data_source" in rows else [None] * len(rows)
    sources = [s if isinstance(s, str) and s else None for s in column]
    if len(set(sources)) == 1:
        return [f"- data: {sources[0] or unknown} (every job)"]
    return [f"- data of `{row['label']}` seed {row['seed']} at {row['network']}: {source or unknown}"
            for row, source in zip(rows.to_dict("records"), sources)]


INDEPENDENT_TRAINING = "independent training"


def mark_independent_training(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """One run's summary rows for the markdown table, a speedup reached before any synchronisation
    was applied (results.independent_training) marked in its cell, and a line per such job."""
    flagged = [independent_training(row) for row in rows.to_dict("records")]
    if not any(flagged):
        return rows, []
    shown = rows.copy()
    shown["speedup_vs_sync"] = shown["speedup_vs_sync"].astype(object)
    lines = []
    for index, flag in zip(rows.index, flagged):
        if not flag:
            continue
        row = rows.loc[index]
        shown.at[index, "speedup_vs_sync"] = f"{_fmt(row['speedup_vs_sync'], 'speedup_vs_sync')} ({INDEPENDENT_TRAINING})"
        first = ("it applied none at all" if pd.isna(row.get("first_sync_step"))
                 else f"its first was applied at step {int(row['first_sync_step'])}")
        lines.append(f"- `{row['label']}` seed {row['seed']} at {row['network']}: **{INDEPENDENT_TRAINING}**: "
                     f"the target was reached before any synchronisation was applied ({first}); its time to "
                     "target is that of replicas trained apart and averaged once, not the mechanism's")
    return shown, lines


def seeds_markdown(seeds: pd.DataFrame) -> list[str]:
    """The across-seeds table of one run's aggregated rows (across_seeds), and one line per group
    with fewer than MIN_SEEDS seeds."""
    if not len(seeds):
        return []
    shown = [c for c in SEED_TABLE_COLUMNS if seeds[f"{c}_n"].fillna(0).astype(int).gt(0).any()]
    # a label on several workloads at one point (compute padded or not): the workload tells them apart
    variants = "workload" in seeds and seeds.duplicated(["label", "network"]).any()
    header = ("| label | network | " + ("workload | " if variants else "") + "seeds | "
              + " | ".join(c.replace("_", " ") for c in shown) + " |")
    rule = "|---|---|" + ("---|" if variants else "") + "---:|" + "---:|" * len(shown)
    body = [f"| {_fmt(row['label'], 'label')} | {row['network']} | " + (f"{row['workload']} | " if variants else "")
            + f"{row['seeds']} | " + " | ".join(format_seed_cell(row, c) for c in shown) + " |"
            for row in seeds.to_dict("records")]
    few = seeds[seeds["few_seeds"]]
    if len(few) == len(seeds) and len(seeds) > 1:  # one line, not one per group
        counts = ", ".join(str(n) for n in sorted(few["seeds"].unique()))
        notes = [f"- **every row has fewer than {MIN_SEEDS} seeds** ({counts}): no row is a headline"]
    else:
        notes = [f"- `{row['label']}` at {row['network']}: **{row['seeds']} seed(s)** (seeds "
                 f"{row['seed_list'] or '?'}), fewer than {MIN_SEEDS}: not a headline" for row in few.to_dict("records")]
    independent = seeds[seeds["independent_seeds"] > 0]
    notes += [f"- `{row['label']}` at {row['network']}: {row['independent_seeds']} of {row['seeds']} seed(s) "
              f"reached the target before any synchronisation (independent training)"
              for row in independent.to_dict("records")]
    return ["#### Across seeds", "", SEEDS_INTRO, "", header, rule, *body, "", *notes, *([""] if notes else [])]


def incomplete_message(run: RunInfo) -> str:
    why = (f"it was interrupted ({run.interrupted})" if run.interrupted
           else "it crashed, was killed or is still running")
    return (f"INCOMPLETE run: {run.path} has no COMPLETE file ({why}); its rows are partial and it is "
            f"left out of the comparison figures")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


# --- fault events -----------------------------------------------------------------------------------

FAULTS_INTRO = ("Fault events the harness applied (`faults.jsonl`, source `fault`) and what the trainers "
                "recorded of them (`membership`: rank 0 saw ranks lost or joined; `rejoin`: a restarted "
                "rank was admitted back), in time order. Time is seconds after the job's processes "
                "started (the scenario's `at:`); training time is the x axis of the training curves, "
                "where each fault is a dashed line; a fault's step is the last step rank 0 had finished. "
                "Every row is in `faults.csv`.")


def _collapse_traces(events: pd.DataFrame) -> pd.DataFrame:
    """One job's events with each link's many ok `trace` rows shown as one row (failed ones stay)."""
    words = events["what"].astype(str).str.split()
    is_trace = (events["source"] == "fault") & (words.str[0] == "trace") & ~events["ok"].map(injection_failed)
    keep = events[~is_trace]
    collapsed = []
    for pair, rows in events[is_trace].groupby(words[is_trace].str[1], sort=False):
        if len(rows) <= TRACE_ROWS_LISTED:
            collapsed.append(rows)
            continue
        first, last = rows.iloc[0], rows.iloc[-1]
        span = f"{str(first['what']).split()[-1]}..{str(last['what']).split()[-1]}"
        collapsed.append(pd.DataFrame([{**first.to_dict(), "what": f"trace {pair} ×{len(rows)} ({span})",
                                        "effect": f"first: {first['effect']}; last: {last['effect']}"}]))
    if not collapsed:
        return events
    out = pd.concat([keep, *collapsed], ignore_index=True)
    return out.sort_values("time_s", kind="stable")


def _fault_cells(row: dict) -> list[str]:
    def number(value, digits: int) -> str:
        return "-" if value is None or pd.isna(value) else f"{float(value):.{digits}f}"

    def text(value) -> str:
        return "-" if value is None or (isinstance(value, float) and pd.isna(value)) or value == "" else \
            str(value).replace("|", "\\|").replace("\n", " ")

    ok = row.get("ok")
    if injection_failed(ok):
        ok_cell = "**FAILED**"
    else:
        ok_cell = "-" if ok is None or pd.isna(ok) else "yes"
    step = row.get("step")
    return [number(row.get("time_s"), 2), number(row.get("train_time_s"), 2),
            "-" if step is None or pd.isna(step) else str(int(step)), text(row.get("source")),
            text(row.get("what")), text(row.get("effect")), ok_cell]


def faults_markdown(faults: pd.DataFrame) -> list[str]:
    """Markdown lines for one run's fault events: per job a heading and a table in time order
    (time, training time, step, source, event, effect, ok); a failed injection reads **FAILED**."""
    lines = []
    for job_id, events in faults.groupby("job_id", sort=True):
        events = events.sort_values("time_s", kind="stable")
        first = events.iloc[0]
        lines += [f"#### `{first['label']}` seed {first['seed']} at {first['network'] or '?'} (`{job_id}`)", ""]
        failed = events[(events["source"] == "fault") & events["ok"].map(injection_failed)]
        if len(failed):
            lines += [f"**{len(failed)} fault injection(s) FAILED**: "
                      + "; ".join(f"{r['what']} ({r['effect']})" for r in failed.to_dict("records")), ""]
        lines += ["| time (s) | training time (s) | step | source | event | effect | ok |",
                  "|---:|---:|---:|---|---|---|---|"]
        lines += ["| " + " | ".join(_fault_cells(row)) + " |" for row in _collapse_traces(events).to_dict("records")]
        lines.append("")
    return lines


# --- the report --------------------------------------------------------------------------------------


@dataclass
class ReportOutcome:
    out_dir: Path
    markdown: Path
    combined_csv: Path
    run_csvs: list[Path]
    figures: list[Path]          # every PNG and SVG written
    incomplete: list[RunInfo]
    skipped_figures: dict        # figure name -> why it was not drawn
    faults_csv: Optional[Path] = None                    # every run's fault events (header only if none)
    run_faults_csvs: list[Path] = field(default_factory=list)
    results: Optional[Results] = None                    # what was reported (the tables written)
    seeds_csv: Optional[Path] = None                     # across_seeds.csv


def _comparison_figures(results: Results) -> tuple[dict, dict]:
    """name -> (title, Figure) for the cross-run figures that have data; name -> why not otherwise."""
    table = results.comparable()
    made, skipped = {}, {}
    if not len(table):
        reason = "no complete run with a job that ended ok"
        return made, {name: reason for name in ("speedup_vs_latency", "speedup_vs_nodes", "throughput_vs_bandwidth",
                                                "accuracy_vs_bytes", "async_vs_sync")}

    def has(column):
        return column in table and table[column].notna().any()

    if has("speedup_vs_sync") or has("throughput_speedup_vs_sync"):
        made["speedup_vs_latency"] = ("Speedup over sync vs latency", plots.speedup_vs_latency(table))
    else:
        skipped["speedup_vs_latency"] = "no speedup against a sync job at the same network point and seed"
    if (has("speedup_vs_sync") or has("throughput_speedup_vs_sync")) and table["nodes"].nunique() > 1:
        made["speedup_vs_nodes"] = ("Speedup over sync vs node count", plots.speedup_vs_nodes(table))
    else:
        skipped["speedup_vs_nodes"] = "the node count was not swept (one node count in the compared runs)"
    rates = table["rate_bit_s"].nunique() if has("rate_bit_s") else table["rate"].nunique()
    if has("steps_per_s") and rates > 1:
        made["throughput_vs_bandwidth"] = ("Throughput vs bandwidth", plots.throughput_vs_bandwidth(table))
    else:
        skipped["throughput_vs_bandwidth"] = "the link rate was not swept (one rate in the compared runs)"
    if has("final_accuracy") and has("bytes_sent_per_node"):
        made["accuracy_vs_bytes"] = ("Accuracy vs bytes on the wire", plots.accuracy_vs_bytes(table))
    else:
        skipped["accuracy_vs_bytes"] = "no job with both a final accuracy and a byte count"
    ratios = plots.compute_comm_ratio(results.steps[results.steps["run_complete"]] if len(results.steps) else results.steps)
    non_sync = table[table["algorithm"] != "sync"]
    if len(ratios) and len(non_sync) and (has("speedup_vs_sync") or has("throughput_speedup_vs_sync")):
        made["async_vs_sync"] = ("Async vs sync by compute/communication ratio",
                                 plots.async_vs_sync(table, results.steps))
    else:
        skipped["async_vs_sync"] = "needs sync's compute_s/comm_blocked_s records and a non-sync job to compare"
    return made, skipped


def _progress_figures(results: Results) -> tuple[list, list[str]]:
    """[(run, network, title, Figure)] per run and network point; plus notes on what was capped."""
    made, notes = [], []
    for run in results.runs:
        steps = results.steps[results.steps["run"] == run.name] if len(results.steps) else results.steps
        evals = results.evals[results.evals["run"] == run.name] if len(results.evals) else results.evals
        faults = results.faults[results.faults["run"] == run.name]
        networks = set(steps["network"]) if len(steps) else set()
        networks = sorted(networks | (set(evals["network"]) if len(evals) else set()))
        if len(networks) > MAX_PROGRESS_FIGURES_PER_RUN:
            notes.append(f"{run.name}: {len(networks)} network points; curves drawn for the first "
                         f"{MAX_PROGRESS_FIGURES_PER_RUN} only")
            networks = networks[:MAX_PROGRESS_FIGURES_PER_RUN]
        for network in networks:
            title = f"{run.name} at {network or 'unknown network (a job without job.json)'}"
            if not run.complete:
                title = "INCOMPLETE run: " + title
            figure = plots.loss_accuracy_vs_time(
                steps[steps["network"] == network] if len(steps) else steps,
                evals[evals["network"] == network] if len(evals) else evals, title=title,
                target_accuracy=run.target_accuracy,
                faults=faults[faults["network"] == network] if len(faults) else faults)
            made.append((run, network, title, figure))
    return made, notes


def _save(figure, base: Path) -> list[Path]:
    paths = []
    for fmt in FIGURE_FORMATS:
        path = base.parent / f"{base.name}.{fmt}"  # not with_suffix: "delay0.25" has a dot
        figure.savefig(path, format=fmt, dpi=plots.DPI, bbox_inches="tight")
        paths.append(path)
    return paths


def budget_sentence(run: RunInfo) -> str:
    """Where this run compares accuracy: the words of its one equal budget (harness/budget.py),
    the budget the stop rule waited for and the summary read."""
    budget = run.budget or EqualBudget(run.budget_steps, run.budget_time_s, run.budget_steps is not None,
                                       run.budget_time_s is not None)
    return budget.sentence()


def budget_lines(rows: pd.DataFrame) -> list[str]:
    """One line per job whose accuracy_delta_vs_sync is empty because it (or its sync) did not
    reach the run's budget, saying why."""
    if "budget_not_reached" not in rows:
        return []
    missed = rows[rows["budget_not_reached"].fillna("").astype(str) != ""]
    return [f"- job `{row['label']}` seed {row['seed']} at {row['network']}: no accuracy_delta_vs_sync: "
            f"{row['budget_not_reached']}" for row in missed.to_dict("records")]


def _values_text(values: Optional[dict]) -> str:
    return "none" if not values else ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in values.items())


def tuning_lines(tuning: Optional[dict], tuning_jobs: int = 0) -> list[str]:
    """The report's words for a run's tuning protocol (tuning.json): the grid, the rule and its
    tie-break, the tuning seed and the reported seeds, then each label's pick with its score."""
    if not tuning:
        return [f"- {tuning_jobs} tuning job(s) (phase tuning) left out of the table; no tuning.json: no picks recorded"]
    grid = "; ".join(f"{key} in {{{', '.join(f'{v:g}' for v in values)}}}" for key, values in tuning["grid"].items())
    by = tuning.get("by", "?")
    seeds = ", ".join(str(s) for s in tuning.get("reported_seeds") or []) or "none"
    scaling = (" (an algorithm averaging every worker's gradient each step, such as sync, also at its own lr x "
               "the workers it averages: the linear-scaling value for its larger global batch)"
               if tuning.get("linear_scaling") else "")
    lines = [f"- **tuned by one protocol**: every algorithm ran the same grid, {grid}{scaling}, on the tuning "
             f"seed {tuning.get('seed')} at each network point; each label's pick by **{by}**: "
             f"{tuning.get('tie_break', '')}. The table and the ratios against sync use the reported seeds "
             f"({seeds}) only, each job against sync at sync's own pick; the {tuning_jobs} tuning job(s) are "
             "in summary.csv (phase tuning) and tuning.json.", ""]
    keys = [column for column, _ in RULE_KEYS.get(by, RULE_KEYS["time_to_target"])]
    score = keys[0]
    lines += [f"| network | label | pick | its {score} | candidates: {', '.join(keys)} |",
              "|---|---|---|---:|---|"]

    def number(value) -> str:
        return "-" if value is None else f"{value:.4g}"

    for record in tuning.get("picks") or []:
        chosen = next((c for c in record.get("candidates") or [] if c.get("job_id") == record.get("pick_job_id")), {})
        cells = []
        for candidate in record.get("candidates") or []:
            text = ("job " + str(candidate.get("status")) if candidate.get("status") != "ok"
                    else " / ".join(number(candidate.get(key)) for key in keys))
            mark = " (linear scaling)" if candidate.get("linear_scaling") else ""
            cells.append(f"{_values_text(candidate.get('values'))}{mark}: {text}")
        pick = _values_text(record.get("pick")) if record.get("pick") is not None else \
            f"none ({record.get('why_no_pick', '?')})"
        lines.append(f"| {record.get('network')} | {record.get('label')} | {pick} | "
                     f"{number(chosen.get(score))} | {'; '.join(cells)} |")
    return lines


def dilation_sentence(run: RunInfo) -> str:
    """The run's time dilation, and how `auto` chose it; "" for an undilated run."""
    if run.time_dilation_auto is not None:
        return f"time dilation {run.time_dilation:g}, chosen by auto: {run.time_dilation_auto.get('why', '?')}"
    return f"time dilation {run.time_dilation:g}" if run.time_dilation != 1.0 else ""


def sim_sentence(run: RunInfo) -> str:
    """On backend sim: that the run's times are simulated, and its compute model; else ""."""
    if run.sim is None and run.environment.get("backend") != "sim":
        return ""
    sim = run.sim or {}
    computes = [f"{c.get('forward_backward_s', 0) * 1e3:.3g} ms per forward + backward"
                + (f" + {c['step_overhead_s'] * 1e3:g} ms per step" if c.get("step_overhead_s") else "")
                + f" ({c.get('source', '?')})" for c in sim.get("compute") or []]
    nic = sim.get("nic_rate_bit_s")
    text = "**times simulated**: backend sim, virtual seconds of the simulator's clock"
    if computes:
        text += "; compute " + "; ".join(computes)
    by_region = sim.get("topology_nic_rate_bit_s") or {}
    if nic:
        text += f"; NIC {nic / 1e6:g} Mbit/s per node"
    elif by_region:
        rates = sorted(set(by_region.values()))
        text += ("; NIC " + " / ".join(f"{r / 1e6:g}" for r in rates) + " Mbit/s per node each way (the topology's"
                 + (": " + ", ".join(f"{k} {v / 1e6:g}" for k, v in by_region.items()) if len(rates) > 1 else "") + ")")
    else:  # a run from before nodes had NICs
        text += "; no NIC limit (per-pair rates only)"
    if sim.get("time_dilation_ignored") is not None:
        text += f"; the scenario's time_dilation {sim['time_dilation_ignored']} not applied"
    return text


def _environment_lines(run: RunInfo) -> str:
    env = run.environment
    if not env:
        return "no environment.json"
    parts = [f"date {env.get('date', '?')}", f"backend {env.get('backend', '?')}",
             f"CPU {env.get('cpu') or '?'} ({env.get('cpu_count', '?')} cores)",
             f"GPU {env.get('gpu') or 'none'}", f"kernel {env.get('kernel', '?')}",
             f"Python {env.get('python', '?')}", f"torch {env.get('torch', '?')}",
             f"commit {str(env.get('git_commit') or '?')[:12]}{' (dirty)' if env.get('git_dirty') else ''}"]
    return ", ".join(parts)


@dataclass
class ReportCsvs:
    combined: Path               # summary.csv of every run
    seeds: Path                  # across_seeds.csv: the summary aggregated over seeds (every run)
    faults: Path                 # faults.csv of every run (header only if none)
    runs: list[Path]             # runs/<run>/summary.csv
    run_faults: list[Path]       # runs/<run>/faults.csv


@dataclass
class ReportFigures:
    written: list[Path]                      # every PNG and SVG
    comparison: dict                         # name -> (title, PNG path)
    skipped: dict                            # name -> why it was not drawn
    progress: list                           # [(run, title, PNG path)]
    notes: list[str]                         # what was capped


def write_csvs(results: Results, out: Path) -> ReportCsvs:
    """summary.csv and faults.csv of every run under `out`, and each run's own under runs/<run>/."""
    combined_csv = out / "summary.csv"
    results.summary.to_csv(combined_csv, index=False)
    seeds_csv = out / "across_seeds.csv"
    results.seeds.to_csv(seeds_csv, index=False)
    faults_csv = out / "faults.csv"
    results.faults.to_csv(faults_csv, index=False)
    run_csvs, run_faults_csvs = [], []
    for run in results.runs:
        run_out = out / "runs" / _safe(run.name)
        run_out.mkdir(parents=True, exist_ok=True)
        path = run_out / "summary.csv"
        results.summary[results.summary["run"] == run.name].to_csv(path, index=False)
        run_csvs.append(path)
        path = run_out / "faults.csv"
        results.faults[results.faults["run"] == run.name].to_csv(path, index=False)
        run_faults_csvs.append(path)
    return ReportCsvs(combined_csv, seeds_csv, faults_csv, run_csvs, run_faults_csvs)


def write_figures(results: Results, figures_dir: Path) -> ReportFigures:
    """Every comparison figure the runs have data for and each run's training curves, as PNG and
    SVG in `figures_dir`."""
    written: list[Path] = []
    comparison, skipped = _comparison_figures(results)
    comparison_files = {}
    for name, (title, figure) in comparison.items():
        paths = _save(figure, figures_dir / name)
        written += paths
        comparison_files[name] = (title, paths[0])
    progress, progress_notes = _progress_figures(results)
    progress_files = []
    for run, network, title, figure in progress:
        paths = _save(figure, figures_dir / f"progress-{_safe(run.name)}-{_safe(network or 'unknown')}")
        written += paths
        progress_files.append((run, title, paths[0]))
    return ReportFigures(written, comparison_files, skipped, progress_files, progress_notes)


def report_markdown(results: Results, figures: ReportFigures, out: Path) -> str:
    """report.md's text: the runs, the summary tables, the faults, the figures (linked relative to `out`)."""
    lines = ["# wanbench report", "",
             f"Generated {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} "
             f"from {len(results.runs)} run(s).", ""]
    for run in results.incomplete:
        lines += [f"> **{incomplete_message(run)}.**", ""]
    lines += ["## Runs", ""]
    for run in results.runs:
        mark = "complete" if run.complete else "**INCOMPLETE**"
        if run.target_accuracy is None and run.target_loss is not None:
            target = f"target held-out loss {run.target_loss:g}"
        else:
            target = "target accuracy " + ("-" if run.target_accuracy is None else f"{run.target_accuracy:g}")
        dilation = dilation_sentence(run)
        simulated = sim_sentence(run)
        lines.append(f"- `{run.name}` ({mark}; {target}; {budget_sentence(run)}"
                     f"{'; ' + dilation if dilation else ''}{'; ' + simulated if simulated else ''}): "
                     f"`{run.path}`; {_environment_lines(run)}")
    lines += ["", "## Summary", "", "What the columns mean (every column is in `summary.csv`):", ""]
    lines += [f"- `{name}`: {sentence}" for name, sentence in METRICS.items()]
    lines += [""]
    for run in results.runs:
        rows = results.summary[results.summary["run"] == run.name]
        tuning_rows = rows[reported_only_mask(rows)]
        rows = rows[~reported_only_mask(rows)]
        heading = f"### {run.name}" + ("" if run.complete else " (INCOMPLETE run: partial rows)")
        shown, independent = mark_independent_training(rows)
        lines += [heading, ""]
        if run.tuning or len(tuning_rows):
            lines += [*tuning_lines(run.tuning, len(tuning_rows)), ""]
        lines += [markdown_table(shown, HEADLINE_COLUMNS), ""]
        if independent:
            lines += [*independent, ""]
        if len(rows):
            lines += [*data_source_lines(rows), ""]
        lines += seeds_markdown(across_seeds(rows))
        missed = budget_lines(rows)
        if missed:
            lines += [*missed, ""]
        bad = rows[rows["status"] != "ok"]
        for row in bad.to_dict("records"):
            lines.append(f"- job `{row['label']}` seed {row['seed']} at {row['network']}: status "
                         f"**{row['status']}**, left out of the comparison figures")
        if len(bad):
            lines.append("")
    for run in results.runs:
        lines += byo.report_lines(run.jobs)  # wall time, congestion control and wire pairs per job
    if len(results.faults):
        lines += ["## Faults", "", FAULTS_INTRO, ""]
        for run in results.runs:
            events = results.faults[results.faults["run"] == run.name]
            if len(events):
                lines += [f"### {run.name}", "", *faults_markdown(events)]
    lines += ["## Comparison figures", ""]
    if results.incomplete:
        lines += ["Drawn from complete runs only.", ""]
    for name, (title, png) in figures.comparison.items():
        lines += [f"### {title}", "", f"![{title}]({png.relative_to(out).as_posix()})", "",
                  f"SVG: [{name}.svg](figures/{name}.svg)", ""]
    for name, why in figures.skipped.items():
        lines.append(f"- `{name}` not drawn: {why}")
    if figures.skipped:
        lines.append("")
    lines += ["## Training curves", ""]
    if (results.faults["source"] == "fault").any():
        lines += ["Dashed vertical lines mark fault events in the colour of the job they hit (red: an "
                  "injection that failed); the Faults section lists them.", ""]
    for note in figures.notes:
        lines += [f"- {note}", ""]
    for run, title, png in figures.progress:
        lines += [f"### {title}", "", f"![{title}]({png.relative_to(out).as_posix()})", ""]
    if not figures.progress:
        lines += ["No step or eval records in any run.", ""]
    return "\n".join(lines)


def write_report(run_dirs: Iterable, out_dir, loaded: Optional[dict] = None,
                 summaries: Optional[dict] = None) -> ReportOutcome:
    """Write report.md, summary.csv and faults.csv (combined and per run) and every figure
    (PNG + SVG) to out_dir. `loaded`: run directory -> RunFrames already read, `summaries`: run
    directory -> its summary already computed (see load_results)."""
    results = load_results(run_dirs, loaded, summaries)
    out = Path(out_dir)
    figures_dir = out / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    csvs = write_csvs(results, out)
    figures = write_figures(results, figures_dir)
    markdown = out / "report.md"
    markdown.write_text(report_markdown(results, figures, out))
    return ReportOutcome(out, markdown, csvs.combined, csvs.runs, figures.written, results.incomplete,
                         figures.skipped, csvs.faults, csvs.run_faults, results, csvs.seeds)


def default_out_dir(run_dirs: list) -> Path:
    """One run: <run_dir>/report; several: results/reports/<UTC time>."""
    if len(run_dirs) == 1:
        return Path(run_dirs[0]) / "report"

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return REPORTS_ROOT / stamp
