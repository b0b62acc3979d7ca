"""Real hosts standing in for a topology's nodes: the hosts file, each host's links, launch scripts.

A hosts file names the machines of a real run and the region each stands for:

    topology: aws-4region.yaml          # relative to this file, or under topologies/
    interface: ens5                     # default device to shape and to carry the trainers' traffic
    repo: /opt/wanbench                 # where this repository is on every host (launch scripts)
    python: .venv/bin/python            # the interpreter there, relative to repo
    ssh_user: ubuntu                    # optional
    master_port: 29500                  # optional: torchrun's rendezvous port on the first host
    hosts:
      london-vm: {region: london, address: 10.0.1.4}
      tokyo-vm:  {region: tokyo,  address: 10.0.2.4}

`wanbench shape HOSTS.yaml --host london-vm --dev ens5` shapes that host's outgoing traffic to
every other host with the pair's one-way delay, jitter, loss and rate (emulator.backends.tc
.host_stage); run it on every host. `wanbench launch HOSTS.yaml SCENARIO --out DIR` writes, per
job of the scenario, the trainer config and the commands that start one rank per host under
torchrun (c10d rendezvous): an SSH script and a Slurm batch script. docs/REAL_HOSTS.md.
"""

from __future__ import annotations

import ipaddress
import json
import shlex
from pathlib import Path
from typing import Optional

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from emulator.plan import make_plan
from emulator.schema import ConfigError, config_error_from_pydantic, load_yaml_mapping
from emulator.topology import LinkSpec, Topology

from .inputs import topology_from_document


class HostEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: str
    address: str

    @field_validator("address")
    @classmethod
    def _ipv4(cls, value: str) -> str:
        try:
            return str(ipaddress.IPv4Address(value))
        except ValueError:
            raise ValueError(f"expected an IPv4 address, got {value!r}") from None


class HostsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    topology: str | dict
    hosts: dict[str, HostEntry] = Field(min_length=2)
    interface: Optional[str] = None
    repo: str = "~/wanbench"
    python: str = ".venv/bin/python"
    ssh_user: Optional[str] = None
    master_port: int = Field(29500, ge=1, le=65535)


class Hosts:
    """A parsed hosts file: its hosts in file order (rank order) and the topology they stand for."""

    def __init__(self, spec: HostsFile, topology: Topology, source: str):
        self.spec = spec
        self.topology = topology
        self.source = source
        self.names = list(spec.hosts)
        # The topology's link model at this many nodes per region (intra-region links included).
        counts = {region: 0 for region in topology.regions}
        for name, entry in spec.hosts.items():
            counts[entry.region] += 1
        plan = make_plan(topology.with_nodes({r: max(1, n) for r, n in counts.items()}))
        self._region_links = plan.region_links

    def link(self, src: str, dst: str) -> LinkSpec:
        """The one-way spec from host `src` to host `dst`."""
        hosts = self.spec.hosts
        return self._region_links[(hosts[src].region, hosts[dst].region)]

    def destinations(self, name: str) -> list[tuple[str, LinkSpec]]:
        """(address, spec) of every other host, as `name` shapes its traffic to them."""
        return [(self.spec.hosts[other].address, self.link(name, other)) for other in self.names if other != name]


def load_hosts(path: str | Path) -> Hosts:
    """Parse and check a hosts file; every error is one line naming the file and the field."""
    source = str(path)
    data = load_yaml_mapping(Path(path))
    try:
        spec = HostsFile.model_validate(data)
    except pydantic.ValidationError as exc:
        raise config_error_from_pydantic(source, exc) from None
    topology = topology_from_document({"topology": spec.topology}, source)
    for name, entry in spec.hosts.items():
        if entry.region not in topology.regions:
            raise ConfigError(f"hosts.{name}.region", f"unknown region {entry.region!r} "
                              f"(regions: {', '.join(topology.regions)})", source=source)
    owner: dict[str, str] = {}
    for name, entry in spec.hosts.items():
        if entry.address in owner:
            raise ConfigError(f"hosts.{name}.address", f"{entry.address} is {owner[entry.address]}'s address too",
                              source=source)
        owner[entry.address] = name
    return Hosts(spec, topology, source)


def check_host(hosts: Hosts, name: str) -> None:
    if name not in hosts.spec.hosts:
        raise ConfigError("--host", f"{name!r} is not in {hosts.source} (hosts: {', '.join(hosts.names)})",
                          source="wanbench shape")


def _torchrun(hosts: Hosts, config: str, node_rank: str, master: str, interface: Optional[str],
              rendezvous_id: str) -> str:
    """One host's torchrun command. `node_rank` and `master` are a number and an address, or shell
    variables ($SLURM_NODEID, $MASTER) that the batch script's shell expands: left unquoted."""
    spec = hosts.spec
    env = ["OMP_NUM_THREADS=1"]
    if interface:
        # the trainers' traffic (gloo, NCCL sockets, our transport) on the shaped interface
        env += [f"GLOO_SOCKET_IFNAME={shlex.quote(interface)}", f"NCCL_SOCKET_IFNAME={shlex.quote(interface)}"]
    words = [shlex.quote(spec.python), "-m", "torch.distributed.run", f"--nnodes={len(hosts.names)}",
             "--nproc-per-node=1", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
             f"--rdzv-endpoint={master}:{spec.master_port}", f"--rdzv-id={shlex.quote(rendezvous_id)}",
             "-m", "trainers", shlex.quote(config)]
    return " ".join(env + words)


def sysctl_commands(sysctls: dict[str, str], saved: str) -> tuple[list[str], list[str]]:
    """The shell commands that set `sysctls` on one host, each key's previous value kept in the
    folder `saved` first, and the commands that put those values back (one per key; values may
    hold spaces, as tcp_rmem's three numbers do). Run through `sudo -n` (root)."""
    apply, restore = [], []
    for key, value in sysctls.items():
        # double quotes, not shlex.quote: `saved` may hold $(hostname -s) for the shell to expand
        kept = f'"{saved}/{key}"'
        apply.append(f'mkdir -p "{saved}" && sysctl -n {key} > {kept} && '
                     f"sudo -n sysctl -q -w {shlex.quote(f'{key}={value}')}")
        restore.append(f'sudo -n sysctl -q -w "{key}=$(cat {kept})"')
    return apply, restore


def write_launch(hosts: Hosts, jobs: list, out: Path, interface: Optional[str] = None,
                 sysctls: Optional[dict[str, str]] = None) -> list[Path]:
    """Write `<out>/hosts.yaml` (a copy of the hosts file) and, per job, `<out>/<job_id>/config.json`,
    `ssh.sh` (shape every host, set `sysctls`, one rank per host over SSH, host order = rank order,
    then unshape and restore the sysctls' previous values) and `slurm.sbatch` (the same with one
    task per allocated node); return the job folders.

    `sysctls`: the topology's and scenario's `node_sysctls` (key -> value), applied host-wide on
    real hosts for the job's length (on the emulator they are per node namespace).

    The scripts expect `<out>` copied to `<repo>/launch/` on every host, and `wanbench` in the
    repository's virtual environment there (setup.sh); shaping and sysctls need root (sudo -n)."""
    interface = interface or hosts.spec.interface
    sysctls = dict(sysctls or {})
    spec = hosts.spec
    master = spec.hosts[hosts.names[0]].address
    out.mkdir(parents=True, exist_ok=True)
    (out / "hosts.yaml").write_text(Path(hosts.source).read_text())
    dev = f" --dev {shlex.quote(interface)}" if interface else ""
    wanbench = ".venv/bin/wanbench"
    folders = []
    for job in jobs:
        folder = out / job.job_id
        folder.mkdir(parents=True, exist_ok=True)
        config = {**job.trainer_config, "output_dir": f"runs/{job.job_id}"}
        (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        remote_config = f"launch/{job.job_id}/config.json"
        lines = ["#!/bin/sh", f"# {job.job_id}: one rank per host, rank = position in hosts.yaml.",
                 "# First copy this launch folder to <repo>/launch/ on every host (e.g. rsync -a).", "set -e"]
        targets = {name: f"{spec.ssh_user}@{spec.hosts[name].address}" if spec.ssh_user else spec.hosts[name].address
                   for name in hosts.names}

        def remote(name: str, command: str) -> str:
            return f"ssh {shlex.quote(targets[name])} {shlex.quote(f'cd {spec.repo} && {command}')}"

        saved = f"launch/{job.job_id}/sysctl-saved"
        apply, restore = sysctl_commands(sysctls, saved)
        if interface or sysctls:
            lines.append("# on exit: the WAN matrix removed from every host's interface, the node_sysctls' "
                         "previous values put back")
            lines.append("restore() {")
            if interface:
                lines += [f"  {remote(name, f'sudo -n {wanbench} unshape{dev}')} || true" for name in hosts.names]
            lines += [f"  {remote(name, command)} || true" for name in hosts.names for command in restore]
            lines += ["}", "trap restore EXIT"]
        if interface:
            lines += [remote(name, f"sudo -n {wanbench} shape launch/hosts.yaml --host {shlex.quote(name)}{dev}")
                      for name in hosts.names]
        if sysctls:
            lines.append("# node_sysctls, host-wide for this job: " + ", ".join(f"{k}={v}" for k, v in sysctls.items()))
            lines += [remote(name, command) for name in hosts.names for command in apply]
        for rank, name in enumerate(hosts.names):
            command = _torchrun(hosts, remote_config, str(rank), master, interface, job.job_id)
            lines.append(f"{remote(name, command)} > {shlex.quote(name)}.log 2>&1 &")
        lines += ["wait", ""]
        (folder / "ssh.sh").write_text("\n".join(lines))
        (folder / "ssh.sh").chmod(0o755)
        sbatch = [
            "#!/bin/bash", f"#SBATCH --job-name={job.job_id}", f"#SBATCH --nodes={len(hosts.names)}",
            "#SBATCH --ntasks-per-node=1",
            "# The allocation's short host names must be the hosts file's names (each node shapes",
            "# itself for the host it stands for); rank = the node's index in the allocation.",
            "set -e", f"cd {spec.repo}",
            "MASTER=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)", "export MASTER",
        ]
        on_exit = []
        if interface:
            sbatch.append(f"srun --ntasks-per-node=1 bash -c {shlex.quote(f'sudo -n {wanbench} shape launch/hosts.yaml --host $(hostname -s){dev}')}")
            on_exit.append(f"srun --ntasks-per-node=1 sudo -n {wanbench} unshape{dev}")
        if sysctls:
            # each node keeps its own previous values (the folder is per host name)
            node_saved = f"{saved}/$(hostname -s)"
            node_apply, node_restore = sysctl_commands(sysctls, node_saved)
            sbatch.append("# node_sysctls, host-wide for this job: " + ", ".join(f"{k}={v}" for k, v in sysctls.items()))
            sbatch += [f"srun --ntasks-per-node=1 bash -c {shlex.quote(command)}" for command in node_apply]
            on_exit += [f"srun --ntasks-per-node=1 bash -c {shlex.quote(command)}" for command in node_restore]
        if on_exit:
            sbatch.append(f"trap {shlex.quote('; '.join(on_exit))} EXIT")
        sbatch += ["srun --ntasks-per-node=1 bash -c " + shlex.quote(
            _torchrun(hosts, remote_config, "$SLURM_NODEID", "$MASTER", interface, job.job_id)), ""]
        (folder / "slurm.sbatch").write_text("\n".join(sbatch))
        folders.append(folder)
    return folders
