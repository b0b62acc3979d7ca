"""Final models re-evaluated on the whole held-out split, from run folders (the snapshots are there,
not in the committed evidence).

A scenario caps its evaluation (`dataset.max_test_samples`: the language-model scenarios of
docs/RESULTS.md section 17 evaluate 500 sequences of 32 bytes, 16 kB from the first held-out
files) to keep the evaluator cheap during training. A gap of a few tenths of a per cent between
two labels is then within what the choice of those 16 kB can move. This script takes each
reported job's last snapshot (the output model the evaluator scored: the global model, the mean of
the replicas, ...), evaluates it on the job's whole held-out split (or `--max-test-samples N`),
and prints, per label, the median over seeds with min-max and the gap to the baseline label, seed
by seed, beside the capped figure from the job's eval.jsonl.

    .venv/bin/python bench/bench_heldout_full.py /work/b64-runs/paper-diloco-lm-b64/<run> \
        [--with <controls run>] [--baseline sync] [--csv results/papers/diloco-lm-b64/heldout-full.csv]
    .venv/bin/python bench/bench_heldout_full.py --from-jobs <a -jobs.csv it wrote> --baseline <another label> \
        --csv <another table>    # the same evaluations against another baseline, nothing evaluated again
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # trainers, run from anywhere
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_diloco_lm beside it

from bench_diloco_lm import seed_list  # noqa: E402


def final_loss(job_dir: Path, max_test_samples: int | None) -> dict:
    """The job's last eval point re-evaluated on `max_test_samples` held-out samples (None: all)."""
    import torch

    from trainers.datasets import load_dataset
    from trainers.evaluate import JobEvaluator

    torch.set_num_threads(1)
    evaluator = JobEvaluator(job_dir)
    dataset = dataclasses.replace(evaluator.config.dataset, max_test_samples=max_test_samples)
    evaluator.data = load_dataset(dataset, evaluator.config.seed)
    evaluator.test_inputs = evaluator.data.inputs(evaluator.data.test_x)
    snapshots = evaluator.snapshots()
    last = max(i for per_rank in snapshots.values() for i in per_rank)
    paths = {rank: per_rank[max(i for i in per_rank if i <= last)] for rank, per_rank in snapshots.items()}
    row = evaluator.evaluate_index(last, paths)
    capped = [json.loads(line) for line in (job_dir / "eval.jsonl").read_text().splitlines() if line.strip()]
    capped_row = next(r for r in reversed(capped) if r.get("eval_index") == last)
    return {"step": row["step"], "loss_full": row["loss"], "loss_capped": capped_row["loss"],
            "test_sequences": len(evaluator.data.test_y), "role": row["role"]}


def reported_jobs(run: Path) -> pd.DataFrame:
    """The run's ok jobs of the reported phase, each with its folder (bench_diloco_lm's readers)."""
    from bench_diloco_lm import job_dir_of, ok_jobs

    summary = ok_jobs(run)
    if "phase" in summary:
        summary = summary[summary["phase"].fillna("reported") == "reported"]
    return summary.assign(job_dir=[job_dir_of(run, r) for _, r in summary.iterrows()])


def summary_table(frame: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Per label of `frame` (one row per job: label, seed, loss_full, loss_capped): the median over
    seeds with min-max, the gap of medians to `baseline` and the per-seed gaps' min, max, median."""
    base = frame[frame["label"] == baseline].set_index("seed")
    table = []
    for label, group in frame.groupby("label", sort=False):
        full, capped = group["loss_full"].median(), group["loss_capped"].median()
        per_seed = [(r["loss_full"] / base.loc[r["seed"], "loss_full"] - 1) * 100 for _, r in group.iterrows()
                    if r["seed"] in base.index]
        table.append({"label": label, "seeds": len(group), "loss_full": full, "loss_full_min": group["loss_full"].min(),
                      "loss_full_max": group["loss_full"].max(), "gap_pct": (full / base["loss_full"].median() - 1) * 100,
                      "gap_pct_seed_min": min(per_seed), "gap_pct_seed_max": max(per_seed),
                      "gap_pct_seed_median": statistics.median(per_seed),
                      "loss_capped": capped, "gap_pct_capped": (capped / base["loss_capped"].median() - 1) * 100})
    return pd.DataFrame(table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, nargs="?", help="a finished run folder (with its jobs' snapshots)")
    parser.add_argument("--with", dest="others", type=Path, action="append", default=[],
                        help="another run of the same workload (its controls); repeatable")
    parser.add_argument("--from-jobs", type=Path, action="append", default=[],
                        help="a -jobs.csv this script wrote: its evaluations taken as they are (nothing "
                             "evaluated again), alone or joined with run folders' new ones; repeatable")
    parser.add_argument("--baseline", default="sync")
    parser.add_argument("--max-test-samples", type=int, default=None, help="default: the whole held-out split")
    parser.add_argument("--seeds", type=seed_list,
                        help="only these seeds of the reported phase (as bench_diloco_lm --seeds)")
    parser.add_argument("--csv", type=Path)
    args = parser.parse_args(argv)
    if args.run is None and not args.from_jobs:
        parser.error("give a run folder or --from-jobs, one of them at least")
    frames, sources = [pd.read_csv(path) for path in args.from_jobs], [f"{p} (evaluated before)" for p in args.from_jobs]
    if args.run is not None:
        jobs = pd.concat([reported_jobs(run) for run in [args.run, *args.others]], ignore_index=True)
        if args.seeds:
            jobs = jobs[jobs["seed"].isin(args.seeds)].reset_index(drop=True)
        rows = []
        for _, job in jobs.iterrows():
            if not (job["job_dir"] / "snapshots").is_dir():
                print(f"{job['job_dir']}: no snapshots (committed evidence keeps none; give the run folder)",
                      file=sys.stderr)
                return 2
            rows.append({"label": job["label"], "seed": int(job["seed"]),
                         **final_loss(job["job_dir"], args.max_test_samples)})
        frames.append(pd.DataFrame(rows))
        sources.append(f"{args.run} (+ {', '.join(map(str, args.others)) or 'nothing'}), the run evaluated "
                       f"{json.loads((args.run / 'scenario.json').read_text())['spec']['workload']['dataset'].get('max_test_samples')}")
    frame = pd.concat(frames, ignore_index=True)
    if args.seeds:
        frame = frame[frame["seed"].isin(args.seeds)].reset_index(drop=True)
    if frame.duplicated(["label", "seed"]).any():
        print("a label and seed evaluated twice (the same job in two sources?)", file=sys.stderr)
        return 2
    source = " + ".join(sources)
    if frame[frame["label"] == args.baseline].empty:
        print(f"no reported '{args.baseline}' job", file=sys.stderr)
        return 2
    print(f"# {source}: final models on {frame['test_sequences'].iloc[0]} held-out sequences\n")
    print(f"| label | seeds | loss, whole split: median [min, max] | vs {args.baseline} (medians) | per seed | "
          f"capped (the run's): median | vs {args.baseline}, capped |")
    print("|---|---|---|---|---|---|---|")
    table = summary_table(frame, args.baseline)
    for row in table.to_dict("records"):
        print(f"| {row['label']} | {row['seeds']} | {row['loss_full']:.4f} [{row['loss_full_min']:.4f}, "
              f"{row['loss_full_max']:.4f}] | {row['gap_pct']:+.2f} % | {row['gap_pct_seed_min']:+.2f} to "
              f"{row['gap_pct_seed_max']:+.2f} % | {row['loss_capped']:.4f} | {row['gap_pct_capped']:+.2f} % |")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.csv, index=False)
        frame.to_csv(args.csv.with_name(args.csv.stem + "-jobs.csv"), index=False)
        print(f"wrote {args.csv} and {args.csv.with_name(args.csv.stem + '-jobs.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
