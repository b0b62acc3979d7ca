"""`wanbench run --cluster ADDRESS` (harness/cluster.py): sim jobs as tasks of a real Dask cluster,
a scheduler and two workers as processes of their own on 127.0.0.1, nothing shared with the
harness but the scheduler's address.

The workers run the light stand-in engine and evaluator of tests/harness/test_resume.py: a
worker is a process the test cannot monkeypatch, so each loads a preload module
(`dask worker --preload FILE`, Dask's own hook) that points harness.jobs at the stand-ins, as
the test_resume fixture does in this process. The stand-in engine also leaves a mark per start
(job id, the worker's PID) in a folder of the test's, so that the test can kill the worker that
runs a job.
"""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

import harness.cluster as cluster_module
import harness.run as run_module
from emulator.schema import ConfigError
from harness import cli
from harness.scenario import load_scenario
from tests.harness.test_resume import LIGHT_ENGINE, ROOT, STUB_EVALUATOR, TUNED, WALL_CLOCK_COLUMNS

# The stand-in engine, leaving MARKS/<job id>.<worker pid> when it starts (the worker is its parent).
MARKED_ENGINE = (
    "import os, sys\nfrom pathlib import Path\n"
    "Path(os.environ['WANBENCH_TEST_MARKS'], f'{Path(sys.argv[1]).name}.{os.getppid()}').touch()\n"
    + LIGHT_ENGINE
)
# Loaded by each worker (dask worker --preload): the stand-ins in place of the simulator and evaluator.
PRELOAD = textwrap.dedent('''
    import sys
    import harness.jobs as jobs
    ENGINE, EVALUATOR = {engine!r}, {evaluator!r}
    jobs.sim_job_argv = lambda job_dir: [sys.executable, ENGINE, str(job_dir)]
    jobs.Evaluator._argv = lambda self: [sys.executable, EVALUATOR, str(self.job_dir)]
''')
START_TIMEOUT_S = 90.0


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def _summary(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "summary.csv").drop(columns=WALL_CLOCK_COLUMNS)


def _end(procs) -> None:
    """End the processes we started, by PID: SIGTERM, then SIGKILL."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def dask_cluster(tmp_path):
    """`dask scheduler` and two `dask worker`s (one thread each, no nanny: the PID is the worker's)
    on 127.0.0.1 at free ports; yields (address, the workers' processes, the marks folder)."""
    pytest.importorskip("distributed", reason="the cluster executor needs dask[distributed] (pyproject.toml)")
    from distributed import Client

    engine, evaluator, preload = tmp_path / "engine.py", tmp_path / "evaluator.py", tmp_path / "stand_ins.py"
    engine.write_text(MARKED_ENGINE)
    evaluator.write_text(STUB_EVALUATOR)
    preload.write_text(PRELOAD.format(engine=str(engine), evaluator=str(evaluator)))
    marks, worker_tmp, scheduler_file = tmp_path / "marks", tmp_path / "worker-tmp", tmp_path / "scheduler.json"
    marks.mkdir()
    worker_tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "WANBENCH_TEST_MARKS": str(marks), "ENGINE_PAUSE_S": "1.5", "TMPDIR": str(worker_tmp),
           "WANBENCH_STATE_DIR": str(tmp_path / "state")}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
             "--no-dashboard", "--scheduler-file", str(scheduler_file)],
            env=env, cwd=tmp_path, stdout=open(logs / "scheduler.log", "w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_TIMEOUT_S
        while not scheduler_file.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert scheduler_file.exists(), (logs / "scheduler.log").read_text()
        address = json.loads(scheduler_file.read_text())["address"]
        workers = [subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", "127.0.0.1", "--nthreads", "1",
             "--no-nanny", "--no-dashboard", "--name", f"w{i}", "--preload", str(preload)],
            env=env, cwd=tmp_path, stdout=open(logs / f"worker{i}.log", "w"), stderr=subprocess.STDOUT)
            for i in range(2)]
        procs += workers
        with Client(address, timeout=START_TIMEOUT_S, set_as_default=False) as client:
            client.wait_for_workers(2, timeout=START_TIMEOUT_S)
        yield address, workers, marks
    finally:
        _end(procs)


@pytest.fixture
def local_stand_ins(tmp_path, monkeypatch):
    """The same stand-ins for a local run in this process (test_resume's fixture, marks too)."""
    import harness.jobs as jobs_module

    engine, evaluator = tmp_path / "local-engine.py", tmp_path / "local-evaluator.py"
    engine.write_text(MARKED_ENGINE)
    evaluator.write_text(STUB_EVALUATOR)
    (tmp_path / "local-marks").mkdir()
    monkeypatch.setenv("WANBENCH_TEST_MARKS", str(tmp_path / "local-marks"))
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(engine), str(job_dir)])
    monkeypatch.setattr(jobs_module.Evaluator, "_argv", lambda self: [sys.executable, str(evaluator), str(self.job_dir)])
    monkeypatch.setattr("emulator.backends.base.STATE_ROOT", tmp_path / "state")
    monkeypatch.setenv("WANBENCH_STATE_DIR", str(tmp_path / "state"))


@pytest.mark.slow
def test_a_tuned_sweep_on_two_workers_equals_a_local_run_and_a_worker_killed_mid_job_is_replaced(
        dask_cluster, local_stand_ins, write_yaml, tmp_path):
    address, workers, marks = dask_cluster
    path = write_yaml(TUNED, "s.yaml")  # tuning: 2 lr x 2 algorithms on seed 0, then 2 x 2 reported seeds
    local = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "local", console=_quiet(), jobs=1)

    killed = {}

    def kill_the_first_worker_that_starts_a_job():
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            started = sorted(marks.glob("*"))
            if started:
                job_id, pid = started[0].name.rsplit(".", 1)
                killed.update(job_id=job_id, pid=int(pid))
                os.kill(int(pid), signal.SIGKILL)  # mid-job: the engine pauses 1.5 s before any record
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_first_worker_that_starts_a_job)
    killer.start()
    try:
        on_cluster = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "cluster", console=_quiet(),
                                             jobs=None, cluster=address)
    finally:
        killer.join()

    assert killed, "no job started on the cluster"
    assert {w.pid for w in workers if w.poll() is not None} == {killed["pid"]}  # one worker gone, by our kill
    # the killed job ran again, on the other worker, and ended ok
    runs_of_killed = [int(mark.name.rsplit(".", 1)[1]) for mark in marks.glob(f"{killed['job_id']}.*")]
    assert len(runs_of_killed) == 2 and killed["pid"] in runs_of_killed, runs_of_killed
    surviving = ({w.pid for w in workers} - {killed["pid"]}).pop()
    run_dir = on_cluster.run_dir
    job = json.loads((run_dir / "jobs" / killed["job_id"] / "job.json").read_text())
    assert job["status"] == "ok"
    # every job's outputs came back over the wire: the run folder was never the workers'
    ran_on = {int(mark.name.rsplit(".", 1)[1]) for mark in marks.glob("*")}
    assert ran_on <= {killed["pid"], surviving}
    for job_dir in (run_dir / "jobs").glob("*"):
        assert (job_dir / "rank0.jsonl").is_file() and (job_dir / "sim.log").is_file(), sorted(job_dir.iterdir())
    assert json.loads((run_dir / "environment.json").read_text())["cluster"]["address"] == address
    assert (run_dir / "COMPLETE").exists()
    summary = _summary(run_dir)
    assert len(summary) == 8 and set(summary["status"]) == {"ok"}
    pd.testing.assert_frame_equal(_summary(local.run_dir), summary)
    # the picks were made in the harness from the tuning phase, as in the local run
    assert json.loads((run_dir / "tuning.json").read_text()) == json.loads((local.run_dir / "tuning.json").read_text())


def test_an_emulated_run_with_cluster_is_refused_naming_the_option(write_yaml, capsys):
    path = write_yaml(TUNED, "s.yaml")
    assert cli.main(["run", path, "--backend", "tun", "--cluster", "tcp://127.0.0.1:1"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--cluster" in err and "sim jobs only" in err and len(err.strip().splitlines()) == 1, err


def test_cluster_without_dask_says_how_to_install_it(write_yaml, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "distributed", None)  # `import distributed` raises ImportError
    path = write_yaml(TUNED, "s.yaml")
    assert cli.main(["run", path, "--cluster", "tcp://127.0.0.1:1", "--output", str(tmp_path / "runs")]) \
        == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--cluster" in err and "pip install" in err and "dask[distributed]" in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("scenario.json"))


def test_a_scheduler_that_does_not_answer_is_one_line_and_no_run_folder(write_yaml, monkeypatch, tmp_path, capsys):
    pytest.importorskip("distributed", reason="the cluster executor needs dask[distributed] (pyproject.toml)")
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(cluster_module, "CONNECT_TIMEOUT_S", 2.0)
    path = write_yaml(TUNED, "s.yaml")
    assert cli.main(["run", path, "--cluster", f"tcp://127.0.0.1:{port}", "--output", str(tmp_path / "runs")]) \
        == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--cluster" in err and f"127.0.0.1:{port}" in err, err
    assert not any((tmp_path / "runs").rglob("scenario.json"))


def test_a_shipped_job_lands_the_folder_a_local_job_writes(local_stand_ins, write_yaml, tmp_path, monkeypatch):
    """ship -> run_shipped (here, in a temporary folder, as a worker does) -> land gives the job
    folder run_sim_job gives, paths included: the evaluator stand-in prints the folder it was given."""
    import harness.jobs as jobs_module
    from emulator.plan import make_plan
    from harness.jobspec import job_spec
    from harness.sim_job import sim_run

    printing = tmp_path / "printing-evaluator.py"
    printing.write_text("import sys; print('evaluated', sys.argv[1])\n")
    monkeypatch.setattr(jobs_module.Evaluator, "_argv", lambda self: [sys.executable, str(printing), str(self.job_dir)])
    scenario = load_scenario(write_yaml(TUNED, "s.yaml")).with_time_dilation(1.0)
    job = scenario.jobs[0]
    plan = make_plan(scenario.topology_for(job.network))
    plan_path = tmp_path / "point" / "plan.json"
    plan_path.parent.mkdir()
    plan_path.write_text(plan.to_json())
    settings = sim_run(scenario).job_settings(job, plan_path, plan)
    local, shipped = (job_spec(scenario, job, tmp_path / where / job.job_id, plan, "sim", sim=settings)
                      for where in ("local", "shipped"))
    assert jobs_module.run_sim_job(local).status == "ok"
    package = cluster_module.ship(shipped)
    assert json.loads(package.plan) == json.loads(plan.to_json())  # the plan's bytes travel, not its path
    result = cluster_module.run_shipped(package)
    assert result.worker_job_dir != str(shipped.job_dir) and not Path(result.worker_job_dir).exists()  # removed
    assert cluster_module.land(shipped, result).status == "ok"

    def folder(job_dir: Path) -> dict:
        return {path.relative_to(job_dir).as_posix(): path.read_text().replace(str(job_dir), "JOB_DIR")
                for path in sorted(job_dir.rglob("*")) if path.is_file() and path.name != "job.json"}

    assert folder(shipped.job_dir) == folder(local.job_dir)
    assert "evaluated JOB_DIR" in folder(shipped.job_dir)["evaluator.log"]
    records = {name: json.loads((spec.job_dir / "job.json").read_text()) for name, spec in
               (("local", local), ("shipped", shipped))}
    assert records["shipped"].pop("host")
    for record in records.values():
        record.pop("wall_s")
    assert records["local"] == records["shipped"]
