"""Labels of later runs set against the sync of an earlier run on the same machine, seed by seed.

A control tuned one step past an edge runs after the main run (its own scenario, no sync in it);
its speedup and accuracy are only meaningful against sync of the same seed on the same machine
(trajectories differ between VMs). This reads the reported seeds of every run given (summary.csv;
tuning candidates left out), takes the baseline label (default ``sync``) from the first run that
has it, and prints one markdown row per other label: time to target median [min..max], seeds that
reached it, speedup in time over the baseline per seed (the baseline's time / the label's, same
seed), steps/s over the baseline, accuracy at the step budget and its difference from the
baseline's in points, and, with ``--reference LABEL``, the reference's time / the label's per seed
(above 1: the label is faster than the reference in that seed). A label whose run had no baseline
gets the output-averaging charge the baseline's run made (harness/results.py
charge_output_sync_from), marked *.

    .venv/bin/python bench/paired_seeds.py results/papers/dts-fmnist-wide/20261207-163102-wide \\
        results/papers/dts-fmnist-wide/20261207-200924-edge2 --reference dts-p16-t64
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness, run from anywhere

from harness.results import charge_output_sync_from  # noqa: E402


def load(run_dirs: list[Path]) -> pd.DataFrame:
    """The reported rows of every run's summary.csv (a run without tuning: all its rows), with its run."""
    frames = []
    for run in run_dirs:
        summary = pd.read_csv(run / "summary.csv")
        if "phase" in summary:
            summary = summary[summary["phase"].astype(str) != "tuning"]
        frames.append(summary.assign(run=run.name))
    return pd.concat(frames, ignore_index=True)


def charge_output_sync(rows: pd.DataFrame, baseline: str = "sync") -> pd.DataFrame:
    """The rows of runs without the baseline charged the output's average as the baseline's run
    charged it, same network point and seed (harness/results.py charge_output_sync_from)."""
    runs = rows.loc[rows["label"] == baseline, "run"]
    if runs.empty:
        return rows.assign(output_sync_charged=False)
    home = runs.iloc[0]
    return charge_output_sync_from(rows, rows[rows["run"] == home])


def _spread(values, fmt: str = "{:.1f}") -> str:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return "never"
    series = pd.Series(values)
    return f"{fmt.format(series.median())} [{fmt.format(series.min())}..{fmt.format(series.max())}]"


def table(rows: pd.DataFrame, baseline: str = "sync", reference: str | None = None) -> pd.DataFrame:
    """One row per label (the baseline's first): per-seed ratios against the baseline of the same
    seed, and against `reference` where given. A seed the baseline lacks is left out of the ratios."""
    rows = charge_output_sync(rows, baseline)
    base = rows[rows["label"] == baseline]
    if base.empty:
        raise SystemExit(f"no reported seeds of {baseline!r} in the runs given")
    base = base[base["run"] == base["run"].iloc[0]].set_index("seed")
    ref = None
    if reference is not None:
        ref = rows[rows["label"] == reference]
        if ref.empty:
            raise SystemExit(f"no reported seeds of {reference!r} in the runs given")
        ref = ref[ref["run"] == ref["run"].iloc[0]].set_index("seed")
    out = []
    for (run, label), group in rows.groupby(["run", "label"], sort=False):
        group = group.set_index("seed")
        seeds = [s for s in group.index if s in base.index]
        time, budget_acc = group["time_to_target_s"], group["accuracy_at_step_budget"]
        speedup = [base.loc[s, "time_to_target_s"] / time[s] for s in seeds]
        rate = [group.loc[s, "steps_per_s"] / base.loc[s, "steps_per_s"] for s in seeds]
        delta = [(budget_acc[s] - base.loc[s, "accuracy_at_step_budget"]) * 100 for s in seeds]
        row = {"run": run, "label": label, "seeds": len(group), "reached": int(time.notna().sum()),
               "charged": bool(group["output_sync_charged"].any()),
               "time_to_target_s": time.median(), "speedup_median": pd.Series(speedup).median(),
               "time": _spread(time.tolist()), "speedup": _spread(speedup),
               "rate": _spread(rate), "accuracy": _spread((budget_acc * 100).tolist(), "{:.2f}"),
               "delta": _spread(delta, "{:+.2f}")}
        if ref is not None:
            against = [ref.loc[s, "time_to_target_s"] / time[s] for s in group.index if s in ref.index]
            row["vs_reference"] = _spread(against, "{:.2f}")
        out.append(row)
    frame = pd.DataFrame(out)
    first = frame["label"] == baseline
    return pd.concat([frame[first].head(1), frame[~first]], ignore_index=True)


def markdown(frame: pd.DataFrame, baseline: str, reference: str | None) -> str:
    head = ["label", "time to target (s)", "reached", f"speedup over {baseline}", f"steps/s over {baseline}",
            "accuracy at the step budget", f"Δ vs {baseline}"] + ([f"{reference}'s time / the label's"] if reference else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    several = frame["label"].duplicated(keep=False)  # a label in two runs: name the run
    for row, named in zip(frame.to_dict("records"), several):
        label = f"{row['label']} ({row['run']})" if named else row["label"]
        label += " *" if row["charged"] else ""
        times = lambda text: text if text == "never" else text + "x"  # noqa: E731
        cells = [label, row["time"], f"{row['reached']} of {row['seeds']}", times(row["speedup"]),
                 times(row["rate"]), row["accuracy"] + " %", row["delta"] + " pp"]
        if reference:
            cells.append(row["vs_reference"])
        lines.append("| " + " | ".join(cells) + " |")
    if frame["charged"].any():
        lines.append(f"\n\\* its run had no {baseline}: the output's average charged as in the {baseline}'s run "
                     "(same network point and seed), added to its time to target")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run or evidence folders (summary.csv); the baseline's first")
    parser.add_argument("--baseline", default="sync", help="the label every other is divided by (default sync)")
    parser.add_argument("--reference", help="a second label to set each against, seed by seed (e.g. dts-p16-t64)")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / "summary.csv").is_file()]
    if missing:
        parser.error(f"no summary.csv in: {', '.join(missing)}")
    print(markdown(table(load(args.runs), args.baseline, args.reference), args.baseline, args.reference))
    return 0


if __name__ == "__main__":
    sys.exit(main())
