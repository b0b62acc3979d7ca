"""A compute profile (min_compute_s): every step's forward + backward is padded to the profiled
accelerator's time, the unpadded time is recorded, and communication still overlaps it."""

import pytest

from tests.trainers.conftest import records, run_training

pytestmark = pytest.mark.slow

PAD_S = 0.04


@pytest.mark.parametrize("algorithm", [{"name": "sync"}, {"name": "p3"}])
def test_every_step_takes_at_least_the_profiled_compute(tmp_path, algorithm):
    out = run_training(tmp_path, 2, {"steps": 6, "eval_every": 3, "min_compute_s": PAD_S, "algorithm": algorithm})
    for rank in range(2):
        steps = records(out, rank, "step")
        assert len(steps) == 6
        for row in steps:
            assert row["compute_unpadded_s"] < PAD_S         # this machine's MLP step is far faster
            assert row["step_s"] >= PAD_S
        if algorithm["name"] == "sync":  # p3's forward waits for last step's slices: blocked, not compute
            # compute_s is step_s less the comm layer's blocked time, which may overlap a step's
            # end by a millisecond or two when a peer lags; the median is the padded compute
            assert sorted(row["compute_s"] for row in steps)[3] >= 0.95 * PAD_S


def test_without_a_profile_nothing_is_padded(tmp_path):
    out = run_training(tmp_path, 2, {"steps": 6, "eval_every": 3})
    steps = records(out, 0, "step")
    assert all(row["compute_unpadded_s"] == pytest.approx(row["compute_s"], abs=0.01) for row in steps[1:])
    assert min(row["compute_s"] for row in steps) < PAD_S
