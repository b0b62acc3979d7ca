"""SwarmSGD's comparison at 16 nodes (scenarios/paper-swarmsgd-fmnist16*.yaml) from finished runs:
per label and seed the final accuracy, time to the target, steps/s, bytes per node (summary.csv),
and what the summary does not hold: how many pairwise averages each node applied over the run
and how stale a reply was (the requester's own steps from sending its request to the reply's
arrival: swarmsgd.py's ``staleness``), from every rank's step records.

    .venv/bin/python bench/bench_swarmsgd_paper.py RUN [RUN ...] [--names NAME ...] [--csv FILE]
    .venv/bin/python bench/bench_swarmsgd_paper.py --figure FILE.png EVIDENCE_RUN [EVIDENCE_RUN ...]

RUN: a run folder (results/runs/<scenario>/<run-id>) with its ranks' records (rank<N>.jsonl);
the committed evidence keeps rank 0's thinned records only, so the averages column needs the
run folders (its CSV is committed beside the evidence). Prints one row per job and one per label
(median over its seeds, with the range), then each label against sync seed by seed (`paired`:
sync's time to target over the label's, and the accuracy difference), labels taken by their base
(an ``-lr<x>`` suffix dropped), so runs that split the labels pair up (the data-centre control's
SwarmSGD and its sync run apart). ``--names`` gives the CSV's run column per run (the evidence
folder's name, where two runs share an id). ``--figure`` draws held-out accuracy against steps and
against virtual time per label of the reported seeds (median line, band over the seeds) from the
jobs' eval.jsonl, which the committed evidence keeps: it needs no run folder; several runs are
drawn as one.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COLUMNS = ("run", "label", "seed", "final_accuracy", "time_to_target_s", "steps_per_s", "bytes_sent_per_node",
           "first_sync_step", "averages_per_node_median", "averages_per_node_min", "averages_per_node_max",
           "reply_staleness_median")


def averages(job_dir: Path) -> tuple[list[int], list[float]]:
    """(averages applied per rank over the run, every applied reply's staleness in steps): the
    sums of the step records' ``syncs_applied`` (a per-step count) and their ``staleness``."""
    per_rank, stale = [], []
    for path in sorted(job_dir.glob("rank*.jsonl")):
        applied = 0
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") != "step":
                continue
            applied += row.get("syncs_applied") or 0
            if row.get("staleness") is not None:
                stale.append(row["staleness"])
        per_rank.append(applied)
    return per_rank, stale


def base_label(label: str) -> str:
    """A label without its tuning suffix: ``sync-lr0.05`` -> ``sync``."""
    return re.sub(r"-lr[0-9.e-]+$", "", label)


def paired(rows: list[dict], reference: str = "sync") -> list[dict]:
    """Each non-reference label against the reference seed by seed, per node count and network
    point (rows of every run given, by base label; a seed both have): speedup = the reference's
    time to target / the label's (NaN where either never reached it), accuracy_delta = the label's
    final accuracy - the reference's. A label's seed given twice (same node count, network, base
    label and seed) is taken from the later row: runs are given in order, so a pick an edge check
    moved, reported by a later run, replaces the first pick's jobs (said on stdout). Returns one
    row per (nodes, network, label): its seeds, the median and range of both, and how many seeds
    reached the target (the median speedup is NaN unless all did)."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for row in rows:
        seeds = by_key.setdefault((row.get("nodes"), row.get("network"), base_label(row["label"])), {})
        if int(row["seed"]) in seeds:   # a later run's job replaces it: a pick an edge check moved
            replaced = seeds[int(row["seed"])]
            print(f"  (paired: {row['label']} seed {row['seed']} of run {row.get('run')} replaces "
                  f"{replaced['label']} of run {replaced.get('run')})")
        seeds[int(row["seed"])] = row
    out = []
    for (nodes, network, label), seeds in by_key.items():
        ref = by_key.get((nodes, network, reference))
        if label == reference or ref is None:
            continue
        common = sorted(set(seeds) & set(ref))
        if not common:
            continue
        speedups = [number(ref[s]["time_to_target_s"]) / number(seeds[s]["time_to_target_s"]) for s in common]
        deltas = [number(seeds[s]["final_accuracy"]) - number(ref[s]["final_accuracy"]) for s in common]
        reached = [x for x in speedups if x == x]
        out.append({"nodes": nodes, "network": network, "label": label, "seeds": common, "reached": len(reached),
                    "speedup_median": statistics.median(speedups) if len(reached) == len(common) else float("nan"),
                    "speedup_min": min(reached, default=float("nan")), "speedup_max": max(reached, default=float("nan")),
                    "accuracy_delta_median": statistics.median(deltas), "accuracy_delta_min": min(deltas),
                    "accuracy_delta_max": max(deltas)})
    return out


def rows_of(run_dir: Path, name: str | None = None) -> list[dict]:
    with open(run_dir / "report" / "summary.csv", newline="") as handle:
        summary = list(csv.DictReader(handle))
    rows = []
    for entry in summary:
        if entry["status"] != "ok":
            continue
        job_dir = run_dir / "jobs" / f"{entry['network']}-{entry['label']}-seed{entry['seed']}"
        per_rank, stale = averages(job_dir)
        if not per_rank:
            raise SystemExit(f"{job_dir}: no rank<N>.jsonl (a run folder, not its evidence, is needed)")
        rows.append({"run": name or run_dir.name, "label": entry["label"], "seed": int(entry["seed"]),
                     "phase": entry.get("phase") or "reported", "network": entry["network"],
                     "nodes": int(entry["nodes"]),
                     **{key: entry[key] for key in COLUMNS[3:8]},
                     "averages_per_node_median": statistics.median(per_rank),
                     "averages_per_node_min": min(per_rank), "averages_per_node_max": max(per_rank),
                     "reply_staleness_median": statistics.median(stale) if stale else ""})
    return rows


def draw(run_dir, path: Path, labels=("sync", "local_sgd-H4", "local_sgd-H16-ring", "swarmsgd", "local_only"),
         target: float = 0.85, title: str | None = None):
    """Accuracy vs step and vs virtual time, per label over its reported seeds (median, min-max
    band, each label's first synchronisation dotted): harness.plots.curves_with_seed_band, the
    figure the SwarmSGD notebook draws, from the run's eval.jsonl and summary. `run_dir`: one run
    folder or a list of them (drawn as one; labels taken by their base, an ``-lr<x>`` suffix dropped).
    """
    import pandas as pd

    from harness import plots
    from harness.report import load_folder

    runs = [Path(run_dir)] if isinstance(run_dir, (str, Path)) else [Path(r) for r in run_dir]
    summaries, evals = [], []
    for run in runs:
        results = load_folder(run)
        if results is None:
            raise SystemExit(f"{run}: no run folder here")
        summaries.append(results.summary)
        evals.append(results.evals)
    summary = pd.concat(summaries, ignore_index=True)
    summary = summary.assign(label=summary["label"].map(base_label))
    evals = pd.concat(evals, ignore_index=True)
    evals = evals.assign(label=evals["label"].map(base_label))
    jobs = summary[(summary["status"] == "ok") & (summary["phase"].fillna("reported") == "reported")
                   & summary["label"].isin(labels)]
    keys = set(zip(jobs["label"], jobs["seed"]))
    curves = evals[[key in keys for key in zip(evals["label"], evals["seed"])]]
    seeds = jobs.groupby("label")["seed"].nunique()
    count = str(seeds.max()) if seeds.min() == seeds.max() else f"{seeds.min()}-{seeds.max()}"
    nodes = int(jobs["nodes"].iloc[0]) if "nodes" in jobs and len(jobs) else 16
    title = title or f"SwarmSGD at {nodes} nodes on aws-4region (sim), LeNet / Fashion-MNIST, {runs[0].name}"
    figure = plots.curves_with_seed_band(
        curves.assign(steps=curves["step"] + 1), y="accuracy", y_label="held-out accuracy (10,000 images)",
        panels=[("steps", f"steps ({nodes} nodes x 32 images each)"), ("time_s", "virtual time (s)")],
        first_sync_step=jobs.groupby("label")["first_sync_step"].median().dropna().to_dict(), target=target,
        log_x=("time_s",),
        title=f"{title}: median of {count} seeds, min-max band")
    figure.savefig(path, dpi=110)
    print(f"figure: {path}")
    return figure


def number(text) -> float:
    return float(text) if text not in ("", None) else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders of scenarios/paper-swarmsgd-fmnist16*.yaml")
    parser.add_argument("--names", nargs="+", help="the CSV's run column, one per run (default: the run id)")
    parser.add_argument("--csv", type=Path, help="write the per-job rows here")
    parser.add_argument("--figure", type=Path, help="draw the runs' accuracy curves here (PNG) and stop")
    parser.add_argument("--title", help="the figure's title (default: names the node count and the first run)")
    args = parser.parse_args(argv)
    if args.figure:
        draw(args.runs, args.figure, title=args.title)
        return 0
    names = args.names or [None] * len(args.runs)
    if len(names) != len(args.runs):
        parser.error(f"--names: {len(names)} names for {len(args.runs)} runs")
    rows = [row for run, name in zip(args.runs, names) for row in rows_of(run, name)]
    print("| run | label | seed | final acc | to target s | steps/s | MB sent/node | averages/node (range) | reply staleness |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row['label']} | {row['seed']} | {number(row['final_accuracy']):.4f} | "
              f"{number(row['time_to_target_s']):.1f} | {number(row['steps_per_s']):.2f} | "
              f"{number(row['bytes_sent_per_node']) / 1e6:.2f} | {row['averages_per_node_median']:g} "
              f"({row['averages_per_node_min']}-{row['averages_per_node_max']}) | {row['reply_staleness_median']} |")
    print("\nper label (median over seeds, range):")
    labels: dict[str, list[dict]] = {}
    for row in rows:
        labels.setdefault(row["label"], []).append(row)
    for label, group in labels.items():
        accuracy = [number(r["final_accuracy"]) for r in group]
        applied = [r["averages_per_node_median"] for r in group]
        print(f"  {label}: {len(group)} seeds, final accuracy {statistics.median(accuracy):.4f} "
              f"({min(accuracy):.4f}-{max(accuracy):.4f}), averages per node {statistics.median(applied):g}")
    pairs = paired([row for row in rows if row.get("phase", "reported") != "tuning"])
    if pairs:
        print("\nagainst sync, seed by seed (sync's time to target / the label's; accuracy difference):")
        for pair in pairs:
            print(f"  {pair['nodes']} nodes, {pair['network']}, {pair['label']}: seeds {pair['seeds']}, reached {pair['reached']} of {len(pair['seeds'])}, "
                  f"speedup {pair['speedup_median']:.2f}x ({pair['speedup_min']:.2f}-{pair['speedup_max']:.2f}), "
                  f"accuracy {100 * pair['accuracy_delta_median']:+.2f} pp "
                  f"({100 * pair['accuracy_delta_min']:+.2f} to {100 * pair['accuracy_delta_max']:+.2f})")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
        print(f"csv: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
