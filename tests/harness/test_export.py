"""`wanbench export` (harness/export.py): a small real run on backend sim, exported as TensorBoard
event files (read back with TensorBoard's own EventAccumulator) and as Parquet tables (read back
with pandas), each compared with the run's records as load_run reads them."""

import io
import json
import sys
import textwrap

import pandas as pd
import pytest

import harness.run as run_module
from harness import cli
from harness.export import parquet_ready, scenario_columns, with_scenario
from harness.results import load_run, summarize
from harness.rundir import RunDir
from harness.scenario import load_scenario
from tests.harness.test_sim_harness import _quiet

# One job (each job costs two processes that import torch: the simulation and the evaluator), with
# params, two ranks and a fault: every frame has rows.
SCENARIO = textwrap.dedent("""
    topology:
      name: exportt
      address_pool: 10.236.0.0/24
      regions: {a: {nodes: 1}, b: {nodes: 1}}
      links: [{between: [a, b], rtt: 40ms, rate: 100Mbit}]
    backend: sim
    workload:
      model: {name: mlp, params: {hidden_sizes: [16]}}
      dataset: {name: digits}
      batch_size: 32
      lr: 0.1
      eval_every: 4
    stop: {steps: 12}
    algorithms: [{name: local_sgd, params: {H: 2}}]
    faults:
      - {at: 0.1s, kind: straggler, node: b-0, factor: 2, duration: 0.1s}
    sim: {compute_s: 0.002, nic: 1Gbit}
""")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run of SCENARIO on the real simulator (about 15 s; more on a busy machine)."""
    folder = tmp_path_factory.mktemp("export")
    path = folder / "s.yaml"
    path.write_text(SCENARIO)
    completed = run_module.run_scenario(load_scenario(str(path)), "sim", folder / "runs",
                                        console=_quiet())
    assert set(completed.summary["status"]) == {"ok"}
    return completed.run_dir


@pytest.fixture(scope="module")
def frames(run_dir):
    return load_run(run_dir)


def _accumulator(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    accumulator.Reload()
    return accumulator


@pytest.mark.slow
def test_tensorboard_has_one_run_per_job_with_the_records_values(run_dir, frames, capsys):
    assert cli.main(["export", str(run_dir), "--format", "tensorboard"]) == 0
    out = run_dir / "export" / "tensorboard"
    assert str(out) in capsys.readouterr().err
    summary = summarize(frames)
    assert sorted(p.name for p in out.iterdir()) == sorted(frames.jobs["job_id"]) and len(frames.jobs) == 1
    for job_id, final_accuracy in zip(frames.jobs["job_id"], summary["final_accuracy"]):
        accumulator = _accumulator(out / job_id)
        tags = set(accumulator.Tags()["scalars"])
        assert {"eval/accuracy", "eval/loss", "train/loss", "train/train_time_s", "bytes_sent/rank0",
                "bytes_recv/rank0", "step_s/rank0", "bytes_sent/rank1", "step_s/rank1"} <= tags

        evals = frames.evals[frames.evals["job_id"] == job_id].sort_values("step")
        accuracy = accumulator.Scalars("eval/accuracy")
        assert [e.step for e in accuracy] == evals["step"].to_list() and len(accuracy) == 3
        assert [e.value for e in accuracy] == pytest.approx(evals["accuracy"].to_list(), rel=1e-6)
        assert accuracy[-1].value == pytest.approx(final_accuracy, rel=1e-6)
        # walltime is training time
        assert [e.wall_time for e in accuracy] == pytest.approx(evals["train_time_s"].to_list())

        for rank in (0, 1):
            steps = frames.steps[(frames.steps["job_id"] == job_id) & (frames.steps["rank"] == rank)]
            steps = steps.sort_values("step")
            for field in ("bytes_sent", "bytes_recv", "step_s"):
                points = accumulator.Scalars(f"{field}/rank{rank}")
                assert [p.step for p in points] == steps["step"].to_list() and len(points) == 12
                assert [p.value for p in points] == pytest.approx(steps[field].to_list(), rel=1e-6)
            if rank == 0:
                assert sum(p.value for p in accumulator.Scalars("bytes_sent/rank0")) > 0
                train_time = [p.value for p in accumulator.Scalars("train/train_time_s")]
                assert train_time == pytest.approx(steps["train_time_s"].to_list(), rel=1e-6)


@pytest.mark.slow
def test_exporting_again_replaces_the_event_files(run_dir, tmp_path):
    out = tmp_path / "tb"
    for _ in range(2):
        assert cli.main(["export", str(run_dir), "--format", "tensorboard", "--out", str(out)]) == 0
    for job in out.iterdir():
        assert len(list(job.glob("events.out.tfevents.*"))) == 1
        assert len(_accumulator(job).Scalars("eval/accuracy")) == 3


@pytest.mark.slow
def test_parquet_has_every_record_and_the_summary_with_the_scenario_fields(run_dir, frames, tmp_path, capsys):
    out = tmp_path / "pq"
    assert cli.main(["export", str(run_dir), "--format", "parquet", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == sorted(
        f"{name}.parquet" for name in ("jobs", "steps", "evals", "faults", "summary"))
    summary = summarize(frames)
    expected = {"jobs": frames.jobs, "steps": frames.steps, "evals": frames.evals, "faults": frames.faults,
                "summary": summary}
    assert len(frames.faults) >= 2 and len(frames.steps) == 2 * 12  # ranks x steps
    scenario_fields = {"job_id", "network", "network.delay_scale", "network.rate", "algorithm", "label", "seed",
                       "params.H", "workload.model.name", "workload.model.params.hidden_sizes",
                       "workload.batch_size", "workload.lr", "workload.eval_every", "workload.steps"}
    for name, frame in expected.items():
        table = pd.read_parquet(out / f"{name}.parquet")
        assert len(table) == len(frame), name
        assert set(frame.columns) | scenario_fields <= set(table.columns), name
        assert set(table["workload.model.name"]) == {"mlp"} and set(table["workload.batch_size"]) == {32}
        assert set(table["workload.model.params.hidden_sizes"]) == {"[16]"}
        assert set(table["network.delay_scale"]) == {1.0}
        assert set(table["algorithm"]) == {"local_sgd"} and set(table["params.H"]) == {2}

    steps = pd.read_parquet(out / "steps.parquet")
    assert steps["bytes_sent"].sum() == frames.steps["bytes_sent"].sum() > 0
    assert steps["train_time_s"].to_list() == pytest.approx(frames.steps["train_time_s"].to_list())
    table = pd.read_parquet(out / "summary.parquet")
    assert table["job_id"].to_list() == frames.jobs["job_id"].to_list()
    assert table["final_accuracy"].to_list() == summary["final_accuracy"].to_list()
    assert table["label"].to_list() == pd.read_csv(run_dir / "summary.csv")["label"].to_list()
    jobs = pd.read_parquet(out / "jobs.parquet")
    assert jobs["wire"].map(lambda text: isinstance(json.loads(text), dict)).all()  # a mapping, as JSON text


@pytest.mark.slow
def test_the_default_output_is_in_the_run_dir(run_dir, capsys):
    assert cli.main(["export", str(run_dir), "--format", "parquet"]) == 0
    assert (run_dir / "export" / "parquet" / "steps.parquet").is_file()
    assert f"in {run_dir / 'export' / 'parquet'}" in capsys.readouterr().err


def test_scenario_columns_are_per_job_and_empty_where_a_job_lacks_a_field(tmp_path):
    (tmp_path / "scenario.json").write_text(json.dumps({"name": "x", "spec": {}, "jobs": [
        {"job_id": "j-sync", "network": {"delay_scale": 1.0, "rate": None}, "algorithm": "sync", "label": "sync",
         "seed": 0, "params": {}, "trainer_config": {"model": {"name": "mlp"}, "seed": 0, "lr": 0.1,
                                                      "algorithm": {"name": "sync"}, "comm": {"allreduce": "auto"}}},
        {"job_id": "j-dts", "network": {"delay_scale": 4.0, "rate": "1Gbit"}, "algorithm": "dts", "label": "dts-p8",
         "seed": 1, "params": {"p": 8, "t": [1, 2]}, "trainer_config": {"model": {"name": "cnn"}, "lr": 0.03}}]}))
    scenario = scenario_columns(RunDir(tmp_path))
    assert set(scenario.columns) == {"job_id", "algorithm", "label", "seed", "network.delay_scale", "network.rate",
                                     "params.p", "params.t", "workload.model.name", "workload.lr"}
    frame = pd.DataFrame({"job_id": ["j-dts", "j-sync", "j-dts"], "step": [0, 0, 1],
                          "label": ["dts-p8", "j-sync", "dts-p8"], "algorithm": ["dts", None, "dts"]})
    rows = parquet_ready(with_scenario(frame, scenario))
    assert rows["step"].to_list() == [0, 0, 1] and rows["workload.model.name"].to_list() == ["cnn", "mlp", "cnn"]
    assert rows["params.p"].isna().to_list() == [False, True, False] and rows["params.t"].iloc[0] == "[1, 2]"
    # the frame's own label stays (job.json's); an empty algorithm is filled from scenario.json
    assert rows["label"].to_list() == ["dts-p8", "j-sync", "dts-p8"] and rows["algorithm"].iloc[1] == "sync"
    assert rows["network.rate"].isna().to_list() == [False, True, False] and rows["network.rate"].iloc[0] == "1Gbit"


def _one_line_error(capsys, argv) -> str:
    assert cli.main(argv) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wanbench: ")
    return err


def test_bad_run_dirs_and_formats_are_one_line(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert "no such run directory" in _one_line_error(capsys, ["export", str(missing), "--format", "parquet"])
    assert "not a run directory (no scenario.json)" in _one_line_error(
        capsys, ["export", str(tmp_path), "--format", "parquet"])
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "scenario.json").write_text(json.dumps({"name": "x", "spec": {}, "jobs": []}))
    err = _one_line_error(capsys, ["export", str(unfinished), "--format", "tensorboard"])
    assert "incomplete run: no COMPLETE file (crashed, killed or still running)" in err
    (unfinished / "INTERRUPTED").write_text("SIGTERM\n")
    assert "(interrupted: SIGTERM)" in _one_line_error(capsys, ["export", str(unfinished), "--format", "parquet"])
    (unfinished / "COMPLETE").write_text("")
    err = _one_line_error(capsys, ["export", str(unfinished), "--format", "csv"])
    assert "--format: unknown format 'csv'; give one of: tensorboard, parquet" in err
    assert not (unfinished / "export").exists()


@pytest.mark.slow
def test_an_unknown_format_writes_nothing_even_for_a_good_run(run_dir, capsys):
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    _one_line_error(capsys, ["export", str(run_dir), "--format", "hdf5"])
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


@pytest.mark.parametrize("fmt, module", [("tensorboard", "torch.utils.tensorboard"), ("parquet", "pyarrow")])
def test_a_missing_writer_package_is_one_line_saying_how_to_install_it(tmp_path, capsys, monkeypatch, fmt, module):
    (tmp_path / "scenario.json").write_text(json.dumps({"name": "x", "spec": {}, "jobs": []}))
    (tmp_path / "COMPLETE").write_text("")
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    assert cli.main(["export", str(tmp_path), "--format", fmt]) == cli.EXIT_SYSTEM
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run scripts/setup.sh" in err and f"export --format {fmt} needs" in err
