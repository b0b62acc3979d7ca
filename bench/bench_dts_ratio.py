"""The compute / all-reduce ratio of the DTS paper's setting on aws-4region, and the compute model
that gives a small workload the same ratio (issue 23, item 1).

The DTS paper trains ResNet-50 on ImageNet; its throughput gain is bounded by how much of a
synchronous step is the all-reduce. This script asks the simulator's own network model
(emulator/simnet.py FluidNetwork, the collectives of trainers/sim/collectives.py, the
all-reduce ``auto`` picks by size) how long one all-reduce of ResNet-50's gradients takes on
aws-4region, back to back as in sync (the window warm, each all-reduce entered one compute step
after the last ended), sets it against a V100's ResNet-50 step (profiles/), and gives the per-step
compute a LeNet or the byte LM needs on sim for the same all-reduce / compute ratio. It also prints
the throughput bound that ratio puts on any algorithm that hides the all-reduce entirely:
(compute + all-reduce) / compute.

    PYTHONPATH=$PWD python bench/bench_dts_ratio.py
"""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from emulator.plan import make_plan  # noqa: E402
from emulator.simnet import FluidNetwork  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from harness.dilation import load_profile  # noqa: E402
from trainers.comm.allreduce import DIRECT_MAX_BYTES  # noqa: E402
from trainers.sim import collectives  # noqa: E402

# torchvision.models.resnet50().parameters(): 25,557,032 (the paper's model; fp32 gradients)
RESNET50_PARAMS = 25_557_032
SCENARIOS = ("paper-dts-fmnist.yaml", "paper-dts-lm.yaml")
PAPER_PROFILE = "v100-resnet50-amp-b64"  # the ratio most favourable to DTS (FP32: 3.3x less)
ROUNDS = 30  # back-to-back all-reduces; the median of the last half is the steady step


def model_params(scenario: Path) -> int:
    """Parameter count of a scenario's model, built as its workload builds it (LeNet on 28x28
    images, 10 classes; the byte LM on seq_len bytes, 256 classes)."""
    import yaml

    from trainers.models import build_model
    spec = yaml.safe_load(scenario.read_text())["workload"]
    model = spec["model"]
    if model["name"] == "lenet":
        shape, classes = (1, 28, 28), 10
    else:
        shape, classes = (spec["dataset"]["params"]["seq_len"],), 256
    built = build_model(model["name"], model.get("params", {}), shape, classes, seed=0)
    return sum(p.numel() for p in built.parameters() if p.requires_grad)


def paper_ratio(profile_name: str = PAPER_PROFILE) -> float:
    """ResNet-50's all-reduce on aws-4region over the profile's GPU step (all-reduce / compute)."""
    step_s = load_profile(profile_name).step_s
    return steady_allreduce_s(RESNET50_PARAMS * 4, step_s)[0] / step_s


def matched_compute_s(params: int, profile_name: str = PAPER_PROFILE) -> float:
    """Per-step compute (s) that gives a model of ``params`` fp32 gradients the paper's ratio."""
    return steady_allreduce_s(params * 4, 0.01)[0] / paper_ratio(profile_name)


def steady_allreduce_s(nbytes: float, compute_s: float) -> tuple[float, str]:
    """Median duration of one all-reduce of ``nbytes`` on aws-4region when each is entered
    ``compute_s`` after the previous one ended (sync's pattern), with ``auto``'s algorithm."""
    plan = make_plan(load_topology(ROOT / "topologies" / "aws-4region.yaml"), prefix="wbr")
    network = FluidNetwork.from_plan(plan)
    n = network.size
    algorithm = "direct" if (n - 1) * nbytes <= DIRECT_MAX_BYTES else "ring"
    run = collectives.direct if algorithm == "direct" else collectives.ring_allreduce
    entered = np.zeros(n)
    durations = []
    for _ in range(ROUNDS):
        done = run(entered, network, nbytes)
        durations.append(float(done.max() - entered.max()))
        entered = np.full(n, float(done.max()) + compute_s)
    return float(np.median(durations[ROUNDS // 2:])), algorithm


def main() -> int:
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
          f"Python {platform.python_version()}; network model: emulator/simnet.py on topologies/aws-4region.yaml")
    rows = []
    for profile_name in ("v100-resnet50-amp-b64", "v100-resnet50-fp32-b64"):
        profile = load_profile(profile_name)
        ar, algorithm = steady_allreduce_s(RESNET50_PARAMS * 4, profile.step_s)
        rows.append((profile_name, profile.step_s, ar, algorithm))
    print("\n| paper's side | GPU step (s) | ResNet-50 all-reduce (s) | algorithm | all-reduce / compute | "
          "throughput bound (c + A) / c |")
    print("|---|---|---|---|---|---|")
    for name, step, ar, algorithm in rows:
        print(f"| {name} | {step:.3f} | {ar:.3f} | {algorithm} | {ar / step:.1f} | {(step + ar) / step:.1f}x |")
    print("\n| scenario | parameters | all-reduce (s) | compute_s for the AMP ratio | for the FP32 ratio |")
    print("|---|---|---|---|---|")
    for scenario in SCENARIOS:
        params = model_params(ROOT / "scenarios" / scenario)
        ar, _ = steady_allreduce_s(params * 4, 0.01)
        print(f"| {scenario} | {params:,} | {ar:.4f} | {ar * rows[0][1] / rows[0][2]:.4f} | "
              f"{ar * rows[1][1] / rows[1][2]:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
