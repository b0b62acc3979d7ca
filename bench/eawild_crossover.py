"""EA-wild's async/sync crossover from runs of scenarios/paper-eawild-sweep*.yaml (issue 23 item 3).

Reads each run's summary.csv (labels ``sync-c<ms>`` and ``eawild-c<ms>``: the same workload with
every step's compute padded to <ms> milliseconds) and prints, per worker count and compute point:

* sync's and EA-wild's time to the target accuracy (virtual seconds; median over the seeds, with
  min-max), EA-wild's speedup over sync per seed (sync's time / EA-wild's, same seed) and its
  median and min-max, and the accuracy at the step budget (equal epochs: both have the same
  workers and batch) as EA-wild minus sync in points;
* sync's communication per step, measured: sync's step time at the smallest compute point minus
  that compute (its all-reduce, hardly hidden there), and the ratio compute / that time;
* where the controls ran at that compute point (labels ``localsgd-c<ms>``: local SGD at EA-wild's
  period, ``localonly-c<ms>``: train apart and average once), each one's median speedup over
  sync (0 for a seed that missed the target), seeds that reached it, and its accuracy at the
  step budget minus sync's, in points;
* the crossover: where EA-wild's speedup crosses 1, interpolated linearly in log(compute) between
  the two compute points around it, for the median and for each seed (their spread). A seed
  that never reached the target has no speedup at that point (counted as a miss).

    .venv/bin/python bench/eawild_crossover.py results/papers/eawild-sweep/<run> [<run> ...]
    .venv/bin/python bench/eawild_crossover.py RUN... --csv results/papers/eawild-sweep/crossover.csv \
        --figure results/papers/eawild-sweep/crossover.png

``--figure``: EA-wild's speedup over sync (time to target) against compute / sync's communication
per step (log scale), one line per worker count (median over seeds, min-max bars), the
crossovers marked; local SGD's median speedup dashed beside it where the control ran (a seed
that missed the target counts 0, drawn at the axis' floor).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness, run from anywhere

# a control's label may name its period (localsgd-H2-c150: the reported seeds of a tuning run)
LABEL = re.compile(r"^(sync|eawild|localsgd|localonly)(?:-H\d+)?-c(\d+)$")
CONTROLS = ("localsgd", "localonly")   # local SGD at EA-wild's period; train apart, average once


def load(run_dirs: list[Path]) -> pd.DataFrame:
    frames = []
    for run in run_dirs:
        summary = pd.read_csv(run / "summary.csv")
        summary = summary[summary["phase"].astype(str) != "tuning"] if "phase" in summary else summary
        frames.append(summary.assign(run=run.name))
    rows = pd.concat(frames, ignore_index=True)
    parsed = rows["label"].str.extract(LABEL)
    rows = rows.assign(algorithm_=parsed[0], compute_ms=pd.to_numeric(parsed[1]))
    rows = rows.dropna(subset=["algorithm_"])
    twice = rows[rows.duplicated(["workers", "algorithm_", "compute_ms", "seed"], keep=False)]
    if len(twice):  # e.g. two runs' sync at one point, or local SGD at two periods
        first = twice.iloc[0]
        raise SystemExit(f"{first['algorithm_']} at {first['compute_ms']:g} ms, seed {first['seed']}, "
                         f"is in more than one of the runs given ({', '.join(sorted(set(twice['run'])))}): "
                         "give one run per algorithm and compute point")
    return rows


def _speedup(sync_s: float, other_s: float) -> float:
    """sync's time over the other's, same seed: 0 where the other missed the target, infinite where
    only sync missed it (a sync seed that diverged is a win for the other, not a seed left out),
    NaN where both missed it."""
    if pd.isna(other_s):
        return math.nan if pd.isna(sync_s) else 0.0
    return math.inf if pd.isna(sync_s) else sync_s / other_s


def crossing(points: list[tuple[float, float]]) -> float | None:
    """The compute (ms) where speedup crosses 1 going from > 1 to <= 1, interpolated in log(ms)
    (from an infinite speedup, sync missing the target: the point where it is <= 1)."""
    points = sorted((c, s) for c, s in points if s is not None and not math.isnan(s))
    for (c0, s0), (c1, s1) in zip(points, points[1:]):
        if s0 > 1 >= s1:
            if math.isinf(s0):  # sync missed the target at c0: no line to interpolate along
                return c1
            x0, x1 = math.log(c0), math.log(c1)
            return math.exp(x0 + (x1 - x0) * (s0 - 1) / (s0 - s1))
    return None


def table(rows: pd.DataFrame) -> tuple[pd.DataFrame, list[str], dict]:
    """Per (workers, compute point) row, the lines that say each crossover, and the crossovers
    ({workers: compute / communication where the median speedup crosses 1})."""
    out, lines, crossings = [], [], {}
    for workers, group in rows.groupby("workers"):
        sync = group[group["algorithm_"] == "sync"].set_index(["compute_ms", "seed"])
        wild = group[group["algorithm_"] == "eawild"].set_index(["compute_ms", "seed"])
        controls = {name: group[group["algorithm_"] == name].set_index(["compute_ms", "seed"]) for name in CONTROLS}
        smallest = sync.index.get_level_values(0).min()
        at_smallest = sync.loc[smallest]
        comm_s = float((1.0 / at_smallest["steps_per_s"] - smallest / 1e3).median())
        per_seed: dict = {}
        medians = []
        for compute in sorted(set(sync.index.get_level_values(0)) & set(wild.index.get_level_values(0))):
            seeds = sorted(set(sync.loc[compute].index) & set(wild.loc[compute].index))
            speedups = []
            for seed in seeds:
                s, w = sync.loc[(compute, seed)], wild.loc[(compute, seed)]
                ratio = _speedup(s["time_to_target_s"], w["time_to_target_s"])
                speedups.append(ratio)
                per_seed.setdefault(seed, []).append((compute, ratio))
            deltas = [(wild.loc[(compute, s)]["accuracy_at_step_budget"] - sync.loc[(compute, s)]["accuracy_at_step_budget"]) * 100
                      for s in seeds]
            median = float(pd.Series(speedups).median())
            medians.append((compute, median))
            against = {}
            for name, control in controls.items():  # each control's speedup over sync and accuracy, same seeds
                if compute not in control.index.get_level_values(0):
                    continue
                ran = [seed for seed in seeds if (compute, seed) in control.index]
                ratios = [_speedup(sync.loc[(compute, seed)]["time_to_target_s"], control.loc[(compute, seed)]["time_to_target_s"])
                          for seed in ran]
                gaps = [(control.loc[(compute, seed)]["accuracy_at_step_budget"]
                         - sync.loc[(compute, seed)]["accuracy_at_step_budget"]) * 100 for seed in ran]
                against[f"{name}_speedup_median"] = float(pd.Series(ratios).median())
                against[f"{name}_reached"] = int(sum(r > 0 for r in ratios))
                against[f"{name}_acc_delta_pp_median"] = float(pd.Series(gaps).median())
            out.append({**against,
                "workers": int(workers), "compute_ms": compute, "seeds": len(seeds),
                "compute_over_comm": compute / 1e3 / comm_s,
                "sync_time_to_target_s": float(sync.loc[compute]["time_to_target_s"].median()),
                "eawild_time_to_target_s": float(wild.loc[compute]["time_to_target_s"].median()),
                "sync_reached": int(sync.loc[compute]["time_to_target_s"].notna().sum()),
                "eawild_reached": int(wild.loc[compute]["time_to_target_s"].notna().sum()),
                "speedup_median": median, "speedup_min": min(speedups), "speedup_max": max(speedups),
                "sync_steps_per_s": float(sync.loc[compute]["steps_per_s"].median()),
                "eawild_steps_per_s": float(wild.loc[compute]["steps_per_s"].median()),
                "acc_delta_pp_median": float(pd.Series(deltas).median()),
                "acc_delta_pp_min": min(deltas), "acc_delta_pp_max": max(deltas),
            })
        median_cross = crossing(medians)
        if median_cross:
            crossings[int(workers)] = median_cross / 1e3 / comm_s
        seed_cross = {seed: crossing(points) for seed, points in per_seed.items()}
        said = ", ".join(f"seed {s}: " + (f"{c:.1f} ms" if c else "none") for s, c in sorted(seed_cross.items()))
        found = [c for c in seed_cross.values() if c]
        spread = f" (seeds {min(found):.1f}-{max(found):.1f} ms)" if found else ""
        after = [(c, m) for c, m in sorted(medians) if median_cross and c > median_cross and m > 1]
        back = (f"; the median is above 1 again at {after[0][0]:g} ms ({after[0][1]:.2f}x): a dip, not a "
                f"crossover sync stays ahead of" if after else "")
        lines.append(f"{int(workers)} workers: sync's communication per step {comm_s * 1e3:.1f} ms (step at "
                     f"{smallest:g} ms compute less that compute); crossover (EA-wild's median speedup = 1) at "
                     + (f"{median_cross:.1f} ms compute = {median_cross / 1e3 / comm_s:.2f} x sync's communication"
                        if median_cross else "none in the sweep") + f"{spread}; per seed: {said}{back}")
    frame = pd.DataFrame(out)
    first = [c for c in frame.columns if not c.startswith(CONTROLS)]
    return frame[first + [c for c in frame.columns if c.startswith(CONTROLS)]], lines, crossings


def figure(frame: pd.DataFrame, crossings: dict, path: Path) -> None:
    """harness.plots `eawild_crossover` (the one copy of the drawing), saved as PNG and SVG."""
    from harness import plots

    drawn = plots.eawild_crossover(frame, crossings)
    drawn.savefig(path, dpi=120)
    drawn.savefig(path.with_suffix(".svg"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--csv", type=Path)
    parser.add_argument("--figure", type=Path)
    args = parser.parse_args()
    frame, lines, crossings = table(load(args.runs))
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.3g}".format):
        print(frame.to_string(index=False))
    for line in lines:
        print(line)
    if args.csv:
        frame.to_csv(args.csv, index=False)
    if args.figure:
        figure(frame, crossings, args.figure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
