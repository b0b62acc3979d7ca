"""Container-grade nodes on a real network (tun backend): each node its own hostname, IPC, PID
space, /tmp and /dev/shm, read-only system folders, memory and pids limits; nothing of a node
survives `down` or `clean` (daemons and double forks included); the process `exec_argv` starts
stands for the command (signals, exit status, death)."""

import os
import re
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from emulator import cgroups, netns, nodes
from emulator.backends.tun import TunBackend
from emulator.clean import clean
from emulator.plan import make_plan
from emulator.topology import load_topology

pytestmark = pytest.mark.integration

TOPOLOGY = """
name: nodes
address_pool: 10.241.0.0/24
regions: {london: {nodes: 1}, tokyo: {nodes: 1}}
links: [{between: [london, tokyo], rtt: 20ms, rate: 100Mbit}]
node_limits: {memory: 150MB, pids: 40}
"""


@pytest.fixture
def prefix(test_prefix):
    """The shared per-test prefix (tests/conftest.py), set in the environment and cleaned after."""
    return test_prefix


@pytest.fixture
def plan(prefix, write_yaml):
    return make_plan(load_topology(write_yaml(TOPOLOGY)))


@pytest.fixture
def network(plan):
    backend = TunBackend(plan)
    backend.up()
    try:
        yield plan
    finally:
        backend.down()


def run_in(plan, name, *argv, timeout=30):
    return subprocess.run(netns.exec_argv(plan.node(name), list(argv)), capture_output=True,
                          text=True, timeout=timeout)


def start_in(plan, name, *argv):
    return subprocess.Popen(netns.exec_argv(plan.node(name), list(argv)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def child_of(pid: int, timeout_s: float = 5.0) -> int:
    """The (host) pid of the command a node_enter process forked."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise AssertionError(f"process {pid} forked nothing")


def gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.02)
    return False


def test_each_node_has_its_own_hostname_pid_space_ipc_tmp_and_shm(network):
    plan = network
    assert run_in(plan, "london-0", "hostname").stdout.strip() == "london-0"
    assert run_in(plan, "tokyo-0", "hostname").stdout.strip() == "tokyo-0"
    assert socket.gethostname() not in ("london-0", "tokyo-0")  # the host keeps its name

    # ps inside a node: its PID 1 (the holder), its own sleep and ps itself; not tokyo's sleep
    sleepers = [start_in(plan, "london-0", "sleep", "300"), start_in(plan, "tokyo-0", "sleep", "301")]
    try:
        child_of(sleepers[0].pid), child_of(sleepers[1].pid)
        listing = run_in(plan, "london-0", "ps", "-e", "-ww", "-o", "pid=,args=").stdout
        rows = [line.split(None, 1) for line in listing.strip().splitlines()]
        assert [pid for pid, _ in rows][0] == "1" and "node_init.py" in rows[0][1], listing
        assert sorted(args.split()[0] for _, args in rows[1:]) == ["ps", "sleep"], listing
        assert "sleep 300" in listing and "sleep 301" not in listing
    finally:
        for proc in sleepers:
            proc.terminate()
            proc.wait(timeout=10)

    # /dev/shm and /tmp: a file in one node is invisible in the other and on the host
    probe = f"wc-probe-{uuid.uuid4().hex[:6]}"
    made = run_in(plan, "london-0", "sh", "-c", f"echo a > /dev/shm/{probe} && echo b > /tmp/{probe} "
                                               f"&& cat /dev/shm/{probe} /tmp/{probe}")
    assert made.returncode == 0 and made.stdout.split() == ["a", "b"], made.stderr
    seen = run_in(plan, "tokyo-0", "ls", "-A", "/dev/shm", "/tmp").stdout
    assert probe not in seen
    assert not Path(f"/dev/shm/{probe}").exists() and not Path(f"/tmp/{probe}").exists()

    # System V IPC: a segment made in london is not listed in tokyo
    made = run_in(plan, "london-0", "ipcmk", "-M", "4096")
    shm_id = re.search(r"id:\s*(\d+)", made.stdout).group(1)
    assert re.search(rf"\b{shm_id}\b", run_in(plan, "london-0", "ipcs", "-m").stdout)
    assert not re.search(rf"^0x\w+\s+{shm_id}\b", run_in(plan, "tokyo-0", "ipcs", "-m").stdout, re.M)

    # the host's system folders are read-only in a node; names resolve; the WAN is there
    touch = run_in(plan, "london-0", "touch", "/usr/wc-probe")
    assert touch.returncode != 0 and "Read-only" in touch.stderr
    tokyo = plan.node("tokyo-0")
    assert run_in(plan, "london-0", "getent", "hosts", "tokyo-0").stdout.split()[0] == tokyo.address
    # a node's groups leave real-time scheduling possible (verify's prober runs SCHED_FIFO)
    assert run_in(plan, "london-0", "chrt", "-f", "5", "true").returncode == 0
    ping = run_in(plan, "london-0", "ping", "-n", "-c", "3", "-i", "0.05", "-W", "2", "tokyo-0")
    rtt = min(float(v) for v in re.findall(r"time=([\d.]+)", ping.stdout))  # the least held up by a busy CPU
    assert 19.5 < rtt < 40, ping.stdout


def test_memory_and_pids_limits_are_set_and_enforced(network):
    plan = network
    group = cgroups.memory_group(plan.prefix, "london-0")
    limit_file = "memory.max" if (group / "memory.max").exists() else "memory.limit_in_bytes"
    limit = int((group / limit_file).read_text())
    assert 150_000_000 - os.sysconf("SC_PAGE_SIZE") < limit <= 150_000_000  # the kernel rounds to pages
    pids_group = cgroups.pids_root() / f"{plan.prefix}-london-0"
    assert (pids_group / "pids.max").read_text().strip() == "40"

    init, _ = nodes.holder_pids(plan.prefix, plan.node("london-0"))
    assert f"memory:/{plan.prefix}-london-0" in Path(f"/proc/{init}/cgroup").read_text()  # PID 1 too

    before = cgroups.oom_kills(plan.prefix, "london-0")
    hog = run_in(plan, "london-0", "python3", "-c", "x = b'x' * 400_000_000; print('survived')")
    assert hog.returncode == -signal.SIGKILL and "survived" not in hog.stdout
    assert cgroups.oom_kills(plan.prefix, "london-0") == before + 1
    assert run_in(plan, "london-0", "python3", "-c", "x = b'x' * 50_000_000").returncode == 0
    assert cgroups.oom_kills(plan.prefix, "tokyo-0") == 0  # the other node's group saw nothing

    # 60 processes in a node limited to 40: the shell cannot fork them all
    forks = run_in(plan, "tokyo-0", "sh", "-c", "for i in $(seq 60); do sleep 30 >/dev/null 2>&1 & done; wait")
    assert forks.returncode != 0 and "fork" in forks.stderr.lower(), forks


def test_down_ends_daemons_double_forks_and_plain_netns_processes(plan):
    backend = TunBackend(plan)
    backend.up()
    try:
        london, tokyo = plan.node("london-0"), plan.node("tokyo-0")
        assert run_in(plan, "london-0", "iperf3", "-s", "-D", "-p", "5999").returncode == 0
        assert run_in(plan, "tokyo-0", "sh", "-c", "(sleep 600 >/dev/null 2>&1 &) & exit 0").returncode == 0
        # a process put into the network namespace by plain `ip netns exec`, outside our holder
        plain = subprocess.Popen(["ip", "netns", "exec", tokyo.namespace, "sleep", "601"],
                                 start_new_session=True)
        time.sleep(0.3)
        inside = {name: netns.pids_in(node.namespace) for name, node in (("london", london), ("tokyo", tokyo))}
        cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pids in inside.values() for pid in pids}
        daemon = [pid for pid, cmd in cmdlines.items() if cmd.startswith(b"iperf3\0-s\0-D")]
        orphan = [pid for pid, cmd in cmdlines.items() if cmd == b"sleep\x00600\x00"]
        assert len(daemon) == 1 and len(orphan) == 1, cmdlines
        holders = [nodes.holder_pids(plan.prefix, node)[0] for node in plan.nodes]
        mount_namespaces = {os.stat(f"/proc/{pid}/ns/mnt").st_ino for pid in holders}
    finally:
        backend.down()
    for pid in daemon + orphan + [plain.pid] + holders:
        assert gone(pid), f"process {pid} survived down"
    plain.wait(timeout=5)
    assert netns.list_namespaces(plan.prefix) == []
    assert nodes.leftover_holders(plan.prefix) == []
    assert not any(group.exists() for node in plan.nodes
                   for group in cgroups.node_groups(plan.prefix, node.name, with_cpu=True))
    # the nodes' mounts lived only in their mount namespaces, and no process holds one any more
    still = {int(p) for p in os.listdir("/proc") if p.isdigit()
             if _mnt_ino(int(p)) in mount_namespaces}
    assert still == set()


def _mnt_ino(pid: int):
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def test_clean_finds_a_node_whose_state_and_name_are_lost(plan, prefix):
    TunBackend(plan).up()
    assert run_in(plan, "london-0", "iperf3", "-s", "-D", "-p", "5998").returncode == 0
    time.sleep(0.2)
    daemon = [pid for pid in netns.pids_in(plan.node("london-0").namespace)
              if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"iperf3\0")]
    assert len(daemon) == 1
    # a crash that lost the run state and the namespaces' names: only the command lines are left
    for node in plan.nodes:
        nodes.pid_file(prefix, node.name).unlink()
        subprocess.run(["ip", "netns", "delete", node.namespace], check=True)
    assert nodes.leftover_holders(prefix)
    removed = clean(prefix)
    assert gone(daemon[0]), "the daemon survived clean"
    assert nodes.leftover_holders(prefix) == []
    assert any(item.startswith("cgroup ") and "memory" in item for item in removed)
    assert not any(group.exists() for node in plan.nodes
                   for group in cgroups.node_groups(prefix, node.name, with_cpu=True))
    assert clean(prefix) == []  # idempotent


def test_the_entering_process_stands_for_the_command(network):
    plan = network
    assert run_in(plan, "london-0", "sh", "-c", "exit 7").returncode == 7
    assert run_in(plan, "london-0", "sh", "-c", "kill -9 $$").returncode == -signal.SIGKILL
    assert run_in(plan, "london-0", "no-such-command-wc").returncode == 127
    # SIGTERM is passed on: the command ends, and its status is ours
    proc = start_in(plan, "london-0", "sleep", "600")
    command = child_of(proc.pid)
    proc.terminate()
    assert proc.wait(timeout=10) == -signal.SIGTERM and gone(command)
    # ... also to a stopped command, which gets SIGCONT after it
    proc = start_in(plan, "london-0", "sleep", "600")
    command = child_of(proc.pid)
    os.kill(command, signal.SIGSTOP)
    proc.terminate()
    assert proc.wait(timeout=5) == -signal.SIGTERM and gone(command)
    # SIGKILL cannot be passed on: the command dies with us (PR_SET_PDEATHSIG)
    proc = start_in(plan, "tokyo-0", "sh", "-c", "trap '' TERM; sleep 600")
    command = child_of(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    assert gone(command)
    # and a node that is not up cannot be entered: one line, not a traceback
    stopped = plan.node("tokyo-0")
    argv = netns.exec_argv(stopped, ["true"])
    nodes.stop(plan, [stopped])
    result = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    assert result.returncode == 125 and "is not running" in result.stderr
    with pytest.raises(RuntimeError, match="tokyo-0 is not running"):
        netns.exec_argv(stopped, ["true"])


def test_a_job_folder_under_the_hosts_tmp_is_shared_into_the_node(network, tmp_path):
    plan = network
    folder = tmp_path / "job"
    folder.mkdir()
    argv = netns.exec_argv(plan.node("london-0"), ["sh", "-c", f"echo from-node > {folder}/out"],
                           share=[folder])
    assert subprocess.run(argv, timeout=30).returncode == 0
    assert (folder / "out").read_text() == "from-node\n"
