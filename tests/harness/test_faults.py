"""Fault timelines: events validated like topologies, compiled into timed actions (data), applied
through an executor, each recorded."""

import json
import textwrap

import pytest

from harness.faults import (FaultEvent, FaultProgram, FaultSchedule, NetworkAndNodes, action_from_record,
                            action_record, compile_actions, read_trace)
from harness.scenario import load_scenario
from emulator.schema import ConfigError
from emulator.topology import LinkSpec

BASE = {("a", "b"): LinkSpec(10.0, 100e6), ("b", "a"): LinkSpec(10.0, 100e6),
        ("a", "a"): LinkSpec(0.05, 10e9), ("b", "b"): LinkSpec(0.05, 10e9)}


class Recorder:
    """Stands in for the backend (set_link) and the job's processes (crash, restart, cpu factor)."""

    def __init__(self):
        self.calls = []

    def set_link(self, src, dst, spec):
        self.calls.append(("link", src, dst, spec))

    def crash(self, node):
        self.calls.append(("crash", node))
        return "killed"

    def restart(self, node):
        self.calls.append(("restart", node))
        return "restarted"

    def set_cpu_factor(self, node, factor):
        self.calls.append(("cpu", node, factor))
        return f"x{factor}"


def compiled(tmp_path, events):
    parsed = tuple(FaultEvent.model_validate(e) for e in events)
    traces = {i: tuple(read_trace(tmp_path / e.file)) for i, e in enumerate(parsed) if e.kind == "trace"}
    return compile_actions(FaultProgram(parsed, traces), BASE)


def timeline(tmp_path, events):
    recorder = Recorder()
    t = FaultSchedule(compiled(tmp_path, events), NetworkAndNodes(recorder, recorder),
                      record_path=tmp_path / "faults.jsonl")
    return t, recorder.calls


def test_partition_and_heal_in_order(tmp_path):
    t, calls = timeline(tmp_path, [{"at": "5s", "kind": "link_down", "between": ["a", "b"]},
                                   {"at": "9s", "kind": "link_up", "between": ["a", "b"]}])
    assert t.poll(4.9) == [] and calls == []
    done = t.poll(5.0)
    assert [d["what"] for d in done] == ["link a->b down", "link b->a down"]
    assert calls == [("link", "a", "b", None), ("link", "b", "a", None)]
    t.poll(100)
    assert calls[-1] == ("link", "b", "a", BASE[("b", "a")])
    records = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [r["effect"] for r in records][:2] == ["down", "down"] and len(records) == 4
    assert t.pending == 0


def test_loss_burst_restores_loss_and_change_keeps_other_fields(tmp_path):
    t, calls = timeline(tmp_path, [
        {"at": "1s", "kind": "link_change", "from": "a", "to": "b", "rate": "10Mbit"},
        {"at": "2s", "kind": "loss_burst", "from": "a", "to": "b", "loss": "30%", "duration": "3s"}])
    t.poll(2.5)
    changed, burst = calls[0][3], calls[1][3]
    assert changed.rate_bit_s == 10e6 and changed.one_way_delay_ms == 10.0
    assert burst.loss_fraction == pytest.approx(0.3) and burst.rate_bit_s == 10e6
    t.poll(5.0)
    assert calls[2][3].loss_fraction == 0.0 and calls[2][3].rate_bit_s == 10e6


def test_trace_file_and_node_events(tmp_path):
    (tmp_path / "trace.csv").write_text("time_s,rate,delay\n0,50Mbit,20ms\n2.5,5Mbit,\n")
    t, calls = timeline(tmp_path, [
        {"at": "1s", "kind": "trace", "from": "a", "to": "b", "file": "trace.csv"},
        {"at": "2s", "kind": "node_crash", "node": "b-0", "restart_after": "4s"},
        {"at": "0s", "kind": "straggler", "node": "a-0", "factor": 3, "duration": "10s"}])
    t.poll(3.6)
    assert calls[0] == ("cpu", "a-0", 3.0)
    assert calls[1][3].rate_bit_s == 50e6 and calls[1][3].one_way_delay_ms == 20.0
    assert calls[2] == ("crash", "b-0")
    assert calls[3][3].rate_bit_s == 5e6 and calls[3][3].one_way_delay_ms == 20.0
    t.poll(11)
    assert ("restart", "b-0") in calls and calls[-1] == ("cpu", "a-0", 1.0)


def test_failed_injection_is_recorded_not_raised(tmp_path):
    class BrokenNetwork:
        def set_link(self, *args):
            return 1 / 0

    actions = compile_actions(FaultProgram((FaultEvent.model_validate({"at": "0s", "kind": "link_down", "from": "a",
                                                                        "to": "b"}),)), BASE)
    t = FaultSchedule(actions, NetworkAndNodes(BrokenNetwork(), None), record_path=tmp_path / "f.jsonl")
    (record,) = t.poll(1)
    assert record["ok"] is False and "ZeroDivisionError" in record["effect"]


SCENARIO = """
topology:
  name: f
  regions: {a: {nodes: 1}, b: {nodes: 1}}
  links: [{between: [a, b], rtt: 20ms}]
algorithms: [{name: sync}]
faults:
  - %s
"""


@pytest.mark.parametrize("event, field, words", [
    ("{at: 1s, kind: link_down, between: [a, mars]}", "faults[0]", "unknown region 'mars'"),
    ("{at: 1s, kind: node_crash, node: b-3}", "faults[0].node", "no node 'b-3'"),
    ("{at: 1s, kind: straggler, node: a-0, factor: 0.5}", "faults[0].factor", "greater than 1"),
    ("{at: 1, kind: link_down, between: [a, b]}", "faults[0].at", "needs a unit"),
    ("{at: 1s, kind: link_change, between: [a, b], rate: fast}", "faults[0]", "expected a rate"),
    ("{at: 1s, kind: loss_burst, between: [a, b], loss: 5%}", "faults[0]", "needs loss and duration"),
    ("{at: 1s, kind: trace, between: [a, b], file: none.csv}", "faults[0].file", "No such file"),
    ("{at: 1s, kind: meteor, node: a-0}", "faults[0].kind", "Input should be"),
])
def test_fault_errors_name_the_field(write_yaml, event, field, words):
    path = write_yaml(SCENARIO % event, "s.yaml")
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert str(info.value).startswith(f"{path}: {field}"), str(info.value)
    assert words in str(info.value)


def test_a_crashing_scenario_runs_tolerant_algorithms_on_the_elastic_comm(write_yaml):
    """Policy: with a node_crash, crash-tolerant algorithms get comm tcp; collective ones keep gloo
    (and fail clearly); a workload that names a backend keeps it."""
    text = (SCENARIO % "{at: 1s, kind: node_crash, node: b-0, restart_after: 2s}").replace(
        "algorithms: [{name: sync}]", "algorithms: [{name: sync}, {name: swarmsgd}, {name: diloco}]")
    jobs = {job.label: job.trainer_config for job in load_scenario(write_yaml(text, "s.yaml")).jobs}
    assert jobs["swarmsgd"]["comm"]["backend"] == "tcp" and jobs["diloco"]["comm"]["backend"] == "tcp"
    assert "comm" not in jobs["sync"]
    pinned = text.replace("algorithms:", "workload: {comm: {backend: gloo}}\nalgorithms:")
    assert all(job.trainer_config["comm"]["backend"] == "gloo"
               for job in load_scenario(write_yaml(pinned, "p.yaml")).jobs)
    calm = text.replace("{at: 1s, kind: node_crash, node: b-0, restart_after: 2s}",
                        "{at: 1s, kind: link_down, between: [a, b]}")
    assert all("comm" not in job.trainer_config for job in load_scenario(write_yaml(calm, "c.yaml")).jobs)


def test_tcp_comm_for_an_algorithm_built_on_collectives_names_the_field(write_yaml):
    text = (SCENARIO % "{at: 1s, kind: link_down, between: [a, b]}").replace(
        "algorithms:", "workload: {comm: {backend: tcp}}\nalgorithms:")
    path = write_yaml(text, "s.yaml")
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert str(info.value).startswith(f"{path}: workload.comm.backend: tcp is for the crash-tolerant algorithms [")
    assert str(info.value).endswith("sync needs every rank in every collective (use gloo or nccl)")


def test_actions_are_data_that_round_trip_through_their_record(tmp_path):
    (tmp_path / "trace.csv").write_text("time_s,rate,delay\n0,50Mbit,20ms\n2.5,5Mbit,\n")
    actions = compiled(tmp_path, [
        {"at": "1s", "kind": "trace", "from": "a", "to": "b", "file": "trace.csv"},
        {"at": "1.5s", "kind": "link_down", "between": ["a", "b"]},
        {"at": "2s", "kind": "node_crash", "node": "b-0", "restart_after": "4s"},
        {"at": "0s", "kind": "straggler", "node": "a-0", "factor": 3, "duration": "10s"}])
    assert [a.op for a in actions] == ["cpu_factor", "set_link", "set_link", "set_link", "crash", "set_link",
                                       "restart", "cpu_factor"]
    records = json.loads(json.dumps([action_record(a) for a in actions]))
    assert [action_from_record(r) for r in records] == list(actions)
    assert records[0] == {"due_s": 0.0, "what": "straggler a-0 x3", "effect": "compute x3",
                          "calls": [{"cpu_factor": ["a-0", 3.0]}]}


def test_loading_and_compiling_leave_the_scenario_s_events_as_they_were(write_yaml, tmp_path):
    """The trace is read once, at load, into the scenario's FaultProgram; no check or compile
    step writes into the events."""
    (tmp_path / "trace.csv").write_text("time_s,rate,delay\n0,50Mbit,20ms\n")
    path = write_yaml((SCENARIO % "{at: 1s, kind: trace, between: [a, b], file: trace.csv}").replace(
        "faults:\n", "faults:\n  - {at: 2s, kind: loss_burst, between: [a, b], loss: 5%, duration: 1s}\n"), "s.yaml")
    scenario = load_scenario(path)
    before = [dict(vars(event)) for event in scenario.spec.faults]
    assert scenario.faults.events == tuple(scenario.spec.faults)
    assert scenario.faults.traces == {1: ((0.0, 50e6, 20.0),)}
    first = compile_actions(scenario.faults, BASE)
    assert compile_actions(scenario.faults, BASE) == first     # compiling twice: the same data
    assert [dict(vars(event)) for event in scenario.spec.faults] == before
    assert not hasattr(scenario.spec.faults[1], "trace_rows")
