"""Results tables and `wanbench report` on synthetic run directories with hand-computed answers.

`write_run` builds a run directory exactly as harness/run.py and trainers/runner.py write one
(scenario.json from the real schema, plan.json from the real planner, job.json, rank<N>.jsonl
with start/step/eval/status records); test_plots, test_regress and test_notebooks use it too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import pytest

from harness import cli
from emulator.plan import make_plan
from harness.report import load_results, network_axes, write_report
from harness.results import charge_output_sync_from, load_run, summarize
from harness.scenario import Job, NetworkPoint, ScenarioFile, load_scenario
from emulator.schema import ConfigError
from emulator.topology import topology_from_dict

TOPOLOGY = {"name": "two-region", "regions": {"east": {"nodes": 1}, "west": {"nodes": 1}},
            "links": [{"between": ["east", "west"], "rtt": "100ms", "rate": "100Mbit"}]}


@dataclass
class FakeJob:
    """What one synthetic job did: every rank steps every `step_time_s`, rank 0 evaluates."""

    algorithm: str
    label: Optional[str] = None
    seed: int = 0
    delay_scale: float = 1.0
    rate: Optional[str] = None
    steps: int = 10
    step_time_s: float = 1.0
    start_s: float = 0.5                 # time_s of the start record (rendezvous before it)
    bytes_per_step: int = 1000           # sent per rank per step
    blocked_s: Optional[float] = 0.4     # comm_blocked_s per step (None: not measured)
    evals: dict = field(default_factory=dict)  # step -> accuracy
    status: Optional[str] = "ok"         # None: no job.json (the job never finished)
    nodes: int = 2
    staleness: Optional[int] = None
    transport: Optional[str] = None      # the start records' all-reduce transport (None: not written)
    output_role: Optional[str] = None    # the eval records' role (replica: mean of every rank's replica)
    config: Optional[dict] = None        # the job's config.json (None: not written)
    data_source: Optional[str] = None    # the data records' source (None: no data record, as in older runs)

    @property
    def network(self) -> NetworkPoint:
        return NetworkPoint(self.delay_scale, self.rate, None)

    @property
    def name(self) -> str:
        return self.label or self.algorithm


def _rank_records(job: FakeJob, rank: int) -> list[dict]:
    def stamp(kind, time_s, **fields):
        return {"kind": kind, "rank": rank, "time_unix": 1.7e9 + time_s, "time_s": time_s, **fields}

    records = [stamp("start", job.start_s, world_size=job.nodes, algorithm=job.algorithm, model="mlp",
                     dataset="digits", host="test", python="3.11", torch="2.x", device="cpu", backend="gloo",
                     **({"transport": job.transport} if job.transport else {}))]
    if job.data_source is not None:
        records.append(stamp("data", job.start_s, dataset="cifar10", source=job.data_source, train_samples=50000,
                             test_samples=10000, input_shape=[3, 32, 32], num_classes=10))
    total = 0
    for step in range(job.steps):
        time_s = job.start_s + (step + 1) * job.step_time_s
        total += job.bytes_per_step
        blocked = job.blocked_s
        records.append(stamp("step", time_s, step=step, epoch=step / 50, loss=2.0 / (1 + step), lr=0.1,
                             step_s=job.step_time_s,
                             compute_s=None if blocked is None else job.step_time_s - blocked,
                             comm_blocked_s=blocked, bytes_sent=job.bytes_per_step, bytes_recv=job.bytes_per_step,
                             bytes_sent_total=total, bytes_recv_total=total, staleness=job.staleness))
        if step in job.evals:
            if rank == 0:
                role = {"role": job.output_role, "ranks": list(range(job.nodes))} if job.output_role else {}
                records.append(stamp("eval", time_s, step=step, accuracy=job.evals[step],
                                     loss=1.0 - job.evals[step], eval_s=0.01, eval_bytes_sent=0, eval_bytes_recv=0,
                                     **role))
    records.append(stamp("status", job.start_s + job.steps * job.step_time_s + 0.01, status="ok",
                         steps=job.steps, stop_reason="steps"))
    return records


def write_run(root, jobs: list[FakeJob], *, name: str = "synthetic", run_id: str = "20250101-000000",
              target_accuracy: Optional[float] = 0.9, complete: bool = True, stop: Optional[dict] = None) -> Path:
    """A run directory under root/<name>/<run_id> in the layout of harness/run.py."""
    run_dir = Path(root) / name / run_id
    run_dir.mkdir(parents=True)
    spec = ScenarioFile.model_validate({
        "name": name, "topology": TOPOLOGY, "workload": {"model": {"name": "mlp"}, "dataset": {"name": "digits"}},
        "stop": {"steps": max(j.steps for j in jobs), "target_accuracy": target_accuracy, **(stop or {})},
        "algorithms": [{"name": a, "label": l} for a, l in dict.fromkeys((j.algorithm, j.name) for j in jobs)]})
    scenario_jobs = [Job(job_id=f"{j.network.key}-{j.name}-seed{j.seed}", network=j.network, algorithm=j.algorithm,
                         label=j.name, seed=j.seed) for j in jobs]
    (run_dir / "scenario.json").write_text(json.dumps({
        "name": name, "source_file": f"scenarios/{name}.yaml", "spec": spec.model_dump(),
        "jobs": [dataclasses.asdict(j) for j in scenario_jobs]}, indent=1, default=str))
    (run_dir / "environment.json").write_text(json.dumps({
        "date": "2025-01-01T00:00:00+00:00", "backend": "tc", "kernel": "6.1", "python": "3.11.2",
        "torch": "2.x", "cpu": "Test CPU", "cpu_count": 4, "gpu": None, "git_commit": "0" * 40,
        "git_dirty": False}))
    topology = topology_from_dict(TOPOLOGY, source="test")
    for point in dict.fromkeys(j.network for j in jobs):
        from emulator.units import parse_rate_bit_s

        scaled = topology.scaled(point.delay_scale, parse_rate_bit_s(point.rate) if point.rate else None)
        (run_dir / point.key).mkdir()
        (run_dir / point.key / "plan.json").write_text(make_plan(scaled).to_json())
    for job, scenario_job in zip(jobs, scenario_jobs):
        job_dir = run_dir / "jobs" / scenario_job.job_id
        job_dir.mkdir(parents=True)
        if job.config is not None:
            (job_dir / "config.json").write_text(json.dumps(job.config))
        for rank in range(job.nodes):
            lines = [json.dumps(r) for r in _rank_records(job, rank)]
            (job_dir / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
        if job.status is not None:
            (job_dir / "job.json").write_text(json.dumps({
                "job_id": scenario_job.job_id, "status": job.status, "wall_s": job.steps * job.step_time_s + 2,
                "reason": "", "label": job.name, "algorithm": job.algorithm, "seed": job.seed,
                "network": dataclasses.asdict(job.network), "network_key": job.network.key, "params": {},
                "nodes": job.nodes}))
    if complete:
        (run_dir / "COMPLETE").write_text("2025-01-01T00:10:00")
    return run_dir


def sync_and_dts(**overrides) -> list[FakeJob]:
    """sync: 1 s/step, reaches 0.92 at step 9 (10 s); dts: 0.5 s/step, reaches 0.91 at step 4 (2.5 s)."""
    return [FakeJob("sync", evals={4: 0.5, 9: 0.92}, **overrides),
            FakeJob("dts", step_time_s=0.5, bytes_per_step=250, blocked_s=0.05, evals={4: 0.91, 9: 0.93}, **overrides)]


def test_transport_column_comes_from_the_start_records(tmp_path):
    jobs = [FakeJob("sync", transport="gloo"), FakeJob("sync", label="sync-ours", transport="ours:auto"),
            FakeJob("dts")]  # a run made before the start record named its transport
    table = summarize(load_run(write_run(tmp_path, jobs))).set_index("label")
    assert table.loc["sync", "transport"] == "gloo"
    assert table.loc["sync-ours", "transport"] == "ours:auto"
    assert pd.isna(table.loc["dts", "transport"])


def test_each_job_is_compared_with_the_sync_job_of_its_own_workload(tmp_path):
    """Sync on two workloads (compute padded or not) in one scenario: EA-wild-heavy against
    sync-heavy, EA-wild-light against sync-light, whatever order the jobs come in."""
    light, heavy = {"model": {"name": "lenet"}, "lr": 0.05}, {"model": {"name": "lenet"}, "lr": 0.05, "min_compute_s": 0.05}
    jobs = [FakeJob("sync", label="sync-heavy", step_time_s=1.0, evals={9: 0.95}, config={**heavy, "algorithm": {"name": "sync"}}),
            FakeJob("sync", label="sync-light", step_time_s=0.5, evals={9: 0.95}, config={**light, "algorithm": {"name": "sync"}}),
            FakeJob("eawild", label="eawild-light", step_time_s=0.25, evals={9: 0.95},
                    config={**light, "algorithm": {"name": "eawild"}, "seed": 0, "comm": {"backend": "tcp"}}),
            FakeJob("eawild", label="eawild-heavy", step_time_s=2.0, evals={9: 0.95},
                    config={**heavy, "algorithm": {"name": "eawild"}})]
    table = summarize(load_run(write_run(tmp_path, jobs))).set_index("label")
    assert table.loc["eawild-light", "workload"] == table.loc["sync-light", "workload"] != table.loc["sync-heavy", "workload"]
    assert table.loc["eawild-light", "throughput_speedup_vs_sync"] == pytest.approx(2.0)
    assert table.loc["eawild-heavy", "throughput_speedup_vs_sync"] == pytest.approx(0.5)
    assert table.loc["eawild-light", "speedup_vs_sync"] == pytest.approx(2.0)
    assert table.loc["eawild-heavy", "speedup_vs_sync"] == pytest.approx(0.5)


@pytest.mark.parametrize("heavy_first", [True, False])
def test_every_comparison_with_sync_takes_the_sync_job_of_its_own_workload(tmp_path, heavy_first):
    """Sync on two workloads at one network point and seed: the speedups, the output's averaging
    cost (output_sync_s, added to time_to_target_s) and compute_comm_ratio each take the sync job
    of the row's own workload, whichever sync job comes first in the run."""
    light, heavy = {"model": {"name": "lenet"}, "lr": 0.05}, {"model": {"name": "lenet"}, "lr": 0.05, "min_compute_s": 0.5}
    syncs = [FakeJob("sync", label="sync-heavy", step_time_s=1.0, blocked_s=0.5, evals={4: 0.5, 9: 0.95},
                     output_role="rank0", config={**heavy, "algorithm": {"name": "sync"}}),
             FakeJob("sync", label="sync-light", step_time_s=0.3, blocked_s=0.2, evals={4: 0.5, 9: 0.95},
                     output_role="rank0", config={**light, "algorithm": {"name": "sync"}})]
    others = [FakeJob("local_sgd", label="local-light", step_time_s=0.15, blocked_s=0.05, evals={4: 0.95},
                      output_role="replica", config={**light, "algorithm": {"name": "local_sgd"}}),
              FakeJob("local_sgd", label="local-heavy", step_time_s=0.6, blocked_s=0.1, evals={4: 0.95},
                      output_role="replica", config={**heavy, "algorithm": {"name": "local_sgd"}})]
    jobs = (syncs if heavy_first else syncs[::-1]) + others
    table = summarize(load_run(write_run(tmp_path, jobs))).set_index("label")
    # one all-reduce of the model on this network, as the same workload's sync measured it
    assert table.loc["local-light", "output_sync_s"] == pytest.approx(0.2)
    assert table.loc["local-heavy", "output_sync_s"] == pytest.approx(0.5)
    assert table.loc["local-light", "time_to_target_s"] == pytest.approx(5 * 0.15 + 0.2)
    assert table.loc["local-heavy", "time_to_target_s"] == pytest.approx(5 * 0.6 + 0.5)
    # compute per step over the same workload's sync all-reduce
    assert table.loc["sync-light", "compute_comm_ratio"] == pytest.approx(0.1 / 0.2)
    assert table.loc["sync-heavy", "compute_comm_ratio"] == pytest.approx(0.5 / 0.5)
    assert table.loc["local-light", "compute_comm_ratio"] == pytest.approx(0.1 / 0.2)
    assert table.loc["local-heavy", "compute_comm_ratio"] == pytest.approx(0.5 / 0.5)
    sync_light_time = table.loc["sync-light", "time_to_target_s"]
    assert table.loc["local-light", "speedup_vs_sync"] == pytest.approx(sync_light_time / (5 * 0.15 + 0.2))
    assert table.loc["local-light", "throughput_speedup_vs_sync"] == pytest.approx(0.3 / 0.15)
    assert table.loc["local-heavy", "throughput_speedup_vs_sync"] == pytest.approx(1.0 / 0.6)


def test_summarize_matches_hand_computed_values(tmp_path):
    run_dir = write_run(tmp_path, sync_and_dts())
    table = summarize(load_run(run_dir)).set_index("label")
    sync, dts = table.loc["sync"], table.loc["dts"]
    # train_time_s counts from the first step's start (0.5 s): step 4 of sync ends at 5 s (0.5),
    # step 9 at 10 s (0.92); the target 0.9 is crossed between them, at 5 + 0.4 / 0.42 * 5 s.
    assert sync["time_to_target_s"] == pytest.approx(5 + 0.4 / 0.42 * 5)
    assert dts["time_to_target_s"] == pytest.approx(2.5)  # the first evaluation is already past it
    assert dts["speedup_vs_sync"] == pytest.approx((5 + 0.4 / 0.42 * 5) / 2.5)
    assert sync["speedup_vs_sync"] == pytest.approx(1.0)
    assert sync["steps_per_s"] == pytest.approx(1.0)
    assert dts["steps_per_s"] == pytest.approx(2.0)
    assert dts["throughput_speedup_vs_sync"] == pytest.approx(2.0)
    assert dts["accuracy_delta_vs_sync"] == pytest.approx(0.01)
    assert sync["bytes_sent_per_node"] == pytest.approx(10_000)
    assert dts["bytes_sent_per_node"] == pytest.approx(2_500)
    assert dts["bytes_per_step_per_node"] == pytest.approx(250)
    assert sync["comm_blocked_fraction"] == pytest.approx(0.4)
    assert dts["comm_blocked_fraction"] == pytest.approx(0.1)
    assert sync["final_accuracy"] == pytest.approx(0.92) and sync["best_accuracy"] == pytest.approx(0.92)


def test_accuracy_at_equal_budgets_and_the_delta_taken_there(tmp_path):
    """Budgets: steps done (an eval record's step is the last step's index) and training time; the
    value is the last evaluation within the budget, and none for a job that ended before it."""
    jobs = [FakeJob("sync", evals={4: 0.5, 9: 0.92, 19: 0.95}, steps=20),
            FakeJob("dts", step_time_s=0.5, evals={4: 0.91, 9: 0.93, 19: 0.96}, steps=20),
            FakeJob("local_sgd", label="short", evals={4: 0.7}, steps=5)]
    run_dir = write_run(tmp_path, jobs, stop={"budget_steps": 10, "budget_time_s": 6.0})
    table = summarize(load_run(run_dir)).set_index("label")
    assert table.loc["sync", "accuracy_at_step_budget"] == pytest.approx(0.92)  # step 9 = 10 steps done
    assert table.loc["dts", "accuracy_at_step_budget"] == pytest.approx(0.93)
    # 6 s of training: sync's step 4 ended at 5 s, dts's step 9 at 5 s (0.5 s a step)
    assert table.loc["sync", "accuracy_at_time_budget"] == pytest.approx(0.5)
    assert table.loc["dts", "accuracy_at_time_budget"] == pytest.approx(0.93)
    assert pd.isna(table.loc["short", "accuracy_at_step_budget"])  # stopped after 5 steps
    # the delta against sync is taken at the step budget, not at the end (0.96 - 0.95)
    assert table.loc["dts", "accuracy_delta_vs_sync"] == pytest.approx(0.01)
    assert table.loc["dts", "final_accuracy"] == pytest.approx(0.96)


def test_report_explains_every_metric_and_where_accuracy_is_compared(tmp_path):
    from harness.results import METRICS

    jobs = [FakeJob("sync", evals={4: 0.5, 9: 0.92}, steps=10), FakeJob("dts", evals={4: 0.91, 9: 0.93}, steps=10)]
    budgeted = write_run(tmp_path / "a", jobs, stop={"budget_steps": 10, "budget_time_s": 6.0})
    markdown = write_report([budgeted], tmp_path / "out-a").markdown.read_text()
    for name in ("time_to_target_s", "accuracy_delta_vs_sync", "wire_bytes_per_node", "final_accuracy"):
        assert f"- `{name}`: {METRICS[name]}" in markdown
    assert "accuracy compared at equal budgets of 10 steps and 6 s of training" in markdown
    # Without stated budgets, the furthest every job got (both evaluated last after 10 steps, 10 s).
    plain = write_run(tmp_path / "b", jobs)
    assert ("accuracy compared at equal budgets of 10 steps and 10 s of training, the furthest every job that "
            "ended ok got (no budget stated" in write_report([plain], tmp_path / "out-b").markdown.read_text())


def test_time_to_target_of_a_mean_of_replicas_includes_one_measured_all_reduce(tmp_path):
    """DTS's output (the replicas' mean) reached the target at step 4 (5 s), before any sync; forming
    that mean costs one all-reduce, measured as sync's median blocked step (0.9 s here): 5.9 s. A
    job whose output is rank 0's model (sync, or here 'other') pays nothing."""
    jobs = [FakeJob("sync", evals={4: 0.5, 9: 0.95}, steps=10, blocked_s=0.9, output_role="rank0"),
            FakeJob("dts", evals={4: 0.95, 9: 0.96}, steps=10, blocked_s=0.1, output_role="replica"),
            FakeJob("local_sgd", label="other", evals={4: 0.95}, steps=10, blocked_s=0.1, output_role="rank0")]
    table = summarize(load_run(write_run(tmp_path, jobs, target_accuracy=0.9))).set_index("label")
    assert table.loc["dts", "output_sync_s"] == pytest.approx(0.9)
    assert table.loc["dts", "time_to_target_s"] == pytest.approx(5.0 + 0.9)
    assert table.loc["other", "output_sync_s"] == 0.0 and table.loc["other", "time_to_target_s"] == pytest.approx(5.0)
    assert table.loc["sync", "output_sync_s"] == 0.0
    sync_time = table.loc["sync", "time_to_target_s"]  # interpolated between steps 4 and 9
    assert table.loc["dts", "speedup_vs_sync"] == pytest.approx(sync_time / 5.9)
    # Without a sync job the cost is unknown: left empty, and not added.
    alone = summarize(load_run(write_run(tmp_path / "alone", jobs[1:2], target_accuracy=0.9)))
    assert pd.isna(alone.loc[0, "output_sync_s"]) and alone.loc[0, "time_to_target_s"] == pytest.approx(5.0)
    # ... until a run with sync on the same network and seed lends its measurement
    charged = charge_output_sync_from(alone, table.reset_index())
    assert charged.loc[0, "output_sync_s"] == pytest.approx(0.9) and bool(charged.loc[0, "output_sync_charged"])
    assert charged.loc[0, "time_to_target_s"] == pytest.approx(5.0 + 0.9)
    elsewhere = charge_output_sync_from(alone, table.reset_index().assign(seed=7))  # another seed: nothing lent
    assert pd.isna(elsewhere.loc[0, "output_sync_s"]) and not elsewhere["output_sync_charged"].any()


def test_budget_beyond_the_run_is_refused(write_yaml):
    path = write_yaml("topology: lan.yaml\nalgorithms: [{name: sync}]\nstop: {steps: 100, budget_steps: 200}\n",
                      "s.yaml")
    with pytest.raises(ConfigError, match="budget_steps 200 is more than steps 100"):
        load_scenario(path)


def test_wire_bytes_come_from_the_backend_counters(tmp_path):
    run_dir = write_run(tmp_path, sync_and_dts())
    job_dir = next((run_dir / "jobs").glob("*-sync-*"))
    (job_dir / "wire.json").write_text(json.dumps({"nodes": {"a-0": {"bytes_sent": 12_000}, "b-0": {"bytes_sent": 14_000}}}))
    table = summarize(load_run(run_dir)).set_index("label")
    assert table.loc["sync", "wire_bytes_per_node"] == pytest.approx(13_000)
    assert table.loc["sync", "wire_overhead"] == pytest.approx(13_000 / 10_000 - 1)
    assert pd.isna(table.loc["dts", "wire_bytes_per_node"])  # no counters: no wire figure, not zero


def test_target_never_reached_leaves_speedup_empty(tmp_path):
    jobs = [FakeJob("sync", evals={9: 0.5}), FakeJob("dts", evals={9: 0.95})]
    table = summarize(load_run(write_run(tmp_path, jobs))).set_index("label")
    assert pd.isna(table.loc["sync", "time_to_target_s"])
    assert pd.isna(table.loc["dts", "speedup_vs_sync"])
    assert table.loc["dts", "throughput_speedup_vs_sync"] == pytest.approx(1.0)


def test_load_run_train_time_counts_from_start_record(tmp_path):
    frames = load_run(write_run(tmp_path, sync_and_dts()))
    first = frames.steps[(frames.steps["label"] == "sync") & (frames.steps["rank"] == 0)].sort_values("step").iloc[0]
    assert first["time_s"] == pytest.approx(1.5)
    assert first["train_time_s"] == pytest.approx(1.0)
    assert frames.complete and frames.target_accuracy == 0.9


def test_network_axes_from_plan(tmp_path):
    jobs = [FakeJob("sync", delay_scale=s, rate="10Mbit", evals={9: 0.9}) for s in (0.5, 2.0)]
    axes = network_axes(write_run(tmp_path, jobs)).set_index("network")
    assert axes.loc["delay0.5-rate10Mbit", "mean_rtt_ms"] == pytest.approx(50.0)
    assert axes.loc["delay2-rate10Mbit", "mean_rtt_ms"] == pytest.approx(200.0)
    assert axes.loc["delay2-rate10Mbit", "rate_bit_s"] == pytest.approx(10e6)


def test_report_writes_markdown_csv_and_figures(tmp_path):
    run_a = write_run(tmp_path / "runs", [*sync_and_dts(delay_scale=0.5, rate="10Mbit"),
                                          *sync_and_dts(delay_scale=2.0, rate="100Mbit")])
    run_b = write_run(tmp_path / "runs", sync_and_dts(), name="other")
    outcome = write_report([run_a, run_b], tmp_path / "out")
    markdown = outcome.markdown.read_text()
    assert "INCOMPLETE" not in markdown
    assert "synthetic/20250101-000000" in markdown and "| network |" in markdown.replace("| run |", "")
    for name in ("speedup_vs_latency", "throughput_vs_bandwidth", "accuracy_vs_bytes", "async_vs_sync"):
        assert (tmp_path / "out" / "figures" / f"{name}.png").stat().st_size > 1000
        assert (tmp_path / "out" / "figures" / f"{name}.svg").is_file()
        assert f"figures/{name}.png" in markdown
    combined = pd.read_csv(outcome.combined_csv)
    assert len(combined) == 6 and set(combined["run"]) == {"synthetic/20250101-000000", "other/20250101-000000"}
    assert len(outcome.run_csvs) == 2 and all(p.is_file() for p in outcome.run_csvs)
    # every figure its runs have data for; one node count, so no scale figure, and the report says why
    assert outcome.skipped_figures == {"speedup_vs_nodes": "the node count was not swept (one node count in "
                                                           "the compared runs)"}
    progress = sorted((tmp_path / "out" / "figures").glob("progress-*.png"))
    assert len(progress) == 3  # two network points of run a, one of run b


def test_incomplete_run_is_flagged_and_left_out_of_comparisons(tmp_path):
    complete = write_run(tmp_path / "runs", sync_and_dts())
    jobs = sync_and_dts()
    jobs[1].status = None  # dts never wrote job.json
    partial = write_run(tmp_path / "runs", jobs, name="crashed", complete=False)
    outcome = write_report([complete, partial], tmp_path / "out")
    markdown = outcome.markdown.read_text()
    assert f"INCOMPLETE run: {partial}" in markdown
    assert [run.path for run in outcome.incomplete] == [partial]
    assert "status **incomplete**" in markdown
    results = load_results([complete, partial])
    assert set(results.comparable()["run"]) == {"synthetic/20250101-000000"}
    assert list((tmp_path / "out" / "figures").glob("progress-crashed-*.png"))


def test_unswept_rate_skips_the_bandwidth_figure_and_says_why(tmp_path):
    outcome = write_report([write_run(tmp_path / "runs", sync_and_dts())], tmp_path / "out")
    assert "not swept" in outcome.skipped_figures["throughput_vs_bandwidth"]
    assert "`throughput_vs_bandwidth` not drawn: the link rate was not swept" in outcome.markdown.read_text()
    assert (tmp_path / "out" / "figures" / "speedup_vs_latency.png").is_file()


def test_interrupted_run_says_why(tmp_path):
    run_dir = write_run(tmp_path / "runs", sync_and_dts(), complete=False)
    (run_dir / "INTERRUPTED").write_text("Interrupted: SIGTERM\n")
    markdown = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert "INCOMPLETE run" in markdown and "Interrupted: SIGTERM" in markdown


def test_report_cli(tmp_path, capsys):
    run_dir = write_run(tmp_path / "runs", sync_and_dts(), complete=False)
    assert cli.main(["report", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "INCOMPLETE run" in captured.err
    assert (tmp_path / "out" / "report.md").is_file()


@pytest.mark.parametrize("make", ["missing", "file", "folder"])
def test_report_cli_rejects_a_non_run_directory(tmp_path, capsys, make):
    path = tmp_path / "thing"
    if make == "file":
        path.write_text("hello")
    elif make == "folder":
        path.mkdir()
    assert cli.main(["report", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err


GENERATED = ("generated CIFAR-shaped (synthetic_cifar, seed 0, 50000 train / 10000 test images) instead of "
             "CIFAR-10 (fallback: generated): CIFAR-10 python batches missing under /data/cifar: ['data_batch_1']")


def test_the_report_says_what_data_the_jobs_trained_on(tmp_path):
    same = write_run(tmp_path / "a", [FakeJob("sync", data_source=GENERATED), FakeJob("dts", data_source=GENERATED)])
    outcome = write_report([same], tmp_path / "out-a")
    assert f"- data: {GENERATED} (every job)" in outcome.markdown.read_text()
    assert list(pd.read_csv(outcome.combined_csv)["data_source"]) == [GENERATED, GENERATED]
    # jobs that trained on different data are each named; a job without a data record says so
    mixed = write_run(tmp_path / "b", [FakeJob("sync", data_source="CIFAR-10 from /data/cifar"),
                                       FakeJob("dts", data_source=GENERATED), FakeJob("local_sgd")])
    markdown = write_report([mixed], tmp_path / "out-b").markdown.read_text()
    assert "- data of `sync` seed 0 at delay1: CIFAR-10 from /data/cifar" in markdown
    assert f"- data of `dts` seed 0 at delay1: {GENERATED}" in markdown
    assert "- data of `local_sgd` seed 0 at delay1: not recorded" in markdown


def test_the_report_says_how_auto_time_dilation_chose_k(tmp_path):
    run_dir = write_run(tmp_path, [FakeJob("sync")])
    scenario = json.loads((run_dir / "scenario.json").read_text())
    scenario["spec"]["time_dilation"] = 14.0
    scenario["time_dilation_auto"] = {"k": 14.0, "why": "resnet20 on cifar10, batch 64: 320.0 ms per forward + backward"}
    (run_dir / "scenario.json").write_text(json.dumps(scenario))
    markdown = write_report([run_dir], tmp_path / "out").markdown.read_text()
    assert "time dilation 14, chosen by auto: resnet20 on cifar10, batch 64: 320.0 ms per forward + backward" in markdown


def _dilated(run_dir: Path, k: float) -> Path:
    scenario = json.loads((run_dir / "scenario.json").read_text())
    scenario["spec"]["time_dilation"] = k
    (run_dir / "scenario.json").write_text(json.dumps(scenario))
    return run_dir


def test_time_dilation_is_backed_out_of_the_listed_columns_only(tmp_path):
    """A dilated run's listed durations are divided by K; a new `_s` field nobody listed keeps the
    value the trainers wrote (it may not run on the dilated clock) instead of being divided by name."""
    from harness.results import DILATED_COLUMNS

    run_dir = _dilated(write_run(tmp_path, [FakeJob("sync", evals={9: 0.95})]), 4.0)
    for path in (run_dir / "jobs").glob("*/rank*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        for record in records:
            if record["kind"] == "step":
                record["queue_wait_s"] = 2.0  # a field the trainers do not write today
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    frames = load_run(run_dir)
    step = frames.steps[(frames.steps["rank"] == 0) & (frames.steps["step"] == 0)].iloc[0]
    assert step["queue_wait_s"] == 2.0
    assert step["step_s"] == pytest.approx(1.0 / 4) and step["comm_blocked_s"] == pytest.approx(0.4 / 4)
    assert step["time_s"] == pytest.approx(1.5 / 4) and step["train_time_s"] == pytest.approx(1.0 / 4)
    assert "step_s" in DILATED_COLUMNS["steps"] and "queue_wait_s" not in DILATED_COLUMNS["steps"]
    assert frames.jobs.iloc[0]["wall_s"] == 12  # the job's own wall clock stays


def _written_duration_fields() -> dict[str, set]:
    """kind -> the `_s` / `_s_min` fields the trainers write in step and eval records (read from the
    source: `writer.write("step", x_s=...)` calls and `{"kind": "eval", "x_s": ...}` literals)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "trainers"
    found: dict[str, set] = {"step": set(), "eval": set()}

    def duration(name) -> bool:
        return isinstance(name, str) and (name.endswith("_s") or name.endswith("_s_min"))

    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write"
                    and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in found):
                found[node.args[0].value] |= {k.arg for k in node.keywords if duration(k.arg)}
            if isinstance(node, ast.Dict):
                keys = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
                kind = keys.get("kind")
                if isinstance(kind, ast.Constant) and kind.value in found:
                    found[kind.value] |= {k for k in keys if duration(k)}
    return found


def test_every_duration_the_trainers_record_is_listed_as_dilated_or_not():
    from harness.results import DILATED_COLUMNS, UNDILATED_FIELDS

    written = _written_duration_fields()
    assert {"step_s", "comm_blocked_s"} <= written["step"] and {"time_s_min", "train_time_s"} <= written["eval"]
    for kind, frame in (("step", "steps"), ("eval", "evals")):
        unlisted = written[kind] - set(DILATED_COLUMNS[frame]) - set(UNDILATED_FIELDS)
        assert not unlisted, f"{kind} records' {sorted(unlisted)}: add to results.DILATED_COLUMNS or UNDILATED_FIELDS"


def test_a_report_reads_each_file_of_a_run_once(tmp_path, monkeypatch):
    """scenario.json, environment.json and every record file are read once per report, and a run
    `wanbench run` has just loaded and summarized is neither read nor summarized again."""
    import harness.report as report_module
    import harness.rundir as rundir_module

    run_dir = write_run(tmp_path / "runs", sync_and_dts())
    reads: dict = {}
    real_read_text, real_records = Path.read_text, rundir_module.read_complete_records

    def read_text(self, *args, **kwargs):
        reads[self.name] = reads.get(self.name, 0) + 1
        return real_read_text(self, *args, **kwargs)

    def records(path, *args, **kwargs):
        key = f"{Path(path).parent.name}/{Path(path).name}"
        reads[key] = reads.get(key, 0) + 1
        return real_records(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(rundir_module, "read_complete_records", records)
    write_report([run_dir], tmp_path / "out")
    assert reads["scenario.json"] == 1 and reads["environment.json"] == 1 and reads["job.json"] == 2
    rank_files = {k: v for k, v in reads.items() if k.endswith(".jsonl")}
    assert len(rank_files) == 2 * 4 and set(rank_files.values()) == {1}  # rank0, rank1, eval, faults per job

    frames = load_run(run_dir)
    summary = summarize(frames)
    reads.clear()
    summarized = []
    monkeypatch.setattr(report_module, "summarize", lambda *a, **k: summarized.append(a) or summarize(*a, **k))
    outcome = write_report([run_dir], tmp_path / "again", loaded={run_dir: frames}, summaries={run_dir: summary})
    assert summarized == [] and reads == {"plan.json": 1}  # the only file the run itself did not need
    assert list(outcome.results.summary["label"]) == list(summary["label"])


def test_a_parameter_servers_network_is_compared_at_the_point_its_job_json_names(tmp_path):
    """A parameter server's network is built in its own folder (delay1-ps1); its mean RTT and rate
    join the summary at the network key job.json gives, as the other jobs' at that point do."""
    run_dir = write_run(tmp_path, [FakeJob("sync", evals={9: 0.95}), FakeJob("async_ps", evals={9: 0.95}, nodes=3)])
    job_dir = next((run_dir / "jobs").glob("*-async_ps-*"))
    info = json.loads((job_dir / "job.json").read_text())
    info["network"]["extra_servers"] = 1
    info["params"] = {"server_ranks": [2]}
    (job_dir / "job.json").write_text(json.dumps(info))
    (run_dir / "delay1").rename(run_dir / "delay1-ps1")  # only the server's network was built
    axes = network_axes(run_dir)
    assert list(axes["network"]) == ["delay1"] and axes.loc[0, "mean_rtt_ms"] == pytest.approx(100.0)
    summary = load_results([run_dir]).summary.set_index("label")
    assert summary.loc["async_ps", "mean_rtt_ms"] == pytest.approx(100.0)
    assert summary.loc["async_ps", "servers"] == 1 and summary.loc["async_ps", "workers"] == 2


def test_the_sim_sentence_names_the_nic_in_force():
    from types import SimpleNamespace

    from harness.report import sim_sentence

    def sentence(sim):
        return sim_sentence(SimpleNamespace(sim=sim, environment={"backend": "sim"}))

    assert "; NIC 1000 Mbit/s per node" in sentence({"nic_rate_bit_s": 1e9})   # sim.nic, as before
    assert "NIC 10000 Mbit/s per node each way (the topology's)" in sentence(
        {"nic_rate_bit_s": None, "topology_nic_rate_bit_s": {"a": 10e9, "b": 10e9}})
    assert "(the topology's: a 10000, b 1000)" in sentence(
        {"nic_rate_bit_s": None, "topology_nic_rate_bit_s": {"a": 10e9, "b": 1e9}})
    assert "no NIC limit" in sentence({"nic_rate_bit_s": None})   # a run from before nodes had NICs
