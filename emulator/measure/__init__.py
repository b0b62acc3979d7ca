"""Measuring a built network: the RTT prober (probe.py) and spec-vs-measured per pair (verify.py)."""
