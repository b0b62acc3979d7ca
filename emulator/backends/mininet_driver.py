"""Mininet driver: builds one Mininet network from a JSON spec, holds it until SIGTERM, then stops it.

Runs under the SYSTEM Python (Debian's `mininet` package lives in /usr/lib/python3/dist-packages),
started by `emulator/backends/mininet.py` as `python3 -I mininet_driver.py serve ...`. It imports
nothing from `emulator` (the system Python has neither pydantic nor pyroute2): the backend decides
names, addresses and shaping as pure data, this process only turns that data into Mininet objects.

Protocol (`serve`): the spec arrives as one JSON document on stdin; once the network is started one
JSON line goes to stdout -- {"ready": true, "driver_pid": ..., "pids": {mininet_name: shell_pid}} or
{"error": "..."} -- and stdout is closed, so this process can outlive the `wanbench up` that started
it. SIGTERM, SIGINT or SIGHUP stop the network (Mininet's own `stop`, which ends the node shells it
started by their process group, never by name) and exit. Diagnostics go to stderr (a log file).

`bench` builds the same spec as plain Mininet `repeats` times and prints the timings as JSON: the
reference point for bench/bench_updown.py.

Spec: {"switch": "<prefix>s0", "hosts": [{"name": "<prefix>h0", "ip": "10.201.0.1/16",
"intf": "eth0", "port": "<prefix>s0-0"}, ...], "repeats": 3 (bench only)}.
"""

import argparse
import json
import os
import resource
import signal
import sys
import time

# Open files a network of a few thousand nodes needs: every node shell holds a pty and pipes.
NOFILE_LIMIT = 16384
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stop(Exception):
    """Raised from the signal handler so that `finally` stops the network."""


def _on_stop_signal(signum, _frame):
    raise Stop(signum)


def make_net(spec):
    """An unbuilt Mininet for `spec`: one LinuxBridge, plain veth links, no controller."""
    from mininet.link import Link
    from mininet.net import Mininet
    from mininet.nodelib import LinuxBridge
    from mininet.topo import Topo

    # Mininet.init() would run fixLimits(), which raises machine-wide sysctls (net.core.wmem_max,
    # neighbour table sizes, fs.file-max) in the host's own namespace. We change nothing outside our
    # namespaces, so we mark it done and only raise this process's own open-file limit.
    Mininet.inited = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < NOFILE_LIMIT:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(NOFILE_LIMIT, hard), hard))

    class SpecTopo(Topo):
        def build(self):
            # dpid given explicitly: Mininet derives it from digits in the name otherwise, and our
            # prefix may have none.
            switch = self.addSwitch(spec["switch"], dpid="1")
            for host in spec["hosts"]:
                self.addHost(host["name"], ip=host["ip"])
                # intf names given: Mininet's "<host>-eth0" could exceed IFNAMSIZ (15) for long
                # prefixes; the switch side must contain the switch name (LinuxBridge.start adds
                # only such interfaces to the bridge).
                self.addLink(host["name"], switch, intfName1=host["intf"], intfName2=host["port"])

    # cleanup=False: Mininet's cleanup (mn -c) kills processes by broad names; never run it.
    return Mininet(topo=SpecTopo(), switch=LinuxBridge, controller=None, link=Link, build=False,
                   cleanup=False, autoSetMacs=False, waitConnected=False)


def serve(spec):
    """Build and start the network, report the shell PIDs on stdout, hold it until a stop signal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_stop_signal)
    net = None
    code = 0
    try:
        net = make_net(spec)
        net.build()
        net.start()
        pids = {node.name: node.pid for node in net.hosts + net.switches}
        report = {"ready": True, "driver_pid": os.getpid(), "pids": pids}
        sys.stdout.write(json.dumps(report) + "\n")
        sys.stdout.flush()
        # The backend stops reading after this line and `wanbench up` exits; a later write to a
        # closed pipe would kill us with SIGPIPE, so stdout now points at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        while True:
            signal.pause()
    except Stop:
        pass
    except Exception as exc:  # report any build failure to the backend, then stop what was built
        code = 1
        print(f"mininet driver: {type(exc).__name__}: {exc}", file=sys.stderr)
        try:
            sys.stdout.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
            sys.stdout.flush()
        except OSError:
            pass
    finally:
        # A second SIGTERM must not interrupt the teardown half way.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        if net is not None:
            net.stop()
    return code


def bench(spec):
    """Plain Mininet up (build + start) and down (stop) `spec["repeats"]` times; timings in seconds."""
    rows = []
    for _ in range(int(spec.get("repeats", 1))):
        start = time.perf_counter()
        net = make_net(spec)
        try:
            net.build()
            net.start()
            built = time.perf_counter()
        finally:
            net.stop()
        stopped = time.perf_counter()
        rows.append({"up_s": built - start, "down_s": stopped - built, "total_s": stopped - start})
    print(json.dumps({"runs": rows}))
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["serve", "bench"])
    # Both only label the process: `wanbench clean` finds our background processes by a command
    # line that names the state folder and an `emulator.` module.
    parser.add_argument("--state-dir", default="")
    parser.add_argument("--owner", default="emulator.backends.mininet")
    args = parser.parse_args(argv)
    from mininet.log import setLogLevel

    setLogLevel("warning")
    spec = json.load(sys.stdin)
    return serve(spec) if args.mode == "serve" else bench(spec)


if __name__ == "__main__":
    sys.exit(main())
