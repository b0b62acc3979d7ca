"""The `tun` backend: node namespaces joined by a userspace delay line (no sch_netem needed).

`up` creates the namespaces, then starts `python -m emulator.delayline` as a background process in
its own session (it outlives the CLI's `up`); that process owns one TUN device per node and shapes
every ordered pair. Its pid, log and counters live in the run-state folder, so `down` works from
another process. The TUN devices are not persistent: if the delay line dies, they vanish with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .. import netns
from ..delayline import control
from ..files import write_json_atomic
from ..linkspec import LinkSpec
from ..processes import stop_pids
from . import tun_shortcut
from .base import Backend, BackendUnavailable, clear_state, read_state, register

READY_TIMEOUT_S = 30.0     # opening devices takes ~10 ms per node; python start-up dominates
STOP_TIMEOUT_S = 5.0       # SIGTERM, then SIGKILL after this long
LINK_CHANGE_TIMEOUT_S = 5.0  # the loop applies changes within one counters interval (1 s)
COUNTERS_TIMEOUT_S = 5.0     # a fresh counters file (SIGUSR1) is written within one loop turn
LOG_TAIL_BYTES = 4000
DELAYLINE_MODULE = "emulator.delayline"
# The repository root, so that `-m emulator.delayline` resolves even when the caller's cwd differs.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def _log_tail(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-LOG_TAIL_BYTES:].decode(errors="replace").strip() or "(empty log)"


def is_our_delayline(pid: int, prefix: str) -> bool:
    """True when `pid` is alive and is the delay line of `prefix` (pids get reused)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return DELAYLINE_MODULE.encode() in argv and any(f"/{prefix}/".encode() in arg for arg in argv)


def stop_delayline(pid: int, prefix: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the delay line `pid`, SIGKILL it after `timeout_s` (s); only if it is really ours."""
    stop_pids([pid], timeout_s, is_ours=lambda candidate: is_our_delayline(candidate, prefix))


@register
class TunBackend(Backend):
    """Namespaces plus one userspace delay-line process that shapes every ordered pair."""

    name = "tun"
    # Extra command-line options for the delay line (see `python -m emulator.delayline --help`);
    # the benchmark sets them to compare timing policies side by side.
    delayline_options: tuple[str, ...] = ()
    # Pairs whose round trip (as applied) is at most this many ms go through the kernel, not the
    # delay line (tun_shortcut.py); None: every pair through the delay line.
    shortcut_max_rtt_ms: Optional[float] = tun_shortcut.DEFAULT_MAX_RTT_MS

    @classmethod
    def check_available(cls) -> None:
        if not Path("/dev/net/tun").exists():
            raise BackendUnavailable(
                "/dev/net/tun is missing: load the tun module (`modprobe tun`) or, in a container, "
                "pass the device through (docker run --device /dev/net/tun --cap-add NET_ADMIN)")
        try:
            netns.check_root()
        except netns.SystemCheckError as exc:
            raise BackendUnavailable(str(exc)) from None

    @property
    def folder(self) -> Path:
        return self.state_dir(self.plan.prefix)

    @property
    def counters_path(self) -> Path:
        return self.folder / control.COUNTERS_FILE

    @property
    def log_path(self) -> Path:
        return self.folder / "delayline.log"

    def delayline_argv(self, plan_path: Path, ready_fd: int) -> list[str]:
        """The command line of the delay-line process (the state folder path names our prefix)."""
        return [sys.executable, "-m", DELAYLINE_MODULE, "--plan", str(plan_path),
                "--counters", str(self.counters_path), "--ready-fd", str(ready_fd),
                *self.delayline_options]

    def up(self) -> None:
        shortcut_limit = tun_shortcut.limit_from_environment(self.shortcut_max_rtt_ms)  # bad input: before anything
        self.check_available()
        existing = read_state(self.plan.prefix)
        if existing is not None:
            raise RuntimeError(
                f"a network with prefix {self.plan.prefix!r} is already up ({self.folder}); "
                f"run `down` first or pick another WANBENCH_PREFIX")
        netns.check_address_pool_free(self.plan.address_pool)
        pid = None
        try:
            # The delay line starts (imports, ~0.2-1 s) while the namespaces are being created.
            pid = self._start_delayline(lambda: netns.create_nodes(self.plan))
            # The shortcut's routes name the node's address as their source: it exists once the
            # delay line has opened the TUN devices.
            pairs = [] if shortcut_limit is None else tun_shortcut.shortcut_pairs(self.plan, shortcut_limit)
            if pairs:
                tun_shortcut.build(self.plan, pairs)
            self.write_state(delayline_pid=pid, counters=str(self.counters_path),
                             log=str(self.log_path), started_unix_s=round(time.time(), 3),
                             shortcut_max_rtt_ms=shortcut_limit,
                             shortcut_pairs=[[a.name, b.name] for a, b in pairs])
        except BaseException:
            if pid is not None:
                stop_delayline(pid, self.plan.prefix)
            netns.remove_nodes(self.plan)
            tun_shortcut.remove(self.plan)
            clear_state(self.plan.prefix)
            raise

    def _start_delayline(self, meanwhile: Callable[[], None] = lambda: None) -> int:
        """Start the delay line, run `meanwhile`, let it open its devices, wait until it is ready.

        Returns its pid, or raises with the tail of its log (after stopping it).
        """
        self.folder.mkdir(parents=True, exist_ok=True)
        plan_path = self.folder / "delayline-plan.json"
        plan_path.write_text(self.plan.to_json())
        self.counters_path.unlink(missing_ok=True)
        ready_read, ready_write = os.pipe()
        go_read, go_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
        try:
            with open(self.log_path, "ab") as log:
                process = subprocess.Popen(
                    [*self.delayline_argv(plan_path, ready_write), "--go-fd", str(go_read)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    pass_fds=(ready_write, go_read), start_new_session=True,
                    cwd=str(PACKAGE_ROOT), env=env)
            os.close(ready_write)
            ready_write = -1
            os.close(go_read)
            go_read = -1
            try:
                meanwhile()
                os.write(go_write, b"g")
                os.close(go_write)
                go_write = -1
                self._wait_ready(process, ready_read)
            except BaseException:
                stop_delayline(process.pid, self.plan.prefix)
                if process.poll() is None:
                    process.kill()
                process.wait()
                raise
        finally:
            os.close(ready_read)
            for fd in (ready_write, go_read, go_write):
                if fd >= 0:
                    os.close(fd)  # closing go_write without a byte tells the delay line to exit
        return process.pid

    def _wait_ready(self, process: subprocess.Popen, ready_read: int) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        message = b""
        while b"\n" not in message:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"delay line not ready after {READY_TIMEOUT_S:.0f} s; log "
                                   f"{self.log_path}:\n{_log_tail(self.log_path)}")
            readable, _, _ = select.select([ready_read], [], [], left)
            if not readable:
                continue
            chunk = os.read(ready_read, 64)
            if not chunk:  # the pipe closed without "ready": the process died
                process.wait(timeout=STOP_TIMEOUT_S)
                raise RuntimeError(f"delay line exited with status {process.returncode} before it "
                                   f"was ready; log {self.log_path}:\n{_log_tail(self.log_path)}")
            message += chunk

    def down(self) -> None:
        saved = read_state(self.plan.prefix)
        if saved is not None:
            state, saved_plan = saved
            if state.get("delayline_pid") is not None:
                stop_delayline(int(state["delayline_pid"]), self.plan.prefix)
            # The network that is up may have been built from another plan (other topology, same
            # prefix): remove its nodes, not only the ones this plan would have made.
            netns.remove_nodes(saved_plan)
        netns.remove_nodes(self.plan)
        tun_shortcut.remove(self.plan)
        clear_state(self.plan.prefix)
        (self.folder / "delayline-plan.json").unlink(missing_ok=True)
        for path in control.control_files(self.folder):
            path.unlink(missing_ok=True)
        # The log stays only if the delay line said something worth reading (a warning, an error).
        try:
            log = self.log_path.read_text()
        except OSError:
            log = ""
        if "WARNING" not in log and "Traceback" not in log:
            self.log_path.unlink(missing_ok=True)
        try:
            self.folder.rmdir()  # empty: nothing of this network is left
        except OSError:
            pass

    @property
    def links_path(self) -> Path:
        return control.links_path(self.folder)

    def _links_in_force(self, changes: list[dict]) -> dict:
        """Region pair -> the spec in force, given the delay line's change list."""
        links = dict(self.plan.region_links)
        for change in changes:
            spec = change["spec"]
            links[(change["src_region"], change["dst_region"])] = None if spec is None else LinkSpec(**spec)
        return links

    def set_link(self, src_region: str, dst_region: str, spec) -> None:
        """Change a region pair's links in the running delay line; returns once they are in force.

        Shortcut pairs (kernel-carried) that the change makes ineligible lose their routes once the
        delay line has the change, so their packets go through it; a change back restores them."""
        state = read_state(self.plan.prefix)
        pid = (state[0] if state else {}).get("delayline_pid")
        if pid is None:
            raise RuntimeError("no delay line is running for this network")
        try:
            data = json.loads(self.links_path.read_text())
        except (OSError, ValueError):
            data = {"sequence": 0, "links": []}
        limit = state[0].get("shortcut_max_rtt_ms")
        # the pairs the kernel carries before and after the change (those whose specs are the plan's)
        before = [] if limit is None else tun_shortcut.shortcut_pairs(self.plan, limit, self._links_in_force(data["links"]))
        links = [c for c in data["links"] if (c["src_region"], c["dst_region"]) != (src_region, dst_region)]
        if spec != self.plan.region_links[(src_region, dst_region)]:
            links.append({"src_region": src_region, "dst_region": dst_region,
                          "spec": None if spec is None else dataclasses.asdict(spec)})
        sequence = data["sequence"] + 1
        write_json_atomic(self.links_path, {"sequence": sequence, "links": links}, indent=None)
        os.kill(int(pid), signal.SIGHUP)
        applied = control.applied_path(self.links_path)
        deadline = time.monotonic() + LINK_CHANGE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if int(applied.read_text() or 0) >= sequence:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        else:
            raise RuntimeError(f"the delay line did not apply link change {sequence} within "
                               f"{LINK_CHANGE_TIMEOUT_S:.0f} s; log {self.log_path}")
        after = [] if limit is None else tun_shortcut.shortcut_pairs(self.plan, limit, self._links_in_force(links))
        leaving = [pair for pair in before if pair not in after]
        joining = [pair for pair in after if pair not in before]
        if leaving:
            tun_shortcut.set_routes(leaving, "del")
        if joining:
            tun_shortcut.set_routes(joining, "add")

    def counters(self, fresh: bool = False) -> list[dict]:
        """Per-pair counters from the delay line's last write (about once a second), or, `fresh`,
        from a write it makes now (SIGUSR1; up to COUNTERS_TIMEOUT_S)."""
        rows = (self._fresh_status() if fresh else self.status()).get("pairs", [])
        state = read_state(self.plan.prefix)
        names = (state[0] if state else {}).get("shortcut_pairs") or []
        if not names:
            return rows
        # The kernel carries these pairs (or did, until a link change sent them to the delay
        # line): what each carried adds up. The kernel's side is read now.
        pairs = [(self.plan.node(a), self.plan.node(b)) for a, b in names]
        kernel = {(row["src"], row["dst"]): row for row in tun_shortcut.counters(self.plan, pairs)}
        return [tun_shortcut.add_counters(row, kernel.get((row["src"], row["dst"]))) for row in rows]

    def _fresh_status(self) -> dict:
        state = read_state(self.plan.prefix)
        pid = (state[0] if state else {}).get("delayline_pid")
        if pid is None:
            raise RuntimeError("no delay line is running for this network")
        asked_unix = time.time()
        os.kill(int(pid), signal.SIGUSR1)
        deadline = time.monotonic() + COUNTERS_TIMEOUT_S
        while time.monotonic() < deadline:
            status = self.status()
            # the file says when the delay line took the reading (rounded to the millisecond)
            if status.get("time_unix_s", 0.0) >= round(asked_unix, 3) - 0.001:
                return status
            time.sleep(0.01)
        raise RuntimeError(f"the delay line did not write its counters within {COUNTERS_TIMEOUT_S:.0f} s; "
                           f"log {self.log_path}")

    def status(self) -> dict:
        """The delay line's whole counters record (lag, unknown destinations, pairs), or {}."""
        try:
            return json.loads(self.counters_path.read_text())
        except (OSError, ValueError):
            return {}
