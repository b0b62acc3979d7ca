"""The `wanbench` command: up, down, exec, verify, run, report, export, evidence, regress, shape, unshape, launch, status, clean.

Input files are validated before anything privileged happens; a bad file is one line on stderr
naming the file and field, exit code 2. A system problem (not root, no TUN, no netem) is one line
saying how to fix it, exit code 3. A run whose jobs did not all end ok exits 4 (its results and
report are written; the console named each failed job's first failed rank, log and error line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from emulator import cgroups
from emulator import clean as clean_mod
from emulator.backends import REGISTRY, BackendUnavailable, choose_backend, read_state
from emulator.dilation import check_time_dilation
from emulator.helpers import network_owner
from emulator.netns import SystemCheckError, check_root, exec_argv
from emulator.plan import TEST_PREFIX_PATTERN, Plan, checked_prefix, make_plan, prefix
from emulator.schema import ConfigError
from emulator.units import UnitError, parse_rate_bit_s
from emulator.visibility import path_with_venv_first

from .console import Interrupted, print_path, stderr_console, stdout_console, teardown_on_signals
from .inputs import topology_of

EXIT_BAD_INPUT = 2
EXIT_SYSTEM = 3
EXIT_JOB_FAILED = 4


def backend_for(name: str, plan: Plan):
    """The backend for `--backend NAME` built on `plan`; says why when `auto` chose."""
    cls, reason = choose_backend(name)
    if reason:
        stderr_console().print(f"backend {reason}")
    return cls(plan)


def refuse_sim(backend: str, command: str) -> None:
    """`up` and `verify` build a real network; sim has none (ConfigError: one line, exit 2)."""
    if backend == "sim":
        raise ConfigError("", f"sim has no network to bring up ({command} builds a real one): use "
                          "'wanbench run SCENARIO --backend sim'", source="--backend")


def load_plan(args) -> Plan:
    """Validate the file and the sweep options into a plan (no privileged step)."""
    topology = topology_of(args.file)
    rate = None
    if getattr(args, "rate", None):
        try:
            rate = parse_rate_bit_s(args.rate)
        except UnitError as exc:
            raise ConfigError("", str(exc), source="--rate") from None
    if args.delay_scale < 0:
        raise ConfigError("", f"must be >= 0, got {args.delay_scale}", source="--delay-scale")
    if args.delay_scale != 1.0 or rate is not None:
        topology = topology.scaled(args.delay_scale, rate)
    cpu_share = getattr(args, "cpu_share", None)
    if cpu_share is not None and not 0 < cpu_share <= 1024:
        raise ConfigError("", f"must be in (0, 1024] cores, got {cpu_share}", source="--cpu-share")
    try:
        dilation = check_time_dilation(args.time_dilation)
    except ValueError as exc:
        raise ConfigError("", str(exc), source="--time-dilation") from None
    return make_plan(topology, cpu_share=cpu_share, time_dilation=dilation)


def _print_plan(plan: Plan, backend: str) -> None:
    from rich.table import Table

    table = Table(title=f"{plan.topology_name}: {len(plan.nodes)} nodes, backend {backend}")
    for column in ("node", "address", "namespace"):
        table.add_column(column)
    for node in plan.nodes:
        table.add_row(node.name, node.address, node.namespace)
    stderr_console().print(table)


def cmd_up(args) -> int:
    refuse_sim(args.backend, "up")
    plan = load_plan(args)
    if args.dry_run:
        from emulator.backends import tc

        if args.backend not in ("tc", "auto"):
            raise SystemExit(f"--dry-run prints the tc backend's script; got --backend {args.backend}")
        sys.stdout.write(tc.script(plan))
        return 0
    existing = read_state(plan.prefix)
    if existing is not None:
        raise SystemCheckError(f"a network is already up under prefix {plan.prefix!r} "
                               f"({existing[1].topology_name}); run 'wanbench down' first")
    backend = backend_for(args.backend, plan)
    with teardown_on_signals():
        backend.up()
        if plan.cpu_share is not None:
            try:  # on the node's own groups, which the backend made and its down removes
                for node in plan.nodes:
                    cgroups.set_cpu_limit(cgroups.create(plan.prefix, node.name), plan.cpu_share)
            except BaseException:
                backend.down()
                raise
    _print_plan(plan, backend.name)
    stderr_console().print("network is up; 'wanbench exec NODE -- CMD' runs inside a node; 'wanbench down' ends it")
    return 0


def cmd_down(args) -> int:
    user = network_owner(prefix())
    if user is not None:  # a run's network: tearing it down under the run fails its jobs
        raise SystemCheckError(f"the network under prefix {prefix()!r} belongs to run process {user}, which "
                               f"still runs: end that run (Ctrl-C, or kill {user}); it takes its network down")
    state = read_state(prefix())
    if state is None:
        stderr_console().print(f"no network is up under prefix {prefix()!r} (leftovers: 'wanbench clean')")
        return 0
    info, plan = state
    REGISTRY[info["backend"]](plan).down()  # every process of the nodes, then their cgroups
    stderr_console().print(f"{plan.topology_name}: down")
    return 0


def cmd_exec(args) -> int:
    state = read_state(prefix())
    if state is None:
        raise SystemCheckError("no network is up: run 'wanbench up TOPOLOGY' first (backend sim builds "
                               "none to enter: it simulates one inside 'wanbench run')")
    _, plan = state
    try:
        node = plan.node(args.node)
    except KeyError as exc:
        raise ConfigError("node", exc.args[0], source="exec") from None
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not argv:
        raise ConfigError("command", "give a command after the node name, e.g. -- ping tokyo-0", source="exec")
    # a script's records folder (trainers/byo.py) must be the host's, not the node's private /tmp
    output_dir = os.environ.get("WANBENCH_OUTPUT_DIR")
    if output_dir:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    try:
        inside = exec_argv(node, argv, share=[output_dir] if output_dir else [])
    except RuntimeError as exc:
        raise SystemCheckError(f"{exc} (leftovers: 'wanbench clean')") from None
    # the user's PATH with our venv's bin/ first: `python`, `torchrun` in the node are the ones
    # wanbench runs with (emulator/visibility.py carries that venv in, wherever it lives)
    os.environ["PATH"] = path_with_venv_first(os.environ.get("PATH"))
    os.execvp(inside[0], inside)  # replaces this process: exit code and signals pass through


def _verify_table(rows: list[dict], title: str):
    from rich.table import Table

    dilation = rows[0].get("time_dilation", 1.0) if rows else 1.0
    if dilation != 1.0:
        title += f" (time dilation {dilation:g}: the network is {dilation:g}x slower than the topology; " \
                 "emulated = measured / K for times, x K for rates)"

    def error(row, key):
        return "-" if row.get(key) is None else f"{row[key]:+.3f}"

    table = Table(title=title, caption="err: measured - spec - the prober's own base; dense: probes "
                  "back to back, sparse: ping-like (the delay line sleeps between them); rate: TCP "
                  "steady state (slow start omitted)")
    for column in ("src", "dst", "RTT spec ms", "dense p50 ms", "p50 err", "p99 err",
                   "sparse p50 err", "p99 err", "rate spec Mbit/s", "rate Mbit/s", "%", "cc"):
        table.add_column(column, justify="right")
    if dilation != 1.0:
        for column in ("emulated RTT spec ms", "emulated RTT p50 ms", "emulated rate spec", "emulated rate"):
            table.add_column(column, justify="right")
    for r in rows:
        rate = r["rate_mbit"]
        cells = [r["src"], r["dst"], f"{r['rtt_spec_ms']:.2f}", f"{r['rtt_p50_ms']:.3f}",
                 error(r, "rtt_p50_error_ms"), error(r, "rtt_p99_error_ms"),
                 error(r, "rtt_sparse_p50_error_ms"), error(r, "rtt_sparse_p99_error_ms"),
                 f"{r['rate_spec_mbit']:g}", "-" if rate is None else f"{rate:.1f}",
                 "-" if rate is None else f"{100 * rate / r['rate_spec_mbit']:.1f}",
                 r.get("congestion", "-")]
        if dilation != 1.0:
            emulated_rate = r.get("rate_emulated_mbit")
            cells += [f"{r['rtt_emulated_spec_ms']:.2f}", f"{r['rtt_emulated_p50_ms']:.3f}",
                      f"{r['rate_emulated_spec_mbit']:g}", "-" if emulated_rate is None else f"{emulated_rate:.1f}"]
        table.add_row(*cells)
    return table


def cmd_verify(args) -> int:
    from emulator.measure.verify import VerifyOptions, rate_warnings, verify

    refuse_sim(args.backend, "verify")
    plan = load_plan(args)
    try:
        options = VerifyOptions(probes=args.probes, sparse_probes=args.sparse_probes,
                                sparse_interval_ms=args.sparse_interval_ms,
                                throughput=not args.no_throughput, duration_s=args.duration,
                                omit_s=args.omit, congestion=args.congestion)
    except ValueError as exc:
        raise ConfigError("", str(exc), source="verify") from None
    if read_state(plan.prefix) is not None:
        raise SystemCheckError(f"a network is already up under prefix {plan.prefix!r}; 'wanbench down' first")
    backend = backend_for(args.backend, plan)
    console = stderr_console()
    with teardown_on_signals():
        backend.up()
        try:
            with console.status("measuring") as status:
                rows = verify(plan, options, progress=lambda what: status.update(f"measuring {what}"))
        finally:
            backend.down()
    if args.json:
        print(json.dumps(rows))
    else:
        stdout_console().print(_verify_table(rows, f"{plan.topology_name} on {backend.name}: spec vs measured"))
    for line in rate_warnings(rows, options.min_rate_ratio):
        console.print(f"[yellow]warning:[/] {line}")
    return 0


def cmd_run(args) -> int:
    from .results import summary_table
    from .paths import RUNS_ROOT
    from .run import refuse_cluster, resume_run, run_scenario
    from .scenario import AUTO_TIME_DILATION, load_scenario

    if args.jobs is not None and args.jobs < 1:
        raise ConfigError("", f"must be an integer >= 1, got {args.jobs}", source="--jobs")
    jobs = args.jobs if args.jobs is not None or args.cluster is not None else 1  # None: the cluster's threads
    if args.resume is not None:
        for option in ("time_dilation", "output"):
            if getattr(args, option) is not None:
                raise ConfigError("", "a resumed run keeps the run's own (leave it out)",
                                  source="--" + option.replace("_", "-"))
        from .rundir import RunDir

        resumed_backend = RunDir(args.resume).environment.get("backend", "sim")
        refuse_cluster(resumed_backend, args.cluster)  # before anything privileged
        if resumed_backend != "sim" and read_state(prefix()) is not None:
            raise SystemCheckError(f"a network is already up under prefix {prefix()!r}: 'wanbench clean' first "
                                   "(the killed run's network and ranks), or 'wanbench down' if it is yours")
        with teardown_on_signals():
            completed = resume_run(args.resume, args.file, args.backend, jobs=jobs, cluster=args.cluster)
        scenario_name = completed.run_dir.parent.name
    else:
        if args.file is None:
            raise ConfigError("", "give a scenario file, or --resume RUN_DIR", source="wanbench run")
        scenario = load_scenario(args.file)  # every check before anything privileged
        if args.time_dilation == AUTO_TIME_DILATION:
            scenario = scenario.with_time_dilation(AUTO_TIME_DILATION)  # ConfigError without a compute profile
        elif args.time_dilation is not None:
            try:
                scenario = scenario.with_time_dilation(check_time_dilation(float(args.time_dilation)))
            except ValueError as exc:
                raise ConfigError("", str(exc), source="--time-dilation") from None
        backend = args.backend or scenario.spec.backend
        refuse_cluster(backend, args.cluster)  # before anything privileged
        if backend != "sim" and read_state(prefix()) is not None:
            raise SystemCheckError(f"a network is already up under prefix {prefix()!r}; 'wanbench down' first")
        with teardown_on_signals():
            completed = run_scenario(scenario, backend, Path(args.output) if args.output else RUNS_ROOT, jobs=jobs,
                                     cluster=args.cluster)
        scenario_name = scenario.name
    run_dir = completed.run_dir
    out = stdout_console()
    out.print(summary_table(completed.summary, f"{scenario_name} {run_dir.name}", wide=args.wide,
                            width=terminal_table_width(out)))
    print_path(out, "run", run_dir)
    from .report import write_report

    outcome = write_report([run_dir], run_dir / "report", loaded={run_dir: completed.frames},
                           summaries={run_dir: completed.summary})
    print_report_paths(stderr_console(), outcome)
    code, lines = run_exit_code(completed.summary)
    for line in lines:
        print(line, file=sys.stderr)
    return code


def terminal_table_width(console) -> int:
    """100 columns, or the terminal's width where it is narrower (rich would otherwise drop the
    columns that do not fit off the right edge, unsaid)."""
    from .results import TERMINAL_WIDTH

    return min(TERMINAL_WIDTH, console.width)


# Up to this many training-progress figures are named one by one; more, and only their folder.
LISTED_PROGRESS_FIGURES = 3


def print_report_paths(console, outcome) -> None:
    """report.md, summary.csv and the figures, one path a line: the training-progress PNGs (for
    a single run the ones to look at) where there are few, then the figures' folder and count."""
    print_path(console, "report", outcome.markdown)
    print_path(console, "summary", outcome.combined_csv)
    if not outcome.figures:
        return
    progress = sorted(f for f in outcome.figures if f.suffix == ".png" and f.name.startswith("progress-"))
    if len(progress) <= LISTED_PROGRESS_FIGURES:
        for figure in progress:
            print_path(console, "figure", figure)
    folders = sorted({f.parent for f in outcome.figures})
    for folder in folders:
        count = sum(1 for f in outcome.figures if f.parent == folder)
        print_path(console, "figures", folder, f"({count} files, PNG and SVG)")


def run_exit_code(summary) -> tuple[int, list[str]]:
    """`wanbench run`'s exit code for a run's summary (0, or EXIT_JOB_FAILED when a job did not
    end ok) and the lines that say which. A tuning candidate that diverged or timed out is an
    outcome of tuning (tuning.json scores it, the pick skips it), not a failed run: said, but the
    exit code is the reported jobs' alone."""
    from .tuning import is_tuning

    not_ok = summary["status"] != "ok"
    lines = []
    if "phase" in summary:
        tuning = summary["phase"].map(is_tuning).astype(bool)
        dropped = summary[not_ok & tuning]
        if len(dropped):
            lines.append(f"wanbench: {len(dropped)} tuning candidate(s) did not end ok (never picked): "
                         + ", ".join(f"{r['label']} ({r['tuned']}) at {r['network']} ({r['status']})"
                                     for r in dropped.to_dict("records")))
        not_ok = not_ok & ~tuning
    failed = summary[not_ok]
    if len(failed):
        lines.append(f"wanbench: {len(failed)} of {len(summary)} jobs did not end ok: "
                     + ", ".join(f"{r['label']} seed {r['seed']} at {r['network']} ({r['status']})"
                                 for r in failed.to_dict("records")))
        return EXIT_JOB_FAILED, lines
    return 0, lines


def cmd_shape(args) -> int:
    from emulator.backends import tc

    from .hosts import check_host, load_hosts

    hosts = load_hosts(args.hosts_file)
    check_host(hosts, args.host)
    dev = args.dev or hosts.spec.interface
    if not dev:
        raise ConfigError("--dev", f"no device to shape: give --dev or `interface:` in {args.hosts_file}",
                          source="wanbench shape")
    cmds = tc.host_stage(dev, hosts.destinations(args.host))
    if args.dry_run:
        print(tc.host_script(dev, cmds, f"wanbench shape: {args.host} ({hosts.spec.hosts[args.host].region}) "
                                        f"of {hosts.topology.name}, {len(hosts.names) - 1} destinations on {dev}"),
              end="")
        return 0
    check_root()
    tc.apply_host(dev, cmds)
    stderr_console().print(f"{dev} shaped for {args.host}: {len(hosts.names) - 1} destinations "
                           f"('wanbench unshape --dev {dev}' removes it)")
    return 0


def cmd_unshape(args) -> int:
    from emulator.backends import tc

    check_root()
    removed = tc.remove_host(args.dev)
    stderr_console().print(f"{args.dev}: " + ("shaping removed" if removed else "nothing of wanbench's to remove"))
    return 0


def cmd_launch(args) -> int:
    from .hosts import load_hosts, write_launch
    from .scenario import load_scenario

    hosts = load_hosts(args.hosts_file)
    scenario = load_scenario(args.scenario)
    first_point = scenario.network_points()[0]
    jobs = [job for job in scenario.jobs if job.network == first_point and job.command is None]
    out = Path(args.out)
    # the topology's node_sysctls (the hosts file's topology), then the scenario's, key by key
    sysctls = {**dict(hosts.topology.node_sysctls), **scenario.spec.node_sysctls}
    folders = write_launch(hosts, jobs, out, interface=args.dev, sysctls=sysctls)
    console = stderr_console()
    console.print(f"{len(folders)} jobs written under {out}/ (config.json, ssh.sh, slurm.sbatch each); "
                  f"{len(hosts.names)} hosts, rank = order in {args.hosts_file}")
    if sysctls:
        console.print("node_sysctls set host-wide by the scripts for each job's length, then restored: "
                      + ", ".join(f"{k}={v}" for k, v in sysctls.items()))
    if len(scenario.network_points()) > 1:
        console.print("[yellow]note:[/] the scenario sweeps the network; only its first point's jobs "
                      "were written (real hosts have one network)")
    return 0


def cmd_status(args) -> int:
    state = read_state(prefix())
    if state is None:
        print(f"no network is up under prefix {prefix()!r}")
        return 0
    info, plan = state
    _print_plan(plan, info["backend"])
    counters = REGISTRY[info["backend"]](plan).counters()
    if counters:
        print(json.dumps(counters, indent=1))
    return 0


def cmd_clean(args) -> int:
    from .paths import RUNS_ROOT
    from .run import remove_orphaned_partials
    prefixes = [checked_prefix(value, "--prefix", "command line") for value in args.prefix or []]
    if args.test_prefixes:
        found = clean_mod.leftover_prefixes(TEST_PREFIX_PATTERN)
        stderr_console().print(f"clean: test prefixes with leftovers: {', '.join(found) if found else 'none'}")
        prefixes += found
    removed = []
    for value in dict.fromkeys(prefixes or [prefix()]):
        removed += clean_mod.clean(value)
    runs_root = Path(args.output) if args.output else RUNS_ROOT
    removed += [f"run folder {path}" for path in remove_orphaned_partials(runs_root)]
    stderr_console().print(f"clean: removed {len(removed)} object(s)" + (": " + ", ".join(removed) if removed else ""))
    return 0


def cmd_report(args) -> int:
    from .report import default_out_dir, incomplete_message, write_report
    from .results import summary_table

    from .byo import run_dir_of

    run_dirs = [run_dir_of(path) for path in args.run_dirs]  # a folder of a script's records too
    outcome = write_report(run_dirs, Path(args.out) if args.out else default_out_dir(run_dirs))
    out = stdout_console()
    for run_name, rows in outcome.results.summary.groupby("run", sort=False):
        out.print(summary_table(rows, run_name, wide=args.wide, width=terminal_table_width(out)))
    console = stderr_console()
    for run in outcome.incomplete:
        console.print(f"[bold red]{incomplete_message(run)}[/]", soft_wrap=True)  # it names the run's path
    for name, why in outcome.skipped_figures.items():
        console.print(f"report: {name} not drawn: {why}")
    print_report_paths(console, outcome)
    return 0


def cmd_export(args) -> int:
    from .export import export_run

    made = export_run(args.run_dir, args.format, Path(args.out) if args.out else None)
    hint = f"; tensorboard --logdir {made.out_dir}" if args.format == "tensorboard" else ""
    # print, not the console: a path is not wrapped or read as markup
    print(f"export: {len(made.files)} {args.format} files in {made.out_dir} ({made.seconds:.2f} s){hint}",
          file=sys.stderr)
    return 0


def cmd_evidence(args) -> int:
    from .evidence import PAPERS_ROOT, write_evidence
    from .report import check_run_dir

    run_dir = check_run_dir(args.run_dir)
    if args.every < 1:
        raise ConfigError("", f"must be >= 1, got {args.every}", source="--every")
    made = write_evidence(run_dir, args.figure, Path(args.out) if args.out else PAPERS_ROOT, every=args.every,
                          command=args.run_command, note=args.note or "", name=args.name)
    stderr_console().print(f"evidence: {made.folder} ({made.jobs} jobs, {made.bytes / 1e3:.0f} kB)")
    return 0


def cmd_regress(args) -> int:
    from .regress import BASELINES, CI_SCENARIOS, regress

    if read_state(prefix()) is not None:
        raise SystemCheckError(f"a network is already up under prefix {prefix()!r}; 'wanbench down' first")
    with teardown_on_signals():
        return regress(Path(args.scenarios) if args.scenarios else CI_SCENARIOS,
                       Path(args.baselines) if args.baselines else BASELINES, backend=args.backend,
                       runs_root=Path(args.output) if args.output else None,
                       update_baselines=args.update_baselines)


WIDE_HELP = ("the terminal table with every headline column under its full name (default: the columns "
             "read first, fitted to 100 columns; summary.csv has them all)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wanbench", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    backends = ["auto", "tun", "tc", "mininet"]

    def network_args(p):
        p.add_argument("file", help="topology file (or a scenario file naming one)")
        # sim is accepted only to say why it cannot be: it has no network to bring up
        p.add_argument("--backend", choices=backends + ["sim"], default="auto",
                       help="auto: tc where the kernel has sch_netem, else tun (default)")
        p.add_argument("--delay-scale", type=float, default=1.0, metavar="K",
                       help="multiply every inter-region delay by K (a sweep point)")
        p.add_argument("--rate", metavar="RATE", help='set every inter-region rate, e.g. "100Mbit"')
        p.add_argument("--time-dilation", type=float, default=1.0, metavar="K",
                       help="slow the network K times: delays x K, rates / K (docs/TIME_DILATION.md)")

    p = sub.add_parser("up", help="build the emulated WAN and return to the shell")
    network_args(p)
    p.add_argument("--cpu-share", type=float, metavar="CORES",
                   help="limit what each node runs (wanbench exec) to this many cores (cgroup cpu quota)")
    p.add_argument("--dry-run", action="store_true", help="print the tc backend's script; change nothing")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="tear down what `up` built")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("exec", help="run a command inside a node: wanbench exec london-0 -- ping tokyo-0")
    p.add_argument("node")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("verify", help="build, measure every pair (RTT, TCP rate), print spec vs measured, tear down")
    network_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON array instead of a table")
    p.add_argument("--probes", type=int, default=200, help="dense RTT probes per pair, 5 ms apart (default 200)")
    p.add_argument("--sparse-probes", type=int, default=25,
                   help="sparse (ping-like) RTT probes per pair, all pairs at once (default 25; 0: none)")
    p.add_argument("--sparse-interval-ms", type=float, default=200.0,
                   help="time between sparse probes (default 200 ms: 5 Hz)")
    p.add_argument("--duration", type=float, default=5.0,
                   help="iperf3 measured seconds per pair, at least (default 5; 25 RTTs if longer)")
    p.add_argument("--omit", type=float, default=None,
                   help="iperf3 seconds omitted for slow start (default: 20 RTTs, at least 1)")
    p.add_argument("--congestion", default=None,
                   help="TCP congestion control for iperf3 -C (default: the namespace's, reported)")
    p.add_argument("--no-throughput", action="store_true", help="RTT only")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("run", help="run a scenario: build, verify, train every algorithm, compare, tear down")
    p.add_argument("file", nargs="?", help="scenario file (scenarios/*.yaml); with --resume, optional: checked "
                                           "against the run's saved scenario (default: the file the run names)")
    p.add_argument("--backend", choices=backends + ["sim"], default=None,
                   help="overrides the scenario's backend; sim: no network, the trainers on a virtual clock "
                        "over a simulated one (docs/SCENARIOS.md)")
    p.add_argument("--time-dilation", default=None, metavar="K",
                   help="overrides the scenario's time_dilation: network K times slower, reported times / K; "
                        "auto: K from this machine's measured step and the compute profile")
    p.add_argument("--output", help="runs folder (default results/runs)")
    p.add_argument("--resume", metavar="RUN_DIR", help="finish an interrupted run (results/runs/<scenario>/<run-id>): "
                                                       "re-run only its jobs that are not ok, keep the rest, then "
                                                       "write the summary and report as an uninterrupted run would")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="run N sim jobs at once, each its own process (default 1; results as one at a time); "
                        "emulated jobs run one at a time. With --cluster: tasks in flight (default: the "
                        "cluster's worker threads)")
    p.add_argument("--cluster", metavar="ADDRESS", default=None,
                   help="run each sim job as a task of the Dask cluster whose scheduler is at ADDRESS "
                        "(tcp://HOST:8786; needs dask[distributed]; docs/SCALE_OUT.md); sim backend only")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="summary tables (markdown, CSV) and figures (PNG, SVG) of run directories")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="results/runs/<scenario>/<run-id>")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/report for one run, "
                                                "else results/reports/<time>)")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("export", help="write a finished run's records as TensorBoard event files (one run per "
                                      "job) or Parquet tables (records and summary with the scenario's fields)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="results/runs/<scenario>/<run-id> (complete)")
    # checked by harness/export.py, not argparse: a bad format is one line and exit 2
    p.add_argument("--format", required=True, metavar="FORMAT", help="tensorboard or parquet")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN_DIR/export/<format>)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("evidence", help="copy a run's summary, scenario, job.json and thinned eval.jsonl files "
                                        "to results/papers/<figure>/<run-id>/ (a headline's committed evidence)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="results/runs/<scenario>/<run-id> (complete)")
    p.add_argument("--figure", required=True, metavar="NAME", help="the headline's folder under results/papers/")
    p.add_argument("--out", metavar="DIR", help="papers folder (default results/papers)")
    p.add_argument("--every", type=int, default=10, metavar="K",
                   help="keep every K-th evaluation, plus those the summary's numbers need (default 10)")
    p.add_argument("--run-command", metavar="CMD", help="the command that made the run, for the manifest")
    p.add_argument("--note", help="a sentence for the README (what was reduced, the machine's load)")
    p.add_argument("--name", help="the folder's name under the figure (default the run id; two runs of one "
                                  "second need two names)")
    p.set_defaults(func=cmd_evidence)

    p = sub.add_parser("regress", help="run scenarios/ci/*.yaml and compare with results/baselines/ (exit 1 on regression)")
    p.add_argument("--scenarios", metavar="DIR", help="scenario folder (default scenarios/ci)")
    p.add_argument("--baselines", metavar="DIR", help="baseline folder with tolerances.yaml (default results/baselines)")
    p.add_argument("--backend", choices=backends, default=None, help="overrides each scenario's backend")
    p.add_argument("--output", help="runs folder (default results/runs)")
    p.add_argument("--update-baselines", action="store_true", help="write each run's summary as the new baseline")
    p.set_defaults(func=cmd_regress)

    p = sub.add_parser("shape", help="shape a real host's interface for a hosts file's matrix (docs/REAL_HOSTS.md)")
    p.add_argument("hosts_file", metavar="HOSTS.yaml")
    p.add_argument("--host", required=True, help="which host of the file this is")
    p.add_argument("--dev", help="the interface to shape (default: the file's `interface:`)")
    p.add_argument("--dry-run", action="store_true", help="print the tc script; change nothing")
    p.set_defaults(func=cmd_shape)

    p = sub.add_parser("unshape", help="remove what `wanbench shape` added to an interface")
    p.add_argument("--dev", required=True)
    p.set_defaults(func=cmd_unshape)

    p = sub.add_parser("launch", help="write torchrun launch scripts (SSH, Slurm) for a scenario's jobs on real hosts")
    p.add_argument("hosts_file", metavar="HOSTS.yaml")
    p.add_argument("scenario", metavar="SCENARIO.yaml")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the jobs' configs and scripts")
    p.add_argument("--dev", help="the hosts' shaped interface for the trainers' traffic (default: the file's)")
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("status", help="what is up, with the backend's counters")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("clean", help="remove anything with our prefix that a crash left behind")
    p.add_argument("--prefix", action="append", metavar="PREFIX",
                   help="clean this prefix instead of WANBENCH_PREFIX's (repeatable)")
    p.add_argument("--test-prefixes", action="store_true",
                   help="also clean every test-suite prefix (wt + 4 hex digits) that still has leftovers; "
                        "only when no test run is going on")
    p.add_argument("--output", help="runs folder whose orphaned hidden run folders to remove (default results/runs)")
    p.set_defaults(func=cmd_clean)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except ConfigError as exc:
        print(f"wanbench: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (SystemCheckError, BackendUnavailable) as exc:
        print(f"wanbench: {exc}", file=sys.stderr)
        return EXIT_SYSTEM
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"wanbench: interrupted ({exc or 'SIGINT'}); torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
