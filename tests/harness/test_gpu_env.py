"""Which GPU each rank gets, which comm backend it may use, and NCCL's settings in a node (CPU-only).

`harness.gpus.place_ranks` is pure: it is tested on GPU counts this machine does not have. The
rank environment `JobProcesses` builds is tested with the GPU lookup replaced (no namespace is
entered: the node's interface name is given), and the no-GPU error on this machine's own torch.
"""

import dataclasses

import pytest
import torch

import harness.gpus as gpus
import harness.jobs as jobs
from emulator.netns import SystemCheckError
from emulator.plan import make_plan
from harness.gpus import GpuPlacement, nccl_environment, place_job, place_ranks, visible_gpus
from harness.jobs import JobProcesses
from harness.jobspec import job_spec
from harness.scenario import load_scenario
from trainers import runner
from trainers.config import Config, ConfigError

SCENARIO = """
topology: lan.yaml
workload: {model: {name: mlp}, dataset: {name: digits}, device: DEVICE, comm: {backend: BACKEND}}
stop: {steps: 5}
algorithms: [{name: sync}]
"""


def job_processes(write_yaml, tmp_path, device: str, backend: str) -> JobProcesses:
    """The 4-node lan scenario's job (device, comm backend) as the harness would start it."""
    scenario = load_scenario(write_yaml(SCENARIO.replace("DEVICE", device).replace("BACKEND", backend), "s.yaml"))
    plan = make_plan(scenario.topology)
    return JobProcesses(plan, job_spec(scenario, scenario.jobs[0], tmp_path / "job", plan, "tun"), 29500)


@pytest.fixture
def four_gpus(monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpus", lambda environ=None: (["0", "1", "2", "3"], "test: 4 GPUs"))


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpus", lambda environ=None: (["0"], "test: 1 GPU"))


@pytest.fixture
def node_interface(monkeypatch):
    """`interface_of` without a namespace: every node's interface is eth0."""
    monkeypatch.setattr(jobs, "interface_of", lambda node: "eth0")


# The decision ------------------------------------------------------------------------------------
def test_four_ranks_on_four_gpus_each_get_their_own_and_may_use_nccl():
    placements = place_ranks(4, ["0", "1", "2", "3"], "cuda", "nccl")
    assert [p.gpu for p in placements] == ["0", "1", "2", "3"]
    assert [p.gpu_slot for p in placements] == [0, 1, 2, 3]
    assert all(p.shared_by == 1 and p.nccl_allowed for p in placements)
    assert all(p.backend == "nccl" and not p.fell_back for p in placements)
    env = placements[2].environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env[gpus.GPU_SHARED_BY_VARIABLE] == "1"
    assert gpus.COMM_BACKEND_VARIABLE not in env  # nothing to override
    assert "its own GPU" in env[gpus.GPU_REASON_VARIABLE]


def test_four_ranks_on_one_gpu_share_it_and_fall_back_to_gloo():
    placements = place_ranks(4, ["0"], "cuda", "nccl")
    assert [p.gpu for p in placements] == ["0"] * 4
    assert all(p.shared_by == 4 and not p.nccl_allowed for p in placements)
    assert all(p.backend == "gloo" and p.requested_backend == "nccl" and p.fell_back for p in placements)
    env = placements[3].environment()
    assert env == {"CUDA_VISIBLE_DEVICES": "0", gpus.GPU_SHARED_BY_VARIABLE: "4",
                   gpus.COMM_BACKEND_VARIABLE: "gloo", gpus.GPU_REASON_VARIABLE: placements[3].reason}
    assert "4 ranks share 1 GPU" in placements[3].reason and "nccl needs a GPU per rank" in placements[3].reason
    record = placements[0].record()
    assert record["fell_back"] is True and record["backend"] == "gloo" and record["gpu"] == "0"


def test_shared_gpus_keep_a_backend_that_takes_cuda_tensors():
    for backend in ("gloo", "tcp"):
        placements = place_ranks(4, ["0"], "cuda", backend)
        assert all(p.backend == backend and not p.fell_back for p in placements)
        assert gpus.COMM_BACKEND_VARIABLE not in placements[0].environment()
        assert "staged through the CPU" in placements[0].reason


def test_more_ranks_than_gpus_go_round_robin():
    placements = place_ranks(5, ["GPU-aaaa", "GPU-bbbb"], "cuda", "nccl")
    assert [p.gpu for p in placements] == ["GPU-aaaa", "GPU-bbbb", "GPU-aaaa", "GPU-bbbb", "GPU-aaaa"]
    assert [p.shared_by for p in placements] == [3, 2, 3, 2, 3]
    assert {p.backend for p in placements} == {"gloo"}
    # more GPUs than ranks: the first ones, each its own
    assert [p.gpu for p in place_ranks(2, ["4", "5", "6"], "cuda", "nccl")] == ["4", "5"]


def test_cuda_without_a_gpu_is_one_line_before_anything_starts():
    with pytest.raises(SystemCheckError) as error:
        place_ranks(4, [], "cuda", "gloo", seen="torch 2.x+cpu, CUDA_VISIBLE_DEVICES=unset")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("device: cuda was asked for but no GPU is visible (torch 2.x+cpu")
    assert "set device: cpu" in message


def test_cpu_and_commands_get_no_gpu_variables():
    cpu = place_ranks(4, ["0", "1"], "cpu", "gloo")
    assert all(p.gpu is None and p.environment() == {} and p.backend == "gloo" for p in cpu)
    # a user's command: a GPU per rank where there are GPUs, its own backend, no error without
    command = place_ranks(2, ["0", "1"], None, None)
    assert [p.environment()["CUDA_VISIBLE_DEVICES"] for p in command] == ["0", "1"]
    assert all(gpus.COMM_BACKEND_VARIABLE not in p.environment() for p in command)
    assert all(p.environment() == {} for p in place_ranks(2, [], None, None))
    with pytest.raises(ValueError, match="world"):
        place_ranks(0, ["0"], "cuda", "gloo")


def test_place_job_reads_the_trainer_config_and_its_defaults(monkeypatch):
    def no_lookup(environ=None):
        raise AssertionError("a CPU job must not look for GPUs")

    monkeypatch.setattr(gpus, "visible_gpus", no_lookup)
    # no device, no comm: the trainers' defaults (cpu, gloo)
    assert [(p.device, p.backend) for p in place_job({"algorithm": {"name": "sync"}}, 2)] == [("cpu", "gloo")] * 2
    placed = place_job({"device": "cuda", "comm": {"backend": "nccl"}}, 2, visible=["0", "1"])
    assert [(p.gpu, p.backend) for p in placed] == [("0", "nccl"), ("1", "nccl")]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert visible_gpus({})[0] == ["0", "1"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"})[0] == ["3", "5"]
    # CUDA stops at the first entry it cannot use; torch counted what it enumerated
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,7,9"})[0] == ["GPU-aaaa", "7"]
    assert "CUDA_VISIBLE_DEVICES='3, 5'" in visible_gpus({"CUDA_VISIBLE_DEVICES": "3, 5"})[1]


def test_this_machines_torch_without_cuda_sees_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    visible, seen = visible_gpus({})
    assert visible == [] and f"torch {torch.__version__}" in seen


# NCCL in a node --------------------------------------------------------------------------------
def test_nccl_is_kept_on_the_node_interface_with_every_shortcut_off():
    env = nccl_environment("eth0", "wanb.tokyo-0")
    assert env == {"NCCL_SOCKET_IFNAME": "=eth0", "NCCL_HOSTID": "wanb.tokyo-0", "NCCL_P2P_DISABLE": "1",
                   "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket",
                   "NCCL_NVLS_ENABLE": "0", "NCCL_MNNVL_ENABLE": "0"}


# The rank environment JobProcesses builds -----------------------------------------------------------
def test_job_ranks_get_their_own_gpu_and_nccl_settings(write_yaml, tmp_path, four_gpus, node_interface, monkeypatch):
    monkeypatch.setenv("NCCL_P2P_DISABLE", "0")  # a user's setting does not reopen the shortcut
    ranks = job_processes(write_yaml, tmp_path, "cuda", "nccl")
    envs = [ranks._environment(node, restarts=0) for node in ranks.plan.nodes]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["0", "1", "2", "3"]
    assert {env["LOCAL_RANK"] for env in envs} == {"0"}  # each node a host of its own
    assert [env["RANK"] for env in envs] == ["0", "1", "2", "3"]
    assert len({env["NCCL_HOSTID"] for env in envs}) == 4
    for env in envs:
        assert env["NCCL_SOCKET_IFNAME"] == "=eth0" and env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["NCCL_P2P_DISABLE"] == env["NCCL_SHM_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
        assert gpus.COMM_BACKEND_VARIABLE not in env
    assert [p.nccl_allowed for p in ranks.gpus] == [True] * 4


def test_job_ranks_share_one_gpu_and_are_told_to_use_gloo(write_yaml, tmp_path, one_gpu, node_interface):
    ranks = job_processes(write_yaml, tmp_path, "cuda", "nccl")
    envs = [ranks._environment(node, restarts=0) for node in ranks.plan.nodes]
    assert {env["CUDA_VISIBLE_DEVICES"] for env in envs} == {"0"}
    assert {env[gpus.COMM_BACKEND_VARIABLE] for env in envs} == {"gloo"}
    assert {env[gpus.GPU_SHARED_BY_VARIABLE] for env in envs} == {"4"}
    assert all("nccl needs a GPU per rank" in env[gpus.GPU_REASON_VARIABLE] for env in envs)


def test_a_cpu_job_keeps_its_environment(write_yaml, tmp_path, node_interface, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ranks = job_processes(write_yaml, tmp_path, "cpu", "gloo")
    env = ranks._environment(ranks.plan.nodes[1], restarts=0)
    assert "CUDA_VISIBLE_DEVICES" not in env and gpus.COMM_BACKEND_VARIABLE not in env
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["RANK"] == "1" and env["LOCAL_RANK"] == "0"


def test_a_cuda_job_on_this_machine_fails_before_any_rank_starts(write_yaml, tmp_path, monkeypatch):
    monkeypatch.setattr(gpus, "visible_gpus", lambda environ=None: ([], "test: no GPU"))
    with pytest.raises(SystemCheckError, match=r"^device: cuda was asked for but no GPU is visible \(test: no GPU\)"):
        job_processes(write_yaml, tmp_path, "cuda", "gloo")
    assert not (tmp_path / "job").exists()  # no config, no log, no rank


# What the rank does with it ----------------------------------------------------------------------------
def test_the_trainers_read_the_variables_the_harness_sets():
    assert runner.COMM_BACKEND_VARIABLE == gpus.COMM_BACKEND_VARIABLE
    assert runner.GPU_SHARED_BY_VARIABLE == gpus.GPU_SHARED_BY_VARIABLE
    assert runner.GPU_REASON_VARIABLE == gpus.GPU_REASON_VARIABLE
    assert gpus.FALLBACK_BACKEND in runner.LAUNCHER_BACKENDS


def test_a_rank_runs_the_backend_the_launcher_imposed(tmp_path):
    config = Config(output_dir=str(tmp_path), device="cuda", comm=dataclasses.replace(Config(str(tmp_path)).comm,
                                                                                       backend="nccl"))
    placement = place_ranks(4, ["0"], "cuda", "nccl")[0]
    fallen = runner.with_launcher_backend(config, placement.environment())
    assert fallen.comm.backend == "gloo" and config.comm.backend == "nccl"  # the original is kept
    assert fallen.comm.timeout_s == config.comm.timeout_s and fallen.device == "cuda"
    assert runner.with_launcher_backend(config, {}) is config
    with pytest.raises(ConfigError, match=gpus.COMM_BACKEND_VARIABLE):
        runner.with_launcher_backend(config, {gpus.COMM_BACKEND_VARIABLE: "mpi"})


def test_the_start_record_says_cpu_and_the_launchers_reason():
    placement = runner._placement(torch.device("cpu"), "gloo", "gloo", {gpus.GPU_REASON_VARIABLE: "device: cpu"})
    assert placement == {"gpu": None, "backend": "gloo", "backend_requested": "gloo", "fell_back": False,
                         "shared_by": None, "reason": "device: cpu"}


def test_a_placement_is_plain_data():
    placement = GpuPlacement(0, "cuda", "0", 0, 1, True, "nccl", "nccl", "why")
    assert placement.record() == {"rank": 0, "device": "cuda", "gpu": "0", "gpu_slot": 0, "shared_by": 1,
                                  "nccl_allowed": True, "backend": "nccl", "requested_backend": "nccl",
                                  "reason": "why", "fell_back": False}
