"""`--backend sim` on the harness side: the scenario's `sim:` section, the CLI's refusals, and the
run loop (harness/run.py, harness/jobs.py run_sim_job, harness/sim_job.py) with the simulator
stood in for by an engine that writes plausible records (the real one: the slow test at the end)."""

import io
import json
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import harness.jobs as jobs_module
import harness.run as run_module
from emulator.schema import ConfigError
from harness import cli
from harness.auto_dilation import StepMeasurement, rank_threads
from harness.faults import action_record, compile_actions
from harness.report import write_report
from harness.scenario import load_scenario
from harness.sim_job import sim_run

SCENARIO = textwrap.dedent("""
    topology:
      name: simt
      address_pool: 10.234.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload: {model: {name: mlp}, dataset: {name: digits}, eval_every: 2}
    stop: {steps: 6}
    algorithms: [{name: sync}, {name: local_sgd, params: {H: 2}}]
    sim: {compute_s: 0.002, overhead_s: 0.0005, nic: 1Gbit}
""")

TOPOLOGY = textwrap.dedent("""
    name: simt
    address_pool: 10.234.0.0/24
    regions: {a: {nodes: 1}, b: {nodes: 1}}
    links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
""")


# --- the scenario ------------------------------------------------------------------------------


def test_a_sim_scenario_loads_with_its_settings(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO, "s.yaml"))
    sim = scenario.spec.sim
    assert scenario.spec.backend == "sim"
    assert (sim.compute_s, sim.overhead_s, sim.nic, sim.nic_rate_bit_s) == (0.002, 0.0005, "1Gbit", 1e9)
    defaults = load_scenario(write_yaml(SCENARIO.replace("sim: {compute_s: 0.002, overhead_s: 0.0005, nic: 1Gbit}", ""),
                                        "d.yaml")).spec.sim
    assert (defaults.compute_s, defaults.overhead_s, defaults.nic) == ("auto", 0.0, None)


@pytest.mark.parametrize("sim, field, message", [
    ("{compute_s: -1}", "sim.compute_s", "greater than 0 and at most 3600, or auto"),
    ("{compute_s: fast}", "sim.compute_s", "got 'fast'"),
    ("{compute_s: true}", "sim.compute_s", "got True"),
    ("{overhead_s: -0.1}", "sim.overhead_s", "greater than or equal to 0"),
    ("{nic: 10 parsecs}", "sim.nic", ""),
    ("{nics: 1Gbit}", "sim.nics", ""),
])
def test_bad_sim_settings_name_the_file_and_field(write_yaml, sim, field, message):
    path = write_yaml(SCENARIO.replace("{compute_s: 0.002, overhead_s: 0.0005, nic: 1Gbit}", sim), "bad.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert caught.value.source == path and caught.value.field == field
    assert message in caught.value.message and "\n" not in str(caught.value)


START_OFFSETS = SCENARIO.replace("algorithms: [{name: sync}, {name: local_sgd, params: {H: 2}}]",
                                 "algorithms: [{name: sync}, {name: async_ps}]")


def test_start_offsets_resolve_per_job_to_ranks_of_its_own_plan(write_yaml):
    from emulator.plan import make_plan

    text = START_OFFSETS.replace("nic: 1Gbit}", "nic: 1Gbit, start_offsets_s: {async_ps: {b-0: 0.4, a-1: 0.1}}}")
    scenario = load_scenario(write_yaml(text, "offsets.yaml"))
    sim = sim_run(scenario)
    sync, ps = sorted(scenario.jobs, key=lambda job: job.label != "sync")
    assert sim.start_offsets == {"async_ps": {"b-0": 0.4, "a-1": 0.1}} and sim.record()["start_offsets_s"]
    assert "start_offsets_s" not in sim.job_compute(sync, make_plan(scenario.topology_for(sync.network)))
    # async PS runs with its server on an extra node a-1: a-0, a-1, b-0 are ranks 0, 1, 2
    plan = make_plan(scenario.topology_for(ps.network))
    assert [node.name for node in plan.nodes] == ["a-0", "a-1", "b-0"]
    assert sim.job_compute(ps, plan)["start_offsets_s"] == [0.0, 0.1, 0.4]
    # node -> seconds: every job, a node a job's plan lacks (the server's a-1 in sync's) left out
    every = load_scenario(write_yaml(START_OFFSETS.replace("nic: 1Gbit}", "nic: 1Gbit, start_offsets_s: {b-0: 0.2, a-1: 0.1}}"),
                                     "every.yaml"))
    sim = sim_run(every)
    sync, ps = sorted(every.jobs, key=lambda job: job.label != "sync")
    assert sim.job_compute(sync, make_plan(every.topology_for(sync.network)))["start_offsets_s"] == [0.0, 0.2]
    assert sim.job_compute(ps, make_plan(every.topology_for(ps.network)))["start_offsets_s"] == [0.0, 0.1, 0.2]


@pytest.mark.parametrize("offsets, field, message", [
    ("{b-0: -1}", "sim.start_offsets_s", "b-0: must be seconds in [0, 3600]"),
    ("{sync: {b-0: 0.1}, b-0: 0.2}", "sim.start_offsets_s", "not both"),
    ("{dts: {b-0: 0.1}}", "sim.start_offsets_s.dts", "no algorithm with this label or name (algorithms: sync, async_ps)"),
    ("{sync: {a-1: 0.1}}", "sim.start_offsets_s.sync.a-1", "no node of that name in the network points of the jobs it applies to (nodes: a-0, b-0)"),
    ("{c-0: 0.1}", "sim.start_offsets_s.c-0", "(nodes: a-0, a-1, b-0)"),
])
def test_bad_start_offsets_name_the_field(write_yaml, offsets, field, message):
    path = write_yaml(START_OFFSETS.replace("nic: 1Gbit}", f"nic: 1Gbit, start_offsets_s: {offsets}}}"), "bad.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert caught.value.field == field and message in caught.value.message


def test_what_sim_cannot_run_is_refused_before_anything_runs(write_yaml, capsys, tmp_path):
    command = SCENARIO.replace("algorithms: [{name: sync}, {name: local_sgd, params: {H: 2}}]", "command: [\"true\"]")
    with pytest.raises(ConfigError, match="command: backend sim runs the trainers"):
        load_scenario(write_yaml(command, "cmd.yaml"))
    ddp = SCENARIO.replace("{name: local_sgd, params: {H: 2}}", "{name: ddp}")
    with pytest.raises(ConfigError, match=r"algorithms\[1\].name: ddp cannot run on backend sim"):
        load_scenario(write_yaml(ddp, "ddp.yaml"))
    gpu = SCENARIO.replace("eval_every: 2}", "eval_every: 2, device: cuda}")
    with pytest.raises(ConfigError, match="workload.device: cuda: simulated ranks compute on the cpu"):
        load_scenario(write_yaml(gpu, "gpu.yaml"))
    # a tun scenario run with --backend sim: the same check, one line, exit 2, no run directory
    path = write_yaml(ddp.replace("backend: sim", "backend: tun"), "ddp-tun.yaml")
    assert cli.main(["run", path, "--backend", "sim", "--output", str(tmp_path / "runs")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "algorithms[1].name: ddp cannot run on backend sim" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["up", "verify"])
def test_up_and_verify_refuse_sim_in_one_line(write_yaml, capsys, command):
    path = write_yaml(TOPOLOGY, "topo.yaml")
    assert cli.main([command, path, "--backend", "sim"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("wanbench: --backend: sim has no network to bring up")
    assert "'wanbench run SCENARIO --backend sim'" in err


def test_link_and_straggler_faults_become_actions_as_data(write_yaml):
    faulty = SCENARIO.replace("sim: {", textwrap.dedent("""\
        faults:
          - {at: 0.1s, kind: link_down, between: [a, b]}
          - {at: 0.2s, kind: link_up, between: [a, b]}
          - {at: 0.15s, kind: straggler, node: a-0, factor: 3, duration: 0.1s}
        sim: {"""))
    scenario = load_scenario(write_yaml(faulty, "f.yaml"))
    base = scenario.topology_for(scenario.network_points()[0])
    from emulator.plan import make_plan

    plan = make_plan(base)
    actions = [action_record(a) for a in compile_actions(scenario.faults, plan.emulated_region_links())]
    assert [(a["due_s"], a["what"]) for a in actions] == [
        (0.1, "link a->b down"), (0.1, "link b->a down"), (0.15, "straggler a-0 x3"),
        (0.2, "link a->b up"), (0.2, "link b->a up"), (pytest.approx(0.25), "straggler a-0 ends")]
    assert actions[0]["calls"] == [{"set_link": ["a", "b", None]}] and actions[0]["effect"] == "down"
    assert actions[2]["calls"] == [{"cpu_factor": ["a-0", 3.0]}] and actions[2]["effect"] == "compute x3"
    assert actions[3]["calls"][0]["set_link"][2]["one_way_delay_ms"] == 20.0
    json.dumps(actions)  # data: it goes into sim.json


def test_crashes_and_restarts_become_actions_the_simulator_applies(write_yaml):
    """node_crash loads on sim (a crash-tolerant algorithm then gets the elastic comm, as on tun);
    its actions are data whose effect the simulator says when it applies them."""
    crashing = SCENARIO.replace("{name: local_sgd, params: {H: 2}}", "{name: swarmsgd, params: {H: 2}}").replace(
        "sim: {", "faults: [{at: 1s, kind: node_crash, node: b-0, restart_after: 0.5s}]\nsim: {")
    scenario = load_scenario(write_yaml(crashing, "crash.yaml"))
    backends = {job.algorithm: job.trainer_config.get("comm", {}).get("backend") for job in scenario.jobs}
    assert backends == {"sync": None, "swarmsgd": "tcp"}
    from emulator.plan import make_plan
    from harness.sim_job import fault_actions

    plan = make_plan(scenario.topology_for(scenario.network_points()[0]))
    planned = compile_actions(scenario.faults, plan.emulated_region_links())
    assert [(a["due_s"], a["what"], a["calls"], a["effect"]) for a in map(action_record, planned)] == [
        (1.0, "node_crash b-0", [{"crash": "b-0"}], None), (1.5, "restart b-0", [{"restart": "b-0"}], None)]
    json.dumps([action_record(a) for a in planned])

    class Simulator:  # what fault_actions asks of trainers.sim.Simulator (which keeps the crash facts)
        def __init__(self):
            self.network, self.calls = None, []

        def crash(self, rank):
            self.calls.append(("crash", rank))
            return f"rank {rank} killed"

        def restart(self, rank):
            self.calls.append(("restart", rank))
            return f"rank {rank} restarted (restart 1)"

    record = Path(write_yaml("", "faults.jsonl"))
    simulator = Simulator()
    for due_s, apply in fault_actions(planned, plan, record, lambda: 1_700_000_000.0):
        apply(simulator)
    assert simulator.calls == [("crash", 1), ("restart", 1)]
    faults = [json.loads(line) for line in record.read_text().splitlines()]
    assert [(f["applied_s"], f["what"], f["effect"], f["ok"]) for f in faults] == [
        (1.0, "node_crash b-0", "rank 1 killed", True), (1.5, "restart b-0", "rank 1 restarted (restart 1)", True)]


# --- the run loop, with a stand-in engine ------------------------------------------------------

FAKE_ENGINE = textwrap.dedent('''
    """A stand-in for trainers.sim + emulator.simnet: plausible records in virtual seconds, and
    what it was given in fake.json."""
    import dataclasses, json, sys
    from pathlib import Path
    from types import SimpleNamespace

    import harness.sim_job
    from trainers.sim import SimulatedRun

    T0 = 1_700_000_000.0
    now = [0.0]

    @dataclasses.dataclass(frozen=True)
    class ComputeModel:
        forward_backward_s: float
        step_overhead_s: float = 0.0
        source: str = ""

    class FluidNetwork:
        def __init__(self, nic, seed, regions):
            self.nic, self.seed, self.regions, self.calls = nic, seed, regions, []

        @classmethod
        def from_plan(cls, plan, nic_rate_bit_s=None, seed=0):
            return cls(nic_rate_bit_s, seed, [n.region for n in plan.nodes])

        def set_link(self, src, dst, spec):
            self.calls.append([src, dst, None if spec is None else dataclasses.asdict(spec)])

    def run_simulated(config, world_size, network, compute, actions=(), wire_scale=1.0):
        out = Path(config.output_dir)
        step_s = compute.forward_backward_s + compute.step_overhead_s + 0.05
        sim = SimpleNamespace(network=network, compute_factor={})
        pending = sorted(actions, key=lambda a: a[0])
        factors = []
        for rank in range(world_size):
            with open(out / f"rank{rank}.jsonl", "w") as f:
                def write(kind, t, **fields):
                    f.write(json.dumps({"kind": kind, "rank": rank, "time_unix": T0 + t, "time_s": t, **fields}) + "\\n")
                write("start", 0.0, world_size=world_size, algorithm=config.algorithm.name, transport="sim")
                for step in range(config.steps):
                    t = (step + 1) * step_s
                    if rank == 0:
                        while pending and pending[0][0] <= t:
                            now[0] = pending[0][0]
                            pending.pop(0)[1](sim)
                            factors.append(dict(sim.compute_factor))
                    write("step", t, step=step, loss=2.0 / (step + 1), step_s=step_s,
                          compute_s=compute.forward_backward_s, comm_blocked_s=0.05, bytes_sent=1000 * wire_scale)
                    if rank == 0 and (step + 1) % config.eval_every == 0:
                        write("eval", t, step=step, accuracy=0.5 + 0.05 * step)
                write("status", config.steps * step_s, state="done")
        (out / "fake.json").write_text(json.dumps({
            "world_size": world_size, "compute": dataclasses.asdict(compute), "nic": network.nic,
            "seed": network.seed, "action_times": [a[0] for a in actions], "set_link": network.calls,
            "factors": factors, **({"wire_scale": wire_scale} if wire_scale != 1.0 else {})}))
        return SimulatedRun([SimpleNamespace(steps=config.steps, stop_reason="steps") for _ in range(world_size)],
                            crashed_at={}, restarts={})

    engine = SimpleNamespace(FluidNetwork=FluidNetwork, ComputeModel=ComputeModel, run_simulated=run_simulated,
                             wall_time=lambda: T0 + now[0])
    sys.exit(harness.sim_job.main(sys.argv[1:], engine=engine))
''')


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    """Sim jobs run the stand-in engine (in their own process, as the real one would)."""
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(script), str(job_dir)])

    def no_network(name):
        raise AssertionError(f"backend sim built a network ({name})")

    monkeypatch.setattr(run_module, "choose_backend", no_network)


def test_a_sim_run_writes_jobs_records_summary_and_says_times_are_simulated(fake_engine, write_yaml, tmp_path):
    faulty = SCENARIO.replace("sim: {", textwrap.dedent("""\
        time_dilation: 4
        faults:
          - {at: 0.1s, kind: link_down, between: [a, b]}
          - {at: 0.2s, kind: link_up, between: [a, b]}
          - {at: 0.15s, kind: straggler, node: b-0, factor: 3, duration: 0.1s}
        sim: {"""))
    scenario = load_scenario(write_yaml(faulty, "s.yaml"))
    console = io.StringIO()
    from rich.console import Console

    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=Console(file=console, width=300))
    out = console.getvalue()
    run_dir = completed.run_dir
    assert (run_dir / "COMPLETE").exists()
    assert "time_dilation 4.0: not applied on sim" in out and "sim: no verify" in out
    assert "sim compute: 2 ms per forward + backward + 0.5 ms per step" in out

    summary = pd.read_csv(run_dir / "summary.csv")
    assert list(summary["label"]) == ["local_sgd", "sync"]  # job folders in name order
    assert set(summary["status"]) == {"ok"} and set(summary["backend"]) == {"sim"}
    assert set(summary["steps"]) == {6} and set(summary["time_dilation"]) == {1.0}
    step_s = 0.002 + 0.0005 + 0.05
    assert summary["steps_per_s"].iloc[0] == pytest.approx(1 / step_s)  # virtual seconds, not divided by K
    assert summary["final_accuracy"].iloc[0] == pytest.approx(0.75)

    assert json.loads((run_dir / "environment.json").read_text())["backend"] == "sim"
    record = json.loads((run_dir / "scenario.json").read_text())
    assert record["sim"]["compute"] == [{"forward_backward_s": 0.002, "step_overhead_s": 0.0005,
                                         "source": f"{scenario.source_file}: sim.compute_s"}]
    assert record["sim"]["time_dilation_ignored"] == 4.0 and record["spec"]["time_dilation"] == 1.0
    assert (run_dir / "delay1" / "plan.json").exists() and not (run_dir / "delay1" / "verify.json").exists()

    job_dir = run_dir / "jobs" / "delay1-sync-seed0"
    given = json.loads((job_dir / "fake.json").read_text())
    assert given["world_size"] == 2 and given["nic"] == 1e9 and given["seed"] == 0
    assert given["compute"]["forward_backward_s"] == 0.002 and given["action_times"] == [0.1, 0.15, 0.2, 0.25]
    down, up = given["set_link"][0], given["set_link"][2]
    assert down[:2] == ["a", "b"] and down[2]["loss_fraction"] == 1.0 and down[2]["one_way_delay_ms"] == 20.0
    assert up[:2] == ["a", "b"] and up[2]["loss_fraction"] == 0.0
    assert given["factors"] == [{}, {"1": 3.0}, {"1": 3.0}, {"1": 1.0}]  # rank 1's slowdown, by rank
    faults = [json.loads(line) for line in (job_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["applied_s"], f["what"], f["ok"]) for f in faults][:3] == [
        (0.1, "link a->b down", True), (0.1, "link b->a down", True), (0.15, "straggler b-0 x3", True)]
    assert faults[0]["time_unix"] == pytest.approx(1_700_000_000.1)  # the virtual clock's, like the records'
    job = json.loads((job_dir / "job.json").read_text())
    assert job["backend"] == "sim" and job["status"] == "ok" and job["compute"]["forward_backward_s"] == 0.002
    assert json.loads((job_dir / "config.json").read_text())["output_dir"] == str(job_dir)

    frames = completed.frames
    link_down = frames.faults[frames.faults["what"] == "link a->b down"]
    assert link_down["time_s"].iloc[0] == pytest.approx(0.1)

    markdown = write_report([run_dir], tmp_path / "report").markdown.read_text()
    assert "**times simulated**: backend sim, virtual seconds of the simulator's clock" in markdown
    assert "NIC 1000 Mbit/s per node" in markdown and "time_dilation 4.0 not applied" in markdown


def test_compute_auto_is_measured_once_per_workload_for_one_rank(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO.replace("compute_s: 0.002, ", ""), "auto.yaml"))
    measured = []

    def measure(config, threads):
        measured.append((config.model.name, threads))
        return StepMeasurement("mlp on digits, batch 32", 0.004, [0.004] * 5, threads)

    sim = sim_run(scenario, measure)
    assert measured == [("mlp", rank_threads(2))]  # two algorithms, one workload; a rank's threads
    compute = sim.job_compute(scenario.jobs[0])
    assert sim.job_compute(scenario.jobs[1]) == compute and sim.nic_rate_bit_s == 1e9
    assert (compute["forward_backward_s"], compute["step_overhead_s"]) == (0.004, 0.0005)
    assert compute["source"].startswith("measured here: mlp on digits, batch 32: 4 ms per forward + backward")
    assert compute["source"].endswith("one rank alone)")


def test_a_failing_simulation_fails_its_job_with_the_error(fake_engine, write_yaml, tmp_path, monkeypatch):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('sim: the engine broke')\n")
    monkeypatch.setattr(jobs_module, "sim_job_argv", lambda job_dir: [sys.executable, str(script)])
    scenario = load_scenario(write_yaml(SCENARIO.replace(", {name: local_sgd, params: {H: 2}}", ""), "s.yaml"))
    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=_quiet())
    assert set(completed.summary["status"]) == {"failed"}
    job = json.loads(next((completed.run_dir / "jobs").glob("*/job.json")).read_text())
    assert job["reason"] == "the simulation exited 1: sim: the engine broke"


def _quiet():
    from rich.console import Console

    return Console(file=io.StringIO(), width=200)


# --- the real engine ---------------------------------------------------------------------------

E2E = textwrap.dedent("""
    topology:
      name: sime2e
      address_pool: 10.235.0.0/24
      regions: {london: {nodes: 1}, tokyo: {nodes: 1}, oregon: {nodes: 1}}
      links:
        - {between: [london, tokyo], rtt: 220ms, rate: 200Mbit}
        - {between: [london, oregon], rtt: 130ms, rate: 200Mbit}
        - {between: [tokyo, oregon], rtt: 100ms, rate: 200Mbit}
    backend: sim
    workload:
      model: {name: mlp, params: {hidden_sizes: [64]}}
      dataset: {name: digits}
      batch_size: 32
      lr: 0.1
      optimizer: {name: sgd, momentum: 0.9}
      eval_every: 10
    stop: {steps: 30}
    algorithms: [{name: sync}]
    faults:
      - {at: 1s, kind: link_change, between: [london, tokyo], rtt: 400ms}
      - {at: 1s, kind: straggler, node: oregon-0, factor: 4, duration: 2s}
    sim: {compute_s: 0.004, nic: 1Gbit}
""")


def _steps(run_dir: Path) -> list[dict]:
    path = next((run_dir / "jobs").glob("*/rank0.jsonl"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time_unix"} for r in records if r["kind"] == "step"]


@pytest.mark.slow
def test_a_small_job_on_the_real_engine_learns_and_repeats_bit_for_bit(write_yaml, tmp_path):
    scenario = load_scenario(write_yaml(E2E, "e2e.yaml"))
    first = run_module.run_scenario(scenario, "sim", tmp_path / "a", console=_quiet())
    second = run_module.run_scenario(scenario, "sim", tmp_path / "b", console=_quiet())
    for completed in (first, second):
        row = completed.summary.iloc[0]
        assert (row["status"], row["backend"], row["steps"]) == ("ok", "sim", 30)
        assert row["final_accuracy"] > 0.7
    steps = _steps(first.run_dir)
    assert len(steps) == 30 and steps == _steps(second.run_dir)
    assert first.summary["final_accuracy"].iloc[0] == second.summary["final_accuracy"].iloc[0]
    # the faults were applied on the virtual clock
    faults = first.frames.faults
    assert list(faults["what"]) == ["link london->tokyo change", "link tokyo->london change",
                                    "straggler oregon-0 x4", "straggler oregon-0 ends"]
    assert faults["ok"].all() and list(faults["time_s"]) == [1.0, 1.0, 1.0, 3.0]


@pytest.mark.slow
def test_a_partition_on_the_real_engine_holds_point_to_point_traffic_back(write_yaml, tmp_path):
    """link_down / link_up reach the fluid network (the plan's link with every packet lost, then
    the plan's link again) at their virtual times, and swarmsgd (point-to-point flows) runs through
    them to its last step."""
    partitioned = (E2E.replace("algorithms: [{name: sync}]", "algorithms: [{name: swarmsgd, params: {H: 2}}]")
                   .replace("{at: 1s, kind: link_change, between: [london, tokyo], rtt: 400ms}",
                            "{at: 0.2s, kind: link_down, between: [tokyo, oregon]}")
                   .replace("{at: 1s, kind: straggler, node: oregon-0, factor: 4, duration: 2s}",
                            "{at: 0.6s, kind: link_up, between: [tokyo, oregon]}"))
    completed = run_module.run_scenario(load_scenario(write_yaml(partitioned, "p.yaml")), "sim", tmp_path / "p",
                                        console=_quiet())
    row = completed.summary.iloc[0]
    assert (row["status"], row["steps"]) == ("ok", 30)
    faults = completed.frames.faults
    assert list(faults["what"]) == ["link tokyo->oregon down", "link oregon->tokyo down",
                                    "link tokyo->oregon up", "link oregon->tokyo up"]
    assert faults["ok"].all() and list(faults["time_s"]) == [0.2, 0.2, 0.6, 0.6]


CRASH_E2E = textwrap.dedent("""
    topology:
      name: simcrash
      address_pool: 10.237.0.0/24
      regions: {london: {nodes: 2}, tokyo: {nodes: 1}, oregon: {nodes: 1}}
      links:
        - {between: [london, tokyo], rtt: 220ms, rate: 200Mbit}
        - {between: [london, oregon], rtt: 130ms, rate: 200Mbit}
        - {between: [tokyo, oregon], rtt: 100ms, rate: 200Mbit}
    backend: sim
    workload:
      model: {name: mlp, params: {hidden_sizes: [32]}}
      dataset: {name: digits}
      batch_size: 32
      lr: 0.05
      optimizer: {name: sgd, momentum: 0.9}
      eval_every: 10
    stop: {steps: 100000, time_budget_s: 8}
    algorithms: [{name: sync}, {name: swarmsgd, params: {H: 2}}]
    faults:
      - {at: 2s, kind: node_crash, node: tokyo-0, restart_after: 1s}
    sim: {compute_s: 0.004, overhead_s: 0.001}
""")


@pytest.mark.slow
def test_a_crash_on_the_real_engine_fails_sync_and_swarmsgd_takes_the_node_back(write_yaml, tmp_path):
    """node_crash with restart_after on sim, end to end (`wanbench run --backend sim`'s loop): the
    same records and job outcome as on tun (tests/emulator/test_faults_e2e.py), on the virtual clock."""
    scenario = load_scenario(write_yaml(CRASH_E2E, "crash.yaml"))
    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=_quiet())
    jobs = {d.name.split("-")[1]: d for d in (completed.run_dir / "jobs").iterdir()}
    summary = completed.summary.set_index("label")
    sync = json.loads((jobs["sync"] / "job.json").read_text())
    assert summary.loc["sync", "status"] == "failed" and sync["status"] == "failed"
    assert "rank 2 killed by the injected node_crash at 2.000 s" in sync["reason"], sync["reason"]

    swarm_dir = jobs["swarmsgd"]
    swarm = json.loads((swarm_dir / "job.json").read_text())
    assert swarm["status"] == "ok" and swarm["reason"] == "crash tolerated: rank 2 killed at 2.0 s (injected), restarted 1x"
    assert json.loads((swarm_dir / "config.json").read_text())["comm"]["backend"] == "tcp"
    faults = [json.loads(line) for line in (swarm_dir / "faults.jsonl").read_text().splitlines()]
    assert [(f["applied_s"], f["what"], f["effect"], f["ok"]) for f in faults] == [
        (2.0, "node_crash tokyo-0", "rank 2 killed", True), (3.0, "restart tokyo-0", "rank 2 restarted (restart 1)", True)]
    rank0 = [json.loads(line) for line in (swarm_dir / "rank0.jsonl").read_text().splitlines()]
    lost, joined = [r for r in rank0 if r["kind"] == "membership"]
    assert lost["lost"] == [2] and joined["joined"] == [2]
    # rank 0 (london) learns of the crash when tokyo's FIN arrives (110 ms), at its next eval point
    assert 2.11 <= lost["time_s"] < 3.0
    rank2 = [json.loads(line) for line in (swarm_dir / "rank2.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rank2].count("rejoin") == 1 and rank2[-1]["kind"] == "status"
    assert rank2[-1]["status"] == "ok" and [r["restarts"] for r in rank2 if r["kind"] == "start"] == [0, 1]
    assert summary.loc["swarmsgd", "status"] == "ok" and summary.loc["swarmsgd", "final_accuracy"] > 0.8
    rows = completed.frames.faults
    rows = rows[rows["label"] == "swarmsgd"]
    assert list(rows["what"]) == ["node_crash tokyo-0", "rank 2 lost", "restart tokyo-0", "rank 2 joined",
                                  "rank 2 rejoined"]
    assert list(rows["time_s"])[0] == 2.0 and list(rows["time_s"])[2] == 3.0
    markdown = write_report([completed.run_dir], tmp_path / "report").markdown.read_text()
    assert "## Faults" in markdown and "rank 2 lost" in markdown and "rank 2 rejoined" in markdown


# --- stand_in: the model a job stands for --------------------------------------------------------

STAND_IN = SCENARIO.replace("sim: {compute_s: 0.002, overhead_s: 0.0005, nic: 1Gbit}",
                            "sim: {nic: 1Gbit}\nstand_in: {parameters: 1e9, step_s: 0.5}")


def test_a_stand_in_reaches_the_simulator_and_the_summary_says_what_was_charged(fake_engine, write_yaml, tmp_path):
    """sim.json carries the wire scale (the stand-in's fp32 bytes over the real model's), the
    compute model is the stand-in's step, job.json and scenario.json say both sizes, and the
    summary (and so the CSV and Parquet export) has utilisation, bandwidths and the scale."""
    from harness.export import export_parquet
    from harness.sim_job import real_parameters

    scenario = load_scenario(write_yaml(STAND_IN, "standin.yaml"))
    completed = run_module.run_scenario(scenario, "sim", tmp_path / "runs", console=_quiet())
    real = real_parameters(scenario.jobs[0].trainer)
    scale = 1e9 * 4 / (real * 4)
    job_dir = completed.run_dir / "jobs" / "delay1-sync-seed0"
    given = json.loads((job_dir / "fake.json").read_text())
    assert given["wire_scale"] == pytest.approx(scale)
    assert given["compute"]["forward_backward_s"] == 0.5 and given["compute"]["step_overhead_s"] == 0.0
    stand_in = json.loads((job_dir / "job.json").read_text())["stand_in"]
    assert (stand_in["parameters"], stand_in["real_parameters"], stand_in["real_bytes"]) == (1e9, real, 4 * real)
    saved = json.loads((completed.run_dir / "scenario.json").read_text())
    assert saved["spec"]["stand_in"]["parameters"] == 1e9 and saved["sim"]["stand_in"] == [stand_in]

    summary = pd.read_csv(completed.run_dir / "summary.csv")
    step_s = 0.5 + 0.05  # the fake engine's step: the compute model's plus 50 ms blocked
    assert summary["compute_utilisation"].tolist() == pytest.approx([0.5 / step_s] * 2)
    assert summary["wire_scale"].tolist() == pytest.approx([scale] * 2)
    assert summary["stand_in_parameters"].tolist() == [1e9, 1e9]
    # the fake's bytes: 1,000 real bytes per step, charged at the scale
    assert summary["bytes_sent_per_node"].tolist() == pytest.approx([6 * 1000 * scale] * 2)
    assert summary["mean_bandwidth_per_node_bit_s"].tolist() == pytest.approx([1000 * scale * 8 / step_s] * 2)
    export_parquet(completed.frames, tmp_path / "parquet")
    table = pd.read_parquet(tmp_path / "parquet" / "summary.parquet")
    for column in ("compute_utilisation", "mean_bandwidth_per_node_bit_s", "peak_bandwidth_per_node_bit_s",
                   "stand_in_parameters", "wire_scale"):
        assert table[column].notna().all(), column


@pytest.mark.parametrize("stand_in, field, message", [
    ("{parameters: 1e9}", "stand_in", "step_s: SECONDS or compute_profile: NAME"),
    ("{parameters: 1e9, step_s: 1, compute_profile: v100-resnet50-fp32-b64}", "stand_in", "one of them"),
    ("{parameters: -5, step_s: 1}", "stand_in.parameters", "greater than 0"),
    ("{parameters: 1e15, step_s: 1}", "stand_in.parameters", "less than or equal to"),
    ("{parameters: 1e9, step_s: 0}", "stand_in.step_s", "greater than 0"),
    ("{parameters: 1e9, step_s: 1, bytes_per_parameter: 0}", "stand_in.bytes_per_parameter", "greater than 0"),
    ("{parameters: 1e9, step_s: 1, params: 3}", "stand_in.params", "unknown field"),
    ("{parameters: 1e9, compute_profile: h900-dreams}", "stand_in.compute_profile", "no such file or profile"),
])
def test_bad_stand_in_settings_name_the_file_and_field_in_one_line(write_yaml, stand_in, field, message):
    path = write_yaml(STAND_IN.replace("{parameters: 1e9, step_s: 0.5}", stand_in), "bad.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert caught.value.source == path and caught.value.field == field
    assert message in caught.value.message and "\n" not in str(caught.value)


@pytest.mark.parametrize("change, field", [
    (("backend: sim", "backend: tun"), "stand_in"),
    (("sim: {nic: 1Gbit}", "sim: {nic: 1Gbit, compute_s: 0.1}"), "sim.compute_s"),
    (("sim: {nic: 1Gbit}", "sim: {nic: 1Gbit, overhead_s: 0.1}"), "sim.overhead_s"),
    (("sim: {nic: 1Gbit}", "sim: {nic: 1Gbit}\ncompute_profile: v100-resnet50-fp32-b64"), "compute_profile"),
])
def test_a_stand_in_is_refused_off_sim_and_beside_another_compute_setting(write_yaml, change, field):
    path = write_yaml(STAND_IN.replace(*change), "clash.yaml")
    with pytest.raises(ConfigError) as caught:
        load_scenario(path)
    assert caught.value.field == field and "\n" not in str(caught.value)


def test_a_stand_in_scenario_of_backend_auto_is_refused_when_the_run_picks_an_emulator(write_yaml):
    from harness.scenario import check_stand_in

    scenario = load_scenario(write_yaml(STAND_IN.replace("backend: sim", "backend: auto"), "auto.yaml"))
    with pytest.raises(ConfigError, match="runs only on backend sim .this run: tun."):
        check_stand_in(scenario.spec, scenario.source_file, "tun")
    assert check_stand_in(scenario.spec, scenario.source_file, "sim") == 0.5


def test_a_stand_in_s_compute_profile_gives_its_step_time(write_yaml):
    scenario = load_scenario(write_yaml(STAND_IN.replace("step_s: 0.5", "compute_profile: v100-resnet50-fp32-b64"),
                                        "profile.yaml"))
    sim = sim_run(scenario)
    assert {c["forward_backward_s"] for c in sim.compute.values()} == {0.180}
    assert {s["step_source"] for s in sim.stand_in.values()} == {"compute_profile v100-resnet50-fp32-b64"}


def test_a_resumed_stand_in_run_charges_what_the_saved_run_did(write_yaml):
    """--resume takes the compute model and the stand-in from scenario.json, not measured again."""
    scenario = load_scenario(write_yaml(STAND_IN, "resume.yaml"))
    made = sim_run(scenario)
    saved = json.loads(json.dumps(made.record()))  # as scenario.json holds it
    restored = run_module._saved_sim(scenario, saved)
    assert restored.stand_in == made.stand_in and restored.compute == made.compute
    with pytest.raises(ConfigError, match="sim.stand_in: holds 2 workloads, the scenario has 1"):
        run_module._saved_sim(scenario, {**saved, "stand_in": saved["stand_in"] * 2})
