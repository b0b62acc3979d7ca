"""The paper figures drawn from committed evidence (harness/plots.py's last section): one line per
label, seed bands and bars whose bounds are the data's min and max, first synchronisations and
crossovers where the data puts them, axis labels; then each drawn from the committed evidence
under results/papers/ as the notebooks draw it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from harness import plots
from harness.evidence import PAPERS_ROOT as PAPERS
from harness.report import committed_summary, load_folder




def made_up_curves() -> pd.DataFrame:
    """Two labels, three seeds, evaluations every 10 steps; seed 2 of `diloco` keeps step 25 too
    (thinning keeps a seed's own extra evaluations), which no other seed has."""
    rows = []
    for label, algorithm, base in (("sync", "sync", 1.0), ("diloco-H5", "diloco", 1.5)):
        for seed in (1, 2, 3):
            steps = [9, 19, 29, 39] + ([25] if label == "diloco-H5" and seed == 2 else [])
            for step in steps:
                rows.append({"label": label, "algorithm": algorithm, "seed": seed, "step": step,
                             "tokens_m": (step + 1) * 0.01, "time_min": (step + 1) * 0.1 * seed,
                             "loss": base + 1.0 / (step + 1) + 0.1 * seed})
    return pd.DataFrame(rows)


def band_bounds(ax) -> list[tuple[float, float]]:
    """Per seed band of `ax`: its lowest and highest y."""
    bounds = []
    for band in [c for c in ax.collections if c.get_gid() == plots.BAND_GID]:
        ys = np.concatenate([path.vertices[:, 1] for path in band.get_paths()])
        bounds.append((ys.min(), ys.max()))
    return bounds


def test_curves_with_seed_band_draws_median_band_and_first_sync():
    curves = made_up_curves()
    figure = plots.curves_with_seed_band(
        curves, y="loss", y_label="held-out loss (nats per byte)",
        panels=[("tokens_m", "tokens (millions)"), ("time_min", "virtual time (minutes)")],
        first_sync_step={"diloco-H5": 4, "sync": 0}, target=1.2, log_x=("time_min",), title="t")
    assert figure.get_suptitle() == "t"
    left, right = figure.axes
    assert left.get_xlabel() == "tokens (millions)" and right.get_ylabel() == "held-out loss (nats per byte)"
    assert right.get_xscale() == "log" and left.get_xscale() == "linear"
    for ax in (left, right):
        lines = {line.get_label(): line for line in plots.series_lines(ax)}
        assert set(lines) == {"sync", "diloco-H5"}   # one line per label, sync first in the legend
        # only the steps every seed evaluated: seed 2's lone step 25 is not on the curve
        assert len(lines["diloco-H5"].get_xdata()) == 4
        medians = curves[curves["step"] != 25].groupby(["label", "step"])["loss"].median()
        assert list(lines["diloco-H5"].get_ydata()) == pytest.approx(list(medians["diloco-H5"]))
        # each band's bounds are the min and max over seeds of the data
        data = curves[curves["step"] != 25].groupby("label")["loss"]
        expected = sorted(zip(data.min(), data.max()))
        assert [v for pair in sorted(band_bounds(ax)) for v in pair] == pytest.approx([v for pair in expected for v in pair])
        assert [line.get_ydata()[0] for line in ax.lines if line.get_gid() == plots.REFERENCE_GID] == [1.2]
    # first sync at step 4: before the first evaluation (step 9), interpolated from 0 at the start
    marks = sorted(line.get_xdata()[0] for line in left.lines if line.get_gid() == plots.FIRST_SYNC_GID
                   and len(line.get_xdata()))
    assert marks == pytest.approx([0.01, 0.05])   # sync at step 0 (0.01 M tokens), diloco at step 4 (0.05 M)
    assert "first sync applied (dotted)" in [t.get_text() for t in left.get_legend().get_texts()]


def test_curves_without_first_sync_or_common_steps():
    curves = made_up_curves()
    figure = plots.curves_with_seed_band(curves, y="loss", y_label="loss (nats)", panels=[("tokens_m", "tokens")])
    assert not [line for line in figure.axes[0].lines if line.get_gid() == plots.FIRST_SYNC_GID]
    lonely = curves[(curves["seed"] == 1) & (curves["step"] == 9) | (curves["seed"] == 2) & (curves["step"] == 19)]
    empty = plots.curves_with_seed_band(lonely, y="loss", y_label="loss (nats)", panels=[("tokens_m", "tokens")])
    assert not plots.series_lines(empty.axes[0]) and "no data" in empty.axes[0].texts[0].get_text()


def crossover_frame() -> pd.DataFrame:
    return pd.DataFrame({
        "workers": [4, 4, 4, 16, 16, 16], "compute_over_comm": [0.1, 1.0, 10.0, 0.1, 1.0, 10.0],
        "speedup_median": [3.0, 1.5, 0.8, 2.0, 0.9, 0.6], "speedup_min": [2.5, 1.2, 0.7, 1.8, 0.8, 0.5],
        "speedup_max": [4.0, 1.7, 1.1, 2.2, 1.0, 0.7],
        "localsgd_speedup_median": [2.0, np.nan, 0.0, np.nan, np.nan, np.nan]})


def test_eawild_crossover_one_line_per_worker_count_with_bars_control_and_crossings():
    frame = crossover_frame()
    figure = plots.eawild_crossover(frame, {4: 5.0, 16: 0.8})
    (ax,) = figure.axes
    labels = [line.get_label() for line in plots.series_lines(ax)]
    assert labels == ["4 workers: EA-wild", "4 workers: local SGD at EA-wild's period (control)", "16 workers: EA-wild"]
    control = plots.series_lines(ax)[1]
    assert list(control.get_ydata()) == [2.0, 0.05]   # a control that missed everywhere sits on the floor
    crossings = sorted(line.get_xdata()[0] for line in ax.lines if line.get_gid() == plots.CROSSOVER_GID)
    assert crossings == [0.8, 5.0]
    caps = [line for line in ax.lines if line.get_gid() == plots.SPREAD_GID]
    ys = sorted(y for cap in caps for y in cap.get_ydata())
    assert ys == pytest.approx(sorted([*frame["speedup_min"], *frame["speedup_max"]]))
    assert ax.get_xscale() == ax.get_yscale() == "log" and "communication" in ax.get_xlabel()
    assert not [line for line in plots.eawild_crossover(frame).axes[0].lines if line.get_gid() == plots.CROSSOVER_GID]


def test_steps_per_s_by_baseline_bars_per_label_with_seed_range():
    table = pd.DataFrame({"scenario": ["a", "a", "b", "b", "b"], "label": ["sync", "p3", "p3", "sync", "ps_sync-2mb"],
                          "steps_per_s_median": [1.0, 2.0, 3.0, 4.0, 5.0], "steps_per_s_min": [0.9, 2.0, 2.5, 4.0, 4.5],
                          "steps_per_s_max": [1.1, 2.0, 3.5, 4.0, 5.5]})
    (ax,) = plots.steps_per_s_by_baseline(table).axes
    containers = {c.get_label(): c for c in ax.containers if hasattr(c, "patches")}
    assert list(containers) == ["p3", "ps_sync-2mb", "sync"]   # the reference first
    heights = {label: [bar.get_height() for bar in c.patches] for label, c in containers.items()}
    assert heights["p3"] == [2.0, 3.0] and heights["sync"] == [1.0, 4.0]
    assert np.isnan(heights["ps_sync-2mb"][0]) and heights["ps_sync-2mb"][1] == 5.0   # no bar where it did not run
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"] and "steps per second" in ax.get_ylabel()
    caps = [y for line in ax.lines if line.get_gid() == plots.SPREAD_GID for y in line.get_ydata() if not np.isnan(y)]
    assert sorted(caps) == pytest.approx(sorted([0.9, 1.1, 2.0, 2.0, 2.5, 3.5, 4.0, 4.0, 4.5, 5.5]))


# --- on the committed evidence ----------------------------------------------------------------------------


def test_evidence_loads_with_its_committed_summary():
    """An evidence folder has no step records to recompute a summary from: load_folder takes the
    committed one (the ratios against sync included) and counts the folder complete."""
    results = load_folder(PAPERS / "dts-fmnist")
    assert results is not None and len(results.runs) == 3 and all(run.complete for run in results.runs)
    committed = pd.concat([committed_summary(run.path) for run in results.runs], ignore_index=True)
    assert len(results.comparable()) == len(committed) == 12
    assert sorted(results.comparable()["speedup_vs_sync"].dropna()) == pytest.approx(
        sorted(committed["speedup_vs_sync"].dropna()))
    assert load_folder(PAPERS / "dts-fmnist" / "20261126-104700-tuning") is None   # tuning record: no jobs


def test_training_curves_one_figure_per_network_accuracy_or_loss_and_median_first_sync():
    curves = made_up_curves().rename(columns={"time_min": "train_time_s"}).assign(accuracy=lambda f: 1 / f["loss"])
    evals = pd.concat([curves.assign(network="delay1"), curves.assign(network="delay4")], ignore_index=True)
    summary = pd.DataFrame({"network": ["delay1"] * 3 + ["delay4"], "label": ["diloco-H5"] * 3 + ["sync"],
                            "first_sync_step": [4, 9, 29, 0]})
    figures = plots.training_curves(evals, summary, target_accuracy=0.6)
    assert [f.get_suptitle().split(" at ")[1].split(" ")[0] for f in figures] == ["delay1", "delay4"]
    time_panel, steps_panel = figures[0].axes
    assert time_panel.get_ylabel() == "accuracy (fraction)" and time_panel.get_xscale() == "log"
    assert steps_panel.get_xlabel() == "steps per worker (count)"
    marks = [line.get_xdata()[0] for line in steps_panel.lines if line.get_gid() == plots.FIRST_SYNC_GID]
    assert marks == [10.0]   # the median of steps 4, 9, 29 (step 9 = 10 steps done); sync has none at delay1
    (loss_figure, _) = plots.training_curves(evals, summary, target_loss=1.3)
    assert loss_figure.axes[0].get_ylabel() == "held-out loss (nats)"
    assert [line.get_ydata()[0] for line in loss_figure.axes[0].lines if line.get_gid() == plots.REFERENCE_GID] == [1.3]
    assert plots.training_curves(evals.iloc[0:0], summary) == []
