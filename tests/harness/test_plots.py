"""Every figure function: a Figure with unit-labelled axes, a title, one line per algorithm, and a
clear note (not a crash) for a single sweep point or no data."""

from __future__ import annotations


import pandas as pd
import pytest
from matplotlib.figure import Figure
from tests.harness.test_report import FakeJob, sync_and_dts, write_run

from harness import plots
from harness.report import load_results



def has_unit(label: str) -> bool:
    return any(unit in label for unit in ("(ms)", "(s)", "nats", "Mbit/s", "B,", "×", "fraction", "steps/s", "s/s",
                                          "(count)"))


def data_lines(ax) -> list:
    """Lines that carry data (not the y=1 / x=1 reference lines)."""
    return plots.series_lines(ax)


def notes(figure: Figure) -> str:
    return " ".join(text.get_text() for ax in figure.axes for text in ax.texts)


def check_figure(figure: Figure):
    assert isinstance(figure, Figure)
    assert figure.get_suptitle()
    assert tuple(figure.get_size_inches())[1] == pytest.approx(4.5) and figure.dpi == plots.DPI
    for ax in figure.axes:
        assert has_unit(ax.get_xlabel()), ax.get_xlabel()
        assert has_unit(ax.get_ylabel()), ax.get_ylabel()
        assert ax.xaxis.label.get_size() >= 10 and ax.yaxis.label.get_size() >= 10


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """sync, dts, local_sgd at three delay scales x two rates, two seeds."""
    root = tmp_path_factory.mktemp("runs")
    jobs = []
    for scale in (0.5, 1.0, 2.0):
        for rate in ("10Mbit", "100Mbit"):
            for seed in (0, 1):
                common = dict(delay_scale=scale, rate=rate, seed=seed)
                jobs += [FakeJob("sync", step_time_s=0.2 + scale, evals={4: 0.5, 9: 0.92}, **common),
                         FakeJob("dts", step_time_s=0.3 + 0.1 * scale, bytes_per_step=250, blocked_s=0.05,
                                 evals={4: 0.91, 9: 0.93}, **common),
                         FakeJob("local_sgd", step_time_s=0.4, bytes_per_step=125, blocked_s=0.02,
                                 evals={4: 0.8, 9: 0.91}, **common)]
    return load_results([write_run(root, jobs)])


def test_same_colour_for_an_algorithm_everywhere(sweep):
    assert plots.color_for("sync") == plots.PALETTE["sync"]
    assert plots.color_for("my-new-algo") == plots.color_for("my-new-algo")
    latency = plots.speedup_vs_latency(sweep.summary)
    bandwidth = plots.throughput_vs_bandwidth(sweep.summary)
    colours = {str(l.get_label()).split(",")[0]: l.get_color() for f in (latency, bandwidth)
               for ax in f.axes for l in data_lines(ax)}
    assert colours["dts"] == plots.PALETTE["dts"] and colours["local_sgd"] == plots.PALETTE["local_sgd"]


def test_loss_accuracy_vs_time(sweep):
    steps = sweep.steps[sweep.steps["network"] == "delay1-rate10Mbit"]
    evals = sweep.evals[sweep.evals["network"] == "delay1-rate10Mbit"]
    figure = plots.loss_accuracy_vs_time(steps, evals, title="t", target_accuracy=0.9)
    check_figure(figure)
    loss_ax, acc_ax = figure.axes
    assert len(data_lines(loss_ax)) == 3 * 2  # three algorithms x two seeds
    assert len(data_lines(acc_ax)) == 3 * 2
    assert {t.get_text() for t in loss_ax.get_legend().get_texts()} == {"sync", "dts", "local_sgd"}


def test_speedup_vs_latency(sweep):
    figure = plots.speedup_vs_latency(sweep.summary)
    check_figure(figure)
    for ax in figure.axes:
        assert "RTT (ms)" in ax.get_xlabel()
        # dts and local_sgd, once per rate (sync is the reference line at 1)
        assert len(data_lines(ax)) == 2 * 2
    dts = [l for l in data_lines(figure.axes[0]) if l.get_label() == "dts, 10 Mbit/s"][0]
    assert list(dts.get_xdata()) == pytest.approx([50.0, 100.0, 200.0])


def test_throughput_vs_bandwidth(sweep):
    figure = plots.throughput_vs_bandwidth(sweep.summary, samples_per_step=64)
    check_figure(figure)
    (ax,) = figure.axes
    assert "Mbit/s" in ax.get_xlabel() and "samples/s" in ax.get_ylabel()
    assert len(data_lines(ax)) == 3 * 3  # three algorithms, split by the three RTTs


def test_accuracy_vs_bytes(sweep):
    figure = plots.accuracy_vs_bytes(sweep.summary)
    check_figure(figure)
    (ax,) = figure.axes
    assert ax.get_xscale() == "log" and "kB" in ax.get_xlabel()
    assert len(data_lines(ax)) == 3


def test_async_vs_sync(sweep):
    ratios = plots.compute_comm_ratio(sweep.steps)
    row = ratios[(ratios["network"] == "delay1-rate10Mbit") & (ratios["seed"] == 0)].iloc[0]
    assert row["compute_comm_ratio"] == pytest.approx((1.2 - 0.4) / 0.4)
    figure = plots.async_vs_sync(sweep.summary, sweep.steps)
    check_figure(figure)
    assert len(data_lines(figure.axes[0])) == 2


def test_async_vs_sync_draws_one_algorithm_across_its_workloads(tmp_path):
    """sync and eawild each on a light and a compute-padded workload, two seeds: one eawild line
    from the light workload's ratio (1.5x faster) to the heavy one's (0.5x), each point the median
    of its seeds at their median ratio."""
    light, heavy = {"lr": 0.05}, {"lr": 0.05, "min_compute_s": 0.05}
    jobs = []
    for seed in (0, 1):
        jobs += [FakeJob("sync", label="sync-light", seed=seed, step_time_s=1.0, blocked_s=0.5 + 0.01 * seed,
                         evals={9: 0.95}, config=light),
                 FakeJob("sync", label="sync-heavy", seed=seed, step_time_s=1.0, blocked_s=0.05,
                         evals={9: 0.95}, config=heavy),
                 FakeJob("eawild", label="eawild-light", seed=seed, step_time_s=1 / 1.5, evals={9: 0.95}, config=light),
                 FakeJob("eawild", label="eawild-heavy", seed=seed, step_time_s=2.0, evals={9: 0.95}, config=heavy)]
    results = load_results([write_run(tmp_path, jobs)])
    figure = plots.async_vs_sync(results.summary, results.steps)
    check_figure(figure)
    (line,) = data_lines(figure.axes[0])
    assert line.get_label() == "eawild"
    xs, ys = list(line.get_xdata()), list(line.get_ydata())
    assert xs == pytest.approx([(0.5 - 0.01 * 0.5) / (0.5 + 0.01 * 0.5), 0.95 / 0.05], rel=0.02)
    assert ys == pytest.approx([1.5, 0.5])


def test_single_sweep_point_still_draws_markers(tmp_path):
    results = load_results([write_run(tmp_path, sync_and_dts(rate="100Mbit"))])
    for figure in (plots.speedup_vs_latency(results.summary), plots.throughput_vs_bandwidth(results.summary),
                   plots.async_vs_sync(results.summary, results.steps)):
        check_figure(figure)
        assert plots.ONE_POINT_NOTE in notes(figure)
        for ax in figure.axes:
            for line in data_lines(ax):
                assert line.get_marker() not in (None, "None", "") and len(line.get_xdata()) == 1


def test_empty_inputs_give_a_labelled_figure_with_a_note():
    empty = pd.DataFrame(columns=["network", "delay_scale", "rate", "algorithm", "label", "seed", "status",
                                  "final_accuracy", "steps_per_s", "speedup_vs_sync", "throughput_speedup_vs_sync",
                                  "bytes_sent_per_node"])
    for figure in (plots.speedup_vs_latency(empty), plots.throughput_vs_bandwidth(empty),
                   plots.accuracy_vs_bytes(empty), plots.async_vs_sync(empty, pd.DataFrame()),
                   plots.loss_accuracy_vs_time(pd.DataFrame(), pd.DataFrame())):
        check_figure(figure)
        assert "no " in notes(figure)


def test_speedup_vs_nodes():
    rows = []
    for nodes, swarm_speedup in ((4, 1.2), (16, 1.6), (64, 2.5), (256, None)):
        rows.append({"label": "sync", "algorithm": "sync", "seed": 0, "nodes": nodes,
                     "speedup_vs_sync": 1.0, "throughput_speedup_vs_sync": 1.0})
        rows.append({"label": "swarmsgd", "algorithm": "swarmsgd", "seed": 0, "nodes": nodes,
                     "speedup_vs_sync": swarm_speedup, "throughput_speedup_vs_sync": 2 * (swarm_speedup or 1.5)})
    figure = plots.speedup_vs_nodes(pd.DataFrame(rows))
    check_figure(figure)
    time_ax, rate_ax = figure.axes
    for ax in (time_ax, rate_ax):
        assert ax.get_xlabel() == "nodes (count)" and ax.get_xscale() == "log"
    # swarmsgd (sync is the reference line at 1); at 256 nodes it never reached the target
    assert list(data_lines(time_ax)[0].get_xdata()) == [4, 16, 64]
    assert list(data_lines(time_ax)[0].get_ydata()) == pytest.approx([1.2, 1.6, 2.5])
    assert list(data_lines(rate_ax)[0].get_xdata()) == [4, 16, 64, 256]
    assert list(data_lines(rate_ax)[0].get_ydata()) == pytest.approx([2.4, 3.2, 5.0, 3.0])
    assert "target not reached at 256 nodes" in notes(figure)


def test_seeds_with_equal_values_draw_their_spread():
    """Three seeds of a deterministic simulation share a throughput whose float mean rounds below
    the min (31.38126012 x 3); the spread bars must still draw (matplotlib refuses negative yerr)."""
    rows = []
    for delay, rtt in ((0.1, 21.6), (1.0, 215.7)):
        for seed in range(3):
            rows.append({"label": "sync", "algorithm": "sync", "seed": seed, "delay_scale": delay,
                         "mean_rtt_ms": rtt, "rate": None, "speedup_vs_sync": 1.0, "throughput_speedup_vs_sync": 1.0})
            rows.append({"label": "dts", "algorithm": "dts", "seed": seed, "delay_scale": delay,
                         "mean_rtt_ms": rtt, "rate": None, "speedup_vs_sync": 20.0 + seed,
                         "throughput_speedup_vs_sync": 31.38126012})
    assert pd.Series([31.38126012] * 3).mean() < 31.38126012  # the rounding this test is about
    figure = plots.speedup_vs_latency(pd.DataFrame(rows))
    check_figure(figure)
    _, rate_ax = figure.axes
    assert list(data_lines(rate_ax)[0].get_ydata()) == pytest.approx([31.38126012] * 2)
