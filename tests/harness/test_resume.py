"""`wanbench run --resume RUN_DIR` (harness/run.py resume_run) and the run's host helpers after a
SIGKILL (emulator/helpers.py, trainers/evaluate.py --parent-pid, `clean`).

The sweeps run on backend sim with a light stand-in engine (no torch: records from the config, a
pause so that a kill lands mid-job) and a stand-in evaluator; the uninterrupted reference and the
resumes run in this process, only the run that is killed runs as a process of its own.
"""

import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

import harness.jobs as jobs_module
import harness.run as run_module
from emulator import helpers
from emulator.processes import alive, cmdline, wait_gone
from harness import cli
from harness.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]

SCENARIO = textwrap.dedent("""
    topology:
      name: rest
      address_pool: 10.235.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload: {model: {name: mlp}, dataset: {name: digits}, lr: 0.05, eval_every: 2}
    stop: {steps: 6, target_accuracy: 0.7}
    algorithms: [{name: sync}, {name: local_sgd, params: {H: 2}}]
    seeds: [0, 1]
    sim: {compute_s: 0.002, overhead_s: 0.0005}
""")
TUNED = SCENARIO.replace("seeds: [0, 1]", "seeds: [0, 1, 2]\ntuning: {grid: {lr: [0.05, 0.1]}, seed: 0}")

# Records from the job's config alone (deterministic): accuracy climbs fastest at the algorithm's
# best lr and shifts with the seed, so picks and rows differ. ENGINE_PAUSE_S before any record;
# with ENGINE_FIRST_ALONE_FAST set, every job but the first to start waits ENGINE_SLOW_S instead.
LIGHT_ENGINE = textwrap.dedent('''
    import json, os, sys, time
    from pathlib import Path

    job = Path(sys.argv[1])
    config = json.loads((job / "config.json").read_text())
    sim = json.loads((job / "sim.json").read_text())
    world = len(json.loads(Path(sim["plan"]).read_text())["nodes"])
    pause = float(os.environ.get("ENGINE_PAUSE_S", "0"))
    gate = os.environ.get("ENGINE_FIRST_ALONE_FAST")  # a folder: only the first job to start is quick
    if gate:
        try:
            os.close(os.open(os.path.join(gate, "first"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pause = float(os.environ["ENGINE_SLOW_S"])
    time.sleep(pause)
    name, seed, lr = config["algorithm"]["name"], config["seed"], config.get("lr", 0.05)
    best = 0.05 if name == "sync" else 0.1
    slope = 0.06 if abs(lr - best) < 1e-9 else (0.04 if lr >= 0.1 else 0.02)
    step_s = sim["compute"]["forward_backward_s"] + (0.05 if name == "sync" else 0.02)
    for rank in range(world):
        with open(job / f"rank{rank}.jsonl", "w") as f:
            def write(kind, t, **fields):
                f.write(json.dumps({"kind": kind, "rank": rank, "time_unix": 1.7e9 + t, "time_s": t, **fields}) + "\\n")
            write("start", 0.0, world_size=world, algorithm=name, transport="sim")
            for step in range(config["steps"]):
                t = (step + 1) * step_s
                write("step", t, step=step, loss=2.0 / (step + 1 + seed), step_s=step_s, compute_s=0.002,
                      comm_blocked_s=step_s - 0.002, bytes_sent=1000 * (rank + 1))
                if rank == 0 and (step + 1) % config["eval_every"] == 0:
                    write("eval", t, step=step, accuracy=min(1.0, 0.5 + slope * step + 0.001 * seed),
                          loss=1.0 - slope * step)
            write("status", config["steps"] * step_s, state="done")
    print("sim: done", flush=True)
''')
STUB_EVALUATOR = "import time; time.sleep(0.1)\n"

# The killed run: `wanbench run`'s run loop in a process of its own, on the stand-ins.
RUNNER = textwrap.dedent('''
    import sys
    from pathlib import Path
    import harness.jobs as jobs
    engine, evaluator, scenario, runs = sys.argv[1:5]
    jobs.sim_job_argv = lambda job_dir: [sys.executable, engine, str(job_dir)]
    jobs.Evaluator._argv = lambda self: [sys.executable, evaluator, str(self.job_dir)]
    from rich.console import Console
    from harness import run
    from harness.scenario import load_scenario
    run.run_scenario(load_scenario(scenario), "sim", Path(runs), console=Console(stderr=True, width=200))
''')

# Columns that are not the same from run to run on sim: the wall clock's (job.json's wall_s).
WALL_CLOCK_COLUMNS = ["wall_s"]


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """The light engine and the stand-in evaluator, for runs in this process and the runner's;
    the helpers' PID files under tmp_path/state."""
    engine, evaluator = tmp_path / "engine.py", tmp_path / "evaluator.py"
    engine.write_text(LIGHT_ENGINE)
    evaluator.write_text(STUB_EVALUATOR)
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(engine), str(job_dir)])
    monkeypatch.setattr(jobs_module.Evaluator, "_argv", lambda self: [sys.executable, str(evaluator), str(self.job_dir)])
    monkeypatch.setattr("emulator.backends.base.STATE_ROOT", tmp_path / "state")
    monkeypatch.setenv("WANBENCH_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("WANBENCH_PREFIX", "rsm" + str(os.getpid() % 1000))
    return engine, evaluator


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


def _summary(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "summary.csv").drop(columns=WALL_CLOCK_COLUMNS)


def _job_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run's ok jobs, by path (what a resume must keep untouched)."""
    ok = [p.parent for p in (run_dir / "jobs").glob("*/job.json") if json.loads(p.read_text())["status"] == "ok"]
    return {str(f.relative_to(run_dir)): f.read_bytes() for job in ok for f in sorted(job.rglob("*")) if f.is_file()}


@pytest.fixture
def reference(stand_ins, write_yaml, tmp_path):
    """An uninterrupted run of SCENARIO (in this process) and the scenario file."""
    path = write_yaml(SCENARIO, "s.yaml")
    completed = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "reference", console=_quiet())
    assert (completed.run_dir / "COMPLETE").exists() and len(completed.summary) == 4
    assert set(completed.summary["status"]) == {"ok"}
    return path, completed.run_dir


def _kill_group_at(argv, when, tmp_path, runs: Path) -> dict:
    """Start `argv` in a process group of its own, SIGKILL the group when `when(run_dir, started)`
    says so; what the kill found (the run folder, its ok jobs, whether a job was under way)."""
    env = {**os.environ, "ENGINE_PAUSE_S": "0.8", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "runner.log", "w"),
                            start_new_session=True)
    deadline = time.monotonic() + 120
    run_dir = None
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = [p for p in runs.glob("*/*") if not p.name.startswith(".")] if runs.is_dir() else []
            run_dir = found[0] if found else None
            if run_dir is not None and when(run_dir):
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before the kill: {(tmp_path / 'runner.log').read_text()[-2000:]}"
        helper_pids = helpers.leftover_helpers(os.environ["WANBENCH_PREFIX"])
        jobs = sorted((run_dir / "jobs").glob("*")) if (run_dir / "jobs").is_dir() else []
        under_way = [j.name for j in jobs if not (j / "job.json").exists()]
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ok = [j.name for j in jobs if (j / "job.json").exists() and json.loads((j / "job.json").read_text())["status"] == "ok"]
    return {"run_dir": run_dir, "helpers": helper_pids, "under_way": under_way, "ok": ok}


@pytest.mark.parametrize("trial", ["random-1", "random-2", "random-3", "mid-job"])
def test_a_sweep_killed_with_sigkill_then_resumed_equals_an_uninterrupted_one(reference, stand_ins, tmp_path, trial):
    scenario_file, reference_dir = reference
    engine, evaluator = stand_ins
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    runs = tmp_path / "killed"
    rng = random.Random(trial)
    if trial == "mid-job":  # once a job's folder is there without its job.json, a little later
        delay = rng.uniform(0.0, 0.4)

        def when(run_dir):
            return any(not (j / "job.json").exists() for j in (run_dir / "jobs").glob("*")) and time.sleep(delay) is None
    else:  # anywhere in the four jobs' stretch (each about 1 s: the engine's pause, two processes)
        at = rng.uniform(0.0, 4.0)
        seen = []

        def when(run_dir):
            seen.append(time.monotonic()) if not seen else None
            return time.monotonic() - seen[0] >= at
    found = _kill_group_at([sys.executable, str(runner), str(engine), str(evaluator), scenario_file, str(runs)],
                           when, tmp_path, runs)
    run_dir = found["run_dir"]
    if trial == "mid-job":
        assert found["under_way"], "the kill was meant to land mid-job"
    # the helpers die with the killed run (PR_SET_PDEATHSIG): nothing of it writes into the folder
    # while it is resumed
    assert wait_gone(found["helpers"], 10.0) == []
    assert not (run_dir / "COMPLETE").exists()
    kept_files = _job_files(run_dir)

    console = io.StringIO()
    from rich.console import Console

    completed = run_module.resume_run(run_dir, console=Console(file=console, width=300))
    out = console.getvalue()
    assert f"{len(found['ok'])} job(s) kept (ok)" in out
    assert f"resume: {4 - len(found['ok'])} job(s) re-run, {len(found['ok'])} kept" in out
    assert (run_dir / "COMPLETE").exists() and not (run_dir / "INTERRUPTED").exists()
    pd.testing.assert_frame_equal(_summary(run_dir), _summary(reference_dir))
    assert list(completed.summary["label"]) == list(_summary(reference_dir)["label"])
    # the kept jobs' files are untouched
    assert {k: v for k, v in _job_files(run_dir).items() if k in kept_files} == kept_files


def test_a_tuned_run_resumes_with_its_picks_made_again_from_the_kept_jobs(stand_ins, write_yaml, tmp_path):
    path = write_yaml(TUNED, "t.yaml")
    reference = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "a", console=_quiet()).run_dir
    picks = json.loads((reference / "tuning.json").read_text())
    assert {r["label"]: r["pick"] for r in picks["picks"]} == {"sync": {"lr": 0.05}, "local_sgd": {"lr": 0.1}}
    # the same run as a kill could leave it: one tuning candidate and one reported job partial
    # (no job.json), the picks and the markers not yet written
    interrupted = tmp_path / "b" / reference.parent.name / reference.name
    shutil.copytree(reference, interrupted)
    jobs = sorted(p.name for p in (interrupted / "jobs").glob("*"))
    candidate = next(j for j in jobs if "local_sgd" in j and "seed0" in j and "lr0.1" in j)
    reported = next(j for j in jobs if "sync" in j and "seed2" in j)
    for job in (candidate, reported):
        (interrupted / "jobs" / job / "job.json").unlink()
    for name in ("tuning.json", "COMPLETE", "summary.csv"):
        (interrupted / name).unlink()
    shutil.rmtree(interrupted / "report", ignore_errors=True)
    console = io.StringIO()
    from rich.console import Console

    run_module.resume_run(interrupted, console=Console(file=console, width=300))
    assert f"{len(jobs) - 2} job(s) kept (ok), 2 folder(s) cleared" in console.getvalue()
    assert "resume: 2 job(s) re-run" in console.getvalue()
    assert json.loads((interrupted / "tuning.json").read_text()) == picks
    pd.testing.assert_frame_equal(_summary(interrupted), _summary(reference))
    assert json.loads((interrupted / "scenario.json").read_text())["jobs"] == \
        json.loads((reference / "scenario.json").read_text())["jobs"]


@pytest.mark.parametrize("change, field", [
    (("steps: 6,", "steps: 8,"), "spec.stop.steps"),
    (("seeds: [0, 1]", "seeds: [0, 1, 2]"), "spec.seeds"),
    (("rate: 100Mbit", "rate: 50Mbit"), "spec.topology.links[0].rate"),
])
def test_resume_refuses_a_scenario_that_differs_from_the_runs_naming_the_field(reference, write_yaml, capsys,
                                                                                change, field):
    _, run_dir = reference
    changed = write_yaml(SCENARIO.replace(*change), "changed.yaml")
    before = sorted(p.name for p in run_dir.rglob("*"))
    assert cli.main(["run", changed, "--resume", str(run_dir)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"wanbench: {changed}: {field}" in err
    assert str(run_dir / "scenario.json") in err and "resume runs the scenario the run was made with" in err
    assert sorted(p.name for p in run_dir.rglob("*")) == before  # nothing cleared


def test_resume_refuses_a_changed_topology_file_by_the_plan_it_makes(stand_ins, write_yaml, capsys, tmp_path):
    topology = SCENARIO.split("topology:\n")[1].split("backend:")[0]
    write_yaml(textwrap.dedent(topology), "topo.yaml")
    path = write_yaml("topology: topo.yaml\nbackend:" + SCENARIO.split("backend:")[1], "s.yaml")
    run_dir = run_module.run_scenario(load_scenario(path), "sim", tmp_path / "runs", console=_quiet()).run_dir
    write_yaml(textwrap.dedent(topology).replace("rtt: 40ms", "rtt: 80ms"), "topo.yaml")
    assert cli.main(["run", "--resume", str(run_dir)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"wanbench: {path}: delay1/plan.json.region_links" in err and "resume runs the scenario" in err


def test_resume_refuses_what_is_not_a_run_folder_and_conflicting_options(reference, tmp_path, capsys):
    scenario_file, run_dir = reference
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["run", "--resume", str(empty)], f"wanbench: {empty}: not a run directory (no scenario.json)"),
        (["run", "--resume", str(run_dir), "--backend", "tun"],
         "wanbench: --backend: tun: the run was made on backend sim"),
        (["run", "--resume", str(run_dir), "--output", str(tmp_path)], "wanbench: --output: a resumed run keeps"),
        (["run"], "wanbench: wanbench run: give a scenario file, or --resume RUN_DIR"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == cli.EXIT_BAD_INPUT, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(message), (argv, err)
    moved = tmp_path / "moved.yaml"
    Path(scenario_file).rename(moved)  # the file the run names is gone: say so, and how to give it
    assert cli.main(["run", "--resume", str(run_dir)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert f"the scenario file the run was made from ({scenario_file}) is not there" in err


def test_resuming_a_complete_run_runs_nothing_and_keeps_its_summary(reference):
    _, run_dir = reference
    before = _summary(run_dir)
    files = _job_files(run_dir)
    console = io.StringIO()
    from rich.console import Console

    run_module.resume_run(run_dir, console=Console(file=console, width=300))
    assert "resume: 0 job(s) re-run, 4 kept" in console.getvalue()
    pd.testing.assert_frame_equal(_summary(run_dir), before)
    assert _job_files(run_dir) == files


def test_an_ok_job_whose_evaluator_failed_runs_again_on_resume(reference):
    """Its ranks ended ok but its evaluator did not (seen: an evaluator that imported a file being
    edited): no accuracy, so the job is not kept; the resumed run has the uninterrupted summary."""
    _, run_dir = reference
    before = _summary(run_dir)
    job = sorted((run_dir / "jobs").glob("*"))[0]
    info = json.loads((job / "job.json").read_text())
    assert info["status"] == "ok"
    (job / "job.json").write_text(json.dumps({**info, "reason": "the evaluator exited 1: SyntaxError: invalid syntax"}))
    (job / "eval.jsonl").unlink(missing_ok=True)
    assert run_module.plan_resume(run_dir).cleared == [job]
    console = io.StringIO()
    from rich.console import Console

    run_module.resume_run(run_dir, console=Console(file=console, width=300))
    assert "resume: 1 job(s) re-run, 3 kept" in console.getvalue()
    pd.testing.assert_frame_equal(_summary(run_dir), before)
    assert not run_module.evaluation_failed(json.loads((job / "job.json").read_text()))


# --- the host helpers after a SIGKILL of the harness ---------------------------------------------

# The harness's side of a job on an emulated network, reduced to its evaluator: it starts the
# following evaluator as run_job does and waits; "watch-only" starts it without PR_SET_PDEATHSIG,
# so that only the evaluator's own watch of its parent (--parent-pid) can end it.
PARENT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    import harness.jobs as jobs
    from emulator import helpers
    if sys.argv[2] == "watch-only":
        helpers.die_with_parent = lambda pid, signum=15: None
    evaluator = jobs.Evaluator(Path(sys.argv[1]), follow=True)
    evaluator.start()
    print(evaluator.proc.pid, flush=True)
    time.sleep(600)
''')


def _job_whose_ranks_never_end(job_dir: Path) -> Path:
    """A job folder as ranks killed mid-training leave it: started, no status record, no snapshot."""
    job_dir.mkdir(parents=True)
    (job_dir / "config.json").write_text(json.dumps({
        "model": {"name": "mlp"}, "dataset": {"name": "digits"}, "eval_every": 2, "seed": 0, "steps": 6,
        "algorithm": {"name": "sync", "params": {}}, "output_dir": str(job_dir)}))
    for rank in range(2):
        (job_dir / f"rank{rank}.jsonl").write_text(json.dumps({"kind": "start", "rank": rank, "world_size": 2}) + "\n")
    return job_dir


@pytest.mark.parametrize("started", ["as-the-harness-does", "watch-only"])
def test_a_following_evaluator_ends_by_itself_when_the_harness_is_killed(tmp_path, monkeypatch, started):
    monkeypatch.setenv("WANBENCH_STATE_DIR", str(tmp_path / "state"))  # the harness's (a process of its own)
    monkeypatch.setattr("emulator.backends.base.STATE_ROOT", tmp_path / "state")  # this process's
    monkeypatch.setenv("WANBENCH_PREFIX", "rse" + str(os.getpid() % 1000))
    job_dir = _job_whose_ranks_never_end(tmp_path / "job")
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(job_dir), started], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        evaluator_pid = int(parent.stdout.readline())
        recorded = helpers.helpers_dir(os.environ["WANBENCH_PREFIX"])
        assert recorded.parent.parent == tmp_path / "state"
        assert (recorded / f"{evaluator_pid}.json").is_file()  # for `clean`
        deadline = time.monotonic() + 90
        while not (job_dir / "eval.jsonl").exists() and time.monotonic() < deadline:  # it follows the job now
            time.sleep(0.1)
        assert (job_dir / "eval.jsonl").exists() and alive(evaluator_pid)
        time.sleep(1.0)
        assert alive(evaluator_pid)  # polling: the ranks' records never end
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the harness's process group; the evaluator has its own session
        parent.wait(timeout=30)
    try:
        assert wait_gone([evaluator_pid], 10.0) == [], "the evaluator outlived the harness"
    finally:  # a failed test leaves nothing behind either
        if alive(evaluator_pid) and "trainers.evaluate" in cmdline(evaluator_pid):
            os.kill(evaluator_pid, signal.SIGKILL)
    if started == "watch-only":
        assert f"(pid {parent.pid}) is gone" in (job_dir / "evaluator.log").read_text()


@pytest.mark.integration
def test_clean_ends_a_recorded_helper_and_only_the_process_recorded(test_prefix, tmp_path, monkeypatch):
    from emulator.clean import clean

    monkeypatch.setattr("emulator.backends.base.STATE_ROOT", tmp_path / "state")
    helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
    other = subprocess.Popen(["sleep", "301"], start_new_session=True)
    harness = subprocess.Popen(["sleep", "302"])  # the run that started the helper, then killed
    try:
        assert helpers.register(test_prefix, helper.pid, helper.args, owner=harness.pid) is not None
        harness.kill()
        harness.wait(timeout=10)
        # a PID file whose process is not the one recorded (a reused PID): left alone
        stale = helpers.register(test_prefix, other.pid, other.args)
        record = json.loads(stale.read_text())
        stale.write_text(json.dumps({**record, "start_ticks": record["start_ticks"] - 1}))
        assert helpers.leftover_helpers(test_prefix) == [helper.pid] and not stale.exists()
        removed = clean(test_prefix)
        assert f"process {helper.pid} (a run's helper)" in removed
        helper.wait(timeout=10)  # ended (stop_pids reaps it: no exit status is left to read)
        assert other.poll() is None
        assert clean(test_prefix) == []  # idempotent
    finally:
        for proc in (helper, other, harness):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_clean_removes_a_killed_runs_hidden_folder_and_keeps_a_starting_one(tmp_path, capsys, monkeypatch):
    """A run killed between its hidden folder and the rename leaves `.<id>.partial`; `wanbench clean
    --output` removes it once it is older than a start could take, and leaves run folders and a
    hidden folder made just now (a run starting) alone."""
    monkeypatch.setattr("emulator.clean.clean", lambda prefix: [])  # no namespaces in this test
    scenario_dir = tmp_path / "runs" / "quick"
    orphan = scenario_dir / ".20261126-100000.partial"
    starting = scenario_dir / ".20261126-100500.partial"
    finished = scenario_dir / "20261126-090000"
    for folder in (orphan, starting, finished):
        folder.mkdir(parents=True)
        (folder / "scenario.json").write_text("{}")
    old = time.time() - 2 * run_module.ORPHANED_AFTER_S
    os.utime(orphan, (old, old))
    os.utime(finished, (old, old))
    assert cli.main(["clean", "--output", str(tmp_path / "runs")]) == 0
    assert not orphan.exists() and starting.is_dir() and finished.is_dir()
    assert f"run folder {orphan}" in capsys.readouterr().err.replace("\n", "")
    assert run_module.remove_orphaned_partials(tmp_path / "runs") == []  # idempotent
