"""A user's own training script end to end (docs/BYO_SCRIPT.md), on tun, as a new user brings it:

- the example (examples/byo/train_ddp.py, scenarios/byo-ddp.yaml) through `wanbench run` from a
  clone under the host's /tmp run by an interpreter whose venv is under /tmp too (the nodes have
  their own /tmp), started from another folder with no venv on PATH; and from a clone elsewhere;
- by hand: `wanbench up`, then `wanbench exec NODE -- torchrun ...` on every node, then
  `wanbench report` on the records folder;
- a script that crashes on one rank: exit 4, and the console names the rank, its log and error.

Both ways end in a report with steps/s and loss curves. Clones are `git clone` of the committed
tree (uncommitted changes are not in them).
"""

import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

import pandas as pd
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "wbb"
RUN_TIMEOUT_S = 900


def clone_into(folder: Path) -> Path:
    """A clone of the tree these tests run from, at its committed HEAD."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    clone = folder / "wanbench"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "checkout", "-q", head], check=True)
    return clone


def venv_under(folder: Path, project: Path) -> Path:
    """A venv under `folder` (pyvenv.cfg, bin/python, bin/torchrun): its packages are this
    interpreter's (a .pth line), its project `project`. Nothing in it is visible in a node unless
    wanbench carries it in."""
    venv = folder / "venv"
    (venv / "bin").mkdir(parents=True)
    base = os.path.realpath(sys.executable)
    (venv / "pyvenv.cfg").write_text(f"home = {os.path.dirname(base)}\ninclude-system-site-packages = false\n"
                                     f"version = {'.'.join(map(str, sys.version_info[:3]))}\n")
    (venv / "bin" / "python").symlink_to(base)
    (venv / "bin" / "python3").symlink_to("python")
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    site.mkdir(parents=True)
    (site / "shared.pth").write_text(f"{project}\n{sysconfig.get_paths()['purelib']}\n")
    torchrun = venv / "bin" / "torchrun"
    torchrun.write_text(f"#!{venv}/bin/python\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    return venv


def bare_env(**extra) -> dict:
    """A user's shell: no venv on PATH, no PYTHONPATH, our prefix."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": "/usr/local/bin:/usr/bin:/bin", "WANBENCH_PREFIX": PREFIX, **extra}


def wanbench(python, *args, cwd, env, timeout=RUN_TIMEOUT_S, check=True):
    result = subprocess.run([str(python), "-m", "harness.cli", *args], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"wanbench {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(autouse=True)
def clean_prefix():
    from emulator.clean import clean

    clean(PREFIX)
    yield
    clean(PREFIX)


def check_example_run(runs: Path) -> pd.DataFrame:
    """The byo-ddp run under `runs`: complete, both delays ran every step, curves drawn."""
    (run_dir,) = list((runs / "byo-ddp").iterdir())
    assert (run_dir / "COMPLETE").exists()
    summary = pd.read_csv(run_dir / "summary.csv").set_index("network")
    assert list(summary.index) == ["delay0.25", "delay1"]
    assert (summary["status"] == "ok").all() and (summary["steps"] == 30).all()
    assert (summary["steps_per_s"] > 0).all() and (summary["wire_bytes_per_node"] > 0).all()
    assert summary.loc["delay0.25", "steps_per_s"] > summary.loc["delay1", "steps_per_s"]  # 4x the delay, slower
    assert summary["congestion_control"].notna().all() and summary["final_accuracy"].notna().all()
    figures = sorted(p.name for p in (run_dir / "report" / "figures").glob("progress-*.png"))
    assert len(figures) == 2, figures
    report = (run_dir / "report" / "report.md").read_text()
    assert "wire bytes per pair" in report and "tcp_congestion_control" in report
    job = json.loads((run_dir / "jobs" / "delay1-command-seed0" / "job.json").read_text())
    assert job["node_stack"]["sysctls"]["net.ipv4.tcp_congestion_control"] in ("bbr", "reno", "cubic")
    return summary


def test_the_example_runs_from_a_clone_and_venv_under_tmp(tmp_path):
    assert str(tmp_path).startswith("/tmp/")  # the host's /tmp: each node has its own
    clone = clone_into(tmp_path)
    venv = venv_under(tmp_path, clone)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = wanbench(venv / "bin" / "python", "run", str(clone / "scenarios" / "byo-ddp.yaml"),
                      "--output", str(tmp_path / "runs"), cwd=elsewhere, env=bare_env())
    check_example_run(tmp_path / "runs")
    assert "Traceback" not in result.stderr


def test_the_example_runs_from_a_clone_elsewhere():
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="wbb-clone-") as folder:
        clone = clone_into(Path(folder))
        (clone / ".venv").symlink_to(Path(sys.prefix))
        wanbench(clone / ".venv" / "bin" / "python", "run", "wanbench/scenarios/byo-ddp.yaml",
                 "--output", str(Path(folder) / "runs"), cwd=folder, env=bare_env(PYTHONPATH=str(clone)))
        check_example_run(Path(folder) / "runs")


def test_by_hand_up_exec_torchrun_then_report(tmp_path):
    clone = clone_into(tmp_path)
    venv = venv_under(tmp_path, clone)
    python = venv / "bin" / "python"
    records = tmp_path / "by-hand"  # under the host's /tmp: exec carries it in
    env = bare_env(WANBENCH_OUTPUT_DIR=str(records))
    wanbench(python, "up", str(clone / "topologies" / "aws-4region.yaml"), "--backend", "tun",
             "--delay-scale", "0.25", cwd=tmp_path, env=env, timeout=120)
    try:
        nodes = ["london-0", "tokyo-0", "oregon-0", "ohio-0"]  # rank order: the plan's
        procs = [subprocess.Popen(
            [str(python), "-m", "harness.cli", "exec", node, "--", "torchrun", "--nnodes", "4",
             "--nproc-per-node", "1", "--node-rank", str(rank), "--master-addr", "london-0",
             "--master-port", "29400", "train_ddp.py", "--steps", "10"],
            cwd=clone / "examples" / "byo", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, node in enumerate(nodes)]
        outputs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * 4, outputs[0][-3000:]
        assert "step 10/10" in outputs[0]
        wanbench(python, "report", str(records), cwd=tmp_path, env=env, timeout=300)
    finally:
        wanbench(python, "down", cwd=tmp_path, env=env, timeout=120, check=False)
    run_dir = records / "wanbench-run"
    summary = pd.read_csv(run_dir / "report" / "summary.csv")
    (row,) = summary.to_dict("records")
    assert row["steps"] == 10 and row["steps_per_s"] > 0 and row["workers"] == 4
    assert row["wire_bytes_per_node"] > 0 and row["congestion_control"] in ("bbr", "reno", "cubic")
    assert list((run_dir / "report" / "figures").glob("progress-*.png"))


def test_a_crash_on_one_rank_is_exit_4_naming_rank_log_and_error(tmp_path):
    (tmp_path / "topo.yaml").write_text(textwrap.dedent("""
        name: byo-two
        address_pool: 10.232.0.0/24
        regions: {east: {nodes: 1}, west: {nodes: 1}}
        defaults: {rate: 200Mbit}
        links:
          - {between: [east, west], rtt: 20ms}
    """))
    scenario = tmp_path / "crash.yaml"
    scenario.write_text(textwrap.dedent(f"""
        name: byo-crash
        topology: topo.yaml
        backend: tun
        command: [python, train_ddp.py, --steps, "20", --crash-rank, "1", --crash-step, "2"]
        cwd: {ROOT / 'examples' / 'byo'}
        verify: {{enabled: false}}
        job_timeout_s: 300
    """))
    result = wanbench(sys.executable, "run", str(scenario), "--output", str(tmp_path / "runs"), cwd=tmp_path,
                      env=bare_env(PYTHONPATH=str(ROOT)), check=False)
    assert result.returncode == 4, result.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs" / "byo-crash").iterdir())
    log = run_dir / "jobs" / "delay1-command-seed0" / "rank1.log"
    # exit 1, or -6 where torch's gloo threads abort the interpreter's exit after the traceback
    # (pytorch/pytorch#190489): either way rank 1 is named, with its exception
    assert re.search(rf"first failed: rank 1 \(exit (1|-6)\), log {re.escape(str(log))}\n", result.stderr), \
        result.stderr[-3000:]
    assert "error: RuntimeError: injected failure on rank 1 at step 2" in result.stderr
    assert "1 of 1 jobs did not end ok" in result.stderr
    assert (run_dir / "COMPLETE").exists() and (run_dir / "report" / "report.md").exists()
