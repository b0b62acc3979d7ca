"""compute_utilisation and the per-node bandwidths (harness/results.py utilisation_and_bandwidth)
on jobs of the real simulator whose compute and communication times are known in closed form."""

import numpy as np
import pandas as pd
import pytest
import torch

from emulator.simnet import FluidNetwork
from harness.results import utilisation_and_bandwidth
from tests.trainers.conftest import BASE_CONFIG, merge, records
from trainers.loading import load_config
from trainers.sim import ComputeModel, run_simulated

RATE_BYTES = 12.5e6      # 100 Mbit/s between the two nodes
ONE_WAY_S = 0.05
STEP_S = 0.5             # the stand-in's compute per step
CHARGED_BYTES = 25e6     # what one copy of the model is charged at
# the digits MLP of BASE_CONFIG (64 -> 32 -> 10), in fp32 bytes
REAL_BYTES = 4 * (64 * 32 + 32 + 32 * 10 + 10)


def network(n=2):
    lat = np.full((n, n), ONE_WAY_S)
    np.fill_diagonal(lat, 0.0)
    return FluidNetwork(latency_s=lat, rate=np.full((n, n), RATE_BYTES), jitter_s=np.zeros((n, n)),
                        loss=np.zeros((n, n)), tcp_window=1e12, region_of=("a", "b"), tcp=False)


def job(tmp_path, name, algorithm, steps):
    config = load_config(merge(BASE_CONFIG, {"steps": steps, "algorithm": algorithm, "eval_every": 1000,
                                             "output_dir": str(tmp_path / name),
                                             "comm": {"allreduce": "direct"}}))
    run_simulated(config, 2, network(), ComputeModel(STEP_S), wire_scale=CHARGED_BYTES / REAL_BYTES)
    frame = pd.DataFrame(records(tmp_path / name, 0, "step") + records(tmp_path / name, 1, "step"))
    return utilisation_and_bandwidth(frame), frame


def test_the_real_model_is_the_one_the_constants_say():
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 10))
    assert 4 * sum(p.numel() for p in model.parameters()) == REAL_BYTES


def test_sync_s_utilisation_is_its_compute_over_compute_plus_the_exchange(tmp_path):
    metrics, frame = job(tmp_path, "sync", {"name": "sync"}, steps=6)
    exchange = 2 * ONE_WAY_S + CHARGED_BYTES / RATE_BYTES  # the direct exchange of 2 ranks: a round trip + bytes
    assert metrics["compute_utilisation"] == pytest.approx(STEP_S / (STEP_S + exchange), rel=0.02)
    # every step sends one copy: the mean and the per-step peak are the same, bytes over the step
    assert metrics["mean_bandwidth_per_node_bit_s"] == pytest.approx(8 * CHARGED_BYTES / (STEP_S + exchange), rel=0.02)
    assert metrics["peak_bandwidth_per_node_bit_s"] == pytest.approx(metrics["mean_bandwidth_per_node_bit_s"], rel=0.02)


def test_diloco_with_a_large_h_keeps_compute_busy_where_sync_does_not(tmp_path):
    H = 50
    diloco, frame = job(tmp_path, "diloco", {"name": "diloco", "params": {"H": H}}, steps=2 * H)
    sync, _ = job(tmp_path, "sync", {"name": "sync"}, steps=4)
    exchange = 2 * ONE_WAY_S + CHARGED_BYTES / RATE_BYTES
    assert diloco["compute_utilisation"] == pytest.approx(H * STEP_S / (H * STEP_S + exchange), rel=0.02)
    assert diloco["compute_utilisation"] > 0.9 and sync["compute_utilisation"] < 0.25
    # one copy per H steps: the peak is the step that sent it, the mean two copies over two rounds
    assert diloco["peak_bandwidth_per_node_bit_s"] == pytest.approx(8 * CHARGED_BYTES / (STEP_S + exchange), rel=0.02)
    assert diloco["mean_bandwidth_per_node_bit_s"] == pytest.approx(
        2 * 8 * CHARGED_BYTES / (2 * H * STEP_S + 2 * exchange), rel=0.02)


def test_without_step_times_there_is_nothing_to_report():
    assert utilisation_and_bandwidth(pd.DataFrame({"rank": [0], "bytes_sent": [10]})) == {}
    frame = pd.DataFrame({"rank": [0, 0], "step_s": [1.0, 1.0], "compute_s": [None, None], "bytes_sent": [8, 0]})
    assert utilisation_and_bandwidth(frame) == {"mean_bandwidth_per_node_bit_s": 32.0,
                                                "peak_bandwidth_per_node_bit_s": 64.0}
