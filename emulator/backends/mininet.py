"""`mininet` backend: Mininet hosts on one Linux bridge, shaped per destination with htb + netem.

How it is built
- Mininet runs in a driver process (`mininet_driver.py`) under the SYSTEM Python, which is where
  Debian installs the `mininet` package; we talk to it in JSON. We chose a separate process over
  putting /usr/lib/python3/dist-packages on our path because (1) the network must outlive
  `wanbench up`, so something has to hold Mininet's node shells anyway, (2) Mininet keeps global
  state (class counters, `Mininet.inited`) and would mix the system's dist-packages (numpy, yaml...)
  into our venv's imports, and (3) a crash in Mininet cannot take the CLI with it. The driver's PID
  and every node shell's PID go into the run state; `down` stops them by PID after checking
  /proc/<pid>/cmdline.
- One Mininet host per plan node (`<prefix>h<rank>`, eth0 = node.address/prefix_length), one
  `LinuxBridge` switch `<prefix>s0` (the kernel may have no Open vSwitch) whose ports are
  `<prefix>s0-<rank>`, plain veth `Link`s, no controller.
- Each host's network namespace is attached as the plan's `<prefix>-<node>` (`ip netns attach`), and
  a node holder (`emulator/nodes.py`: own hostname, IPC, PID space, mounts, cgroups) is started in
  it, so `wanbench exec`, verify and runs enter a node as on every backend, and
  /etc/netns/<ns>/hosts makes node names resolve. The plan's sysctls are set inside each namespace.
  Mininet's own host shells stay outside the holder's namespaces (they share the host's hostname,
  IPC, PID space and mounts, as in plain Mininet); `down` ends the holders with all they run and
  anything else in the namespaces except those shells, which the driver stops.

Mapping the per-pair matrix: Mininet's `TCLink` shapes an interface as a whole -- one rate, one
delay for every destination -- which cannot express london->tokyo 107.85 ms next to london->ohio
43.3 ms on the same host. So the links are plain, and shaping is the tc backend's link model
(`tc.delay_stage`, `tc.bottleneck_stage`): each host's eth0 gets the propagation stage (netem per
destination: delay, jitter, loss), run as one `tc -batch` per host; each switch port (the bridge
side of a host's veth, in the root namespace) gets the bottleneck stage (htb class per source at
the pair's rate, bfifo queue bounded in bytes), all ports in one `tc -batch`.

No netem: Mininet logs "Specified qdisc kind is unknown" and carries on with NO delay. We never
trust that: after shaping, `up` pings across the pair with the largest RTT and, if the delay is not
there, tears everything down and raises `DelayNotApplied` (a `BackendUnavailable`) saying so.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional

from pyroute2 import IPRoute

from .. import netns, nodes
from ..processes import alive, cmdline, send_signal, wait_gone
from ..plan import Node, Plan
from . import tc
from .base import Backend, BackendUnavailable, clear_state, read_state, register

# Debian's mininet is installed for this interpreter; override for other layouts.
MININET_PYTHON = os.environ.get("WANBENCH_MININET_PYTHON", "/usr/bin/python3")
DRIVER_PATH = Path(__file__).with_name("mininet_driver.py")
# In the driver's command line, so `wanbench clean` (which looks for the state folder and an
# `emulator.` module name) and our own /proc checks recognise it.
DRIVER_OWNER = "emulator.backends.mininet"
HOST_IFNAME = tc.NODE_IFNAME  # "eth0", as in the tc backend, so tc.delay_stage applies as is
REQUIRED_TOOLS = {
    "mnexec": "apt-get install mininet",
    "brctl": "apt-get install bridge-utils",
    "ifconfig": "apt-get install net-tools",
    "tc": "apt-get install iproute2",
    "ip": "apt-get install iproute2",
    "ping": "apt-get install iputils-ping",
}

# Mininet starts one shell per host plus one per switch; ~0.05 s each here. Generous on top: in
# the user-mode-linux guest on a loaded host, `up` of 3 nodes took 27-43 s and once ran past 31.5 s.
READY_TIMEOUT_BASE_S = 90.0
READY_TIMEOUT_PER_NODE_S = 0.5
STOP_TIMEOUT_BASE_S = 10.0
STOP_TIMEOUT_PER_NODE_S = 0.2

# The delay check: pings across one pair. The measured minimum RTT must reach this fraction of the
# configured minimum (one-way delays minus jitter, both directions); netem's timer is accurate to
# well under 10% at the delays of a WAN, and a missing netem gives ~0.05 ms.
PING_COUNT = 3
PING_INTERVAL_S = 0.2
DELAY_CHECK_FRACTION = 0.9
# Below this RTT a ping cannot tell shaped from unshaped (a veth round trip alone is 0.03-0.1 ms);
# there we rely on tc's own error alone.
MIN_CHECKABLE_RTT_MS = 1.0
NO_NETEM_MARK = "qdisc kind is unknown"


class DelayNotApplied(BackendUnavailable):
    """The network came up but the configured delay is not there (e.g. the kernel has no sch_netem)."""


# ---- names (pure) -------------------------------------------------------------------------------

def host_name(plan: Plan, node: Node) -> str:
    """Mininet host name; also the tag in its shell's command line ("mininet:<name>")."""
    return f"{plan.prefix}h{node.rank}"


def switch_name(plan: Plan) -> str:
    return f"{plan.prefix}s0"


def port_name(plan: Plan, node: Node) -> str:
    """Bridge-side veth of a node: contains the switch name, which LinuxBridge.start requires."""
    return f"{switch_name(plan)}-{node.rank}"


def root_link_pattern(prefix: str) -> re.Pattern:
    """Links this backend may leave in the host namespace: the bridge, its ports, a stray host end."""
    return re.compile(rf"^{re.escape(prefix)}(s0|s0-\d+|h\d+)$")


def shell_pattern(prefix: str) -> re.Pattern:
    """Command line of a Mininet node shell of ours: `bash ... -is mininet:<prefix>h3`."""
    return re.compile(rf"mininet:{re.escape(prefix)}(h\d+|s0)$")


def driver_spec(plan: Plan) -> dict:
    """The JSON spec the driver builds: switch, and per node the host name, address and veth names."""
    return {
        "switch": switch_name(plan),
        "hosts": [
            {"name": host_name(plan, node), "ip": f"{node.address}/{plan.prefix_length}",
             "intf": HOST_IFNAME, "port": port_name(plan, node)}
            for node in plan.nodes
        ],
    }


def driver_argv(mode: str, prefix: str) -> list[str]:
    """Command line of the driver; -I keeps the venv's PYTHON* variables and user site out."""
    return [MININET_PYTHON, "-I", str(DRIVER_PATH), mode,
            "--state-dir", f"{Backend.state_dir(prefix)}/", "--owner", DRIVER_OWNER]


# ---- shaping (pure) -----------------------------------------------------------------------------

def shaping_batch(plan: Plan, node: Node) -> str:
    """`node`'s propagation stage (tc backend layout) as a `tc -n <ns> -batch -` script."""
    return "".join(shlex.join(cmd) + "\n" for cmd in tc.delay_stage(plan, node))


def bottleneck_batch(plan: Plan) -> str:
    """Every switch port's bottleneck stage (tc backend layout) as one `tc -batch -` script."""
    return "".join(shlex.join(cmd) + "\n" for node in plan.nodes
                   for cmd in tc.bottleneck_stage(plan, node, port_name(plan, node)))


# ---- the delay check (pure) ---------------------------------------------------------------------

def check_pair(plan: Plan) -> tuple[Node, Node]:
    """The pair with the largest round-trip delay (first by rank on ties): the easiest to measure.

    plan: at least two nodes. Returns (src, dst); the check pings dst from src.
    """
    best, best_rtt = None, -1.0
    for src, dst, spec in plan.pairs():
        rtt = spec.one_way_delay_ms + plan.link(dst, src).one_way_delay_ms
        if rtt > best_rtt:
            best, best_rtt = (src, dst), rtt
    if best is None:
        raise ValueError("a delay check needs at least two nodes")
    return best


def expected_rtt_ms(plan: Plan, src: Node, dst: Node) -> tuple[float, float]:
    """(configured RTT, lowest RTT jitter allows), both in ms, for src -> dst -> src."""
    there, back = plan.link(src, dst), plan.link(dst, src)
    rtt = there.one_way_delay_ms + back.one_way_delay_ms
    return rtt, rtt - there.jitter_ms - back.jitter_ms


def parse_ping_rtts_ms(output: str) -> list[float]:
    """Per-reply round-trip times (ms) from iputils ping output ("... time=215 ms")."""
    return [float(m) for m in re.findall(r"time[=<]([0-9.]+) ?ms", output)]


def delay_applied(lowest_expected_rtt_ms: float, measured_min_rtt_ms: float) -> bool:
    """True when the measured minimum RTT reaches DELAY_CHECK_FRACTION of the configured minimum.

    lowest_expected_rtt_ms: configured RTT minus jitter both ways (ms); below MIN_CHECKABLE_RTT_MS
    the measurement cannot decide and this returns True. measured_min_rtt_ms: smallest ping RTT (ms).
    """
    if lowest_expected_rtt_ms < MIN_CHECKABLE_RTT_MS:
        return True
    return measured_min_rtt_ms >= DELAY_CHECK_FRACTION * lowest_expected_rtt_ms


def no_delay_message(src: Node, dst: Node, expected_ms: float, measured_ms: float,
                     tc_errors: dict[str, str]) -> str:
    """The error for a delay that did not take effect; names the cause when tc told us.

    expected_ms, measured_ms: configured and measured minimum RTT (ms); tc_errors: node -> tc stderr.
    """
    no_netem = any(NO_NETEM_MARK in err for err in tc_errors.values())
    cause = "the kernel has no sch_netem, the delay" if no_netem else "the delay"
    message = (f"mininet backend: {cause} was not applied (measured {measured_ms:.2f} ms for "
               f"{expected_ms:g} ms, {src.name} -> {dst.name} -> {src.name}); use --backend tun")
    if tc_errors and not no_netem:
        first = next(iter(tc_errors.items()))
        message += f" (tc on {first[0]}: {first[1]})"
    return message


# ---- processes (side effects, by PID only) ------------------------------------------------------

def is_our_driver(pid: int, prefix: str) -> bool:
    line = cmdline(pid)
    return DRIVER_OWNER in line and f"{Backend.state_dir(prefix)}/" in line and DRIVER_PATH.name in line


def our_shell_pids(prefix: str) -> list[int]:
    """PIDs of Mininet node shells whose names carry our prefix (left over if the driver died)."""
    pattern = shell_pattern(prefix)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pattern.search(cmdline(int(entry.name))) and alive(int(entry.name)):
            pids.append(int(entry.name))
    return sorted(pids)


def our_root_links(prefix: str) -> list[str]:
    """Names of our links in the host namespace (bridge, its ports)."""
    pattern = root_link_pattern(prefix)
    with IPRoute() as ipr:
        names = [link.get_attr("IFLA_IFNAME") for link in ipr.get_links()]
    return sorted(name for name in names if name and pattern.match(name))


@register
class MininetBackend(Backend):
    """Mininet (LinuxBridge, veth links) held by a driver process; per-destination htb + netem."""

    name = "mininet"

    def __init__(self, plan: Plan):
        super().__init__(plan)
        self._driver: Optional[subprocess.Popen] = None  # set while this process started it

    @classmethod
    def check_available(cls) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailable("mininet backend needs root (namespaces, bridges): run with sudo")
        for tool, fix in REQUIRED_TOOLS.items():
            if shutil.which(tool) is None:
                raise BackendUnavailable(f"mininet backend: `{tool}` not found; {fix}")
        probe = subprocess.run(
            [MININET_PYTHON, "-I", "-c", "import mininet.net, mininet.nodelib"],
            capture_output=True, text=True) if Path(MININET_PYTHON).exists() else None
        if probe is None or probe.returncode != 0:
            why = probe.stderr.strip().splitlines()[-1] if probe and probe.stderr.strip() else "not found"
            raise BackendUnavailable(
                f"mininet backend: {MININET_PYTHON} cannot import mininet ({why}); "
                f"apt-get install mininet bridge-utils, or set WANBENCH_MININET_PYTHON; "
                f"or use --backend tun")

    # ---- up ----

    def up(self) -> None:
        self.check_available()
        plan = self.plan
        if len(plan.nodes) > 1:
            check_pair(plan)  # fail before building anything if the plan cannot be checked
        existing = read_state(plan.prefix)
        if existing is not None:
            raise netns.SystemCheckError(
                f"a network ({existing[0].get('backend')}) is already up under prefix {plan.prefix}; "
                f"run 'wanbench down' first")
        leftovers = netns.list_namespaces(plan.prefix) + our_root_links(plan.prefix)
        if leftovers:
            raise netns.SystemCheckError(f"objects with prefix {plan.prefix} exist ({', '.join(leftovers[:5])}); "
                               f"run 'wanbench clean'")
        netns.check_address_pool_free(plan.address_pool)
        netns.check_node_sysctls(plan)
        try:
            pids = self._start_driver()
            self._attach_namespaces(pids)
            self._configure_nodes()
            # Our holders (own hostname, IPC, PID space, mounts, cgroups) in Mininet's namespaces:
            # `wanbench exec`, verify and the harness enter a node through them, as on tun and tc.
            nodes.start(plan)
            tc_errors = self._shape()
            self._check(tc_errors)
        except BaseException:
            self.down()
            raise

    def _start_driver(self) -> dict[str, int]:
        """Start the driver, send it the spec, wait for its ready line; return Mininet name -> PID."""
        folder = self.state_dir(self.plan.prefix)
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / "mininet-driver.log"
        with open(log_path, "w") as log:
            # start_new_session: the driver must not get the terminal's Ctrl-C after `up` returns.
            self._driver = subprocess.Popen(
                driver_argv("serve", self.plan.prefix), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, start_new_session=True)
        # Recorded before anything else, so a `down` from another process finds it if we die now.
        self.write_state(driver_pid=self._driver.pid, pids={})
        try:
            self._driver.stdin.write(json.dumps(driver_spec(self.plan)).encode())
            self._driver.stdin.close()
        except BrokenPipeError:
            pass  # it died at start; its log says why, and the missing ready line reports it below
        timeout_s = READY_TIMEOUT_BASE_S + READY_TIMEOUT_PER_NODE_S * len(self.plan.nodes)
        ready, _, _ = select.select([self._driver.stdout], [], [], timeout_s)
        line = self._driver.stdout.readline() if ready else b""
        self._driver.stdout.close()
        try:
            report = json.loads(line) if line else {}
        except ValueError:
            report = {}
        if not report.get("ready"):
            tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
            why = report.get("error") or (f"no answer in {timeout_s:g} s" if not ready else "it exited")
            raise tc.CommandFailed(f"mininet backend: the Mininet driver failed: {why}"
                               + (f" (log {log_path}: {' | '.join(tail)})" if tail else ""))
        pids = {name: int(pid) for name, pid in report["pids"].items()}
        self.write_state(
            driver_pid=self._driver.pid, pids=pids,
            # For `nsenter -t PID -n` (the namespaces are also attached by name for `ip netns exec`).
            host_pids={node.name: pids[host_name(self.plan, node)] for node in self.plan.nodes})
        return pids

    def _attach_namespaces(self, pids: dict[str, int]) -> None:
        """Give each host's namespace the plan's name, in one `ip -batch` process."""
        script = "".join(f"netns attach {node.namespace} {pids[host_name(self.plan, node)]}\n"
                         for node in self.plan.nodes)
        result = subprocess.run(["ip", "-batch", "-"], input=script, capture_output=True, text=True)
        if result.returncode != 0:
            raise tc.CommandFailed(f"ip -batch - (netns attach): {' '.join(result.stderr.split())}")

    def _configure_nodes(self) -> None:
        """Hosts file and the plan's sysctls in every node namespace (as netns.create_node does)."""
        hosts = self.plan.hosts_file()
        for node in self.plan.nodes:
            etc = netns.NETNS_ETC_DIR / node.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            netns.apply_sysctls(self.plan, node)

    def _shape(self) -> dict[str, str]:
        """Run every host's tc batch and the switch ports' batch (in parallel); return what -> tc's
        error, for failures."""
        running = []
        for node in self.plan.nodes:
            proc = subprocess.Popen(["tc", "-n", node.namespace, "-batch", "-"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            running.append((node.name, proc, shaping_batch(self.plan, node)))
        proc = subprocess.Popen(["tc", "-batch", "-"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        running.append((switch_name(self.plan), proc, bottleneck_batch(self.plan)))
        errors = {}
        for name, proc, script in running:
            _, err = proc.communicate(script)
            if proc.returncode != 0:
                errors[name] = " ".join(err.split()) or f"exit {proc.returncode}"
        return errors

    def counters(self, fresh: bool = False) -> list[dict]:
        """Per-pair counters read from the kernel now (`tc -s -j qdisc show`), as the tc backend's:
        always fresh."""
        try:
            core_stats = {dst.name: tc.read_json(["tc", "-s", "-j", "qdisc", "show", "dev",
                                                  port_name(self.plan, dst)]) for dst in self.plan.nodes}
            delay_stats = {src.name: tc.read_json(["tc", "-s", "-j", "-n", src.namespace, "qdisc", "show",
                                                   "dev", HOST_IFNAME]) for src in self.plan.nodes}
        except (tc.CommandFailed, ValueError):
            return []
        return tc.pair_counters(self.plan, core_stats, delay_stats)

    def _check(self, tc_errors: dict[str, str]) -> None:
        """Measure the RTT of the largest-delay pair; raise unless the configured delay is there."""
        if len(self.plan.nodes) < 2:
            if tc_errors:
                raise tc.CommandFailed(f"mininet backend: tc -batch failed: {tc_errors}")
            return
        src, dst = check_pair(self.plan)
        expected, lowest = expected_rtt_ms(self.plan, src, dst)
        deadline_s = math.ceil(PING_COUNT * PING_INTERVAL_S + 2 * expected / 1000.0 + 3)
        argv = netns.exec_argv(src, ["ping", "-n", "-c", str(PING_COUNT), "-i", str(PING_INTERVAL_S),
                                     "-w", str(deadline_s), dst.address])
        result = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s + 5)
        rtts = parse_ping_rtts_ms(result.stdout)
        if not rtts:
            raise tc.CommandFailed(f"mininet backend: no ping reply from {dst.name} to {src.name} "
                               f"({result.stdout.strip()[-200:] or result.stderr.strip()})")
        measured = min(rtts)
        no_netem = any(NO_NETEM_MARK in err for err in tc_errors.values())
        if no_netem or not delay_applied(lowest, measured):
            raise DelayNotApplied(no_delay_message(src, dst, expected, measured, tc_errors))
        if tc_errors:
            name, err = next(iter(tc_errors.items()))
            raise tc.CommandFailed(f"mininet backend: tc -batch on {name} failed: {err}")

    # ---- down ----

    def down(self) -> None:
        """Stop the driver and every shell by PID, remove namespaces, links and state. Idempotent."""
        prefix = self.plan.prefix
        stored = read_state(prefix)
        info = stored[0] if stored and stored[0].get("backend") == self.name else {}
        pattern = shell_pattern(prefix)
        recorded = [pid for pid in info.get("pids", {}).values() if pattern.search(cmdline(pid))]
        # Every process of the nodes but Mininet's own shells (the driver ends those): the holders
        # with all they run, then anything else put in the namespaces (e.g. by `ip netns exec`).
        nodes.stop(self.plan)
        netns.end_processes((node.namespace for node in self.plan.nodes),
                            spare=set(recorded) | set(our_shell_pids(prefix)))
        # Detach the names first: a namespace then dies with the last process inside it.
        for node in self.plan.nodes:
            netns.remove_namespace(node.namespace)
        driver_pid = info.get("driver_pid") or (self._driver.pid if self._driver else None)
        stop_timeout_s = STOP_TIMEOUT_BASE_S + STOP_TIMEOUT_PER_NODE_S * len(self.plan.nodes)
        if driver_pid and alive(driver_pid) and is_our_driver(driver_pid, prefix):
            send_signal(driver_pid, signal.SIGTERM)  # Mininet's stop: links, bridge, shells
            for pid in wait_gone([driver_pid], stop_timeout_s):
                send_signal(pid, signal.SIGKILL)
        if self._driver is not None:
            self._driver.wait()  # reap our child
            self._driver = None
        # Shells the driver did not end (it was killed or crashed): the PIDs we recorded plus any
        # shell named with our prefix, each checked against its command line, killed by PID.
        shells = sorted(set(recorded) | set(our_shell_pids(prefix)))
        for pid in shells:
            send_signal(pid, signal.SIGKILL)
        wait_gone(shells, 2.0)
        with IPRoute() as ipr:
            for name in our_root_links(prefix):
                try:
                    ipr.link("del", ifname=name)
                except Exception:  # noqa: BLE001  (gone already with its veth peer)
                    pass
        clear_state(prefix)
