"""Network up+down wall time: plain Mininet vs every registered, available wanbench backend.

For each node count (the aws-4region matrix with N/4 nodes per region) and each repeat, in the same
run and interleaved (so drift of the machine hits all systems alike):
  (a) plain Mininet: `Mininet(topo, switch=LinuxBridge, controller=None, link=Link)`, build + start,
      then stop, timed inside a system-Python process (mininet_driver.py bench) so that interpreter
      start and imports are not counted -- as for ours, which are timed in this process;
  (b) each wanbench backend: `Backend(make_plan(topology)).up()` then `.down()`.
Prints a table of medians and the ratio ours/mininet, and writes every run to
results/bench/updown-<UTC time>.csv, with hardware, versions and date in the header lines.

Usage (root; a prefix of its own so nothing of a user's or a colleague's network is touched):
  WANBENCH_PREFIX=wbmn .venv/bin/python bench/bench_updown.py --nodes 4 16 32 --repeats 3
"""

from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# --code DIR: time the emulator of another checkout (e.g. `git archive` of main), for a before/after
# comparison run side by side with this one; read before the imports below.
CODE_ROOT = Path(sys.argv[sys.argv.index("--code") + 1]).resolve() if "--code" in sys.argv[:-1] else ROOT
sys.path.insert(0, str(CODE_ROOT))

from emulator.backends.base import REGISTRY, BackendUnavailable, read_state  # noqa: E402
from emulator.plan import make_plan, prefix  # noqa: E402
from emulator.topology import load_topology  # noqa: E402
from harness.environment import environment  # noqa: E402

MININET = "mininet-plain"
TOPOLOGY_FILE = ROOT / "topologies" / "aws-4region.yaml"
NOT_BACKENDS = {"__init__", "base", "mininet_driver"}


def register_all() -> dict[str, str]:
    """Import every backend module so each registers itself; return module -> import error."""
    errors = {}
    for path in sorted((ROOT / "emulator" / "backends").glob("*.py")):
        if path.stem in NOT_BACKENDS:
            continue
        try:
            importlib.import_module(f"emulator.backends.{path.stem}")
        except Exception as exc:  # noqa: BLE001  (a colleague's backend may be half written)
            errors[path.stem] = f"{type(exc).__name__}: {exc}"
    return errors


def topology_for(nodes: int):
    """aws-4region's matrix with `nodes`/4 nodes per region (nodes: a multiple of 4)."""
    base = load_topology(TOPOLOGY_FILE)
    regions = len(base.regions)
    if nodes % regions:
        raise SystemExit(f"--nodes {nodes}: must be a multiple of {regions} (the regions of {TOPOLOGY_FILE.name})")
    return base.with_nodes({region: nodes // regions for region in base.regions})


def plain_mininet_run(plan) -> dict:
    """One plain Mininet build+start+stop of `plan`'s hosts; seconds as measured by the driver."""
    from emulator.backends import mininet

    spec = {**mininet.driver_spec(plan), "repeats": 1}
    result = subprocess.run(mininet.driver_argv("bench", plan.prefix), input=json.dumps(spec),
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"mininet driver failed: {result.stderr.strip()[-300:]}")
    return json.loads(result.stdout)["runs"][0]


def backend_run(cls, plan) -> dict:
    """One `up` then `down` of backend `cls` on `plan`; seconds. On failure, down, then raise."""
    backend = cls(plan)
    cpu_start = cpu_seconds()
    start = time.perf_counter()
    try:
        backend.up()
    except BaseException:
        backend.down()
        raise
    built = time.perf_counter()
    backend.down()
    stopped = time.perf_counter()
    return {"up_s": built - start, "down_s": stopped - built, "total_s": stopped - start,
            "cpu_s": cpu_seconds() - cpu_start}


def cpu_seconds() -> float:
    """CPU time of this process and of the children it has reaped (the delay line, node holders)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_environment() -> dict:
    """Hardware, versions and date (harness.environment) plus Mininet's and pyroute2's versions."""
    from emulator.backends import mininet

    mn = subprocess.run([mininet.MININET_PYTHON, "-I", "-c",
                         "import mininet.net, platform; print(mininet.net.VERSION, platform.python_version())"],
                        capture_output=True, text=True)
    mn_version, system_python = (mn.stdout.split() + ["?", "?"])[:2]
    import pyroute2

    # The machine may be shared (colleagues' tests): the load says how much to trust a ratio.
    return environment(mininet=f"{mn_version} (system python {system_python})", pyroute2=pyroute2.__version__,
                       prefix=prefix(), code=str(CODE_ROOT), loadavg_1min_start=f"{os.getloadavg()[0]:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16, 32], help="node counts (multiples of 4)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; the table shows medians")
    parser.add_argument("--backends", nargs="*", default=None,
                        help="wanbench backends to time (default: every registered and available one)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench")
    parser.add_argument("--code", type=Path, default=ROOT,
                        help="checkout whose emulator is timed (default: this one); for before/after runs")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench_updown needs root (namespaces, bridges): run with sudo")
    if read_state(prefix()) is not None:
        raise SystemExit(f"a network is up under prefix {prefix()}; run 'wanbench down' or set WANBENCH_PREFIX")

    import_errors = register_all()
    env = bench_environment()
    for key, value in env.items():
        print(f"{key:16} {value}")
    for module, error in import_errors.items():
        print(f"{'skipped':16} backend module {module}: {error}")

    systems = [MININET]
    for name in args.backends if args.backends is not None else sorted(REGISTRY):
        cls = REGISTRY.get(name)
        if cls is None:
            print(f"{'skipped':16} {name}: not registered")
            continue
        try:
            cls.check_available()
        except (BackendUnavailable, OSError, RuntimeError) as exc:
            print(f"{'skipped':16} {name}: {exc}")
            continue
        systems.append(name)
    print()

    rows: list[dict] = []
    failed: dict[tuple[str, int], str] = {}
    for nodes in args.nodes:
        topology = topology_for(nodes)
        for repeat in range(args.repeats):
            for system in systems:
                if (system, nodes) in failed:
                    continue
                plan = make_plan(topology)
                try:
                    timing = plain_mininet_run(plan) if system == MININET else backend_run(REGISTRY[system], plan)
                except Exception as exc:  # noqa: BLE001  (reported in the table, the others go on)
                    failed[(system, nodes)] = " ".join(str(exc).split())[:160]
                    print(f"{system} at {nodes} nodes failed: {failed[(system, nodes)]}")
                    if os.environ.get("BENCH_TRACEBACK"):
                        traceback.print_exc()
                    continue
                rows.append({"system": system, "nodes": nodes, "repeat": repeat, **timing})
                print(f"{system:14} {nodes:3} nodes  run {repeat + 1}/{args.repeats}: "
                      f"up {timing['up_s']:.3f} s  down {timing['down_s']:.3f} s  total {timing['total_s']:.3f} s",
                      flush=True)

    env["loadavg_1min_end"] = f"{os.getloadavg()[0]:.2f}"
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = env["date"].replace(":", "").replace("-", "").replace("+0000", "Z").replace("+00:00", "Z")
    csv_path = args.out / f"updown-{stamp}.csv"
    with open(csv_path, "w", newline="") as handle:
        for key, value in env.items():
            handle.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(handle, fieldnames=["system", "nodes", "repeat", "up_s", "down_s", "total_s",
                                                    "cpu_s"])
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6f}" if isinstance(v, float) else v) for k, v in row.items()})

    def median(system, nodes, key="total_s", pick=statistics.median):
        values = [r[key] for r in rows if r["system"] == system and r["nodes"] == nodes]
        return pick(values) if values else None

    print()
    # The minimum as well: on a shared machine it is the least disturbed run.
    header = (f"{'nodes':>5}  {'system':14} {'up s':>8} {'down s':>8} {'up+down s':>10} {'ours/mininet':>13}"
              f" {'min up+down s':>14} {'min ratio':>10}")
    print(f"median of {args.repeats} runs, wall time; load average (1 min) "
          f"{env['loadavg_1min_start']} at start, {env['loadavg_1min_end']} at end on {os.cpu_count()} cores")
    print(header)
    print("-" * len(header))
    for nodes in args.nodes:
        reference = median(MININET, nodes)
        for system in systems:
            total = median(system, nodes)
            if total is None:
                print(f"{nodes:>5}  {system:14} failed: {failed.get((system, nodes), 'no runs')}")
                continue
            fastest, fastest_reference = median(system, nodes, pick=min), median(MININET, nodes, pick=min)
            ratio = "" if system == MININET or not reference else f"{total / reference:.2f}"
            min_ratio = "" if system == MININET or not fastest_reference else f"{fastest / fastest_reference:.2f}"
            print(f"{nodes:>5}  {system:14} {median(system, nodes, 'up_s'):8.3f} "
                  f"{median(system, nodes, 'down_s'):8.3f} {total:10.3f} {ratio:>13} {fastest:14.3f} {min_ratio:>10}")
    print(f"\nwritten: {csv_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
