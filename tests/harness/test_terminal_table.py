"""The terminal's summary table fits 100 columns without cutting a label; --wide shows the headline
columns; paths printed after it are never split across lines (issue 25 item 5)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from harness import cli
from harness.console import print_path
from harness.results import HEADLINE_COLUMNS, TERMINAL_COLUMNS, summary_table

from .test_report import sync_and_dts, write_run
from .test_sim_harness import SCENARIO as SIM_SCENARIO
from .test_sim_harness import fake_engine  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[2]
# a committed run: 18 jobs, labels up to 13 characters (dts-p16-t256, local_sgd-H16)
COMMITTED = REPO / "results" / "papers" / "dts-90x" / "20261126-043513" / "summary.csv"


def rendered_lines(table, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def assert_fits_with_whole_labels(lines: list[str], labels, width: int = 100) -> None:
    too_wide = [line for line in lines if len(line) > width]
    assert not too_wide, f"{len(too_wide)} lines wider than {width}: {too_wide[0]!r}"
    assert "…" not in "\n".join(lines), "a cell was cut:\n" + "\n".join(lines)
    cells = {cell.strip() for line in lines for cell in line.split("  ")}
    for label in labels:
        assert label in cells, f"label {label!r} not whole in:\n" + "\n".join(lines)
    # every column is in the header or named in the caption: rich itself drops no_wrap columns
    # off the right edge, silently, when they do not fit
    header = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("─")) - 1]
    shown = [cell.strip() for cell in header.split("  ") if cell.strip()]
    caption = " ".join(" ".join(lines[lines.index(header):]).split())
    left_out = caption.split("left out for width: ")[1] if "left out for width: " in caption else ""
    for _, short, _ in TERMINAL_COLUMNS:
        if short != "phase":
            assert short in shown or short in left_out, f"{short!r} neither shown nor named:\n" + "\n".join(lines)


def test_a_committed_runs_table_fits_100_columns_with_every_label_whole():
    summary = pd.read_csv(COMMITTED)
    lines = rendered_lines(summary_table(summary, "paper-dts-90x 20261126-043513"), 100)
    assert_fits_with_whole_labels(lines, summary["label"].unique())
    header = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("─")) - 1]
    for short in ("network", "seed", "status", "acc", "to target s", "steps/s", "speedup", "acc Δ"):
        assert short in header
    assert "bytes" not in "\n".join(lines)  # the wide columns stay in summary.csv and the report
    assert "left out for width" not in "\n".join(lines)


def test_long_labels_take_their_width_and_other_columns_give_way():
    summary = pd.read_csv(COMMITTED)
    summary["label"] = summary["label"] + "-inflight8-padded-compute-with-a-long-tail"
    summary["network"] = summary["network"] + "-rate100Mbit"
    lines = rendered_lines(summary_table(summary, "long"), 100)
    assert_fits_with_whole_labels(lines, summary["label"].unique())
    header = lines[next(i for i, line in enumerate(lines) if line.strip().startswith("─")) - 1]
    assert "speedup" in header and "status" in header and "steps/s" not in header
    caption = " ".join(" ".join(lines).split())  # the caption says what gave way
    assert "left out for width: steps/s, seed, acc Δ, to target s, acc" in caption


def test_a_tuning_runs_phase_shows_where_there_is_room_and_gives_way_first():
    summary = pd.read_csv(COMMITTED)
    summary.insert(summary.columns.get_loc("seed") + 1, "phase", "reported")
    lines = rendered_lines(summary_table(summary, "tuned"), 100)
    assert_fits_with_whole_labels(lines, summary["label"].unique())
    assert "phase" in lines[next(i for i, line in enumerate(lines) if line.strip().startswith("─")) - 1]
    summary["label"] = summary["label"] + "-" + "x" * 40
    lines = rendered_lines(summary_table(summary, "tuned"), 100)
    assert_fits_with_whole_labels(lines, summary["label"].unique())
    assert "left out for width: steps/s, phase" in " ".join(" ".join(lines).split())


def test_a_narrower_terminal_gets_a_table_of_its_width():
    summary = pd.read_csv(COMMITTED)
    assert cli.terminal_table_width(Console(width=72)) == 72
    assert cli.terminal_table_width(Console(width=250)) == 100
    lines = rendered_lines(summary_table(summary, "narrow", width=72), 72)
    assert_fits_with_whole_labels(lines, summary["label"].unique(), width=72)


def test_a_label_that_needs_all_100_columns_is_still_whole():
    """Status (all ok) and network (only one) give way too, and the caption says so."""
    summary = pd.read_csv(COMMITTED).head(3)
    summary["label"] = [f"{i}" + "x" * 93 for i in range(3)]
    lines = rendered_lines(summary_table(summary, "one long label"), 100)
    assert_fits_with_whole_labels(lines, summary["label"])
    caption = " ".join(" ".join(lines).split())
    assert "status (all ok), network (all delay4)" in caption


@pytest.mark.parametrize("label_length", range(8, 97))
def test_any_label_that_fits_alone_is_whole_in_100_columns(label_length):
    """Every label length up to what 100 columns can hold: the table's own width sum must match
    rich's to the character, or a label near a boundary is cut."""
    summary = pd.read_csv(COMMITTED).head(3)
    summary["label"] = [f"{i}" + "x" * (label_length - 1) for i in range(3)]
    lines = rendered_lines(summary_table(summary, "boundary"), 100)
    assert_fits_with_whole_labels(lines, summary["label"])


def test_wide_shows_the_headline_columns_under_their_full_names():
    summary = pd.read_csv(COMMITTED)
    text = "\n".join(rendered_lines(summary_table(summary, "wide", wide=True), 400))
    for column in HEADLINE_COLUMNS:
        assert column.replace("_", " ") in text
    assert max(len(line) for line in text.splitlines()) > 100


def test_a_long_path_stays_on_one_line_of_a_narrow_console(tmp_path):
    path = tmp_path / ("a-folder-with-a-long-name-" * 4) / "report" / "figures" / "progress-nic-sync-scale.png"
    console = Console(width=60, record=True, file=open("/dev/null", "w"), color_system=None)
    print_path(console, "figure", path)
    lines = console.export_text().splitlines()
    assert lines == [f"figure: {path}"]


def test_report_cli_table_and_paths(tmp_path, capsys):
    run_dir = write_run(tmp_path / "runs", sync_and_dts())
    out = tmp_path / ("a-report-folder-with-a-long-name-" * 3)
    assert cli.main(["report", str(run_dir), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "steps/s" in captured.out and "bytes sent per node" not in captured.out
    assert max(len(line) for line in captured.out.splitlines()) <= 100
    err = captured.err.splitlines()
    assert f"report: {out / 'report.md'}" in err  # whole, on one line of its own
    assert any(line.startswith(f"figures: {out / 'figures'} (") for line in err)

    assert cli.main(["report", str(run_dir), "--out", str(out), "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "bytes" in wide and "blocked" in wide and max(len(line) for line in wide.splitlines()) > 100


def test_run_cli_prints_the_fitted_table_then_each_path_whole(fake_engine, write_yaml, tmp_path, capsys):
    """`wanbench run` (sim, the stand-in engine): a 100-column table, then the run folder,
    report.md and the figures each on one line, longer than the 80 columns stderr gets here."""
    runs = tmp_path / ("a-runs-folder-with-a-long-name-" * 3)
    assert cli.main(["run", write_yaml(SIM_SCENARIO, "s.yaml"), "--output", str(runs)]) == 0
    captured = capsys.readouterr()
    run_dir = next(runs.glob("*/*"))
    out, err = captured.out.splitlines(), captured.err.splitlines()
    assert_fits_with_whole_labels(out[:out.index(f"run: {run_dir}")], ["sync", "local_sgd"])
    assert f"report: {run_dir / 'report' / 'report.md'}" in err
    assert f"figure: {next((run_dir / 'report' / 'figures').glob('progress-*.png'))}" in err
    assert any(line.startswith(f"figures: {run_dir / 'report' / 'figures'} (") for line in err)
