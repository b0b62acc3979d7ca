"""Aggregates over seeds (issue 21 §10): harness/results.py `across_seeds` on hand-made summary
rows, the report's across-seeds table and CSV, and the figures' median marker with min..max bars."""

from __future__ import annotations

import pandas as pd
import pytest

from harness import plots
from harness.report import seeds_markdown
from harness.results import MIN_SEEDS, across_seeds, format_seed_cell, seed_stats


def row(label, seed, network="delay1", algorithm=None, **values):
    return {"network": network, "label": label, "algorithm": algorithm or label.split("-")[0], "seed": seed,
            "workload": "w1", "status": "ok", **values}


def test_seed_stats_median_and_range():
    assert seed_stats([3.0, 1.0, 2.0, None]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert seed_stats([4.0, 1.0]) == {"n": 2, "median": 2.5, "min": 1.0, "max": 4.0}
    assert seed_stats([None, float("nan")]) == {"n": 0, "median": None, "min": None, "max": None}


def test_ratios_are_aggregated_per_seed_not_as_a_ratio_of_medians():
    """sync 10 / 100 / 40 s and dts 1 / 50 / 2 s: per seed 10x, 2x, 20x (median 10x), while the
    ratio of the medians would say 40 / 2 = 20x."""
    sync_times, dts_times = [10.0, 100.0, 40.0], [1.0, 50.0, 2.0]
    rows = []
    for seed, (sync_t, dts_t) in enumerate(zip(sync_times, dts_times)):
        rows.append(row("sync", seed, time_to_target_s=sync_t, speedup_vs_sync=1.0))
        rows.append(row("dts-p4", seed, algorithm="dts", time_to_target_s=dts_t, speedup_vs_sync=sync_t / dts_t))
    seeds = across_seeds(pd.DataFrame(rows)).set_index("label")
    per_seed = sorted(s / d for s, d in zip(sync_times, dts_times))  # 2, 10, 20
    assert seeds.loc["dts-p4", "speedup_vs_sync_median"] == per_seed[1] == 10.0
    assert seeds.loc["dts-p4", "speedup_vs_sync_min"] == 2.0 and seeds.loc["dts-p4", "speedup_vs_sync_max"] == 20.0
    ratio_of_medians = pd.Series(sync_times).median() / pd.Series(dts_times).median()
    assert ratio_of_medians == 20.0 != seeds.loc["dts-p4", "speedup_vs_sync_median"]
    assert seeds.loc["dts-p4", "time_to_target_s_median"] == 2.0
    assert seeds.loc["sync", "speedup_vs_sync_n"] == 3


def test_groups_by_network_label_and_workload_and_flags_few_seeds():
    rows = [row("sync", s, network=net, steps_per_s=10.0 + s) for net in ("delay1", "delay4") for s in (0, 1, 2)]
    rows += [row("dts", 0, steps_per_s=100.0), row("dts", 1, steps_per_s=120.0)]
    rows += [row("dts", 0, steps_per_s=50.0, workload="padded")]
    seeds = across_seeds(pd.DataFrame(rows))
    assert len(seeds) == 4
    sync1 = seeds[(seeds["label"] == "sync") & (seeds["network"] == "delay1")].iloc[0]
    assert (sync1["seeds"], sync1["seed_list"], sync1["few_seeds"]) == (3, "0 1 2", False)
    assert (sync1["steps_per_s_median"], sync1["steps_per_s_min"], sync1["steps_per_s_max"]) == (11.0, 10.0, 12.0)
    dts = seeds[(seeds["label"] == "dts") & (seeds["workload"] == "w1")].iloc[0]
    assert dts["seeds"] == 2 and dts["few_seeds"] and dts["steps_per_s_median"] == 110.0
    padded = seeds[seeds["workload"] == "padded"].iloc[0]
    assert padded["seeds"] == 1 and padded["steps_per_s_median"] == 50.0  # never averaged with w1
    assert MIN_SEEDS == 3


def test_a_tuning_candidate_is_never_pooled_with_the_reported_seeds_at_its_pick():
    """Under a tuning protocol the tuning seed's candidate at lr 0.1 and the reported seeds at the
    pick lr 0.1 have the same label and workload: the phase keeps them apart."""
    rows = [row("sync", 0, phase="tuning", steps_per_s=1.0)]
    rows += [row("sync", s, phase="reported", steps_per_s=10.0 + s) for s in (1, 2, 3)]
    seeds = across_seeds(pd.DataFrame(rows)).set_index("phase")
    assert seeds.loc["reported", "seed_list"] == "1 2 3" and seeds.loc["reported", "steps_per_s_min"] == 11.0
    assert seeds.loc["tuning", "seeds"] == 1 and seeds.loc["tuning", "few_seeds"]


def test_a_value_missing_on_some_seeds_counts_only_the_others():
    """time to target on 2 of 3 seeds (one never reached it): n 2, and the cell says so."""
    rows = [row("dts", 0, time_to_target_s=4.0), row("dts", 1, time_to_target_s=None), row("dts", 2, time_to_target_s=2.0)]
    (agg,) = across_seeds(pd.DataFrame(rows)).to_dict("records")
    assert agg["seeds"] == 3 and agg["time_to_target_s_n"] == 2 and agg["time_to_target_s_median"] == 3.0
    assert format_seed_cell(agg, "time_to_target_s") == "3 [2..4] (n=2)"
    assert format_seed_cell(agg, "speedup_vs_sync") == "-"


def test_independent_training_is_counted_per_seed():
    rows = [row("dts", 0, time_to_target_s=1.0, syncs_before_target=0, first_sync_step=543),
            row("dts", 1, time_to_target_s=1.0, syncs_before_target=3, first_sync_step=543),
            row("dts", 2, time_to_target_s=None, syncs_before_target=None, first_sync_step=543)]
    (agg,) = across_seeds(pd.DataFrame(rows)).to_dict("records")
    assert agg["independent_seeds"] == 1 and agg["first_sync_step_median"] == 543


def test_the_report_table_flags_fewer_than_three_seeds():
    rows = [row("sync", s, speedup_vs_sync=1.0) for s in (0, 1, 2)]
    rows += [row("dts", 0, speedup_vs_sync=5.0), row("dts", 1, speedup_vs_sync=7.0)]
    text = "\n".join(seeds_markdown(across_seeds(pd.DataFrame(rows))))
    assert "| dts | delay1 | 2 | 6 [5..7] |" in text
    assert "`dts` at delay1: **2 seed(s)** (seeds 0 1), fewer than 3" in text
    assert "`sync` at delay1: **" not in text


def test_the_report_writes_across_seeds_csv(tmp_path):
    from tests.harness.test_report import FakeJob, write_run
    from harness.report import write_report

    jobs = [FakeJob("sync", seed=s, step_time_s=1.0, evals={9: 0.95}) for s in (0, 1, 2)]
    jobs += [FakeJob("dts", seed=s, step_time_s=0.5 / (s + 1), evals={9: 0.95}) for s in (0, 1)]
    outcome = write_report([write_run(tmp_path, jobs)], tmp_path / "report")
    seeds = pd.read_csv(outcome.seeds_csv)
    dts = seeds[seeds["label"] == "dts"].iloc[0]
    assert dts["seeds"] == 2 and bool(dts["few_seeds"])
    assert dts["throughput_speedup_vs_sync_median"] == pytest.approx((2.0 + 4.0) / 2)
    assert dts["throughput_speedup_vs_sync_min"] == pytest.approx(2.0)
    markdown = outcome.markdown.read_text()
    assert "#### Across seeds" in markdown and "fewer than 3" in markdown


def test_figures_draw_the_median_with_min_max_bars():
    """Three seeds 10 / 11 / 30: the marker at the median 11 (the mean, 17, would hide the outlier's
    pull), the bar from 10 to 30."""
    rows = []
    for seed, speedup in enumerate((10.0, 11.0, 30.0)):
        rows.append({"label": "sync", "algorithm": "sync", "seed": seed, "delay_scale": 1.0, "mean_rtt_ms": 200.0, "rate": None,
                     "speedup_vs_sync": 1.0, "throughput_speedup_vs_sync": 1.0})
        rows.append({"label": "dts", "algorithm": "dts", "seed": seed, "delay_scale": 1.0, "mean_rtt_ms": 200.0, "rate": None,
                     "speedup_vs_sync": speedup, "throughput_speedup_vs_sync": speedup})
    figure = plots.speedup_vs_latency(pd.DataFrame(rows))
    time_ax = figure.axes[0]
    (line,) = [l for l in time_ax.get_lines() if l.get_label() == "dts"]
    assert list(line.get_ydata()) == [11.0]
    caps = [l for l in time_ax.get_lines() if l.get_gid() == plots.SPREAD_GID]
    assert sorted(float(y) for cap in caps for y in cap.get_ydata()) == [10.0, 30.0]


def test_accuracy_vs_bytes_draws_one_marker_per_point_at_the_median_of_its_seeds():
    rows = [{"label": "dts", "algorithm": "dts", "seed": seed, "network": "delay1", "workload": "w",
             "bytes_sent_per_node": 1e6 * (1 + seed), "final_accuracy": accuracy}
            for seed, accuracy in enumerate((0.90, 0.97, 0.92))]
    figure = plots.accuracy_vs_bytes(pd.DataFrame(rows))
    (ax,) = figure.axes
    (line,) = plots.series_lines(ax)
    assert list(line.get_xdata()) == [2.0] and list(line.get_ydata()) == [0.92]  # MB, the medians
    caps = [l for l in ax.get_lines() if l.get_gid() == plots.SPREAD_GID]
    ys = sorted(float(y) for cap in caps for y in cap.get_ydata())
    assert min(ys) == pytest.approx(0.90) and max(ys) == pytest.approx(0.97)


def test_the_report_table_names_the_workload_where_a_label_has_several():
    rows = [row("eawild", s, workload=w, speedup_vs_sync=v) for s in (0, 1, 2) for w, v in (("light", 1.6), ("heavy", 0.9))]
    text = "\n".join(seeds_markdown(across_seeds(pd.DataFrame(rows))))
    assert "| eawild | delay1 | light | 3 | 1.6 |" in text and "| eawild | delay1 | heavy | 3 | 0.9 |" in text
