"""bench_standin_utilisation's helpers: the bandwidth a target utilisation needs, read off a swept
curve; the paper's fragment counts; the uniform-bandwidth topology (issue 24)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from bench_standin_utilisation import (  # noqa: E402
    TOPOLOGY, algorithm_for, bandwidth_for_utilisation, fragments_for, log_grid, network_topology,
)


def curve(*points):
    return [{"rate_gbit_s": rate, "compute_utilisation": util} for rate, util in points]


def test_interpolates_log_linearly_between_the_points_around_the_target():
    # halfway in utilisation between 1 and 100 Gbit/s is halfway in log rate: 10 Gbit/s
    assert bandwidth_for_utilisation(curve((1, 0.5), (100, 1.0)), 0.75) == pytest.approx(10.0)
    # a quarter of the way: 10 ** 0.5
    assert bandwidth_for_utilisation(curve((1, 0.5), (100, 1.0)), 0.625) == pytest.approx(math.sqrt(10))


def test_uses_the_pair_around_the_first_crossing_whatever_the_row_order():
    rows = curve((100, 0.97), (0.1, 0.2), (10, 0.96), (1, 0.6), (30, 0.94))  # dips after the crossing
    # first grid point at or above 0.95 is 10 Gbit/s (0.96); its neighbour below is 1 Gbit/s (0.6)
    expected = math.exp(math.log(1) + (0.95 - 0.6) / (0.96 - 0.6) * (math.log(10) - math.log(1)))
    assert bandwidth_for_utilisation(rows, 0.95) == pytest.approx(expected)
    assert bandwidth_for_utilisation(rows, 0.6) == pytest.approx(1.0)  # a grid point exactly


def test_none_when_never_reached_and_the_lowest_rate_when_always_reached():
    rows = curve((0.3, 0.4), (3, 0.6), (30, 0.67))
    assert bandwidth_for_utilisation(rows, 0.95) is None
    assert bandwidth_for_utilisation(rows, 0.3) == 0.3


def test_bad_rows_fail_naming_the_field():
    with pytest.raises(ValueError, match="rows"):
        bandwidth_for_utilisation([], 0.5)
    with pytest.raises(ValueError, match="rate_gbit_s"):
        bandwidth_for_utilisation(curve((0, 0.9)), 0.5)


def test_fragments_are_the_papers_three_layers_rounded_to_a_divisor_of_H():
    # arXiv 2501.18512 Table 4: 24 / 48 / 108 layers, 3 per fragment -> 8 / 16 / 36
    assert fragments_for(1e9, 100) == 10
    assert fragments_for(10e9, 100) == 20
    assert fragments_for(100e9, 100) == 25
    assert fragments_for(10e9, 96) == 16  # a divisor itself when H allows it
    with pytest.raises(ValueError, match="fragments"):
        fragments_for(3e9, 100)


def test_log_grid_spans_its_ends_evenly_in_log():
    grid = log_grid("0.1,100,2")
    assert grid[0] == 0.1 and grid[-1] == 100 and len(grid) == 7
    ratios = [b / a for a, b in zip(grid, grid[1:])]
    assert all(r == pytest.approx(math.sqrt(10), rel=1e-3) for r in ratios)


def test_uniform_sets_the_intra_region_links_to_the_swept_rate_too():
    plain = network_topology(TOPOLOGY, 2, None, 3e9, uniform=False)
    uniform = network_topology(TOPOLOGY, 2, None, 3e9, uniform=True)
    assert plain.intra_region.rate_bit_s == 10e9  # the topology's own
    assert uniform.intra_region.rate_bit_s == 3e9
    for topology in (plain, uniform):
        assert {spec.rate_bit_s for spec in topology.links.values()} == {3e9}
        assert topology.node_count == 8
    assert network_topology(TOPOLOGY, 2, {"london": 3, "tokyo": 1, "oregon": 0, "ohio": 0}, 1e9,
                            uniform=True).node_count == 4


def test_no_slow_start_after_idle_reaches_the_plan():
    from emulator.plan import make_plan

    assert make_plan(network_topology(TOPOLOGY, 2, None, 1e9, uniform=True)).slow_start_after_idle()
    assert not make_plan(network_topology(TOPOLOGY, 2, None, 1e9, uniform=True,
                                          slow_start_after_idle=False)).slow_start_after_idle()


@pytest.mark.parametrize("method, label, params", [
    ("diloco", "diloco-H100", {"H": 100, "outer_precision": "fp32"}),
    ("diloco-int4", "diloco-H100-int4", {"H": 100, "outer_precision": "int4"}),
    ("diloco-int4-ring", "diloco-H100-int4-ring", {"H": 100, "outer_precision": "int4", "outer_reduce": "ring"}),
    ("streaming-int4-ring", "streaming-H100-F20-tau1-int4-ring",
     {"H": 100, "outer_precision": "int4", "outer_reduce": "ring", "fragments": 20, "overlap": 1}),
])
def test_methods_name_their_precision_and_reduce_and_are_valid_trainer_params(method, label, params):
    from trainers.algorithms import get_algorithm
    from trainers.config import from_dict

    got_label, algorithm, _ = algorithm_for(method, 100, 20, 1)
    assert (got_label, algorithm["params"]) == (label, params)
    from_dict(get_algorithm(algorithm["name"]).Params, algorithm["params"], "algorithm.params")


def test_an_unknown_method_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown method 'diloco-fp8'"):
        algorithm_for("diloco-fp8", 100, 20, 1)


def test_from_csv_joins_several_sweeps_into_one_table(capsys, tmp_path):
    """--from-csv with the committed 10B sweep and the data-parallel sweep: one thresholds table
    with both files' methods, and a figure with a panel per size (no simulation)."""
    from bench_standin_utilisation import main

    bench = REPO / "results" / "bench"
    assert main(["--from-csv", str(bench / "standin_utilisation_uniform_nossai.csv"),
                 str(bench / "standin_utilisation_uniform_nossai_sync.csv"), "--plot", str(tmp_path / "curves")]) == 0
    out = capsys.readouterr().out
    assert "streaming-H100-F20-tau1-int4" in out and "sync" in out and "1e+11" in out
    assert (tmp_path / "curves.png").stat().st_size > 10_000
