"""A user's own script (harness/byo.py, trainers/byo.py, emulator/visibility.py): what is checked
before anything is built, how a failure is told, and what its records give the summary. Unit
tier: no namespaces (the end-to-end runs are in test_byo_e2e.py)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from emulator.node_enter import outermost, resolve_links, visible_plan
from emulator.visibility import NotVisibleError, check_visible, default_folders, path_with_venv_first, venv_bin
from harness import byo
from harness.rundir import RunDir
from harness.results import load_run, summarize
from trainers.byo import Recorder

ROOT = Path(__file__).resolve().parents[2]


def test_links_on_the_way_are_followed_and_named(tmp_path):
    real = tmp_path / "real" / "venv"
    (real / "bin").mkdir(parents=True)
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(real)
    (tmp_path / "rel").symlink_to("clone/.venv/bin")
    found, links = resolve_links(str(tmp_path / "rel"))
    assert found == str(real / "bin")
    assert links == [(str(tmp_path / "rel"), "clone/.venv/bin"), (str(clone / ".venv"), str(real))]
    folders, links = visible_plan([str(clone / ".venv"), str(clone)])
    assert folders == [str(real), str(clone)]
    assert links == [(str(clone / ".venv"), str(real))]


def test_outermost_keeps_one_folder_of_nested_ones():
    assert outermost(["/tmp/a/b", "/tmp/a", "/tmp/ab", "/tmp/a/b/c"]) == ["/tmp/a", "/tmp/ab"]


def test_a_path_a_node_cannot_see_is_one_line(tmp_path):
    with pytest.raises(NotVisibleError, match=r"^mounts\[0\]: .*/nope: no such folder$"):
        check_visible([tmp_path / "nope"], "mounts[0]:")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotVisibleError, match="not a folder"):
        check_visible([tmp_path / "file"])
    with pytest.raises(NotVisibleError, match="inside /proc"):
        check_visible(["/proc/self"])
    assert check_visible(["/dev/shm"]) == ["/dev/shm"]


def test_the_interpreter_and_project_are_always_carried():
    folders = default_folders()
    assert sys.prefix in folders and str(ROOT) in {os.path.realpath(f) for f in folders}
    assert path_with_venv_first("/usr/bin:" + venv_bin()).split(":") == [venv_bin(), "/usr/bin"]
    assert path_with_venv_first(None).split(":")[0] == venv_bin()


@pytest.mark.parametrize("field, value, message", [
    ("cwd", "no-such-folder", "cwd: .*/no-such-folder: no such folder"),
    ("mounts", ["/var/tmp/wanbench-no-such-mount"], r"mounts\[0\]: /var/tmp/wanbench-no-such-mount: no such folder"),
])
def test_a_missing_cwd_or_mount_is_exit_2_in_one_line_before_anything_is_built(tmp_path, field, value, message):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(textwrap.dedent(f"""
        name: byo-bad
        topology: aws-4region.yaml
        command: ["python", "train.py"]
        {field}: {json.dumps(value)}
    """))
    env = {**os.environ, "WANBENCH_PREFIX": "wbd", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(scenario), "--output",
                             str(tmp_path / "runs")], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(scenario) in lines[0], result.stderr
    import re

    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was started
    # nothing was built: no network state, no namespace of the prefix
    assert not Path("/run/wanbench/wbd/state.json").exists()
    assert not list(Path("/run/netns").glob("wbd-*")) if Path("/run/netns").is_dir() else True


def test_cwd_without_a_command_is_refused(tmp_path):
    from emulator.schema import ConfigError
    from harness.scenario import scenario_from_dict

    with pytest.raises(ConfigError, match="cwd"):
        scenario_from_dict({"topology": "aws-4region.yaml", "algorithms": [{"name": "sync"}],
                            "cwd": str(tmp_path)}, str(tmp_path / "s.yaml"))


def test_relative_cwd_and_mounts_start_at_the_scenario_folder(tmp_path):
    from harness.scenario import load_scenario

    (tmp_path / "code").mkdir()
    (tmp_path / "data").mkdir()
    path = tmp_path / "s.yaml"
    path.write_text("topology: aws-4region.yaml\ncommand: [python, x.py]\ncwd: code\nmounts: [data]\n")
    job = load_scenario(path).jobs[0]
    assert job.cwd == str(tmp_path / "code")
    assert job.mounts == [str(tmp_path), str(tmp_path / "data")]
    assert byo.shares_for(job) == [str(tmp_path), str(tmp_path / "data"), str(tmp_path / "code")]


TRACEBACK = """\
[rank2]: Traceback (most recent call last):
  File "train_ddp.py", line 70, in main
[rank2]: RuntimeError: injected failure on rank 2 at step 2
E1125 torch/distributed/elastic/multiprocessing/api.py: failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
"""


def test_the_error_line_is_the_tracebacks_not_the_launchers(tmp_path):
    log = tmp_path / "rank2.log"
    log.write_text(TRACEBACK)
    assert byo.error_line(log) == "RuntimeError: injected failure on rank 2 at step 2"
    log.write_text("starting\nsegfault somewhere\n\n")
    assert byo.error_line(log) == "segfault somewhere"
    assert byo.error_line(tmp_path / "missing.log") == ""


def test_the_first_failed_rank_is_the_one_whose_log_ended_first(tmp_path):
    for rank, mtime in ((0, 200.0), (1, 100.0), (3, 150.0)):
        (tmp_path / f"rank{rank}.log").write_text(f"ValueError: rank {rank}\n")
        os.utime(tmp_path / f"rank{rank}.log", (mtime, mtime))
    reason = "rank 0 exited 1; rank 1 exited 1; rank 3 exited -15; the other ranks were ended"
    assert byo.first_failed_rank(tmp_path, reason) == (1, 1)
    lines = byo.failure_lines(tmp_path, "failed", reason)
    assert lines == [f"first failed: rank 1 (exit 1), log {tmp_path / 'rank1.log'}", "error: ValueError: rank 1"]
    assert byo.failure_lines(tmp_path, "stalled", "no rank wrote a record for 120 s") == [
        "stalled: no rank wrote a record for 120 s"]
    assert byo.failure_lines(tmp_path, "ok", "") == []
    # a rank ended by a signal: the signal (and what the harness said of it) is the error, not the
    # last line its log happened to hold
    (tmp_path / "rank1.log").write_text("[W socket.cpp:207] The hostname of the client socket cannot be retrieved\n")
    os.utime(tmp_path / "rank1.log", (100.0, 100.0))  # it ended first, as a killed rank does
    crashed = "rank 0 exited 1; rank 1 exited -9 (injected node_crash at 12.2 s)"
    assert byo.failure_lines(tmp_path, "failed", crashed)[1] == "error: killed by signal 9 (injected node_crash at 12.2 s)"


GLOO_PEER_LOSS = ("[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                  "peer [10.232.0.2]:27294. This is typically caused by a remote worker crashing.\n")


def test_a_rank_that_lost_its_peer_is_not_the_first_to_fail_even_when_its_log_ended_first(tmp_path):
    """Two ranks that end within the file clock's resolution: the one whose error is its peer's
    loss is the consequence; the one that raised is named, with its exception though an abort
    in torch's teardown ended it (exit -6)."""
    (tmp_path / "rank0.log").write_text(GLOO_PEER_LOSS)
    (tmp_path / "rank1.log").write_text("[rank1]: RuntimeError: injected failure on rank 1 at step 2\n"
                                        "terminate called without an active exception\n")
    os.utime(tmp_path / "rank0.log", (100.0, 100.0))
    os.utime(tmp_path / "rank1.log", (100.004, 100.004))
    reason = "rank 0 exited 1; rank 1 exited -6"
    assert byo.first_failed_rank(tmp_path, reason) == (1, -6)
    assert byo.failure_lines(tmp_path, "failed", reason) == [
        f"first failed: rank 1 (exit -6), log {tmp_path / 'rank1.log'}",
        "error: RuntimeError: injected failure on rank 1 at step 2 (then signal 6 as it exited)"]
    # when every failed rank lost a peer, the times decide as before
    (tmp_path / "rank1.log").write_text(GLOO_PEER_LOSS.replace("rank0", "rank1"))
    os.utime(tmp_path / "rank1.log", (100.004, 100.004))
    assert byo.first_failed_rank(tmp_path, "rank 0 exited 1; rank 1 exited 1") == (0, 1)


def test_sysctl_output_is_parsed():
    assert byo.parse_sysctl("net.ipv4.tcp_congestion_control = bbr\nnet.ipv4.tcp_rmem = 4096\t131072  6291456\n") == {
        "net.ipv4.tcp_congestion_control": "bbr", "net.ipv4.tcp_rmem": "4096 131072 6291456"}


def _run_dir_with(tmp_path: Path, write_records) -> Path:
    run_dir = tmp_path / "run"
    job_dir = run_dir / "jobs" / "delay1-command-seed0"
    job_dir.mkdir(parents=True)
    (run_dir / "scenario.json").write_text(json.dumps({"name": "byo", "spec": {"stop": {"target_accuracy": 0.5}}}))
    (job_dir / "job.json").write_text(json.dumps({
        "job_id": job_dir.name, "status": "ok", "wall_s": 12.5, "label": "command", "algorithm": "command",
        "seed": 0, "network": {"delay_scale": 1.0, "rate": None}, "network_key": "delay1", "nodes": 2,
        "node_stack": {"sysctls": {"net.ipv4.tcp_congestion_control": "reno"}, "nodes": {}}}))
    (job_dir / "wire.json").write_text(json.dumps({"nodes": {"a-0": {"bytes_sent": 1000, "rank": 0},
                                                             "b-0": {"bytes_sent": 3000, "rank": 1}},
                                                   "pairs": [{"src": "a-0", "dst": "b-0", "bytes": 1000},
                                                             {"src": "b-0", "dst": "a-0", "bytes": 3000}]}))
    write_records(job_dir)
    return run_dir


def test_records_of_the_helper_give_the_built_in_summary(tmp_path, monkeypatch):
    def write(job_dir):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WANBENCH_OUTPUT_DIR", str(job_dir))
            with Recorder() as rec:
                for step in range(4):
                    rec.step(step, loss=2.0 - step / 4, step_s=0.5)
                    if rank == 0 and step % 2 == 1:
                        rec.eval(step, accuracy=0.3 * (step + 1) / 2)

    run_dir = _run_dir_with(tmp_path, write)
    frames = load_run(run_dir)
    row = summarize(frames).iloc[0]
    # training time runs from the first step's start (its time_s less its step_s) to the last step
    assert row["steps"] == 4 and 0.5 <= row["train_time_s"] < 5
    assert row["steps_per_s"] == pytest.approx(4 / row["train_time_s"])
    assert row["final_accuracy"] == pytest.approx(0.6) and row["time_to_target_s"] is not None
    assert row["wire_bytes_per_node"] == 2000 and row["congestion_control"] == "reno" and row["wall_s"] == 12.5
    assert pd_isna(row["bytes_sent_per_node"])  # the script counted none: not shown as 0
    assert list(frames.steps["loss"])[:4] == [2.0, 1.75, 1.5, 1.25]
    lines = "\n".join(byo.report_lines(RunDir(run_dir).jobs))
    assert "wall time 12.5 s" in lines and "tcp_congestion_control reno" in lines
    assert "wire bytes per pair: b-0->a-0 3 kB, a-0->b-0 1 kB" in lines  # the busiest first


def pd_isna(value) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def test_the_helper_is_a_no_op_outside_wanbench(monkeypatch, tmp_path):
    monkeypatch.delenv("WANBENCH_OUTPUT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    rec = Recorder()
    assert rec.step(0, loss=1.0) is None and rec.eval(0, accuracy=0.5) is None
    rec.close()
    assert list(tmp_path.iterdir()) == []


def test_the_example_imports_no_wanbench():
    source = (ROOT / "examples" / "byo" / "train_ddp.py").read_text()
    imports = [line.strip() for line in source.splitlines() if line.strip().startswith(("import ", "from "))]
    assert [line for line in imports if "trainers" in line or "harness" in line or "emulator" in line] == [
        "from trainers.byo import Recorder  # optional: records for wanbench's report"]
    assert "except ImportError:" in source


def test_a_folder_of_records_reports_as_a_one_job_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANBENCH_PREFIX", "wbd")  # no network up under it: no plan, no wire
    out = tmp_path / "by-hand"
    for rank in (0, 1):
        with Recorder(str(out), rank=rank) as rec:
            for step in range(3):
                rec.step(step, loss=1.0, step_s=0.1)
    run_dir = byo.run_dir_of(out)
    assert run_dir == out / byo.BY_HAND_RUN and byo.run_dir_of(run_dir) == run_dir
    row = summarize(load_run(run_dir)).iloc[0]
    assert row["steps"] == 3 and row["steps_per_s"] == pytest.approx(3 / row["train_time_s"]) and row["status"] == "ok"
