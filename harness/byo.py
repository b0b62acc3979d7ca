"""A user's own training script (`command:` in a scenario): where it runs, what it sees, how its
failure is told, and what the job record says of the network stack it ran on.

- `check_command_paths`: a scenario's `cwd:` and `mounts:` (relative to the scenario's folder),
  checked when the scenario is read: a missing one is a ConfigError (one line, exit 2) before
  anything is built.
- `shares_for` / `command_environment`: what a command's ranks get besides the trainers' env: the
  scenario's folder and mounts visible in the node, PATH with the venv's bin/ first.
- `failure_lines`: per failed job, the first rank that failed, its log and its last error line.
- `node_stack`: the congestion control and TCP sysctls in force inside each node, read there.
- `report_lines`: the report's section on each job's wall time, network stack and wire pairs.

The script itself needs none of this: docs/BYO_SCRIPT.md; `trainers/byo.py` is the optional
helper a script imports to write records in the trainers' format.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Iterable, Optional

from emulator.schema import ConfigError
from emulator.visibility import NotVisibleError, check_visible, path_with_venv_first
from trainers.jsonl import read_complete_records

# Read inside every node for job.json: what decides how TCP behaves on the emulated WAN.
STACK_SYSCTLS = ("net.ipv4.tcp_congestion_control", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem",
                 "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat",
                 "net.ipv4.tcp_no_metrics_save", "net.core.default_qdisc")
SYSCTL_TIMEOUT_S = 10.0
# A traceback's last line names the error; torchrun's own summary (ChildFailedError) follows the
# failing worker's and says less.
ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*)?(Error|Exception|Interrupt|Exit)\b(:|$)")
LAUNCHER_ERRORS = ("ChildFailedError",)
# torch's "[rank1]: " and torchrun --tee's "[default0]:" in front of what a rank printed
RANK_PREFIX = re.compile(r"^\[[^\]]*\]:\s*")
RANK_EXIT = re.compile(r"rank (\d+) exited (-?\d+)")
# what the reason says of one rank's exit, e.g. "rank 1 exited -9 (injected node_crash at 12.2 s)"
RANK_EXIT_NOTE = r"rank {rank} exited -?\d+ \(([^)]*)\)"
# An error that says a peer went away first: the consequence of another rank's failure, not the
# cause (gloo's "Connection closed by peer ... typically caused by a remote worker crashing",
# a reset or broken pipe, NCCL's remote error, our tcp comm's PeerLost).
PEER_LOSS = re.compile(r"closed by peer|reset by peer|Broken pipe|remote (worker|process|peer)|PeerLost"
                       r"|NCCL.*remote", re.IGNORECASE)
# How wide the report's table of one job's wire pairs gets.
MAX_PAIR_ROWS = 12


def scenario_folder(source: str) -> str:
    """The folder of the scenario file `source` (the working folder for one read from no file)."""
    return str(Path(source).absolute().parent) if source and Path(source).is_file() else os.getcwd()


def check_command_paths(cwd: Optional[str], mounts: Iterable[str], source: str) -> tuple[Optional[str], list[str]]:
    """`cwd:` and `mounts:` as absolute folders (relative ones from the scenario's folder), each
    checked to exist and to be one a node can be given; ConfigError names the file and field."""
    base = Path(scenario_folder(source))

    def absolute(path: str) -> str:
        return os.path.normpath(base / os.path.expanduser(path))

    checked_cwd = None
    if cwd is not None:
        checked_cwd = absolute(cwd)
        try:
            check_visible([checked_cwd])
        except NotVisibleError as exc:
            raise ConfigError("cwd", str(exc), source=source) from None
    checked_mounts = []
    for index, mount in enumerate(mounts):
        path = absolute(mount)
        try:
            check_visible([path])
        except NotVisibleError as exc:
            raise ConfigError(f"mounts[{index}]", str(exc), source=source) from None
        checked_mounts.append(path)
    return checked_cwd, checked_mounts


def shares_for(job) -> list[str]:
    """Folders a job's ranks must see besides the defaults (emulator/visibility.py): the
    scenario's folder (the script beside it), its mounts and cwd."""
    extra = [*getattr(job, "mounts", ()), getattr(job, "cwd", None)]
    return [folder for folder in extra if folder]


def command_environment(env: dict) -> dict:
    """A rank's environment with PATH as a user's with the venv active (torchrun, python: ours)."""
    return {**env, "PATH": path_with_venv_first(env.get("PATH"))}


# Why a job failed -------------------------------------------------------------------------------
def error_line(log: Path) -> str:
    """The line of a rank's log that says what went wrong: the last error a traceback ends with
    (not a launcher's summary of it), else the last line with text in it; "" for an empty log."""
    try:
        lines = [RANK_PREFIX.sub("", line.strip()) for line in log.read_text(errors="replace").splitlines()]
        lines = [line for line in lines if line]
    except OSError:
        return ""
    errors = [line for line in lines if ERROR_LINE.match(line) and not line.startswith(LAUNCHER_ERRORS)
              and not any(line.split(":", 1)[0].endswith(name) for name in LAUNCHER_ERRORS)]
    if errors:
        return errors[-1]
    texts = [line for line in lines if re.search(r"\w", line)]
    return texts[-1] if texts else ""


def first_failed_rank(job_dir: Path, reason: str) -> Optional[tuple[int, int]]:
    """(rank, exit code) of the rank that failed first: of those the job's reason names as
    exiting in error on their own, one whose error is not a peer's loss (PEER_LOSS: that is
    the consequence) and, among those, the one whose log was last written earliest.

    The error comes first because the times alone do not order two ranks that end within a few
    milliseconds (a crashed rank's log is written as it dies, its peer's as it notices, and a
    file's time has the kernel's coarse clock)."""
    failed = [(int(rank), int(code)) for rank, code in RANK_EXIT.findall(reason or "") if code != "0"]
    if not failed:
        return None

    def order(item):
        log = Path(job_dir) / f"rank{item[0]}.log"
        try:
            ended = log.stat().st_mtime
        except OSError:
            ended = float("inf")
        return (bool(PEER_LOSS.search(error_line(log))), ended, item[0])

    return min(failed, key=order)


def failure_lines(job_dir: Path, status: str, reason: str) -> list[str]:
    """What the console says of a job that did not end ok: the first rank that failed, its log
    and the log's error line (or, for a stall or a timeout, the reason)."""
    if status == "ok":
        return []
    first = first_failed_rank(job_dir, reason)
    if first is None:
        return [f"{status}: {reason}"] if reason else [status]
    rank, code = first
    log = Path(job_dir) / f"rank{rank}.log"
    if code < 0:  # ended by a signal: its log ends wherever it was, the signal is the error...
        note = re.search(RANK_EXIT_NOTE.format(rank=rank), reason or "")
        line = f"killed by signal {-code}" + (f" ({note.group(1)})" if note else "")
        raised = error_line(log)
        if note is None and ERROR_LINE.match(raised):
            # ...unless it raised first and the signal came as it exited (an abort in a
            # library's teardown after the traceback): the exception is what went wrong
            line = f"{raised} (then signal {-code} as it exited)"
    else:
        line = error_line(log) or "(the log is empty)"
    return [f"first failed: rank {rank} (exit {code}), log {log}", f"error: {line}"]


# The network stack a job ran on ---------------------------------------------------------------
def parse_sysctl(text: str) -> dict[str, str]:
    """`sysctl` output ("key = value" lines) as a mapping; values' inner whitespace made single."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = " ".join(value.split())
    return found


def node_stack(plan, names: Iterable[str] = STACK_SYSCTLS) -> dict:
    """The sysctls in force inside each node, read there (`sysctl` in the node), and the values
    every node shares: {"sysctls": {key: value or "mixed"}, "nodes": {node: {key: value}}}.
    Every key the plan sets (`node_sysctls` included) is read besides `names`."""
    from emulator.netns import exec_argv

    import shutil

    names = list(dict.fromkeys([*names, *plan.sysctls()]))
    # sbin is not on every user's PATH (a `sudo` keeps it, a plain shell may not)
    sysctl = shutil.which("sysctl", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))
    if sysctl is None:
        return {"sysctls": {}, "nodes": {}, "error": "no sysctl program (procps) on this machine"}
    try:
        procs = {node.name: subprocess.Popen(exec_argv(node, [sysctl, "-e", *names]), stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, text=True)
                 for node in plan.nodes}
    except (OSError, RuntimeError) as exc:  # a record of the job's setting, never a reason to fail it
        return {"sysctls": {}, "nodes": {}, "error": str(exc)}
    nodes = {}
    for name, proc in procs.items():
        try:
            out, _ = proc.communicate(timeout=SYSCTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        nodes[name] = parse_sysctl(out or "")
    common = {}
    for key in names:
        values = {values.get(key) for values in nodes.values()} - {None}
        if values:
            common[key] = values.pop() if len(values) == 1 else "mixed"
    return {"sysctls": common, "nodes": nodes}


def congestion_control(job: dict) -> Optional[str]:
    """A job record's congestion control in force in its nodes, or None where it was not read."""
    return ((job.get("node_stack") or {}).get("sysctls") or {}).get("net.ipv4.tcp_congestion_control")


def has_values(frame, column: str) -> bool:
    """Whether a records frame has `column` with a value in it (a user's script writes only some)."""
    return column in frame and frame[column].notna().any()


# The report ----------------------------------------------------------------------------------
def _bytes(value) -> str:
    for factor, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {unit}"
    return f"{value:.0f} B"


def report_lines(jobs) -> list[str]:
    """Markdown: per job (a run's JobDir folders, harness/rundir.py), its wall time, the network
    stack in its nodes, and the bytes each pair of nodes put on the emulated wire (the busiest
    first); [] when no job says any of it."""
    lines = []
    for job_dir in jobs:
        job = job_dir.info
        stack = (job.get("node_stack") or {}).get("sysctls") or {}
        pairs = job_dir.wire.get("pairs") or []
        if not stack and not pairs:
            continue
        wall = job.get("wall_s")
        lines += [f"- `{job_dir.job_id}`: {job.get('status', '?')}"
                  + (f", wall time {wall:.1f} s" if isinstance(wall, (int, float)) else "")
                  + ("; in the nodes: " + ", ".join(f"{k.split('.')[-1]} {v}" for k, v in stack.items())
                     if stack else "")]
        busiest = sorted((p for p in pairs if p.get("bytes")), key=lambda p: -p["bytes"])[:MAX_PAIR_ROWS]
        if busiest:
            lines.append("  - wire bytes per pair: " + ", ".join(
                f"{p.get('src')}->{p.get('dst')} {_bytes(p['bytes'])}" for p in busiest)
                + (f" (and {len(pairs) - len(busiest)} more)" if len(pairs) > len(busiest) else ""))
    if not lines:
        return []
    return ["## Jobs: wall time, network stack in the nodes, wire bytes per pair", "", *lines, ""]


# A script run by hand (`wanbench up` + `wanbench exec NODE -- torchrun ...`) -------------------
BY_HAND_RUN = "wanbench-run"  # the run directory `report` makes inside a folder of records


def _records_wall_s(rank_files: list[Path]) -> Optional[float]:
    """From the first writer's creation to the last record, over every rank file (wall clock)."""
    starts, ends = [], []
    for path in rank_files:
        for record in read_complete_records(path):
            if record.get("time_unix") is not None:
                ends.append(record["time_unix"])
                if record.get("time_s") is not None:
                    starts.append(record["time_unix"] - record["time_s"])
    return round(max(ends) - min(starts), 3) if starts and ends else None


def run_dir_of(path) -> Path:
    """`path` as `wanbench report` takes it: a run directory as it is; a folder of a script's
    records (rank<N>.jsonl, the WANBENCH_OUTPUT_DIR of a run by hand) made into a one-job run
    directory inside it (`<path>/wanbench-run/`, made afresh each time), with the network that is
    up now (its plan, the congestion control in its nodes, the bytes its pairs carried since `up`)
    when one is."""
    folder = Path(path)
    rank_files = sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []
    if (folder / "scenario.json").is_file() or not rank_files:
        return folder
    import shutil

    from emulator.backends import REGISTRY, read_state
    from emulator.files import write_json_atomic
    from emulator.measure.counters import pair_deltas, traffic_by_node
    from emulator.plan import prefix

    run_dir = folder / BY_HAND_RUN
    shutil.rmtree(run_dir, ignore_errors=True)
    state = read_state(prefix())
    plan = state[1] if state is not None else None
    network_key = plan.topology_name if plan is not None else "by-hand"
    job_dir = run_dir / "jobs" / folder.name
    job_dir.mkdir(parents=True)
    for rank_file in rank_files:
        shutil.copy2(rank_file, job_dir / rank_file.name)
    record = {"job_id": folder.name, "status": "ok", "wall_s": _records_wall_s(rank_files),
              "reason": "a script run by hand (wanbench exec): its exit was not watched",
              "label": folder.name, "algorithm": "command", "seed": None,
              "network": {"delay_scale": None, "rate": None}, "network_key": network_key,
              "nodes": len(rank_files)}
    if plan is not None:
        (run_dir / network_key).mkdir()
        (run_dir / network_key / "plan.json").write_text(plan.to_json())
        record["node_stack"] = node_stack(plan)
        record["backend"] = state[0].get("backend")
        try:
            after = REGISTRY[state[0]["backend"]](plan).counters(fresh=True) or []
        except (OSError, RuntimeError, TypeError):
            after = []
        if after:
            nodes = traffic_by_node([], after)
            for name, traffic in nodes.items():
                traffic["rank"] = plan.node(name).rank
            write_json_atomic(job_dir / "wire.json", {"source": "backend counters since up", "nodes": nodes,
                                                      "pairs": pair_deltas([], after)})
    write_json_atomic(job_dir / "job.json", record)
    write_json_atomic(run_dir / "scenario.json", {"name": folder.name, "source_file": None,
                                                  "spec": {"stop": {}, "time_dilation": 1.0}, "jobs": []})
    (run_dir / "COMPLETE").write_text("records of a script run by hand\n")
    return run_dir
