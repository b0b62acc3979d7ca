"""verify's steady-state throughput rules, its rate warnings and its wait for the echo servers (no network)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from emulator.measure.verify import VerifyOptions, rate_warnings, steady_goodput_bit_s, wait_until_bound


def interval(start, seconds, mbit, omitted=False):
    return {"sum": {"start": start, "end": start + seconds, "seconds": seconds,
                    "bytes": int(mbit * 1e6 / 8 * seconds), "omitted": omitted}}


def test_omit_and_duration_scale_with_the_rtt():
    options = VerifyOptions()
    assert options.throughput_seconds(0.1) == (1, 5)       # short path: 1 s omitted, 5 s measured
    assert options.throughput_seconds(215.7) == (5, 6)     # 20 and 25 RTTs, rounded up
    assert options.throughput_seconds(1000.0) == (20, 25)
    assert VerifyOptions(omit_s=2.0).throughput_seconds(215.7) == (2, 6)


def test_steady_goodput_leaves_out_omitted_intervals_the_first_and_the_drain():
    report = {"intervals": [interval(0, 1, 50, omitted=True),
                            interval(0, 1, 1127),   # slow-start bytes read after the omit reset
                            interval(1, 1, 900), interval(2, 1, 950),
                            interval(3, 1.3, 1400)]}  # the sender's buffer draining
    assert steady_goodput_bit_s(report) == pytest.approx(925e6, rel=1e-6)
    assert steady_goodput_bit_s({"intervals": [interval(0, 1, 800)]}) == pytest.approx(800e6, rel=1e-6)
    assert steady_goodput_bit_s({}) is None


def test_pairs_under_the_minimum_are_named():
    rows = [{"src": "a", "dst": "b", "rate_mbit": 880.0, "rate_spec_mbit": 1000.0, "rate_ratio": 0.88,
             "congestion": "bbr", "rtt_spec_ms": 215.7},
            {"src": "b", "dst": "a", "rate_mbit": 950.0, "rate_spec_mbit": 1000.0, "rate_ratio": 0.95,
             "congestion": "bbr", "rtt_spec_ms": 215.7},
            {"src": "a", "dst": "c", "rate_mbit": None, "rate_spec_mbit": 1000.0}]
    warnings = rate_warnings(rows, 0.92)
    assert len(warnings) == 1
    assert warnings[0].startswith("a -> b: 880.0 Mbit/s is 88.0% of 1000 Mbit/s")
    assert "bbr" in warnings[0]


@pytest.mark.parametrize("field,value", [("probes", -1), ("sparse_interval_ms", 0), ("omit_s", -1.0),
                                         ("min_rate_ratio", 1.5)])
def test_bad_options_fail_at_once_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        VerifyOptions(**{field: value})


def _server(code):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_verify_waits_for_each_echo_server_to_say_it_is_bound():
    """A server slower to start than a fixed sleep is waited for; one that dies or stays silent is named."""
    from emulator.processes import stop

    nodes = [SimpleNamespace(name="a-0"), SimpleNamespace(name="b-0")]
    slow = "import time; time.sleep(0.8); print('probe server on 0.0.0.0:47000', flush=True); time.sleep(30)"
    servers = [_server(slow), _server(slow)]
    try:
        wait_until_bound(nodes, servers)
        assert all(s.poll() is None for s in servers)
    finally:
        stop(servers, grace_s=1)
    dead = [_server(slow), _server("import sys; sys.exit('cannot bind: Address already in use')")]
    try:
        with pytest.raises(RuntimeError, match="b-0 did not start: cannot bind"):
            wait_until_bound(nodes, dead)
    finally:
        stop(dead, grace_s=1)
    silent = [_server("import time; time.sleep(30)")]
    try:
        with pytest.raises(RuntimeError, match="a-0 did not start: silent for 1 s"):
            wait_until_bound(nodes[:1], silent, timeout_s=1.0)
    finally:
        stop(silent, grace_s=1)
