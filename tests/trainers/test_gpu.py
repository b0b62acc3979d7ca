"""CUDA runs: compute on the GPU, communicate with gloo (staged through CPU) or NCCL; and a 4-rank
CUDA job through the emulated WAN, placed on GPUs by the harness (harness/gpus.py, docs/GPU.md)."""

import dataclasses
import json
import textwrap

import pytest
import torch

from tests.conftest import network_up
from tests.trainers.conftest import records, run_sessions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; torch sees none"),
]

RUN = {"steps": 20, "eval_every": 10, "save_final_model": True, "optimizer": {"momentum": 0.9}}


def test_cuda_with_gloo_matches_cpu(spawn_ranks, tmp_path):
    # Two ranks may share one GPU under gloo (each copies to CPU to communicate).
    outputs = run_sessions(spawn_ranks, tmp_path, 2, {
        "cpu": {**RUN, "algorithm": {"name": "sync"}},
        "cuda_sync": {**RUN, "device": "cuda", "algorithm": {"name": "sync"}},
        "cuda_dts": {**RUN, "device": "cuda", "algorithm": {"name": "dts", "params": {"p": 2, "t": 1}}},
        "cuda_diloco": {**RUN, "device": "cuda", "lr": 0.003, "algorithm": {"name": "diloco", "params": {"H": 5}}},
    })
    cpu = torch.load(outputs["cpu"] / "rank0_final.pt")
    gpu = torch.load(outputs["cuda_sync"] / "rank0_final.pt", map_location="cpu")
    assert max((cpu[k] - gpu[k]).abs().max().item() for k in cpu) < 1e-4
    for name in outputs:
        for rank in range(2):
            assert records(outputs[name], rank, "status")[-1]["status"] == "ok"
        assert records(outputs[name], 1, "step")[-1]["bytes_sent_total"] > 0


def test_nccl_backend(spawn_ranks, tmp_path):
    # NCCL needs one GPU per rank.
    world_size = min(2, torch.cuda.device_count())
    outputs = run_sessions(spawn_ranks, tmp_path, world_size, {
        "nccl_sync": {**RUN, "device": "cuda", "comm": {"backend": "nccl"}, "algorithm": {"name": "sync"}},
        "nccl_ddp": {**RUN, "device": "cuda", "comm": {"backend": "nccl"}, "algorithm": {"name": "ddp"}},
    })
    for name, out in outputs.items():
        assert records(out, 0, "status")[-1]["status"] == "ok", name
    sync = torch.load(outputs["nccl_sync"] / "rank0_final.pt", map_location="cpu")
    ddp = torch.load(outputs["nccl_ddp"] / "rank0_final.pt", map_location="cpu")
    assert max((sync[k] - ddp[k]).abs().max().item() for k in sync) < 1e-4


WAN_STEPS = 20
WAN_SCENARIO = textwrap.dedent(f"""
    topology:
      name: gpu4
      address_pool: 10.238.0.0/24
      regions: {{a: {{nodes: 2}}, b: {{nodes: 2}}}}
      intra_region: {{rtt: 2ms, rate: 1Gbit}}
      links: [{{between: [a, b], rtt: 20ms, rate: 500Mbit}}]
    workload: {{device: cuda, comm: {{backend: nccl}}, model: {{name: mlp, params: {{hidden_sizes: [256]}}}},
               dataset: {{name: digits}}, batch_size: 32, lr: 0.1, eval_every: 10, save_final_model: true}}
    stop: {{steps: {WAN_STEPS}}}
    algorithms: [{{name: sync}}]
""")


@pytest.mark.integration
def test_four_rank_cuda_job_through_the_emulated_wan(test_prefix, write_yaml, tmp_path, monkeypatch):
    """4 ranks, device cuda, comm nccl, on the tun backend: with 4+ GPUs each rank has its own and
    NCCL runs over sockets through the delay line; with fewer they share and fall back to gloo.
    Either way the gradients cross the emulated links (the delay line's byte counters)."""
    from emulator.backends.tun import TunBackend
    from emulator.plan import make_plan
    from harness.gpus import visible_gpus
    from harness.jobs import run_job
    from harness.jobspec import job_spec
    from harness.scenario import load_scenario

    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # the ranks inherit it: their logs name NCCL's transport
    monkeypatch.setenv("NCCL_DEBUG_SUBSYS", "INIT,NET")
    scenario = load_scenario(write_yaml(WAN_SCENARIO, "scenario.yaml"))
    plan = make_plan(scenario.topology)
    visible, _ = visible_gpus()
    own = len(visible) >= len(plan.nodes)
    job_dir = tmp_path / "job"
    with network_up(TunBackend(plan)) as backend:
        spec = job_spec(scenario, scenario.jobs[0], job_dir, plan, backend.name)
        outcome = run_job(plan, dataclasses.replace(spec, timeout_s=540), 29670, network=backend)
    logs = [(job_dir / f"rank{rank}.log").read_text() for rank in range(4)]
    assert outcome.status == "ok", (outcome, logs[0][-3000:])

    model_bytes = sum(t.numel() * t.element_size()
                      for t in torch.load(job_dir / "rank0_final.pt", map_location="cpu").values())
    for rank in range(4):
        start = records(job_dir, rank, "start")[0]
        placement = start["placement"]
        assert start["device"] == "cuda:0"  # CUDA_VISIBLE_DEVICES holds the rank's one GPU
        assert placement["gpu"] == visible[rank % len(visible)]
        assert placement["name"] == torch.cuda.get_device_name(rank % len(visible))  # the harness's numbering
        assert placement["backend_requested"] == "nccl"
        if own:
            assert start["backend"] == "nccl" and placement["shared_by"] == 1 and not placement["fell_back"]
            assert start["transport"] == "nccl"
        else:
            assert start["backend"] == "gloo" and placement["fell_back"]
            assert placement["shared_by"] >= 2 and "nccl needs a GPU per rank" in placement["reason"]
        assert records(job_dir, rank, "status")[-1]["status"] == "ok"
        assert len(records(job_dir, rank, "step")) == WAN_STEPS

    # The gradients crossed the emulated WAN: every node put at least one model's worth per step
    # on the wire (a ring all-reduce sends 1.5 models per step with 4 ranks), by the delay line's
    # own counters. A P2P, SHM or loopback shortcut would leave them near zero.
    wire = json.loads((job_dir / "wire.json").read_text())
    assert set(wire["nodes"]) == {node.name for node in plan.nodes}
    for name, node in wire["nodes"].items():
        assert node["bytes_sent"] > WAN_STEPS * model_bytes, (name, node, model_bytes)
    if own:
        for rank, log in enumerate(logs):
            assert "NET/Socket" in log, f"rank {rank}: NCCL did not report its socket transport"
            assert "via P2P" not in log and "via SHM" not in log, f"rank {rank} took an intra-host shortcut"
