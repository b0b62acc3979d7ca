"""Which GPU each rank of a job gets, which comm backend it may use there, and the NCCL settings
that keep NCCL's traffic on the emulated links.

Every node of an emulated network is a namespace on this one machine, so all the job's ranks share
the machine's GPUs. `place_ranks` decides, purely from the rank count, the visible GPUs and the
job's device and comm backend: each rank gets its own GPU when there are enough, else they share
them round robin; NCCL is allowed only when every rank has its own GPU (NCCL refuses two ranks of
one host on one GPU, and a shared GPU would time-slice NCCL's spinning kernels), otherwise a job
that asked for nccl falls back to gloo, which stages CUDA tensors through the CPU (the trainers'
comm layer does that for gloo and for our tcp comm alike). `nccl_environment` is what NCCL needs to
treat every node as a host of its own and to send over the node's emulated interface only.

The rank learns its GPU through CUDA_VISIBLE_DEVICES (see `GpuPlacement.environment`) and the
fallback through WANBENCH_COMM_BACKEND; the trainers record both in the rank's `start` record
(docs/GPU.md).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

from emulator.netns import SystemCheckError
# The variables the harness hands a rank, by the names trainers/runner.py reads (docs/GPU.md).
from trainers.config import COMM_BACKEND_VARIABLE, GPU_REASON_VARIABLE, GPU_SHARED_BY_VARIABLE, CommConfig, Config

# What a job falls back to when its ranks must share GPUs: gloo takes CUDA tensors (staged through
# the CPU by trainers/comm/) and runs our own all-reduce (comm.allreduce) over its messages.
FALLBACK_BACKEND = "gloo"


@dataclasses.dataclass(frozen=True)
class GpuPlacement:
    """One rank's device decision.

    Args:
        rank: the rank (= the node's index in the plan).
        device: the job's device: cpu | cuda, or None for a user's command (its own choice).
        gpu: the CUDA_VISIBLE_DEVICES entry of the rank's GPU ("0", "GPU-<uuid>", ...), None without one.
        gpu_slot: that GPU's position among the visible ones (None without one).
        shared_by: how many of the job's ranks run on that GPU (1: its own; 0: no GPU).
        nccl_allowed: every rank of the job has a GPU of its own.
        backend: the comm backend the rank runs (None: a command job's own choice).
        requested_backend: the comm backend the job's config asked for (None for a command).
        reason: the decision in one line, for the records.
    """

    rank: int
    device: Optional[str]
    gpu: Optional[str]
    gpu_slot: Optional[int]
    shared_by: int
    nccl_allowed: bool
    backend: Optional[str]
    requested_backend: Optional[str]
    reason: str

    @property
    def fell_back(self) -> bool:
        """The rank runs another comm backend than its config asked for."""
        return self.backend != self.requested_backend

    def environment(self) -> dict[str, str]:
        """The variables that carry this decision into the rank's process.

        The GPU goes as CUDA_VISIBLE_DEVICES set to that one device, not as an index of our own:
        the rank's GPU is then cuda:0 for any program (the trainers' `LOCAL_RANK % device_count()`
        with LOCAL_RANK 0, a user's command, torch's own defaults), the process cannot create a
        stray context on another rank's GPU (as code that touches "cuda" before set_device does
        on GPU 0), and NCCL still tells GPUs apart by PCI bus id. Nothing is set on CPU.
        """
        if self.gpu is None:
            return {}
        env = {"CUDA_VISIBLE_DEVICES": self.gpu, GPU_SHARED_BY_VARIABLE: str(self.shared_by),
               GPU_REASON_VARIABLE: self.reason}
        if self.backend is not None and self.fell_back:
            env[COMM_BACKEND_VARIABLE] = self.backend
        return env

    def record(self) -> dict:
        """The decision as plain data (for a job record)."""
        return {**dataclasses.asdict(self), "fell_back": self.fell_back}


def place_ranks(world: int, visible: Sequence[str], device: Optional[str], backend: Optional[str],
                seen: str = "") -> list[GpuPlacement]:
    """Each rank's GPU and comm backend.

    Args:
        world: the job's ranks, all on this machine (one per node).
        visible: the CUDA_VISIBLE_DEVICES entries of the GPUs the ranks may use, in order
            (`visible_gpus()`); empty without GPUs.
        device: the trainers' `device` (cpu | cuda), or None for a user's command, which gets a GPU
            per rank when there are any and keeps its own backend.
        backend: the trainers' `comm.backend` (gloo | nccl | tcp), None for a user's command.
        seen: what was looked at to find `visible`, for the error message.

    Raises:
        SystemCheckError: device cuda and no GPU visible (one line, before any rank starts).
    """
    if world < 1:
        raise ValueError(f"world: must be >= 1 rank, got {world}")
    if device == "cpu":
        return [GpuPlacement(rank, device, None, None, 0, False, backend, backend, "device: cpu")
                for rank in range(world)]
    if not visible:
        if device is None:
            return [GpuPlacement(rank, None, None, None, 0, False, None, None, "no GPU visible")
                    for rank in range(world)]
        raise SystemCheckError(f"device: cuda was asked for but no GPU is visible{f' ({seen})' if seen else ''}: "
                               "set device: cpu, or run where torch sees a GPU (a CUDA build of torch, "
                               "an NVIDIA driver, CUDA_VISIBLE_DEVICES naming a GPU)")
    gpus = len(visible)
    own = gpus >= world
    placements = []
    for rank in range(world):
        slot = rank % gpus
        shared_by = world // gpus + (1 if slot < world % gpus else 0)
        chosen = backend
        if own:
            why = f"its own GPU ({world} ranks, {gpus} GPUs visible)"
            if backend is not None:
                why += f"; {backend} as configured" + ("" if backend == "nccl" else " (nccl would be allowed)")
        else:
            why = f"{world} ranks share {gpus} GPU{'s' if gpus > 1 else ''} round robin ({shared_by} on this one)"
            if backend == "nccl":
                chosen = FALLBACK_BACKEND
                why += (f"; nccl needs a GPU per rank, so {FALLBACK_BACKEND} with CUDA tensors staged "
                        "through the CPU")
            elif backend is not None:
                why += f"; {backend} as configured, CUDA tensors staged through the CPU"
        placements.append(GpuPlacement(rank, device, visible[slot], slot, shared_by, own, chosen, backend, why))
    return placements


def nccl_environment(ifname: str, host_id: str) -> dict[str, str]:
    """NCCL's settings for a rank in a node: socket transport over the node's emulated interface.

    Every node is a namespace on this one machine, and NCCL would take shortcuts between ranks it
    believes share a host: CUDA peer-to-peer copies (P2P), host shared memory (SHM; a node's
    /dev/shm is its own tmpfs anyway), NVLink SHARP (NVLS), multi-node NVLink, InfiniBand.
    Each would move the job's bytes around the emulated WAN. NCCL decides "same host" by a hash of
    the host name and the kernel's boot id, or of NCCL_HOSTID when set (src/misc/utils.cc,
    getHostHash); our nodes have their own host names (UTS namespaces), and NCCL_HOSTID makes it
    explicit whatever the backend. The rest are NCCL's documented switches (docs.nvidia.com,
    NCCL "Environment Variables"). Set over whatever the user's environment holds: a shortcut
    left on would make the emulation untrue.

    Args:
        ifname: the interface holding the node's address inside its namespace (`netns.interface_of`).
        host_id: a string unique to the node within the job.
    """
    return {
        "NCCL_SOCKET_IFNAME": "=" + ifname,  # "=": exactly this interface, not every name it prefixes
        "NCCL_HOSTID": host_id,
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_NET": "Socket",                # NCCL's internal socket transport, not a plugin (since 2.10)
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_MNNVL_ENABLE": "0",
    }


def visible_gpus(environ: Mapping[str, str] = os.environ) -> tuple[list[str], str]:
    """The GPUs the ranks may use, as CUDA_VISIBLE_DEVICES entries, and what was looked at.

    torch counts the devices CUDA enumerates under the caller's CUDA_VISIBLE_DEVICES (which stops
    at its first invalid entry), so the first `count` entries of that list are the usable ones;
    without the variable, devices 0..count-1.
    """
    import torch  # here, not at the top: the harness starts without torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"torch {torch.__version__}, CUDA_VISIBLE_DEVICES={'unset' if listed is None else repr(listed)}"
    if listed is None:
        return [str(index) for index in range(count)], seen
    return [entry.strip() for entry in listed.split(",") if entry.strip()][:count], seen


def place_job(trainer_config: Optional[Mapping], world: int, environ: Mapping[str, str] = os.environ,
              visible: Optional[Sequence[str]] = None) -> list[GpuPlacement]:
    """`place_ranks` for a job: its trainer config (None for a user's command) and this machine's
    GPUs (looked up only where the job may use one)."""
    if trainer_config is None:
        device, backend = None, None
    else:
        device = trainer_config.get("device", Config.__dataclass_fields__["device"].default)
        backend = (trainer_config.get("comm") or {}).get("backend", CommConfig.__dataclass_fields__["backend"].default)
    seen = ""
    if visible is None:
        visible, seen = ([], "") if device == "cpu" else visible_gpus(environ)
    return place_ranks(world, visible, device, backend, seen)
