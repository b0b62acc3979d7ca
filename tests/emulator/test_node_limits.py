"""Node limits and node cgroups without root: `node_limits` validation (file + field in the error),
the cgroup files written for v1 and v2 layouts (on a fake /sys/fs/cgroup), the holder's command line."""

from pathlib import Path

import pytest

from emulator import cgroups, nodes
from emulator.plan import make_plan
from emulator.schema import ConfigError
from emulator.topology import load_topology

BASE = """
name: lim
regions: {london: {nodes: 1}, tokyo: {nodes: 2}}
links: [{between: [london, tokyo], rtt: 20ms}]
"""


def test_limits_parse_with_units_and_reach_the_plan(write_yaml):
    topology = load_topology(write_yaml(BASE + "node_limits: {memory: 4GB, pids: 512}\n"))
    assert (topology.memory_bytes, topology.pids_max) == (4_000_000_000, 512)
    plan = make_plan(topology)
    assert (plan.memory_bytes, plan.pids_max) == (4_000_000_000, 512)
    assert make_plan(load_topology(write_yaml(BASE))).memory_bytes is None
    assert load_topology(write_yaml(BASE + "node_limits: {memory: 512MiB}\n")).memory_bytes == 512 * 1024**2


@pytest.mark.parametrize("limits, field, words", [
    ("{memory: 4}", "node_limits.memory", "needs a unit"),
    ("{memory: 4 apples}", "node_limits.memory", "unknown size unit"),
    ("{memory: 1MB}", "node_limits.memory", "out of range"),
    ("{pids: 2}", "node_limits.pids", "out of range"),
    ("{pids: many}", "node_limits.pids", "whole number"),
    ("{cpu: 2}", "node_limits.cpu", "unknown field"),
])
def test_bad_limits_name_the_file_and_field(write_yaml, limits, field, words):
    path = write_yaml(BASE + f"node_limits: {limits}\n")
    with pytest.raises(ConfigError) as caught:
        load_topology(path)
    assert caught.value.source == path and caught.value.field == field
    assert words in caught.value.message and "\n" not in str(caught.value)


def fake_v1(root):
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "pids").mkdir()
    (root / "pids" / "cgroup.procs").write_text("")


def fake_v2(root):
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpu\n")


def test_v1_groups_one_per_hierarchy_with_limits(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    fake_v1(tmp_path)
    groups = cgroups.create_node_groups("wcu", "london-0", memory_bytes=150_000_000, pids_max=40)
    assert groups == [tmp_path / "memory" / "wcu-london-0", tmp_path / "pids" / "wcu-london-0"]
    # the CPU group is made only for a CPU share (a v1 cpu group has no real-time budget)
    assert not (tmp_path / "cpu" / "wcu-london-0").exists()
    assert cgroups.node_groups("wcu", "london-0", with_cpu=True)[0] == tmp_path / "cpu" / "wcu-london-0"
    assert (tmp_path / "memory" / "wcu-london-0" / "memory.limit_in_bytes").read_text() == "150000000"
    assert (tmp_path / "pids" / "wcu-london-0" / "pids.max").read_text() == "40"
    (tmp_path / "memory" / "wcu-london-0" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert cgroups.oom_kills("wcu", "london-0") == 3
    assert cgroups.oom_kills("wcu", "tokyo-0") == 0  # no group: nothing was killed there


def test_v2_one_group_with_controllers_enabled_and_no_swap(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    fake_v2(tmp_path)
    written = []
    real_write = type(tmp_path).write_text

    def record(self, text, *args, **kwargs):
        if self.name == "cgroup.subtree_control":
            written.append(text)
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tmp_path), "write_text", record)
    group = tmp_path / "wcu-tokyo-1"
    group.mkdir()
    (group / "memory.swap.max").write_text("max\n")
    assert cgroups.create_node_groups("wcu", "tokyo-1", memory_bytes=10**9, pids_max=100) == [group]
    assert sorted(written) == ["+memory", "+pids"]  # cpu was enabled already
    assert (group / "memory.max").read_text() == "1000000000"
    assert (group / "memory.swap.max").read_text() == "0"
    assert (group / "pids.max").read_text() == "100"
    (group / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\n")
    assert cgroups.oom_kills("wcu", "tokyo-1") == 2


def test_a_limit_without_its_controller_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    (tmp_path / "cpu").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    with pytest.raises(RuntimeError, match="no cgroup memory controller"):
        cgroups.create_node_groups("wcu", "london-0", memory_bytes=10**9)
    assert cgroups.create_node_groups("wcu", "london-0") == []  # no limit asked, none needed


def test_holder_command_line(write_yaml, monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wcu")
    node = make_plan(load_topology(write_yaml(BASE))).node("tokyo-1")
    argv = nodes.holder_argv(node, ready_fd=7, groups=[Path("/sys/fs/cgroup/memory/wcu-tokyo-1")])
    assert argv[:3] == ["nsenter", "--net=/run/netns/wcu-tokyo-1", "--"]
    unshare = argv[3:argv.index("--", 3)]
    assert unshare[0] == "unshare" and {"--uts", "--ipc", "--mount", "--pid", "--fork", "--kill-child"} <= set(unshare)
    assert argv[argv.index("--node") + 1] == "tokyo-1" and argv[argv.index("--ready-fd") + 1] == "7"
    assert argv[argv.index("--cgroup") + 1] == "/sys/fs/cgroup/memory/wcu-tokyo-1"  # PID 1 joins it
    # what `clean` recognises a holder of this prefix by
    assert nodes.state_marker("wcu") in argv and str(nodes.INIT_SCRIPT) in argv
    assert nodes.prefix_of(node) == "wcu"
