"""The UDP echo prober: percentiles, and a real round trip on loopback (no root needed)."""

import math
import threading

import pytest

from emulator.delayline.probe import percentile, probe, serve, summarize


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 50.0
    assert percentile(values, 0.99) == 99.0
    assert percentile(values, 1.0) == 100.0
    assert math.isnan(percentile([], 0.5))
    summary = summarize([3.0, 1.0, 2.0], sent=5)
    assert (summary["received"], summary["lost"], summary["min_ms"], summary["p50_ms"]) == (3, 2, 1.0, 2.0)


def test_probe_round_trip_on_loopback():
    ready = threading.Event()
    port = 39417
    threading.Thread(target=serve, args=(port, "127.0.0.1", ready.set), daemon=True).start()
    assert ready.wait(5)
    result = probe("127.0.0.1", port, count=50, interval_ms=1.0, size_bytes=200)
    assert result["received"] == 50 and result["lost"] == 0
    assert 0 < result["min_ms"] <= result["p50_ms"] <= result["p99_ms"] < 100
    assert len(result["samples_ms"]) == 50


def test_probe_arguments_are_checked():
    with pytest.raises(ValueError, match="size_bytes"):
        probe("127.0.0.1", 1, size_bytes=4)
    with pytest.raises(ValueError, match="count"):
        probe("127.0.0.1", 1, count=0)
