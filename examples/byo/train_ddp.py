"""A plain torchrun DDP training script: an MLP on scikit-learn's digits (bundled, nothing downloaded).

Nothing here knows wanbench. Run it as any torchrun script:

    torchrun --nnodes 4 --nproc-per-node 1 --node-rank R --master-addr HOST --master-port 29500 train_ddp.py

or with torchrun's variables set by someone else (`wanbench run` sets RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK in every node). gloo on CPU, NCCL when CUDA is there. When
wanbench's helper is importable (`trainers/byo.py`), every rank writes a step record per step and
rank 0 an eval record every --eval-every steps, so the report draws its curves; otherwise it prints.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from trainers.byo import Recorder  # optional: records for wanbench's report
except ImportError:
    Recorder = None


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=int(os.environ.get("BYO_STEPS", "30")))
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--crash-rank", type=int, default=None,
                        help="this rank raises at --crash-step (to see how a failure is reported)")
    parser.add_argument("--crash-step", type=int, default=2)
    return parser.parse_args()


def load_digits_split(seed: int):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    held_out = len(x) // 5
    return (x[held_out:], y[held_out:]), (x[:held_out], y[:held_out])


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")  # env://: torchrun's variables
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if use_cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    (train_x, train_y), (test_x, test_y) = load_digits_split(args.seed)
    shard_x, shard_y = train_x[rank::world].to(device), train_y[rank::world].to(device)
    test_x, test_y = test_x.to(device), test_y.to(device)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    recorder = Recorder() if Recorder is not None else None
    generator = torch.Generator().manual_seed(args.seed + rank)
    started = time.monotonic()
    for step in range(args.steps):
        if args.crash_rank == rank and step == args.crash_step:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        batch = torch.randint(len(shard_x), (args.batch_size,), generator=generator)
        optimizer.zero_grad()
        loss = loss_fn(ddp(shard_x[batch]), shard_y[batch])
        loss.backward()  # DDP all-reduces the gradients here, over the (emulated) network
        optimizer.step()
        if recorder is not None:
            recorder.step(step, loss=loss.item())
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step == args.steps - 1):
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            if recorder is not None:
                recorder.eval(step, accuracy=accuracy)
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} accuracy {accuracy:.3f} "
                  f"{(step + 1) / (time.monotonic() - started):.2f} steps/s", flush=True)
    if recorder is not None:
        recorder.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
