"""The userspace delay line of the `tun` backend: one TUN device per node, every pair shaped here.

`scheduler` is the pure per-pair link model (queue, rate, delay, jitter, loss); `packet` parses the
few header fields it needs; `device` opens TUN devices; `runtime` is the process that moves packets;
`probe` is a standalone UDP echo prober for measuring round-trip times precisely.
"""
