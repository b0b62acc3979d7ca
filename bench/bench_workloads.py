"""What each ready workload reaches trained alone: on all of its data, and on one shard of 4.

    python bench/bench_workloads.py [--steps-scale 1.0] [--workloads digits-mlp,fashion-lenet,stdlib-lm]
                                    [--seed 0] [--out results/bench]

For every workload (scenarios/workloads/*.yaml: the digits MLP, the Fashion-MNIST LeNet, the byte-level
Transformer on the Python standard library) this trains one process for the workload's steps at
its learning rate three times: on rank 0's iid shard of 4 (a quarter of the data: what one node of
a 4-node job sees, and all that a job that never communicates learns from, per replica); on the
whole training set at the same batch; and on the whole set at 4x the batch (what sync over 4
nodes computes: sync equals single-process large batch, tests/trainers/test_equivalence.py). If
the quarter alone already reaches the target, a 4-node comparison on that workload says little
about communication. Prints a table
(held-out accuracy, loss, perplexity for the language model) with hardware, versions and date,
and writes it as CSV under --out. The training loop is the trainers' own parts (loss_fn, lr_at,
the sampler and sharding, evaluate), with the workload's optimizer; no network, no records.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402

from trainers.datasets import BatchSampler, load_dataset, shard_indices  # noqa: E402
from trainers.loading import load_config  # noqa: E402
from trainers.models import build_model  # noqa: E402
from trainers.training import evaluate, loss_fn, lr_at  # noqa: E402

WORKLOADS = {
    "digits-mlp": "scenarios/workloads/digits-mlp.yaml",
    "fashion-lenet": "scenarios/workloads/fashion-mnist-lenet.yaml",
    "stdlib-lm": "scenarios/workloads/stdlib-lm.yaml",
}
SHARDS = 4


def workload_config(path: Path, steps_scale: float, seed: int):
    """The trainer config of a workload file's `workload:` with its stop.steps (scaled)."""
    document = yaml.safe_load(path.read_text())
    config = dict(document["workload"])
    config["steps"] = max(1, int(round(document["stop"]["steps"] * steps_scale)))
    config["seed"] = seed
    config["output_dir"] = "unused"
    target = document["stop"].get("target_accuracy"), document["stop"].get("target_loss")
    return load_config(config), target


def train_alone(config, shard_of: int, batch_scale: int = 1) -> dict:
    """Train one process on rank 0's shard of `shard_of` (1: all the data) at `batch_scale` times
    the config's batch; held-out scores."""
    torch.manual_seed(config.seed * 1000)
    data = load_dataset(config.dataset, config.seed)
    keys = data.train_y if data.train_y.dim() == 1 else data.train_y[:, 0]
    indices = shard_indices(keys, shard_of, config.dataset.shard, config.dataset.alpha, config.seed)[0]
    sampler = BatchSampler(indices, config.batch_size * batch_scale, seed=config.seed * 1000)
    model = build_model(config.model.name, config.model.params, data.input_shape, data.num_classes, config.seed)
    opt = config.optimizer
    if opt.name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=opt.momentum, nesterov=opt.nesterov,
                                    weight_decay=opt.weight_decay)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=tuple(opt.betas),
                                      weight_decay=opt.weight_decay)
    started = time.perf_counter()
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config.lr, config.lr_schedule, config.steps)
        batch_indices = sampler.next_indices()
        optimizer.zero_grad()
        loss_fn(model, (data.inputs(data.train_x[batch_indices]), data.train_y[batch_indices])).backward()
        optimizer.step()
    train_s = time.perf_counter() - started
    accuracy, loss = evaluate(model, data.inputs(data.test_x), data.test_y, torch.device("cpu"))
    return {"train_samples": len(indices), "test_samples": len(data.test_x), "epochs": sampler.epoch_float,
            "accuracy": accuracy, "loss": loss,
            "perplexity": math.exp(loss) if data.kind == "tokens" else None,
            "train_s": train_s, "source": data.source}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--steps-scale", type=float, default=1.0, help="multiply each workload's stop.steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    parser.add_argument("--out", default=str(REPO / "results" / "bench"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench_workloads  {date}  {platform.node()}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus (shared with other work), python {platform.python_version()}, "
          f"torch {torch.__version__}, {args.threads} thread(s), seed {args.seed}")
    rows = []
    for name in args.workloads.split(","):
        config, (target_accuracy, target_loss) = workload_config(REPO / WORKLOADS[name], args.steps_scale, args.seed)
        for shard_of, batch_scale in ((SHARDS, 1), (1, 1), (1, SHARDS)):
            result = train_alone(config, shard_of, batch_scale)
            target = (f"acc>={target_accuracy:g}" if target_accuracy is not None
                      else f"loss<={target_loss:g}" if target_loss is not None else "")
            reached = ("" if not target else
                       "yes" if (target_accuracy is not None and result["accuracy"] >= target_accuracy)
                       or (target_loss is not None and result["loss"] <= target_loss) else "no")
            data = f"1/{shard_of} shard" if shard_of > 1 else "all" if batch_scale == 1 else f"all, batch x{batch_scale}"
            rows.append({"workload": name, "data": data,
                         "steps": config.steps, "batch_size": config.batch_size * batch_scale, "lr": config.lr,
                         "train_samples": result["train_samples"], "epochs": round(result["epochs"], 2),
                         "test_samples": result["test_samples"], "accuracy": round(result["accuracy"], 4),
                         "loss": round(result["loss"], 4),
                         "perplexity": None if result["perplexity"] is None else round(result["perplexity"], 3),
                         "target": target, "reached": reached, "train_s": round(result["train_s"], 1),
                         "source": result["source"], "seed": args.seed, "date": date,
                         "python": platform.python_version(), "torch": torch.__version__})
            row = rows[-1]
            print(f"{name:14s} {row['data']:14s} steps {row['steps']:5d} batch {row['batch_size']:4d}  train {row['train_samples']:6d} "
                  f"({row['epochs']:5.2f} ep)  test {row['test_samples']:5d}  acc {row['accuracy']:.4f}  "
                  f"loss {row['loss']:.4f}  ppl {row['perplexity'] or '-'}  target {target or '-'}: "
                  f"{reached or '-'}  {row['train_s']:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"workloads-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}.csv"
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
