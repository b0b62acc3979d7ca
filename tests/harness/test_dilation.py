"""Time dilation on the harness side (harness/dilation.py): what the ranks are given, what the
fault timeline waits for, and what the results report."""

import json
from pathlib import Path

import pytest

from emulator.linkspec import LinkSpec
from emulator.schema import ConfigError
from harness.dilation import dilated_trainer_config, load_profile
from harness.faults import FaultEvent, FaultProgram, FaultSchedule, NetworkAndNodes, compile_actions
from harness.jobspec import JobSpec, dilated
from harness.results import load_run, summarize
from harness.scenario import load_scenario
from tests.harness.test_report import FakeJob, write_run

SCENARIO = """
topology: lan.yaml
time_dilation: 4
compute_profile: v100-resnet50-fp32-b64
workload:
  model: {name: mlp}
  dataset: {name: digits}
stop: {steps: 50, time_budget_s: 30}
algorithms:
  - {name: sync}
"""


def test_every_duration_handed_to_the_ranks_is_k_times_longer():
    config = {"time_budget_s": 30.0, "eval_every_s": 2.0, "min_compute_s": 0.18, "lr": 0.1, "steps": 50}
    slow = dilated_trainer_config(config, 4.0)
    assert (slow["time_budget_s"], slow["eval_every_s"], slow["min_compute_s"]) == (120.0, 8.0, 0.72)
    assert (slow["lr"], slow["steps"]) == (0.1, 50)          # not durations
    assert slow["comm"]["timeout_s"] == 4 * 300.0          # the trainers' default, dilated too
    assert config == {"time_budget_s": 30.0, "eval_every_s": 2.0, "min_compute_s": 0.18, "lr": 0.1, "steps": 50}
    assert dilated_trainer_config(config, 1.0) == config


def test_a_scenario_states_its_dilation_and_the_accelerator_it_stands_for(write_yaml):
    scenario = load_scenario(write_yaml(SCENARIO, "s.yaml"))
    assert scenario.time_dilation == 4.0
    # emulated seconds in the job; the run dilates them
    assert scenario.jobs[0].trainer_config["min_compute_s"] == load_profile("v100-resnet50-fp32-b64").step_s == 0.18
    assert scenario.with_time_dilation(8.0).time_dilation == 8.0 and scenario.time_dilation == 4.0


@pytest.mark.parametrize("change, message", [
    (("time_dilation: 4", "time_dilation: 0.5"), r"s.yaml: time_dilation: .*greater than or equal to 1"),
    (("compute_profile: v100-resnet50-fp32-b64", "compute_profile: tpu-v9"),
     r"s.yaml: compute_profile: 'tpu-v9': no such file or profile \(profiles: .*v100-resnet50-fp32-b64"),
])
def test_bad_dilation_or_profile_is_one_line_naming_the_field(write_yaml, change, message):
    with pytest.raises(ConfigError, match=message):
        load_scenario(write_yaml(SCENARIO.replace(*change), "s.yaml"))


def test_a_profile_without_its_source_is_refused(tmp_path):
    (tmp_path / "p.yaml").write_text("name: x\nstep_s: 0.1\n")
    with pytest.raises(ConfigError, match=r"p.yaml: source"):
        load_profile(str(tmp_path / "p.yaml"))


def test_a_profile_has_no_per_layer_field(tmp_path):
    """Per-layer shares come from a measured layer profile (a scenario's layer_profile), not from a
    step-time profile: a field there would be silently ignored, so it is refused."""
    (tmp_path / "p.yaml").write_text("name: x\nstep_s: 0.1\nsource: s\nlayer_fractions: [0.5, 0.5]\n")
    with pytest.raises(ConfigError, match=r"p.yaml: layer_fractions"):
        load_profile(str(tmp_path / "p.yaml"))


P3_SIM = Path(__file__).parents[2] / "scenarios" / "paper-p3-resnet50.yaml"


def test_a_measured_layer_profile_gives_every_job_the_shares_of_this_repository_s_model(tmp_path):
    """The H200 profile's ResNet-50 (CUDA events per layer) is this repository's ResNet-50 layer for
    layer (107 layers, the same parameters each): its forward and gradient-to-gradient times become
    shares of the step summing to 1, the forward ones scaled to the measured forward pass."""
    from trainers.models import build_model
    from trainers.padding import measured_shares, owning_layers

    text = P3_SIM.read_text() + "\nlayer_profile: {file: h200-layers-b64.json, model: resnet50}\n"
    (tmp_path / "p3.yaml").write_text(text)
    shares = load_scenario(str(tmp_path / "p3.yaml")).jobs[0].trainer_config["layer_shares"]
    measured = next(m for m in json.loads((Path(__file__).parents[2] / "profiles" / "h200-layers-b64.json")
                                          .read_text())["models"] if m["model"] == "resnet50")
    step = measured["forward_ms"] + sum(layer["backward_ms"] for layer in measured["layers"])
    assert len(shares) == 107 and sum(f + b for _, f, b in shares) == pytest.approx(1.0)
    assert sum(f for _, f, _ in shares) == pytest.approx(measured["forward_ms"] / step)
    assert shares[1][2] == pytest.approx(measured["layers"][1]["backward_ms"] / step)   # bn1's gradient
    model = build_model("resnet50", {}, (3, 32, 32), 10, 0)
    forward, backward = measured_shares(owning_layers(model), shares)  # refuses another model
    assert forward[0] == pytest.approx(shares[0][1]) and sum(backward.values()) == pytest.approx(1 - sum(forward))


@pytest.mark.parametrize("profile", ["h200-layers-b32.json", "h200-sockeye-rnn-b32-len50.json"])
def test_the_measured_sockeye_rnn_is_this_repository_s_with_each_token_s_calls_summed(tmp_path, profile):
    """The H200 profiles of Sockeye's RNN (bench/profile_layers.py --models sockeye_rnn) are of
    trainers/models.py's SockeyeRNN, layer for layer (16 layers, the same parameters each), and the
    layers the decoder runs once per token were timed at every call: one call each for the
    encoder, seq_len calls for the decoder's cells and attention, their forward times summed."""
    from trainers.models import build_model
    from trainers.padding import measured_shares, owning_layers

    measured = next(m for m in json.loads((Path(__file__).parents[2] / "profiles" / profile).read_text())["models"]
                    if m["model"] == "sockeye_rnn")
    calls = {layer["layer"]: layer["calls"] for layer in measured["layers"]}
    assert calls["source_embedding"] == calls["encoder_forward"] == calls["output"] == 1
    assert calls["decoder.0"] == calls["decoder.1"] == calls["attention_query"] == measured["seq_len"]
    text = P3_SIM.read_text() + f"\nlayer_profile: {{file: {profile}, model: sockeye_rnn}}\n"
    (tmp_path / "p3.yaml").write_text(text)
    shares = load_scenario(str(tmp_path / "p3.yaml")).jobs[0].trainer_config["layer_shares"]
    model = build_model("sockeye_rnn", {}, (measured["seq_len"],), 100, 0)
    forward, backward = measured_shares(owning_layers(model), shares)  # refuses another model
    assert len(forward) == 16 and sum(forward) + sum(backward.values()) == pytest.approx(1.0)
    assert sum(p.numel() for p in model.parameters()) == measured["parameters"]
    # the layers' summed calls fit in the forward pass they were timed in (medians: a small margin)
    assert sum(layer["forward_ms"] for layer in measured["layers"]) <= 1.02 * measured["forward_ms"]


def test_profile_layers_sums_every_call_of_a_layer_and_drops_a_call_without_an_end():
    """bench/profile_layers.py's forward_ms_of: a layer that runs once per token is charged all its
    calls, not the last one; a call whose forward hook did not run leaves the step out."""
    from tests.conftest import bench_module

    bench = bench_module("profile_layers")

    class At:  # an event recorded at time t (ms), as torch.cuda.Event.elapsed_time reads it
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, end):
            return end.t - self.t

    assert bench.forward_ms_of([[At(0.0), At(2.0)]]) == 2.0
    assert bench.forward_ms_of([[At(0.0), At(2.0)], [At(5.0), At(8.5)], [At(9.0), At(9.5)]]) == 6.0
    assert bench.forward_ms_of([[At(0.0), At(2.0)], [At(5.0)]]) is None
    assert bench.forward_ms_of([]) is None


@pytest.mark.parametrize("backend, extra, message", [
    ("sim", "layer_profile: {file: h200-layers-b64.json, model: resnet5}",
     r"p3.yaml: layer_profile.model: 'resnet5' is not in h200-layers-b64.json \(models: resnet50, vgg19"),
    ("sim", "layer_profile: {file: nowhere.json, model: resnet50}",
     r"p3.yaml: layer_profile.file: 'nowhere.json': no such file \(measured layer profiles: h200-layers-b32.json, "
     r"h200-layers-b64.json, h200-sockeye-rnn-b32-len50.json\)"),
    ("tun", "layer_profile: {file: h200-layers-b64.json, model: resnet50}",
     r"p3.yaml: layer_profile: on backend tun the shares spread a compute profile's pad"),
])
def test_a_bad_layer_profile_is_one_line_naming_the_field(tmp_path, backend, extra, message):
    text = P3_SIM.read_text()
    if backend != "sim":   # the emulator: no sim section, and no pad_layers for the shares to spread
        text = text.replace("backend: sim\n", f"backend: {backend}\n").replace("sim: {compute_s: 0.468}\n", "")
    (tmp_path / "p3.yaml").write_text(text + "\n" + extra + "\n")
    with pytest.raises(ConfigError, match=message):
        load_scenario(str(tmp_path / "p3.yaml"))


@pytest.mark.parametrize("model, profile", [("resnet50", "m60-resnet50-fp32-b32"), ("vgg19", "m60-vgg19-fp32-b32"),
                                            ("sockeye", "m60-sockeye-rnn-fp32-b32")])
def test_the_p3_paper_scenarios_charge_their_profile_s_step(model, profile):
    """The sim scenarios give the profile's step as sim.compute_s (a profile's min_compute_s would
    come on top of the simulator's compute); the baselines the paper's gain is quoted over are there."""
    scenario = load_scenario(Path(__file__).parents[2] / "scenarios" / f"paper-p3-{model}.yaml")
    assert scenario.spec.sim.compute_s == load_profile(profile).step_s
    assert {"sync", "p3", "ps_sync-mxnet", "ps_sync-25mb"} <= {job.base_label or job.label for job in scenario.jobs}


def test_fault_times_are_emulated_seconds_and_links_emulated_units(tmp_path):
    applied = []

    class Network:
        def set_link(self, src, dst, spec):
            applied.append((src, dst, spec))

    base = {("a", "b"): LinkSpec(one_way_delay_ms=10.0, rate_bit_s=100e6, queue_bytes=10_000),
            ("b", "a"): LinkSpec(one_way_delay_ms=10.0, rate_bit_s=100e6, queue_bytes=10_000)}
    event = FaultEvent.model_validate({"at": "5s", "kind": "link_change", "from": "a", "to": "b", "delay": "20ms"})
    job = load_scenario_job()
    emulated = JobSpec(job=job, job_dir=tmp_path, backend="tun", nodes=2, trainer=None, trainer_document={},
                       faults=compile_actions(FaultProgram((event,)), base))
    timeline = FaultSchedule(dilated(emulated, 4.0).faults, NetworkAndNodes(Network(), None),
                             record_path=tmp_path / "faults.jsonl")
    assert timeline.poll(19.9) == [] and applied == []      # due at 4 x 5 s of wall clock
    [record] = timeline.poll(20.0)
    assert record["due_s"] == 20.0 and "delay 20 ms" in record["effect"]   # said in emulated units
    assert applied[0][2].one_way_delay_ms == 80.0 and applied[0][2].rate_bit_s == 25e6  # applied dilated


def load_scenario_job():
    from harness.scenario import Job, NetworkPoint

    return Job(job_id="delay1-sync-seed0", network=NetworkPoint(), algorithm="sync", label="sync", seed=0)


def test_a_dilated_run_reports_the_same_figures_as_the_undilated_one(tmp_path):
    """The same job recorded at K = 4 (every wall-clock time 4x longer) summarizes like K = 1."""
    def run(root, k):
        jobs = [FakeJob("sync", steps=10, step_time_s=0.5 * k, blocked_s=0.2 * k, evals={4: 0.5, 9: 0.95}),
                FakeJob("local_sgd", steps=10, step_time_s=0.25 * k, blocked_s=0.05 * k, evals={4: 0.6, 9: 0.95})]
        run_dir = write_run(root, jobs, stop={"time_budget_s": 100.0})
        scenario = json.loads((run_dir / "scenario.json").read_text())
        scenario["spec"]["time_dilation"] = k
        (run_dir / "scenario.json").write_text(json.dumps(scenario))
        return summarize(load_run(run_dir))

    plain, dilated = run(tmp_path / "k1", 1.0), run(tmp_path / "k4", 4.0)
    assert list(dilated["time_dilation"]) == [4.0, 4.0] and list(plain["time_dilation"]) == [1.0, 1.0]
    for column in ("time_to_target_s", "train_time_s", "steps_per_s", "speedup_vs_sync", "comm_blocked_fraction",
                   "compute_s_per_step", "compute_comm_ratio", "output_sync_s"):
        assert list(dilated[column]) == pytest.approx(list(plain[column])), column
    assert plain["time_to_target_s"].notna().all() and plain["compute_comm_ratio"].notna().all()
