"""The committed runs under results/ (the examples' run directories) still load and summarize,
and give the summary and report they gave before harness/rundir.py read them.

tests/harness/golden/<scenario>.summary.csv and .report.md are what the code gave for each run
(the report's "Generated" time left out); after a deliberate change of a metric or of the report,
write them again with `WANBENCH_UPDATE_GOLDEN=1 pytest tests/harness/test_committed_runs.py` and
say why in the commit. The runs' own summary.csv was written by the code of their day: the
columns whose meaning has not changed since must still agree with it.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pandas as pd
import pytest

from harness.evidence import PAPERS_ROOT
from harness.paths import RUNS_ROOT
from harness.report import find_run_dirs, write_report
from harness.results import load_run, summarize

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden"
UPDATE = os.environ.get("WANBENCH_UPDATE_GOLDEN") == "1"
# Committed runs only: results/runs/ is run output (git-ignored; `wanbench regress` writes there
# before the tests in CI, a user's runs land there too). results/papers/ holds evidence, not runs
# (thinned evaluations, no rank records: tests/harness/test_papers.py checks it).
RUNS = [run.relative_to(ROOT) for run in find_run_dirs(ROOT / "results")
        if not run.is_relative_to(RUNS_ROOT) and not run.is_relative_to(PAPERS_ROOT)]
# Computed the same way since the examples were run (time to target, training time and the
# ratios built on them have been refined since: see the golden files for today's values).
STABLE_COLUMNS = ["network", "delay_scale", "rate", "nodes", "algorithm", "label", "seed", "status",
                  "final_accuracy", "best_accuracy", "steps", "bytes_sent_per_node", "bytes_per_step_per_node",
                  "comm_blocked_fraction", "mean_staleness"]


def check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} differs: WANBENCH_UPDATE_GOLDEN=1 if the change is meant"


def test_there_are_committed_runs():
    assert len(RUNS) >= 4 and all((ROOT / run / "summary.csv").is_file() for run in RUNS)


@pytest.mark.parametrize("run", RUNS, ids=[run.parent.name for run in RUNS])
def test_a_committed_run_summarizes_as_before(run):
    text = summarize(load_run(ROOT / run)).to_csv(index=False)
    check_golden(GOLDEN / f"{run.parent.name}.summary.csv", text)
    now, then = pd.read_csv(io.StringIO(text)), pd.read_csv(ROOT / run / "summary.csv")
    for column in STABLE_COLUMNS:
        pd.testing.assert_series_equal(now[column], then[column], check_dtype=False, rtol=1e-9, obj=column)


@pytest.mark.parametrize("run", RUNS, ids=[run.parent.name for run in RUNS])
def test_a_committed_run_reports_as_before(run, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the report names the run by the path it was given
    markdown = write_report([run], tmp_path / "report").markdown.read_text()
    check_golden(GOLDEN / f"{run.parent.name}.report.md", re.sub(r"Generated \S+ ", "Generated X ", markdown))
