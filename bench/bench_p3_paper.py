"""The P3 paper's comparison from finished sim runs of scenarios/paper-p3-*.yaml: steps/s per
job, the median and range over seeds per label, and p3 over each baseline.

Steps/s is rank 0's steady state: steps 3..N-1 over their virtual time. The first two steps are
warm-up (the first has no earlier exchange to overlap, the second waits for the first's), and the
last is left out too: p3's and ps_sync's last step record also holds the final flush, a whole
exchange more (twice the bytes). summary.csv's steps_per_s counts every step. On sim the clock
does not depend on the data, so the seeds should give the same figure: the range says whether
they did.

    .venv/bin/python bench/bench_p3_paper.py results/runs/paper-p3-resnet50/<run> [more runs] \
        [--csv results/papers/p3/p3-paper.csv]

Prints the runs, versions and date; with --csv writes one row per job and one per label. A run
may also be its committed evidence (results/papers/p3/<scenario>/<stamp>: each job's step records
as rank<N>.steps.jsonl beside job.json), from which the same rows follow.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

WARMUP_STEPS = 2
P3 = "p3"


def steady_steps_per_s(rank0: Path, warmup: int = WARMUP_STEPS) -> tuple[float, int, float]:
    """(steps/s after `warmup` steps, steps counted, bytes sent per step) from a rank's records."""
    steps = [row for row in map(json.loads, rank0.read_text().splitlines()) if "step_s" in row and "time_s" in row]
    if len(steps) < warmup + 3:
        raise ValueError(f"{rank0}: {len(steps)} steps, need at least {warmup + 3}")
    times = [row["time_s"] for row in steps]
    counted = steps[warmup + 1 : -1]  # time_s is each step's end
    sent = statistics.median(row.get("bytes_sent", float("nan")) for row in counted)
    return len(counted) / (times[-2] - times[warmup]), len(counted), sent


def jobs(run_dir: Path) -> list[dict]:
    scenario = json.loads((run_dir / "scenario.json").read_text())
    name = scenario.get("name") or scenario.get("spec", {}).get("name") or run_dir.parent.name
    rows = []
    for job_dir in sorted((run_dir / "jobs").iterdir()):
        if not (job_dir / "job.json").is_file():  # written when the job has ended
            print(f"skipped (not finished): {job_dir}")
            continue
        spec = json.loads((job_dir / "job.json").read_text())
        if spec.get("status") != "ok":
            print(f"skipped ({spec.get('status')}: {spec.get('reason') or ''}): {job_dir}")
            continue
        records = job_dir / "rank0.jsonl"
        rate, counted, sent = steady_steps_per_s(records if records.is_file() else job_dir / "rank0.steps.jsonl")
        label = spec.get("base_label") or spec.get("label")
        rows.append({"scenario": name, "run": run_dir.name, "label": label, "seed": spec.get("seed"),
                     "steps_per_s": rate, "steps_counted": counted, "rank0_bytes_sent_per_step": sent})
    return rows


def by_label(rows: list[dict]) -> list[dict]:
    table = []
    for scenario in dict.fromkeys(row["scenario"] for row in rows):
        mine = [row for row in rows if row["scenario"] == scenario]
        medians = {}
        for label in dict.fromkeys(row["label"] for row in mine):
            rates = [row["steps_per_s"] for row in mine if row["label"] == label]
            medians[label] = statistics.median(rates)
            table.append({"scenario": scenario, "label": label, "seeds": len(rates), "steps_per_s_median": medians[label],
                          "steps_per_s_min": min(rates), "steps_per_s_max": max(rates)})
        for row in table:
            if row["scenario"] == scenario and P3 in medians:
                row["p3_over_this"] = medians[P3] / row["steps_per_s_median"]
        strongest = max((label for label in medians if label != P3), key=medians.get, default=None)
        for row in table:
            if row["scenario"] == scenario:
                row["strongest_baseline"] = strongest
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (results/runs/paper-p3-*/<stamp>)")
    parser.add_argument("--csv", type=Path, help="write the per-job and per-label rows here")
    args = parser.parse_args(argv)
    rows = [row for run in args.runs for row in jobs(run)]
    table = by_label(rows)
    print(f"# P3 paper comparison, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
          f"python {platform.python_version()}, {platform.machine()}; runs: {', '.join(str(r) for r in args.runs)}")
    print(f"steady state: rank 0's steps after the first {WARMUP_STEPS}, the last left out; virtual time (sim)\n")
    print("| scenario | label | seeds | steps/s median | range | p3 / this |")
    print("|---|---|---|---|---|---|")
    for row in table:
        ratio = row.get("p3_over_this")
        print(f"| {row['scenario']} | {row['label']} | {row['seeds']} | {row['steps_per_s_median']:.4f} | "
              f"{row['steps_per_s_min']:.4f}-{row['steps_per_s_max']:.4f} | {'' if ratio is None else f'{ratio:.3f}x'} |")
    for scenario in dict.fromkeys(row["scenario"] for row in table):
        strongest = next(row["strongest_baseline"] for row in table if row["scenario"] == scenario)
        gain = next((row.get("p3_over_this") for row in table if row["scenario"] == scenario and row["label"] == strongest), None)
        if gain is not None:
            print(f"{scenario}: strongest baseline {strongest}; p3 {100 * (gain - 1):+.1f} % over it")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        fields = ["kind", "scenario", "run", "label", "seed", "seeds", "steps_per_s", "steps_counted",
                  "rank0_bytes_sent_per_step", "steps_per_s_median", "steps_per_s_min", "steps_per_s_max",
                  "p3_over_this", "strongest_baseline"]
        with args.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fields, extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({"kind": "job", **row})
            for row in table:
                writer.writerow({"kind": "label", **row})
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
