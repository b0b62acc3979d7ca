"""time_dilation: auto (harness/auto_dilation.py): K from the measured step time and the compute
profile, so that the padded step covers the real one; with injected timings."""

import itertools
import json
import math

import pytest

from emulator.schema import ConfigError
from harness import cli
from harness.auto_dilation import (AUTO_HEADROOM, StepMeasurement, auto_time_dilation, choose_time_dilation,
                                   contention_factor, measure_step_s, rank_threads)
from harness.dilation import load_profile
from harness.run import scenario_record
from harness.scenario import load_scenario

AMP = load_profile("v100-resnet50-amp-b64")  # step_s 0.055

SCENARIO = """
topology: lan.yaml
nodes: {lan: 2}
time_dilation: auto
compute_profile: v100-resnet50-amp-b64
workload:
  model: {name: resnet20}
  dataset: {name: cifar10, params: {fallback: generated, generated: {n_train: 64, n_test: 16}}}
  batch_size: 64
stop: {steps: 50}
algorithms:
  - {name: sync}
  - {name: local_sgd, params: {H: 4}}
"""


def measured(step_s: float, threads: int = 1) -> StepMeasurement:
    return StepMeasurement("resnet20 on cifar10, batch 64", step_s, [step_s] * 5, threads)


@pytest.mark.parametrize("step_s, ranks, cores", list(itertools.product([0.001, 0.03, 0.3, 2.5], [1, 2, 4, 8], [2, 16])))
def test_k_makes_the_padded_step_cover_the_cpu_step_with_headroom(step_s, ranks, cores):
    threads = max(1, cores // ranks)
    choice = choose_time_dilation(AMP, [measured(step_s, threads)], ranks=ranks, cores=cores)
    assert choice.contention == max(1.0, threads * ranks / cores)
    assert choice.rank_step_s == pytest.approx(step_s * choice.contention)
    assert choice.k == int(choice.k) and 1 <= choice.k <= 1000
    assert AUTO_HEADROOM == 1.5
    assert AMP.step_s * choice.k >= 1.5 * choice.rank_step_s - 1e-12   # the padding covers the step, +50%
    if choice.k > 1:
        assert AMP.step_s * (choice.k - 1) < 1.5 * choice.rank_step_s  # and K is the smallest that does


def test_k_for_a_resnet20_step_and_why():
    # 0.2 s on 1 thread; 4 ranks share 2 cores: 0.4 s a rank step; 1.5 x 0.4 / 0.055 = 10.91 -> 11
    choice = choose_time_dilation(AMP, [measured(0.2)], ranks=4, cores=2)
    assert (choice.k, choice.contention, choice.required_k) == (11.0, 2.0, pytest.approx(10.909, abs=1e-3))
    assert choice.why == ("resnet20 on cifar10, batch 64: 200.0 ms per forward + backward here (cpu, 1 thread(s), "
                          "median of 5); 4 ranks on 2 cores: x2 -> 400.0 ms per rank step; x1.5 headroom / "
                          "v100-resnet50-amp-b64's 55 ms = 10.91 -> K = 11")
    assert not choice.clamped


def test_k_is_at_least_one_and_at_most_the_limit():
    assert choose_time_dilation(AMP, [measured(0.001)], ranks=1, cores=2).k == 1.0
    huge = choose_time_dilation(AMP, [measured(100.0)], ranks=1, cores=2)
    assert huge.k == 1000.0 and huge.clamped and "clamped at 1000" in huge.why


def test_the_slowest_workload_decides():
    fast, slow = StepMeasurement("mlp", 0.01, [0.01]), StepMeasurement("resnet20", 0.3, [0.3])
    assert choose_time_dilation(AMP, [fast, slow], ranks=1, cores=2).k == math.ceil(1.5 * 0.3 / 0.055)


def test_contention_counts_the_ranks_sharing_cores_and_a_cpu_share():
    assert contention_factor(ranks=4, cores=2, threads=1, cpu_share=None) == 2.0
    assert contention_factor(ranks=2, cores=2, threads=1, cpu_share=None) == 1.0
    assert contention_factor(ranks=1, cores=2, threads=2, cpu_share=None) == 1.0
    assert contention_factor(ranks=2, cores=2, threads=1, cpu_share=0.25) == 4.0
    assert rank_threads(4, {}) >= 1 and rank_threads(4, {"OMP_NUM_THREADS": "3"}) == 3


def test_a_scenario_with_auto_gets_k_from_each_distinct_workload_measured_once(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO, "s.yaml"))
    assert scenario.time_dilation == "auto"
    calls = []

    def measure(config, threads):
        calls.append((config.batch_size, threads))
        return measured(0.3 if config.batch_size == 64 else 0.6, threads)

    chosen = auto_time_dilation(scenario, measure, cores=2)
    assert calls == [(64, 1)]                   # sync and local SGD train the same workload: timed once
    assert chosen.time_dilation == math.ceil(1.5 * 0.3 / 0.055) == 9.0
    assert chosen.time_dilation_auto["measured"][0]["step_s"] == 0.3
    assert chosen.jobs[0].trainer_config["min_compute_s"] == 0.055   # emulated seconds; the run dilates them
    # an algorithm with its own batch size is a second workload, and the slower one decides
    bigger = load_scenario(write_yaml(SCENARIO.replace("{name: local_sgd, params: {H: 4}}",
                                                       "{name: local_sgd, workload: {batch_size: 128}}"), "b.yaml"))
    calls.clear()
    assert auto_time_dilation(bigger, measure, cores=2).time_dilation == math.ceil(1.5 * 0.6 / 0.055)
    assert sorted(calls) == [(64, 1), (128, 1)]


def test_scenario_json_records_k_and_why(write_yaml):
    scenario = auto_time_dilation(load_scenario(write_yaml(SCENARIO, "s.yaml")), lambda c, t: measured(0.3, t),
                                  cores=2)
    record = json.loads(json.dumps(scenario_record(scenario)))
    assert record["spec"]["time_dilation"] == 9.0                     # what load_run divides by
    auto = record["time_dilation_auto"]
    assert (auto["k"], auto["profile"], auto["profile_step_s"], auto["ranks"]) == (9.0, "v100-resnet50-amp-b64", 0.055, 2)
    assert auto["measured"][0]["workload"] == "resnet20 on cifar10, batch 64" and "K = 9" in auto["why"]
    plain = load_scenario(write_yaml(SCENARIO.replace("time_dilation: auto", "time_dilation: 3"), "p.yaml"))
    assert "time_dilation_auto" not in scenario_record(plain) and scenario_record(plain)["spec"]["time_dilation"] == 3.0


@pytest.mark.parametrize("change, message", [
    (("compute_profile: v100-resnet50-amp-b64\n", ""),
     r"^\S*s.yaml: time_dilation: auto chooses K from a compute profile's step time: add compute_profile"),
    (("time_dilation: auto", "time_dilation: fast"),
     r"^\S*s.yaml: time_dilation: must be a number greater than or equal to 1 and at most 1000, or auto"),
])
def test_bad_auto_is_one_line_naming_the_file_and_field(write_yaml, change, message):
    with pytest.raises(ConfigError, match=message):
        load_scenario(write_yaml(SCENARIO.replace(*change), "s.yaml"))


def test_time_dilation_auto_on_the_command_line_needs_a_profile(write_yaml, capsys):
    path = write_yaml(SCENARIO.replace("compute_profile: v100-resnet50-amp-b64\n", "")
                      .replace("time_dilation: auto", "time_dilation: 2"), "s.yaml")
    assert cli.main(["run", path, "--time-dilation", "auto"]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"wanbench: {path}: time_dilation (--time-dilation auto): auto chooses K from a compute profile")
    assert cli.main(["run", path, "--time-dilation", "often"]) == cli.EXIT_BAD_INPUT
    assert "--time-dilation" in capsys.readouterr().err


def test_the_measurement_times_forward_and_backward_after_the_warm_up(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO.replace("resnet20", "mlp"), "s.yaml"))
    ticks = iter([0.0, 9.0, 0.0, 9.0] + [t for step in (0.5, 0.1, 0.3, 0.2, 0.4) for t in (10.0, 10.0 + step)])
    result = measure_step_s(scenario.jobs[0].trainer, threads=1, clock=lambda: next(ticks))
    assert result.samples == pytest.approx([0.5, 0.1, 0.3, 0.2, 0.4])   # the two 9 s warm-up steps left out
    assert result.step_s == pytest.approx(0.3)                          # the median
    assert result.workload == "mlp on cifar10, batch 64" and result.threads == 1
    assert result.data_source.startswith("generated CIFAR-shaped (synthetic_cifar, seed 0, 64 train / 16 test")


@pytest.mark.slow
def test_a_run_chooses_k_before_the_network_and_its_report_names_k_and_the_data(tmp_path, write_yaml, monkeypatch):
    """harness.run.run_scenario end to end with the network left out: a backend that builds
    nothing and every job's ranks on loopback (real trainers, real records), the measured step
    injected; scenario.json, the console and report.md say K and the data."""
    import io

    from rich.console import Console

    import harness.run as run_module
    from harness.jobs import JobOutcome
    from harness.report import write_report
    from trainers.launch import launch_local

    events = []

    class NoNetwork:
        name = "none"

        def __init__(self, plan):
            self.plan = plan

        def up(self):
            events.append("up")

        def down(self):
            events.append("down")

    def ranks_on_loopback(plan, spec, port, tick, **kwargs):
        job, job_dir = spec.job, spec.job_dir
        spec.write()
        exits = launch_local(job_dir / "config.json", len(plan.nodes), timeout_s=120)
        failed = [f"rank {e.rank}: {e.stderr_tail}" for e in exits if e.returncode != 0]
        outcome = JobOutcome(job.job_id, "failed" if failed else "ok", 1.0, "; ".join(failed))
        (job_dir / "job.json").write_text(json.dumps({
            "job_id": job.job_id, "status": outcome.status, "wall_s": 1.0, "reason": outcome.reason,
            "label": job.label, "algorithm": job.algorithm, "seed": job.seed, "network_key": job.network.key,
            "network": {"delay_scale": 1.0, "rate": None}, "params": job.params, "nodes": len(plan.nodes)}))
        return outcome

    def measure(config, threads):
        events.append("measure")
        return StepMeasurement("mlp on cifar10, batch 64", 0.1, [0.1] * 5, threads)

    monkeypatch.setattr(run_module, "choose_backend", lambda name: (NoNetwork, ""))
    monkeypatch.setattr(run_module, "run_job", ranks_on_loopback)
    scenario = load_scenario(write_yaml(SCENARIO.replace("resnet20", "mlp").replace("  - {name: local_sgd, params: {H: 4}}\n", "")
                                        .replace("stop: {steps: 50}", "stop: {steps: 4}\nverify: {enabled: false}"), "e2e.yaml"))
    console = Console(file=io.StringIO(), width=200)
    completed = run_module.run_scenario(scenario, "auto", tmp_path / "runs", console=console, measure=measure)

    assert events == ["measure", "up", "down"]              # measured before any network was built
    k = math.ceil(1.5 * 0.1 / 0.055)                        # 2 ranks on 2 cores: no contention
    assert f"time dilation auto: K = {k} (" in console.file.getvalue()
    record = json.loads((completed.run_dir / "scenario.json").read_text())
    assert record["spec"]["time_dilation"] == k and record["time_dilation_auto"]["k"] == k
    assert list(completed.summary["status"]) == ["ok"] and list(completed.summary["time_dilation"]) == [k]
    config = json.loads(next((completed.run_dir / "jobs").glob("*/config.json")).read_text())
    assert config["min_compute_s"] == pytest.approx(0.055 * k)  # the profile's step, dilated
    markdown = write_report([completed.run_dir], tmp_path / "report").markdown.read_text()
    assert f"time dilation {k}, chosen by auto: mlp on cifar10, batch 64: 100.0 ms per forward + backward" in markdown
    assert ("- data: generated CIFAR-shaped (synthetic_cifar, seed 0, 64 train / 16 test images) instead of "
            "CIFAR-10 (fallback: generated): cifar10 needs dataset.path") in markdown
