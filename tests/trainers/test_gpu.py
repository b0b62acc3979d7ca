"""CUDA runs: compute on the GPU, communicate with gloo (staged through CPU) or NCCL."""

import pytest
import torch

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
