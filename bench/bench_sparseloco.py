"""SparseLoCo and hierarchical DiLoCo against DiLoCo: bytes per node and loss, from a finished sim
run of scenarios/sparseloco-lm.yaml (8 nodes on aws-4region, 2 per region; issue 24, part 2).

Per job: bytes sent per node over the run (every rank's last step record, bytes_sent_total: the
comm layer's counters, the payloads as sent), their mean and max over ranks (hierarchical: the
region leaders send more than the members), the ratio to DiLoCo's mean, the final training loss
(rank 0, mean of the last 10 steps), the evaluator's last validation loss (nats per byte) and the
virtual time of rank 0's last step.

    PYTHONPATH=$PWD .venv/bin/python -m harness.cli run scenarios/sparseloco-lm.yaml --backend sim
    PYTHONPATH=$PWD .venv/bin/python bench/bench_sparseloco.py results/runs/sparseloco-lm/<run> [--csv FILE]
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

BASELINE = "diloco-H30"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def job_row(job_dir: Path) -> dict:
    config = json.loads((job_dir / "config.json").read_text())
    ranks = sorted(job_dir.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    sent = []
    for path in ranks:
        steps = [r for r in read_jsonl(path) if r.get("kind") == "step"]
        sent.append(steps[-1]["bytes_sent_total"] if steps else float("nan"))
    rank0 = [r for r in read_jsonl(ranks[0]) if r.get("kind") == "step"]
    evals = [r for r in read_jsonl(job_dir / "eval.jsonl") if r.get("loss") is not None]
    label = job_dir.name.split("-", 1)[1].rsplit("-seed", 1)[0]
    return {"label": label, "algorithm": config["algorithm"]["name"],
            "params": json.dumps(config["algorithm"].get("params", {}), sort_keys=True),
            "nodes": len(ranks), "steps": len(rank0),
            "bytes_sent_mean": statistics.mean(sent), "bytes_sent_max": max(sent),
            "train_loss_last10": statistics.mean(r["loss"] for r in rank0[-10:]) if rank0 else float("nan"),
            "val_loss": evals[-1]["loss"] if evals else float("nan"),
            "val_step": evals[-1].get("step") if evals else None,
            "virtual_s": rank0[-1]["time_s"] if rank0 else float("nan")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a run folder of scenarios/sparseloco-lm.yaml")
    parser.add_argument("--csv", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = [job_row(d) for d in sorted((args.run / "jobs").iterdir()) if (d / "config.json").is_file()]
    base = next((r["bytes_sent_mean"] for r in rows if r["label"] == BASELINE), None)
    print(f"# sparseloco-lm, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, python "
          f"{platform.python_version()}, {platform.machine()}; run {args.run}; backend sim (virtual time)\n")
    print("| label | nodes | steps | MB sent per node (mean / max) | / diloco | train loss (last 10) | val loss (step) | virtual s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['bytes_sent_mean'] / base:.4f}" if base else ""
        print(f"| {r['label']} | {r['nodes']} | {r['steps']} | {r['bytes_sent_mean'] / 1e6:.3f} / "
              f"{r['bytes_sent_max'] / 1e6:.3f} | {ratio} | {r['train_loss_last10']:.3f} | "
              f"{r['val_loss']:.3f} ({r['val_step']}) | {r['virtual_s']:.2f} |")
    if args.csv:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
