"""`wanbench regress`: run the CI scenarios and compare each summary with its baseline.

Baselines are `results/baselines/<scenario>.csv` (a summary.csv as `wanbench run` writes it);
how far each metric may move before a check fails is in `results/baselines/tolerances.yaml`.
`compare` is a pure function of two summary tables and the tolerances; the command runs the
scenarios, prints the checks (metric, baseline, now, allowed, verdict) and exits 1 on any FAIL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Optional

import pandas as pd

from emulator.files import write_text_atomic
from emulator.schema import ConfigError, load_yaml_mapping

from .paths import BASELINES, CI_SCENARIOS, RUNS_ROOT
from .results import SUMMARY_COLUMNS

TOLERANCES_FILE = "tolerances.yaml"
KEY_COLUMNS = ["network", "label", "seed"]
CHECK_COLUMNS = [*KEY_COLUMNS, "metric", "baseline", "now", "allowed", "verdict", "note"]
EXIT_REGRESSION = 1


@dataclass(frozen=True)
class Tolerance:
    """How far `metric` may move in its bad direction: `absolute` in the metric's own unit, or
    `relative` as a fraction of the baseline value (give exactly one)."""

    metric: str
    better: Literal["higher", "lower"]
    absolute: Optional[float] = None
    relative: Optional[float] = None

    def __post_init__(self):
        if self.better not in ("higher", "lower"):
            raise ValueError(f"{self.metric}.better must be 'higher' or 'lower', got {self.better!r}")
        if (self.absolute is None) == (self.relative is None):
            raise ValueError(f"{self.metric}: give exactly one of absolute or relative")
        slack = self.absolute if self.absolute is not None else self.relative
        if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < math.inf:
            raise ValueError(f"{self.metric}: the allowed change must be a number >= 0, got {slack!r}")
        if self.relative is not None and self.relative > 10:
            raise ValueError(f"{self.metric}.relative is a fraction (0.25 = 25%), got {self.relative}")

    def bound(self, baseline: float) -> float:
        """The worst value that still passes."""
        slack = self.absolute if self.absolute is not None else abs(baseline) * self.relative
        return baseline - slack if self.better == "higher" else baseline + slack

    def passes(self, baseline: float, now: float) -> bool:
        bound = self.bound(baseline)
        eps = 1e-12 * max(1.0, abs(bound))  # a value exactly on the bound passes despite rounding
        return now >= bound - eps if self.better == "higher" else now <= bound + eps

    def describe(self, baseline: float) -> str:
        sign = ">=" if self.better == "higher" else "<="
        change = (f"{'-' if self.better == 'higher' else '+'}{self.absolute:g}" if self.absolute is not None
                  else f"{'-' if self.better == 'higher' else '+'}{100 * self.relative:g}%")
        return f"{sign} {_num(self.bound(baseline))} ({change})"


def parse_tolerances(data: Mapping, source: str = "tolerances") -> dict[str, Tolerance]:
    """{metric: {better, absolute | relative}} -> {metric: Tolerance}; ConfigError naming the field."""

    out = {}
    if not data:
        raise ConfigError("", "no tolerances given", source=source)
    for metric, spec in data.items():
        if isinstance(spec, Tolerance):
            out[metric] = spec
            continue
        if metric not in SUMMARY_COLUMNS:
            raise ConfigError(str(metric), f"not a summary column (one of {', '.join(SUMMARY_COLUMNS)})", source=source)
        if not isinstance(spec, Mapping):
            raise ConfigError(metric, "expected a mapping such as {better: higher, absolute: 0.05}", source=source)
        unknown = set(spec) - {"better", "absolute", "relative"}
        if unknown:
            raise ConfigError(f"{metric}.{sorted(unknown)[0]}", "unknown field (better, absolute, relative)", source=source)
        try:
            out[metric] = Tolerance(metric, spec.get("better"), spec.get("absolute"), spec.get("relative"))
        except ValueError as exc:
            raise ConfigError(metric, str(exc), source=source) from None
    return out


def load_tolerances(path) -> dict[str, Tolerance]:
    return parse_tolerances(load_yaml_mapping(path), str(path))


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (int, float)):
        return f"{value:.4g}"
    return str(value)


def _keyed(table: pd.DataFrame) -> dict:
    rows = {}
    for row in table.to_dict("records"):
        seed = row.get("seed")
        seed = int(seed) if isinstance(seed, (int, float)) and not pd.isna(seed) else seed
        rows[(str(row.get("network")), str(row.get("label")), seed)] = row
    return rows


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def compare(baseline: pd.DataFrame, current: pd.DataFrame, tolerances: Mapping) -> pd.DataFrame:
    """One row per check: every (network, label, seed) of the baseline must be in `current`, have
    ended ok, and keep every tolerated metric within its bound. Verdict FAIL, pass, or new (a row
    only `current` has; not a failure)."""
    tolerances = parse_tolerances(tolerances)
    base_rows, now_rows = _keyed(baseline), _keyed(current)
    checks = []

    def check(key, metric, base, now, allowed, verdict, note=""):
        checks.append(dict(zip(KEY_COLUMNS, key), metric=metric, baseline=base, now=now, allowed=allowed,
                           verdict=verdict, note=note))

    for key, base in base_rows.items():
        now = now_rows.get(key)
        if now is None:
            check(key, "row", "present", "missing", "present", "FAIL",
                  f"no {key[1]} seed {key[2]} at {key[0]} in this run")
            continue
        status = str(now.get("status"))
        check(key, "status", str(base.get("status")), status, "ok", "pass" if status == "ok" else "FAIL")
        for metric, tolerance in tolerances.items():
            b, n = base.get(metric), now.get(metric)
            if _missing(b):
                check(key, metric, None, n, "-", "pass", "no baseline value" if _missing(n) else "new value")
            elif _missing(n):
                check(key, metric, b, None, tolerance.describe(b), "FAIL", "no value now (the baseline had one)")
            else:
                check(key, metric, b, n, tolerance.describe(b), "pass" if tolerance.passes(b, n) else "FAIL")
    for key in now_rows.keys() - base_rows.keys():
        check(key, "row", "missing", "present", "-", "new", "not in the baseline (--update-baselines records it)")
    return pd.DataFrame(checks, columns=CHECK_COLUMNS)


def regressed(checks: pd.DataFrame) -> bool:
    return bool((checks["verdict"] == "FAIL").any())


def checks_table(checks: pd.DataFrame, title: str):
    """A rich Table of the checks (job, metric, baseline, now, allowed, verdict, note), failures in red."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("job", "metric", "baseline", "now", "allowed", "verdict", "note"):
        table.add_column(column, justify="right" if column in ("baseline", "now") else "left",
                         overflow="fold")
    for row in checks.to_dict("records"):
        verdict = row["verdict"]
        shown = {"FAIL": "[bold red]FAIL[/]", "pass": "[green]pass[/]"}.get(verdict, f"[yellow]{verdict}[/]")
        table.add_row(f"{row['label']} seed {row['seed']} @ {row['network']}", row["metric"], _num(row["baseline"]),
                      _num(row["now"]), str(row["allowed"]), shown, str(row["note"] or ""))
    return table


def run_scenario(scenario, backend: str, runs_root: Path):
    """harness.run.run_scenario (a seam: tests replace it with a synthetic run)."""
    from .run import run_scenario as run

    return run(scenario, backend, runs_root)


def regress(scenarios_dir=CI_SCENARIOS, baselines_dir=BASELINES, *, backend: Optional[str] = None,
            runs_root=None, update_baselines: bool = False, console=None) -> int:
    """Run every scenario of `scenarios_dir`; compare with the baselines, or write new ones.

    Returns 0 (no regression, or baselines written) or EXIT_REGRESSION. ConfigError (exit 2) when
    there are no scenarios, no tolerances or a scenario has no baseline, before anything runs.
    """
    from rich.console import Console

    from .scenario import load_scenario

    console = console or Console(stderr=True, highlight=False)
    from .console import stdout_console

    out = stdout_console()  # CI logs: no 80-column wrap of the checks table
    scenarios_dir, baselines_dir = Path(scenarios_dir), Path(baselines_dir)
    files = sorted(scenarios_dir.glob("*.yaml")) + sorted(scenarios_dir.glob("*.yml"))
    if not files:
        raise ConfigError("", "no scenarios (*.yaml) to run: the CI scenarios go here, "
                                                  f"their baselines in {baselines_dir}/<scenario>.csv", source=str(scenarios_dir))
    scenarios = [load_scenario(path) for path in files]  # every file checked before anything runs
    names = [s.name for s in scenarios]
    duplicate = sorted({n for n in names if names.count(n) > 1})
    if duplicate:
        raise ConfigError("", f"two scenarios are named {duplicate[0]!r}; baselines are by name", source=str(scenarios_dir))
    tolerances = {}
    if not update_baselines:
        tolerances_path = baselines_dir / TOLERANCES_FILE
        if not tolerances_path.is_file():
            raise ConfigError("", "no tolerances file: it says how far each metric may move", source=str(tolerances_path))
        tolerances = load_tolerances(tolerances_path)
        for scenario in scenarios:
            path = baselines_dir / f"{scenario.name}.csv"
            if not path.is_file():
                raise ConfigError("", f"no baseline for scenario {scenario.name!r}; record one with "
                                                 "'wanbench regress --update-baselines'", source=str(path))
    failed = []
    for scenario in scenarios:
        console.print(f"[bold]regress[/]: {scenario.name} ({scenario.source_file}, {len(scenario.jobs)} jobs)")
        completed = run_scenario(scenario, backend or scenario.spec.backend, Path(runs_root or RUNS_ROOT))
        run_dir, current = completed.run_dir, completed.summary
        baseline_path = baselines_dir / f"{scenario.name}.csv"
        if update_baselines:
            baselines_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(baseline_path, current.to_csv(index=False))
            console.print(f"  baseline written: {baseline_path} ({len(current)} rows, from {run_dir})")
            continue
        checks = compare(pd.read_csv(baseline_path), current, tolerances)
        out.print(checks_table(checks, f"{scenario.name}: {run_dir}\n  vs baseline {baseline_path}"))
        fails = int((checks["verdict"] == "FAIL").sum())
        if fails:
            failed.append(scenario.name)
            console.print(f"  [bold red]REGRESSION[/]: {fails} failed check(s) in {scenario.name}")
        else:
            console.print(f"  [green]no regression[/] in {scenario.name} ({len(checks)} checks)")
    if update_baselines:
        return 0
    if failed:
        console.print(f"[bold red]regress: {len(failed)} of {len(scenarios)} scenario(s) regressed: {', '.join(failed)}[/]")
        return EXIT_REGRESSION
    console.print(f"regress: {len(scenarios)} scenario(s), no regression")
    return 0
