"""Real hosts: the hosts file, `wanbench shape --dry-run`, and launch scripts that really train.

Applying the shaping needs a kernel with netem: tests/emulator/test_netem_guest.py
(test_shape_puts_the_matrix_on_real_interfaces) runs `shape`/`unshape` in the guest.
"""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from emulator.backends import tc
from emulator.schema import ConfigError
from harness.hosts import load_hosts, write_launch
from harness.scenario import load_scenario
from tests.conftest import run_wanbench

ROOT = Path(__file__).resolve().parents[2]

HOSTS = """topology: aws-4region.yaml
interface: ens5
hosts:
  london-vm: {region: london, address: 10.0.1.4}
  tokyo-vm: {region: tokyo, address: 10.0.2.4}
  ohio-vm: {region: ohio, address: 10.0.4.4}
"""


def test_each_host_shapes_its_links_to_every_other(write_yaml):
    hosts = load_hosts(write_yaml(HOSTS, "hosts.yaml"))
    assert hosts.names == ["london-vm", "tokyo-vm", "ohio-vm"]
    destinations = dict(hosts.destinations("london-vm"))
    assert set(destinations) == {"10.0.2.4", "10.0.4.4"}
    assert destinations["10.0.2.4"].one_way_delay_ms == pytest.approx(215.7 / 2)
    assert destinations["10.0.4.4"].one_way_delay_ms == pytest.approx(86.6 / 2)
    cmds = tc.host_stage("ens5", hosts.destinations("london-vm"))
    assert cmds[0] == ["qdisc", "add", "dev", "ens5", "root", "handle", "5742:", "htb", "default", "1"]
    netems = [c for c in cmds if "netem" in c]
    assert [c[c.index("delay") + 1] for c in netems] == ["107.85ms", "43.3ms"]
    filters = [c[c.index("dst") + 1] for c in cmds if c[:2] == ["filter", "add"]]
    assert filters == ["10.0.2.4/32", "10.0.4.4/32"]
    rates = [c[c.index("rate") + 1] for c in cmds if c[:2] == ["class", "add"]][1:]
    assert rates == ["1Gbit", "1Gbit"]
    # netem holds what is in flight plus the queue, in full-size packets
    spec = destinations["10.0.2.4"]
    limit = int(netems[0][netems[0].index("limit") + 1])
    assert limit == tc.host_netem_limit(spec)
    assert limit * 1514 >= spec.rate_bit_s / 8 * spec.one_way_delay_ms / 1000


@pytest.mark.parametrize("text,field", [
    (HOSTS.replace("region: ohio", "region: mars"), "hosts.ohio-vm.region"),
    (HOSTS.replace("10.0.4.4", "10.0.2.4"), "hosts.ohio-vm.address"),
    (HOSTS.replace("10.0.4.4", "10.0.4"), "hosts.ohio-vm.address"),
    (HOSTS.replace("aws-4region.yaml", "nowhere.yaml"), "topology"),
    ("topology: aws-4region.yaml\nhosts:\n  a: {region: london, address: 10.0.0.1}\n", "hosts"),
])
def test_bad_hosts_files_are_one_line_naming_the_field(write_yaml, text, field):
    with pytest.raises(ConfigError) as caught:
        load_hosts(write_yaml(text, "hosts.yaml"))
    assert caught.value.field == field
    assert "hosts.yaml" in str(caught.value) and "\n" not in str(caught.value)


def test_shape_dry_run_and_its_errors(write_yaml):
    path = write_yaml(HOSTS, "hosts.yaml")
    done = run_wanbench("shape", path, "--host", "tokyo-vm", "--dry-run")
    script = done.stdout
    assert script.startswith("#!/bin/sh") and "dev ens5" in script
    assert "netem delay 107.85ms" in script and "netem delay 79.15ms" in script
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)
    bad = run_wanbench("shape", path, "--host", "paris-vm", "--dry-run", check=False)
    assert bad.returncode == 2 and "paris-vm" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    no_dev = write_yaml(HOSTS.replace("interface: ens5\n", ""), "nodev.yaml")
    bad = run_wanbench("shape", no_dev, "--host", "tokyo-vm", "--dry-run", check=False)
    assert bad.returncode == 2 and "--dev" in bad.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.integration
def test_launch_scripts_start_one_rank_per_host_under_torchrun(tmp_path, write_yaml):
    """Two 'hosts' on loopback addresses run the SSH script's commands (without ssh): torchrun's
    c10d rendezvous, one rank each, a sync job that trains and writes its records."""
    hosts_file = write_yaml(
        f"topology: aws-4region.yaml\nrepo: {tmp_path}\npython: {sys.executable}\nmaster_port: {_free_port()}\n"
        "hosts:\n  east: {region: london, address: 127.0.0.1}\n  west: {region: ohio, address: 127.0.0.2}\n",
        "hosts.yaml")
    scenario_file = write_yaml(
        "name: launch-check\ntopology: aws-4region.yaml\n"
        "workload: {model: {name: mlp, params: {hidden_sizes: [16]}}, dataset: {name: digits}, batch_size: 32, lr: 0.1}\n"
        "stop: {steps: 6}\nalgorithms: [{name: sync}]\n", "scenario.yaml")
    hosts, scenario = load_hosts(hosts_file), load_scenario(scenario_file)
    folders = write_launch(hosts, scenario.jobs, tmp_path / "launch")
    assert [f.name for f in folders] == [job.job_id for job in scenario.jobs]
    folder = folders[0]
    lines = [line for line in (folder / "ssh.sh").read_text().splitlines() if line.startswith("ssh ")]
    assert len(lines) == 2   # no interface: no shape/unshape lines, one rank per host
    commands = []
    for rank, line in enumerate(lines):
        words = shlex.split(line.split(" > ")[0].rstrip(" &"))
        assert words[0] == "ssh" and words[1] == ["127.0.0.1", "127.0.0.2"][rank]
        assert f"--node-rank={rank}" in words[2] and "--rdzv-endpoint=127.0.0.1:" in words[2]
        commands.append(words[2])
    sbatch = (folder / "slurm.sbatch").read_text()
    assert "--node-rank=$SLURM_NODEID" in sbatch and "#SBATCH --nodes=2" in sbatch
    subprocess.run(["bash", "-n", str(folder / "slurm.sbatch")], check=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for command in commands]
    outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][-3000:]
    run_dir = tmp_path / "runs" / folder.name
    for rank in (0, 1):
        rows = [json.loads(line) for line in (run_dir / f"rank{rank}.jsonl").read_text().splitlines()]
        assert rows[0]["kind"] == "start" and rows[0]["world_size"] == 2
        assert rows[-1]["status"] == "ok" and rows[-1]["steps"] == 6


@pytest.mark.integration
def test_launch_scripts_set_node_sysctls_for_the_job_and_restore_them(tmp_path, write_yaml, test_prefix):
    """ssh.sh run for real, each 'host' a network namespace of the test's own (net.* sysctls are
    per namespace): a fake `ssh` runs the host's command in its namespace, and in place of
    torchrun reads the sysctl the scenario sets; after the script the previous values are back."""
    from pyroute2 import netns as pyroute2_netns

    key = "net.ipv4.tcp_slow_start_after_idle"
    hosts_file = write_yaml(
        f"topology: aws-4region.yaml\nrepo: {tmp_path}\n"
        "hosts:\n  east: {region: london, address: 10.0.1.4}\n  west: {region: ohio, address: 10.0.4.4}\n",
        "hosts.yaml")
    scenario_file = write_yaml(
        "name: launch-sysctls\ntopology: aws-4region.yaml\n"
        f"node_sysctls: {{{key}: 0, net.ipv4.tcp_congestion_control: reno}}\n"
        "workload: {model: {name: mlp, params: {hidden_sizes: [16]}}, dataset: {name: digits}, batch_size: 32, lr: 0.1}\n"
        "stop: {steps: 6}\nalgorithms: [{name: sync}]\n", "scenario.yaml")
    out = tmp_path / "launch"
    done = run_wanbench("launch", hosts_file, scenario_file, "--out", str(out))
    assert "node_sysctls set host-wide" in done.stderr
    folder = next(p for p in out.iterdir() if p.is_dir())
    sbatch = (folder / "slurm.sbatch").read_text()
    assert f"sudo -n sysctl -q -w {key}=0" in sbatch and "sysctl-saved/$(hostname -s)" in sbatch
    subprocess.run(["bash", "-n", str(folder / "slurm.sbatch")], check=True)

    namespaces = {"10.0.1.4": f"{test_prefix}-east", "10.0.4.4": f"{test_prefix}-west"}
    shims = tmp_path / "bin"
    shims.mkdir()
    seen = tmp_path / "seen"
    (shims / "ssh").write_text(
        "#!/bin/bash\n"
        f"case $1 in 10.0.1.4) ns={namespaces['10.0.1.4']};; 10.0.4.4) ns={namespaces['10.0.4.4']};; *) exit 9;; esac\n"
        "if [[ $2 == *torch.distributed.run* ]]; then\n"
        f"  exec ip netns exec $ns sh -c 'echo $(sysctl -n {key}) $(sysctl -n net.ipv4.tcp_congestion_control)' >> {seen}\n"
        "fi\n"
        "exec ip netns exec $ns bash -c \"$2\"\n")
    (shims / "sudo").write_text("#!/bin/sh\n[ \"$1\" = -n ] && shift\nexec \"$@\"\n")
    for shim in shims.iterdir():
        shim.chmod(0o755)
    (tmp_path / "launch").mkdir(exist_ok=True)
    for namespace in namespaces.values():
        pyroute2_netns.create(namespace)
    try:
        def read(namespace, name):
            return subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-n", name], capture_output=True,
                                  text=True, check=True).stdout.strip()

        before = {ns: (read(ns, key), read(ns, "net.ipv4.tcp_congestion_control")) for ns in namespaces.values()}
        assert all(value[0] == "1" for value in before.values())
        env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
        done = subprocess.run(["bash", str(folder / "ssh.sh")], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert sorted(seen.read_text().split("\n")[:2]) == ["0 reno", "0 reno"]   # in force while the ranks ran
        after = {ns: (read(ns, key), read(ns, "net.ipv4.tcp_congestion_control")) for ns in namespaces.values()}
        assert after == before
    finally:
        for namespace in namespaces.values():
            pyroute2_netns.remove(namespace)
