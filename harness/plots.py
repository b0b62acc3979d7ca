"""Figures of a run's results: functions DataFrame(s) -> matplotlib Figure, no file I/O inside.

Every figure is meant to be read at a glance: axes labelled with units, a legend, a title, fonts
of 10 pt or more at 7 x 4.5 in and 150 dpi. An algorithm has the same colour in every figure
(`color_for`); variants of one algorithm (e.g. dts-p1, dts-p4) share its colour and differ in line
style and marker. A sweep with a single point still draws its markers and says "one sweep point".

Inputs are the frames of `harness.results` (`load_run(...).steps/.evals/.faults`,
`summarize(...)`), optionally with the network columns `harness.report.network_axes` adds
(`mean_rtt_ms`, `rate_bit_s`).
"""

from __future__ import annotations

import zlib
from typing import Optional

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from .results import injection_failed, seed_stats

FIGSIZE_IN = (7.0, 4.5)
WIDE_FIGSIZE_IN = (11.0, 4.5)   # two panels side by side
DPI = 150
FONT_PT = 10
TITLE_PT = 12

# Fixed colours by algorithm registry name (colour-blind-safe Okabe-Ito first, then tab10).
PALETTE = {
    "sync": "#000000",
    "ddp": "#7F7F7F",
    "dts": "#0072B2",
    "local_sgd": "#E69F00",
    "diloco": "#009E73",
    "streaming_diloco": "#117733",
    "swarmsgd": "#CC79A7",
    "dpsgd": "#9467BD",
    "adpsgd": "#8C564B",
    "easgd": "#D55E00",
    "eawild": "#B22222",
    "async_ps": "#17BECF",
    "quantized": "#56B4E9",
    "p3": "#BCBD22",
    "ps_sync": "#6B6B00",
    "local_only": "#A0A0A0",  # the control: light grey, beside sync's black
}
_FALLBACK = ["#1f77b4", "#2ca02c", "#d62728", "#e377c2", "#ff7f0e", "#393b79", "#637939", "#843c39",
             "#5254a3", "#7b4173"]
_LINESTYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P"]

# Reference lines (sync = 1, target accuracy) carry this gid; every other line is data.
REFERENCE_GID = "reference"
SPREAD_GID = "seed-spread"  # the caps of min-max bars over seeds
FAULT_GID = "fault"         # vertical marks (and their labels) at fault events
BAND_GID = "seed-band"          # the min-max band over seeds around a median curve
FIRST_SYNC_GID = "first-sync"   # vertical marks where a label's first synchronisation was applied
CROSSOVER_GID = "crossover"     # vertical marks where a median speedup crosses 1
ONE_POINT_NOTE = "one sweep point: no trend to read"
FAILED_FAULT_COLOR = "#D62728"
FAULT_TEXT_COLOR = "#444444"
# Fault marks closer than this fraction of the time axis share one label (joined by " / ").
FAULT_LABEL_MERGE_FRACTION = 0.02


def series_lines(ax) -> list:
    """The lines of `ax` that are data series (not reference lines, error-bar caps or fault marks)."""
    marks = (REFERENCE_GID, SPREAD_GID, FAULT_GID, FIRST_SYNC_GID, CROSSOVER_GID)
    return [line for line in ax.get_lines() if line.get_gid() not in marks]


def fault_lines(ax) -> list:
    """The vertical fault marks of `ax`."""
    return [line for line in ax.get_lines() if line.get_gid() == FAULT_GID]


def fault_texts(ax) -> list[str]:
    """The fault labels of `ax`, left to right."""
    texts = sorted((t for t in ax.texts if t.get_gid() == FAULT_GID), key=lambda t: t.get_position()[0])
    return [t.get_text() for t in texts]


def color_for(algorithm: Optional[str]) -> str:
    """The fixed colour of an algorithm (a stable hash picks one for names not in PALETTE)."""
    name = str(algorithm or "")
    if name in PALETTE:
        return PALETTE[name]
    return _FALLBACK[zlib.crc32(name.encode()) % len(_FALLBACK)]


def _styles(frame: pd.DataFrame) -> dict:
    """label -> dict(color, linestyle, marker): colour by algorithm, style by variant within it."""
    styles = {}
    pairs = frame[["algorithm", "label"]].drop_duplicates() if len(frame) else frame
    by_algorithm: dict = {}
    for algorithm, label in sorted(pairs.itertuples(index=False, name=None), key=lambda p: (str(p[0]), str(p[1]))):
        index = by_algorithm.setdefault(algorithm, 0)
        by_algorithm[algorithm] = index + 1
        styles[label] = {"color": color_for(algorithm), "linestyle": _LINESTYLES[index % len(_LINESTYLES)],
                         "marker": _MARKERS[index % len(_MARKERS)]}
    return styles


def _label_order(frame: pd.DataFrame) -> list:
    """Labels with sync first (the reference), then alphabetical."""
    labels = [label for label in frame["label"].dropna().unique()] if len(frame) else []
    return sorted(labels, key=lambda label: (not str(label).startswith("sync"), str(label)))


def _new_figure(panels: int = 1):
    # A plain Figure on an Agg canvas: headless, and no global state (pyplot's figure list, the
    # session's backend) is touched, so a notebook or a long report never accumulates figures.
    with matplotlib.rc_context({"font.size": FONT_PT}):
        figure = Figure(figsize=WIDE_FIGSIZE_IN if panels > 1 else FIGSIZE_IN, dpi=DPI)
        FigureCanvasAgg(figure)
        axes = figure.subplots(1, panels, squeeze=False)[0]
    for ax in axes:
        ax.tick_params(labelsize=FONT_PT)
        ax.grid(True, alpha=0.3)
    return figure, list(axes)


def _finish(figure: Figure, axes, title: str) -> Figure:
    figure.suptitle(title, fontsize=TITLE_PT)
    for ax in axes:
        ax.xaxis.label.set_size(FONT_PT + 1)
        ax.yaxis.label.set_size(FONT_PT + 1)
        ax.title.set_size(FONT_PT + 1)
        handles, _ = ax.get_legend_handles_labels()
        if len(handles) > 6:  # a long legend would hide the data: put it beside the axes
            ax.legend(fontsize=FONT_PT - 1, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.85)
        elif handles:
            ax.legend(fontsize=FONT_PT, loc="best", framealpha=0.85)
    figure.tight_layout()
    return figure


def _note(ax, text: str, where: str = "bottom") -> None:
    """A grey note inside the axes (one sweep point, no data, ...)."""
    y, va = (0.03, "bottom") if where == "bottom" else (0.5, "center")
    ax.text(0.5, y, text, transform=ax.transAxes, ha="center", va=va, fontsize=FONT_PT,
            color="#555555", bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#bbbbbb"})


def _has(frame: pd.DataFrame, column: str) -> bool:
    return column in frame.columns and frame[column].notna().any()


def _with_seed_spread(frame: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Median, min and max of `y` over seeds at each `x` (one row per x, sorted): the same
    statistics as the report's across-seeds table (harness/results.py `seed_stats`)."""
    clean = frame[[x, y]].dropna()
    if not len(clean):
        return pd.DataFrame(columns=[x, "median", "min", "max", "n"])
    rows = [{x: value, **seed_stats(group[y])} for value, group in clean.groupby(x)]
    return pd.DataFrame(rows, columns=[x, "median", "min", "max", "n"]).sort_values(x)


def _plot_series(ax, frame: pd.DataFrame, x: str, y: str, styles: dict, *, skip_labels=(),
                 split: Optional[str] = None, split_format: str = "{:g}") -> int:
    """One line per label (the median over seeds, min-max bars); returns how many x values there were.

    When `split` (another sweep axis) takes several values, each (label, value) gets its own line,
    so points of different network settings are never averaged together.
    """
    xs = set()
    split_values = sorted(frame[split].dropna().unique()) if split and _has(frame, split) else []
    if len(split_values) < 2:
        split_values = [None]
    for label in _label_order(frame):
        if label in skip_labels:
            continue
        for split_index, value in enumerate(split_values):
            rows = frame[frame["label"] == label]
            if value is not None:
                rows = rows[rows[split] == value]
            stats = _with_seed_spread(rows, x, y)
            if not len(stats):
                continue
            xs.update(stats[x].tolist())
            style = styles[label]
            linestyle = style["linestyle"] if value is None else _LINESTYLES[split_index % len(_LINESTYLES)]
            name = str(label) if value is None else f"{label}, {split_format.format(value)}"
            ax.plot(stats[x], stats["median"], label=name, color=style["color"], linestyle=linestyle,
                    marker=style["marker"], markersize=7, linewidth=2,
                    alpha=1.0 if value is None else 1.0 - 0.5 * split_index / len(split_values))
            if (stats["n"] > 1).any():
                # clip: kept from the mean this drew before (its rounding fell below the min of
                # equal values); errorbar refuses a negative length
                bars = ax.errorbar(stats[x], stats["median"], yerr=[(stats["median"] - stats["min"]).clip(lower=0),
                                                                     (stats["max"] - stats["median"]).clip(lower=0)],
                                   fmt="none", ecolor=style["color"], alpha=0.5, capsize=3)
                for cap in bars.lines[1]:
                    cap.set_gid(SPREAD_GID)
    return len(xs)


def _log_x_or_note(ax, points: int, no_data: str) -> None:
    """A log x axis with plain tick labels when there are points; else the no-data note; one
    point gets the single-point note."""
    if not points:
        _note(ax, no_data, "center")
        return
    ax.set_xscale("log")
    _plain_log_ticks(ax.xaxis)
    if points == 1:
        _note(ax, ONE_POINT_NOTE)


def _plain_log_ticks(axis) -> None:
    """Tick labels on a log axis as plain numbers (0.5, 2, 30), not 5x10^-1."""
    from matplotlib.ticker import FuncFormatter

    formatter = FuncFormatter(lambda value, _: f"{value:g}")
    axis.set_major_formatter(formatter)
    axis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if
                                           f"{value:.1e}"[0] in "25" else ""))


# --- fault marks on a time axis -------------------------------------------------------------------


def fault_label(what: str) -> str:
    """A short label for a fault's `what` (harness/faults.py's names): "node_crash b-0" ->
    "crash b-0", "link a->b down" -> "link a-b down" (both directions read the same), "loss burst
    a->b 30%" -> "loss 30%", "trace a->b t=5s" -> "trace"; others as they are."""
    words = str(what).split()
    if not words:
        return "fault"
    if words[0] == "node_crash" and len(words) > 1:
        return f"crash {words[1]}"
    if words[0] == "link" and len(words) >= 3 and "->" in words[1]:
        return f"link {'-'.join(sorted(words[1].split('->')))} {words[2]}"
    if words[:2] == ["loss", "burst"] and len(words) >= 4:
        return "loss ends" if words[3] == "ends" else f"loss {words[3]}"
    if words[0] == "trace":
        return "trace"
    return " ".join(words)


def fault_marks(faults: pd.DataFrame) -> pd.DataFrame:
    """Where to mark faults on the training clock: one row per (job, event) with x (train_time_s),
    text, ok, algorithm.

    The harness's rows only (source "fault"). The two directions of a link event, which share a
    label and a due time, make one mark; every `trace` row of a job makes one mark at the first,
    labelled with the number of trace times ("trace ×12"). A failed injection says so in its text
    and has ok False.
    """
    columns = ["job_id", "algorithm", "x", "text", "ok"]
    if faults is None or not len(faults) or not {"source", "train_time_s"} <= set(faults.columns):
        return pd.DataFrame(columns=columns)
    rows = faults[(faults["source"] == "fault") & faults["train_time_s"].notna()]
    if not len(rows):
        return pd.DataFrame(columns=columns)
    rows = rows.assign(text=rows["what"].map(fault_label), failed=rows["ok"].map(injection_failed))
    rows = rows.assign(due=rows["due_s"].where(rows["text"] != "trace", -1.0).fillna(rows["train_time_s"]))
    marks = []
    for (job_id, text, _), group in rows.groupby(["job_id", "text", "due"], sort=False, dropna=False):
        failed = int(group["failed"].sum())
        if text == "trace":
            times = group["due_s"].nunique() or len(group)
            text = f"trace ×{times}" + (f" ({failed} failed)" if failed else "")
        elif failed:
            text = f"{text} (failed)"
        marks.append({"job_id": job_id, "algorithm": group["algorithm"].iloc[0],
                      "x": float(group["train_time_s"].min()), "text": text, "ok": not failed})
    return pd.DataFrame(marks, columns=columns).sort_values("x", kind="stable").reset_index(drop=True)


def _draw_fault_marks(axes, marks: pd.DataFrame, x_span: float) -> None:
    """Thin dashed vertical lines (the job's colour; red when the injection failed) and one
    rotated label per cluster of nearby marks at the top of each axes."""
    from matplotlib.transforms import blended_transform_factory

    window = FAULT_LABEL_MERGE_FRACTION * max(x_span, 1e-9)
    clusters: list[dict] = []
    for mark in marks.to_dict("records"):
        if clusters and mark["x"] - clusters[-1]["last_x"] <= window:
            cluster = clusters[-1]
            cluster["last_x"] = mark["x"]
        else:
            cluster = {"x": mark["x"], "last_x": mark["x"], "texts": [], "failed": False}
            clusters.append(cluster)
        if mark["text"] not in cluster["texts"]:
            cluster["texts"].append(mark["text"])
        cluster["failed"] = cluster["failed"] or not mark["ok"]
    for ax in axes:
        for mark in marks.to_dict("records"):
            ax.axvline(mark["x"], color=color_for(mark["algorithm"]) if mark["ok"] else FAILED_FAULT_COLOR,
                       linestyle="--", linewidth=0.8, alpha=0.7, gid=FAULT_GID)
        to_axes = blended_transform_factory(ax.transData, ax.transAxes)
        for cluster in clusters:
            ax.text(cluster["x"], 0.98, " / ".join(cluster["texts"]), transform=to_axes, rotation=90,
                    ha="right", va="top", fontsize=FONT_PT, gid=FAULT_GID,
                    color=FAILED_FAULT_COLOR if cluster["failed"] else FAULT_TEXT_COLOR)


# --- loss and accuracy against wall-clock ---------------------------------------------------------


def loss_accuracy_vs_time(steps: pd.DataFrame, evals: pd.DataFrame, *, title: str = "Training progress",
                          smooth_steps: Optional[int] = None, target_accuracy: Optional[float] = None,
                          faults: Optional[pd.DataFrame] = None) -> Figure:
    """Two panels against training wall-clock (s): rank 0's training loss, and test accuracy.

    Args:
        steps: step records (load_run(...).steps); rank 0's rows are drawn.
        evals: eval records (load_run(...).evals).
        title: the figure title (say which run and network point).
        smooth_steps: rolling-mean window over steps for the loss (default: about 1/50 of the run).
        target_accuracy: drawn as a dotted horizontal line when given.
        faults: fault events of the same jobs (load_run(...).faults): a dashed vertical line per
            job and event at its `train_time_s` (see `fault_marks`), labelled at the top.
    One line per (label, seed) in each panel; seeds of a label share its style.
    """
    figure, (loss_ax, acc_ax) = _new_figure(2)
    both = pd.concat([f[["algorithm", "label"]] for f in (steps, evals) if len(f) and "label" in f], ignore_index=True) \
        if (len(steps) or len(evals)) else pd.DataFrame(columns=["algorithm", "label"])
    styles = _styles(both)
    rank0 = steps[steps["rank"] == 0] if len(steps) and "rank" in steps else steps
    window = smooth_steps
    if window is None:
        longest = int(rank0.groupby(["label", "seed"], dropna=False).size().max()) if len(rank0) else 1
        window = max(1, longest // 50)
    labelled = set()
    for label in _label_order(rank0):
        for seed, rows in rank0[rank0["label"] == label].groupby("seed", dropna=False):
            rows = rows.sort_values("step")
            loss = rows["loss"].astype(float).rolling(window, min_periods=1).mean()
            style = styles[label]
            loss_ax.plot(rows["train_time_s"], loss, color=style["color"], linestyle=style["linestyle"],
                         linewidth=1.6, label=None if label in labelled else str(label))
            labelled.add(label)
    labelled = set()
    for label in _label_order(evals):
        for seed, rows in evals[evals["label"] == label].groupby("seed", dropna=False):
            rows = rows.sort_values("step")
            style = styles[label]
            acc_ax.plot(rows["train_time_s"], rows["accuracy"], color=style["color"], linestyle=style["linestyle"],
                        marker=style["marker"], markersize=4 if len(rows) > 1 else 7, linewidth=1.6,
                        label=None if label in labelled else str(label))
            labelled.add(label)
    if target_accuracy is not None:
        acc_ax.axhline(target_accuracy, color="#888888", linestyle=":", linewidth=1.2,
                       label=f"target {target_accuracy:g}", gid=REFERENCE_GID)
    marks = fault_marks(faults)
    if len(marks):
        times = pd.concat([rank0["train_time_s"] if len(rank0) else pd.Series(dtype=float),
                           evals["train_time_s"] if len(evals) else pd.Series(dtype=float), marks["x"]])
        _draw_fault_marks([loss_ax, acc_ax], marks, float(times.max() - times.min()))
    loss_ax.set_xlabel("training wall-clock time (s)")
    loss_ax.set_ylabel("training loss (cross-entropy, nats)")
    loss_ax.set_title("Loss, rank 0" + (f", mean of {window} steps" if window > 1 else ""))
    acc_ax.set_xlabel("training wall-clock time (s)")
    acc_ax.set_ylabel("test accuracy (fraction)")
    acc_ax.set_title("Accuracy")
    if not len(rank0):
        _note(loss_ax, "no step records", "center")
    if not len(evals):
        _note(acc_ax, "no eval records", "center")
    elif len(evals) and evals.groupby(["label", "seed"], dropna=False).size().max() == 1:
        _note(acc_ax, "one eval per run: no curve to read")
    return _finish(figure, [loss_ax, acc_ax], title)


# --- speedup against latency (DTS) ------------------------------------------------------------------


def _latency_axis(summary: pd.DataFrame) -> tuple[str, str]:
    if _has(summary, "mean_rtt_ms"):
        return "mean_rtt_ms", "mean inter-region RTT (ms)"
    return "delay_scale", "delay scale (× the topology's one-way delays)"


def speedup_vs_latency(summary: pd.DataFrame, *, title: str = "Speedup over sync vs network latency") -> Figure:
    """DTS's main plot: speedup over sync (time to target, and steps/s) against latency.

    Args:
        summary: summarize(...) rows; x is `mean_rtt_ms` when present (harness.report.network_axes
            adds it from each point's plan), else `delay_scale`. Median over seeds, min-max bars.
    One line per non-sync label in each panel; the dashed line at 1 is sync.
    """
    figure, (time_ax, rate_ax) = _new_figure(2)
    x, xlabel = _latency_axis(summary)
    styles = _styles(summary)
    frame = summary.assign(rate_mbit=_rate_mbit(summary)) if len(summary) else summary.assign(rate_mbit=[])
    sync_labels = [label for label in _label_order(summary) if
                   (summary.loc[summary["label"] == label, "algorithm"] == "sync").all()]
    points = 0
    for ax, column, name in ((time_ax, "speedup_vs_sync", "time-to-target speedup over sync (×)"),
                             (rate_ax, "throughput_speedup_vs_sync", "throughput speedup over sync (×, steps/s)")):
        points = max(points, _plot_series(ax, frame, x, column, styles, skip_labels=sync_labels,
                                          split="rate_mbit", split_format="{:g} Mbit/s"))
        ax.axhline(1.0, color=color_for("sync"), linestyle="--", linewidth=1.2, label="sync (= 1)", gid=REFERENCE_GID)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(name)
        if not _has(summary, column):
            why = "no run reached the target accuracy" if column == "speedup_vs_sync" else "no sync reference"
            _note(ax, f"no data: {why}", "center")
    time_ax.set_title("Time to target accuracy")
    rate_ax.set_title("Training throughput")
    if points == 1:
        for ax in (time_ax, rate_ax):
            _note(ax, ONE_POINT_NOTE)
    return _finish(figure, [time_ax, rate_ax], title)


def speedup_vs_nodes(summary: pd.DataFrame, *, title: str = "Speedup over sync vs node count") -> Figure:
    """SwarmSGD's scale plot: speedup over sync (time to target, and steps/s) against the number
    of nodes (log 2 axis), one line per non-sync label, median over seeds with min-max bars; the
    dashed line at 1 is sync at the same node count."""
    figure, (time_ax, rate_ax) = _new_figure(2)
    styles = _styles(summary)
    sync_labels = [label for label in _label_order(summary) if
                   (summary.loc[summary["label"] == label, "algorithm"] == "sync").all()]
    points = 0
    for ax, column, name in ((time_ax, "speedup_vs_sync", "time-to-target speedup over sync (×)"),
                             (rate_ax, "throughput_speedup_vs_sync", "throughput speedup over sync (×, steps/s)")):
        points = max(points, _plot_series(ax, summary, "nodes", column, styles, skip_labels=sync_labels))
        ax.axhline(1.0, color=color_for("sync"), linestyle="--", linewidth=1.2, label="sync (= 1)", gid=REFERENCE_GID)
        ax.set_xlabel("nodes (count)")
        ax.set_ylabel(name)
        if points > 1:
            ax.set_xscale("log", base=2)
            _plain_log_ticks(ax.xaxis)
        if not _has(summary, column):
            why = "no run reached the target accuracy" if column == "speedup_vs_sync" else "no sync reference"
            _note(ax, f"no data: {why}", "center")
    if _has(summary, "speedup_vs_sync"):
        others = summary[~summary["label"].isin(sync_labels)]
        missing = sorted(others.loc[others["speedup_vs_sync"].isna(), "nodes"].unique())
        if missing:  # a point left off the time panel is a result, not a gap: say it
            _note(time_ax, "target not reached at " + ", ".join(f"{n:g}" for n in missing) + " nodes")
    time_ax.set_title("Time to target accuracy")
    rate_ax.set_title("Training throughput")
    return _finish(figure, [time_ax, rate_ax], title)


# --- throughput against bandwidth (P3) --------------------------------------------------------------


def _rate_mbit(summary: pd.DataFrame) -> pd.Series:
    from emulator.units import parse_rate_bit_s

    if _has(summary, "rate_bit_s"):
        return summary["rate_bit_s"].astype(float) / 1e6
    return summary["rate"].map(lambda r: parse_rate_bit_s(r) / 1e6 if isinstance(r, str) and r else np.nan)


def throughput_vs_bandwidth(summary: pd.DataFrame, *, samples_per_step: Optional[float] = None,
                            title: str = "Training throughput vs inter-region bandwidth") -> Figure:
    """P3's plot: training throughput against the inter-region link rate (Mbit/s, log scale).

    Args:
        summary: summarize(...) rows; x from `rate_bit_s` (network_axes) or the swept `rate`.
        samples_per_step: global batch (batch size × nodes): y becomes samples/s instead of steps/s.
    One line per label.
    """
    figure, (ax,) = _new_figure(1)
    frame = summary.copy()
    frame["rate_mbit"] = _rate_mbit(frame) if len(frame) else []
    y = "steps_per_s"
    ylabel = "training throughput (steps/s)"
    if samples_per_step:
        frame["samples_per_s"] = frame["steps_per_s"] * samples_per_step
        y, ylabel = "samples_per_s", "training throughput (samples/s)"
    latency, _ = _latency_axis(frame)
    points = _plot_series(ax, frame, "rate_mbit", y, _styles(frame), split=latency,
                          split_format="RTT {:g} ms" if latency == "mean_rtt_ms" else "delay ×{:g}")
    ax.set_xlabel("inter-region link rate (Mbit/s)")
    ax.set_ylabel(ylabel)
    _log_x_or_note(ax, points, "no data: no rate on the sweep and no rate_bit_s column")
    return _finish(figure, [ax], title)


# --- accuracy against bytes on the wire --------------------------------------------------------------


_BYTE_UNITS = [(1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")]


def accuracy_vs_bytes(summary: pd.DataFrame, *, title: str = "Final accuracy vs traffic per node") -> Figure:
    """Final accuracy against the bytes each node sent (log scale, in B/kB/MB/GB by magnitude):
    one marker set per label, a marker per network point (and workload) at the median of its seeds,
    with min..max bars on both axes where there are several seeds."""
    figure, (ax,) = _new_figure(1)
    frame = summary.copy()
    sent = frame["bytes_sent_per_node"].astype(float) if len(frame) else pd.Series(dtype=float)
    zero = sent.notna() & (sent <= 0)
    dropped = int(zero.sum())
    frame, sent = frame[~zero], sent[~zero]
    typical = float(sent.median()) if sent.notna().any() else 1e6
    scale, unit = next(((f, u) for f, u in _BYTE_UNITS if typical >= f), _BYTE_UNITS[-1])
    frame = frame.assign(sent_scaled=sent / scale)
    styles = _styles(frame)
    drawn = 0
    for label in _label_order(frame):
        keys = [k for k in ("network", "workload") if k in frame.columns]
        jobs = frame[frame["label"] == label].dropna(subset=["sent_scaled", "final_accuracy"])
        if not len(jobs):
            continue
        groups = jobs.groupby(keys, dropna=False) if keys else [(None, jobs)]
        points = pd.DataFrame([{**{f"x_{k}": v for k, v in seed_stats(g["sent_scaled"]).items()},
                                **{f"y_{k}": v for k, v in seed_stats(g["final_accuracy"]).items()}}
                               for _, g in groups]).sort_values("x_median")
        style = styles[label]
        ax.plot(points["x_median"], points["y_median"], label=str(label), color=style["color"],
                linestyle="none", marker=style["marker"], markersize=8, alpha=0.85)
        if (points["y_n"] > 1).any():
            bars = ax.errorbar(points["x_median"], points["y_median"],
                               xerr=[points["x_median"] - points["x_min"], points["x_max"] - points["x_median"]],
                               yerr=[points["y_median"] - points["y_min"], points["y_max"] - points["y_median"]],
                               fmt="none", ecolor=style["color"], alpha=0.5, capsize=3)
            for cap in bars.lines[1]:
                cap.set_gid(SPREAD_GID)
        drawn += len(jobs)
    ax.set_xlabel(f"bytes sent per node ({unit}, log scale)")
    ax.set_ylabel("final test accuracy (fraction)")
    if drawn:
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
    else:
        _note(ax, "no data: no job with both accuracy and traffic", "center")
    if dropped:
        _note(ax, f"{dropped} job(s) sent 0 bytes: not drawn on a log axis")
    elif drawn == 1:
        _note(ax, "one run: nothing to compare")
    return _finish(figure, [ax], title)


# --- async against sync by compute/communication ratio (EA-wild) --------------------------------------


def compute_comm_ratio(steps: pd.DataFrame) -> pd.DataFrame:
    """Per (network, seed, workload): sum of sync's compute_s over sum of its comm_blocked_s, all
    ranks (the workload column only where the steps have one: results.workload_key)."""
    keys = ["network", "seed"] + (["workload"] if "workload" in steps.columns else [])
    columns = keys + ["compute_comm_ratio"]
    if not len(steps) or not {"compute_s", "comm_blocked_s", "algorithm"} <= set(steps.columns):
        return pd.DataFrame(columns=columns)
    sync = steps[(steps["algorithm"] == "sync")].dropna(subset=["compute_s", "comm_blocked_s"])
    if not len(sync):
        return pd.DataFrame(columns=columns)
    sums = sync.groupby(keys)[["compute_s", "comm_blocked_s"]].sum().reset_index()
    sums = sums[sums["comm_blocked_s"] > 0]
    sums["compute_comm_ratio"] = sums["compute_s"] / sums["comm_blocked_s"]
    return sums[columns]


def _one_line_per_algorithm_across_workloads(frame: pd.DataFrame) -> pd.DataFrame:
    """Prepare the EA-wild figure's points: each (label, network, workload) at the median of its
    seeds' ratios (seeds differ a little in x, and their speedups then drawn as the median with min-max
    bars), and an algorithm whose labels are one per workload (eawild-light, eawild-heavy: the same
    algorithm with compute padded or not) drawn as one line named after the algorithm, across the
    ratio axis as in the paper's figure."""
    if not len(frame) or not _has(frame, "compute_comm_ratio"):
        return frame
    frame = frame.copy()
    keys = ["label", "network"] + (["workload"] if "workload" in frame.columns else [])
    frame["compute_comm_ratio"] = frame.groupby(keys, dropna=False)["compute_comm_ratio"].transform("median")
    if "workload" in frame.columns:
        for algorithm, rows in frame.groupby("algorithm"):
            labels = rows.groupby("label")["workload"].nunique()
            if len(labels) > 1 and (labels == 1).all() and rows["workload"].nunique() == len(labels):
                frame.loc[rows.index, "label"] = algorithm
    return frame


def async_vs_sync(summary: pd.DataFrame, steps: pd.DataFrame, *, metric: str = "speedup_vs_sync",
                  title: str = "Speedup over sync vs compute/communication ratio") -> Figure:
    """EA-wild's conclusion: the speedup of each non-sync algorithm over sync (y) against sync's
    compute/communication ratio at the same network point and seed (x, log scale).

    Args:
        summary: summarize(...) rows.
        steps: step records (load_run(...).steps) holding sync's compute_s and comm_blocked_s.
        metric: speedup_vs_sync (time to target) or throughput_speedup_vs_sync; falls back to the
            latter, and says so on the axis, when no run reached the target.
    """
    figure, (ax,) = _new_figure(1)
    ratios = compute_comm_ratio(steps)
    # x is sync's ratio at each point (the summary's own column is each job's: left out here)
    summary = summary.drop(columns=["compute_comm_ratio"], errors="ignore")
    keys = [k for k in ratios.columns if k != "compute_comm_ratio"]
    if "workload" in keys and "workload" not in summary.columns:
        keys.remove("workload")   # a summary from before workloads were recorded
        ratios = ratios.groupby(keys, as_index=False)["compute_comm_ratio"].median()
    frame = summary.merge(ratios[keys + ["compute_comm_ratio"]], on=keys, how="left") if len(summary) else \
        summary.assign(compute_comm_ratio=[])
    if not _has(frame, metric) and metric == "speedup_vs_sync" and _has(frame, "throughput_speedup_vs_sync"):
        metric = "throughput_speedup_vs_sync"
    ylabel = {"speedup_vs_sync": "time-to-target speedup over sync (×)",
              "throughput_speedup_vs_sync": "throughput speedup over sync (×, steps/s)"}.get(metric, metric)
    frame = frame[frame["algorithm"] != "sync"] if len(frame) else frame
    frame = _one_line_per_algorithm_across_workloads(frame)
    points = _plot_series(ax, frame, "compute_comm_ratio", metric, _styles(frame))
    ax.axhline(1.0, color=color_for("sync"), linestyle="--", linewidth=1.2, label="sync (= 1)", gid=REFERENCE_GID)
    ax.axvline(1.0, color="#888888", linestyle=":", linewidth=1, gid=REFERENCE_GID)
    ax.set_xlabel("sync's compute / communication-blocked time (s/s, log scale)")
    ax.set_ylabel(ylabel)
    _log_x_or_note(ax, points, "no data: needs sync's compute_s and comm_blocked_s and a non-sync speedup")
    return _finish(figure, [ax], title)



# --- the paper figures drawn from committed evidence (results/papers/) ------------------------------



def _seed_band(rows: pd.DataFrame, x: str, y: str) -> pd.DataFrame:
    """Per step that every seed of `rows` evaluated (evidence thins each seed's evaluations on its
    own, so a step only some seeds kept would make the band jump): x's median over seeds and y's
    median, min and max over seeds."""
    table = rows.pivot_table(index="step", columns="seed", values=[x, y], aggfunc="first").dropna()
    return pd.DataFrame({"step": table.index, "x": table[x].median(axis=1).to_numpy(),
                         "median": table[y].median(axis=1).to_numpy(), "min": table[y].min(axis=1).to_numpy(),
                         "max": table[y].max(axis=1).to_numpy()})


def curves_with_seed_band(curves: pd.DataFrame, *, y: str, y_label: str, panels: list[tuple[str, str]],
                          first_sync_step: Optional[dict] = None, target: Optional[float] = None,
                          log_x: tuple = (), title: str = "Training curves, median of seeds") -> Figure:
    """One panel per x axis: per label, y's median over seeds against x (min-max band over seeds),
    and where the label's first synchronisation was applied (a dotted mark at that step's x).

    Args:
        curves: one row per evaluation: `label`, `seed`, `step`, `y` and every panel's x column
            (e.g. harness.report Results.evals, with a `tokens` column added for a language model);
            `algorithm` when present picks the colours (harness.plots PALETTE).
        y, y_label: the curve's column and its axis label (e.g. "loss", "held-out loss (nats/byte)").
        panels: (x column, x axis label) per panel, left to right.
        first_sync_step: label -> the step its first synchronisation was applied (summary.csv's
            `first_sync_step`); the mark sits at that step's x on the label's median curve
            (interpolated; x is taken as 0 before the first step). Labels absent: no mark.
        target: a y value drawn as a dashed horizontal reference (the target accuracy or loss).
        log_x: the x columns drawn on a log scale.
    """
    figure, axes = _new_figure(len(panels))
    frame = curves if "algorithm" in curves else curves.assign(algorithm=curves["label"])
    styles = _styles(frame)
    first_sync_step = first_sync_step or {}
    for ax, (x, x_label) in zip(axes, panels):
        for label in _label_order(frame):
            band = _seed_band(frame[frame["label"] == label], x, y)
            if not len(band):
                continue
            style = styles[label]
            ax.plot(band["x"], band["median"], label=str(label), color=style["color"],
                    linestyle=style["linestyle"], marker=style["marker"], markersize=3, linewidth=1.5)
            ax.fill_between(band["x"], band["min"], band["max"], color=style["color"], alpha=0.15,
                            gid=BAND_GID, label=None)
            step = first_sync_step.get(label)
            if step is not None and pd.notna(step):
                at = float(np.interp(step, [-1.0, *band["step"]], [0.0, *band["x"]]))
                ax.axvline(at, color=style["color"], linestyle=":", linewidth=1.2, gid=FIRST_SYNC_GID)
        if target is not None:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, gid=REFERENCE_GID)
        if x in log_x:
            ax.set_xscale("log")
        ax.set_xlabel(x_label)
        ax.set_ylabel(y_label)
        if not ax.lines:
            _note(ax, "no data: no step that every seed of a label evaluated", "center")
    if any(line.get_gid() == FIRST_SYNC_GID for ax in axes for line in ax.lines):
        axes[0].plot([], [], color="grey", linestyle=":", label="first sync applied (dotted)", gid=FIRST_SYNC_GID)
    return _finish(figure, axes, title)


def training_curves(evals: pd.DataFrame, summary: pd.DataFrame, *, target_accuracy: Optional[float] = None,
                    target_loss: Optional[float] = None, title: str = "Training curves") -> list[Figure]:
    """Per network point, `curves_with_seed_band` of the evaluations against training time and
    against steps: accuracy when the run has a target accuracy or the records carry accuracy, else
    the held-out loss; each label's first synchronisation (the median over its seeds of
    summary's `first_sync_step`) marked, the target drawn.

    Args:
        evals: harness.report Results.evals (an evidence folder's thinned evaluations do).
        summary: the rows to take first_sync_step from (Results.comparable()).
        target_accuracy, target_loss: the run's stop targets (RunInfo), drawn when given.
    """
    figures = []
    if not len(evals):
        return figures
    use_accuracy = target_accuracy is not None or (_has(evals, "accuracy") and target_loss is None)
    y, y_label, target = (("accuracy", "accuracy (fraction)", target_accuracy) if use_accuracy
                          else ("loss", "held-out loss (nats)", target_loss))
    time_column = "train_time_s" if _has(evals, "train_time_s") else "time_s"
    curves = evals.assign(steps_done=evals["step"] + 1)
    for network in sorted(curves["network"].dropna().unique()):
        rows = curves[curves["network"] == network]
        firsts = summary[summary["network"] == network] if "first_sync_step" in summary else summary.iloc[0:0]
        first_sync_step = firsts.groupby("label")["first_sync_step"].median().dropna().to_dict() if len(firsts) else {}
        figures.append(curves_with_seed_band(
            rows, y=y, y_label=y_label, target=target, first_sync_step=first_sync_step,
            panels=[(time_column, "training time (s, log scale)"), ("steps_done", "steps per worker (count)")],
            log_x=(time_column,), title=f"{title} at {network} (median of seeds, min-max band)"))
    return figures


def eawild_crossover(frame: pd.DataFrame, crossings: Optional[dict] = None, *,
                     title: str = "EA-wild vs sync: the crossover (median of seeds, min-max)") -> Figure:
    """EA-wild's speedup over sync (time to target) against compute / sync's communication per
    step (log-log), one line per worker count with min-max bars over seeds, local SGD at EA-wild's
    period (the control) dashed where it ran, and the crossovers marked.

    Args:
        frame: bench/eawild_crossover.py `table`'s rows (results/papers/eawild-sweep/crossover.csv):
            `workers`, `compute_over_comm`, `speedup_median`, `speedup_min`, `speedup_max`, and
            optionally `localsgd_speedup_median` (a seed that missed the target counts 0: drawn
            at 0.05, the axis' floor).
        crossings: workers -> compute / communication where the median speedup crosses 1 (that
            function's third result); none drawn when left out.
    """
    figure, (ax,) = _new_figure()
    crossings = crossings or {}
    for index, (workers, group) in enumerate(frame.groupby("workers")):
        group = group.sort_values("compute_over_comm")
        color = _FALLBACK[index % len(_FALLBACK)]
        ax.plot(group["compute_over_comm"], group["speedup_median"], color=color, marker="o",
                label=f"{workers} workers: EA-wild")
        bars = ax.errorbar(group["compute_over_comm"], group["speedup_median"],
                           yerr=[(group["speedup_median"] - group["speedup_min"]).clip(lower=0),
                                 (group["speedup_max"] - group["speedup_median"]).clip(lower=0)],
                           fmt="none", ecolor=color, alpha=0.6, capsize=3)
        for cap in bars.lines[1]:
            cap.set_gid(SPREAD_GID)
        if "localsgd_speedup_median" in group and group["localsgd_speedup_median"].notna().any():
            control = group.dropna(subset=["localsgd_speedup_median"])
            ax.plot(control["compute_over_comm"], control["localsgd_speedup_median"].clip(lower=0.05),
                    color=color, linestyle="--", marker="s", markersize=4, alpha=0.7,
                    label=f"{workers} workers: local SGD at EA-wild's period (control)")
        ratio = crossings.get(int(workers))
        if ratio:
            ax.axvline(ratio, color=color, linestyle=":", linewidth=1, gid=CROSSOVER_GID)
            ax.annotate(f"{ratio:.2f}", (ratio, 1.0), textcoords="offset points", xytext=(4, 6),
                        color=color, fontsize=FONT_PT - 2)
    ax.axhline(1.0, color="grey", linewidth=1, gid=REFERENCE_GID)
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)   # a speedup axis spans less than a decade: label its minor ticks
    ax.set_xlabel("compute per step / sync's communication per step (log scale)")
    ax.set_ylabel("speedup over sync, time to target (log)")
    return _finish(figure, [ax], title)


def steps_per_s_by_baseline(table: pd.DataFrame, *, reference: str = "p3",
                            title: str = "Steps/s per baseline (median of seeds, min-max)") -> Figure:
    """P3's comparison as bars: per scenario (a model and NIC), each label's steps/s (median over
    seeds, min-max bars), the `reference` label's bar edged in black.

    Args:
        table: one row per (scenario, label): `scenario`, `label`, `steps_per_s_median`,
            `steps_per_s_min`, `steps_per_s_max` (bench/bench_p3_paper.py's CSV, its `kind ==
            "label"` rows: results/papers/p3/p3-paper.csv).
    """
    figure, (ax,) = _new_figure()
    scenarios = list(dict.fromkeys(table["scenario"]))
    labels = sorted(dict.fromkeys(table["label"]), key=lambda label: (label != reference, label))
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        rows = table[table["label"] == label].set_index("scenario").reindex(scenarios)
        x = np.arange(len(scenarios)) + (index - (len(labels) - 1) / 2) * width
        median = rows["steps_per_s_median"].to_numpy(dtype=float)
        color = PALETTE.get(label, _FALLBACK[index % len(_FALLBACK)])   # variants (ps_sync-2mb) apart
        ax.bar(x, median, width, label=label, color=color, alpha=1.0 if label == reference else 0.75,
               edgecolor="black" if label == reference else "none", hatch=_HATCHES[index % len(_HATCHES)])
        bars = ax.errorbar(x, median, yerr=[np.clip(median - rows["steps_per_s_min"].to_numpy(dtype=float), 0, None),
                                            np.clip(rows["steps_per_s_max"].to_numpy(dtype=float) - median, 0, None)],
                           fmt="none", ecolor="black", alpha=0.6, capsize=2)
        for cap in bars.lines[1]:
            cap.set_gid(SPREAD_GID)
    ax.set_xticks(np.arange(len(scenarios)))
    ax.set_xticklabels(scenarios, rotation=15, ha="right")
    ax.set_xlabel("scenario (model and NIC)")
    ax.set_ylabel("steps per second (virtual time)")
    return _finish(figure, [ax], title)


_HATCHES = ["", "//", "..", "xx", "\\\\", "--"]

FIGURES = {
    "speedup_vs_latency": speedup_vs_latency,
    "throughput_vs_bandwidth": throughput_vs_bandwidth,
    "accuracy_vs_bytes": accuracy_vs_bytes,
    "async_vs_sync": async_vs_sync,
    "loss_accuracy_vs_time": loss_accuracy_vs_time,
    "curves_with_seed_band": curves_with_seed_band,
    "eawild_crossover": eawild_crossover,
    "steps_per_s_by_baseline": steps_per_s_by_baseline,
}
