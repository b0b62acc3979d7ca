"""Bad input, generated: every malformed topology or scenario is one line naming the file, exit 2.

Hypothesis mutates valid documents (wrong types, unknown keys, bad units, out-of-range values,
missing regions, huge sizes, non-mapping YAML) and feeds them to the CLI's own entry point. The
property: `wanbench verify`/`up`/`run` either accept the file or exit 2 with one line that starts
with the file's path — never a traceback, never a namespace created.
"""

import copy
import io
import contextlib

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import cli
from emulator.netns import list_namespaces

VALID_TOPOLOGY = {
    "name": "fuzz",
    "regions": {"a": {"nodes": 1}, "b": {"nodes": 2}},
    "defaults": {"rate": "100Mbit", "loss": "0%", "queue": "auto"},
    "intra_region": {"rtt": "0.1ms"},
    "links": [{"between": ["a", "b"], "rtt": "20ms", "jitter": "1ms"}],
    "node_limits": {"memory": "4GB", "pids": 512},
}
VALID_SCENARIO = {
    "topology": copy.deepcopy(VALID_TOPOLOGY),
    "workload": {"model": {"name": "mlp"}, "dataset": {"name": "digits"}, "batch_size": 16, "lr": 0.1},
    "stop": {"steps": 10, "target_accuracy": 0.5},
    "algorithms": [{"name": "sync"}, {"name": "local_sgd", "params": {"H": 2}}],
    "seeds": [0],
    "sweep": {"delay_scale": [1.0]},
    "node_limits": {"memory": "1GB"},
}

junk = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10**12, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["68.1", "1 parsec", "-5Mbit", "1e99Gbit", "150%", "-1ms", "9999999s", "auto",
                     "10.0.0.0/33", "8.8.8.0/24", "", "0", "1Gbit", "5ms"]),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(doc, prefix=()):
    """Every (path) to a value inside nested dicts/lists."""
    yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from _paths(value, prefix + (index,))


@st.composite
def mutated(draw, base):
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths or not isinstance(doc, dict):
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["replace", "delete", "add_unknown", "huge"]))
        leaf = path[-1]
        if action == "replace":
            parent[leaf] = draw(junk)
        elif action == "delete":
            del parent[leaf]
        elif action == "add_unknown" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(junk)
        elif action == "huge":
            parent[leaf] = draw(st.sampled_from([10**9, "x" * 10000, list(range(5000))]))
    if draw(st.integers(0, 20)) == 0:
        doc = draw(st.sampled_from([[doc], "just a string", 42, None]))
    return doc


def _run_cli(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(argv)
    return code, err.getvalue()


def _check(tmp_path, doc, command):
    path = tmp_path / "input.yaml"
    path.write_text(yaml.safe_dump(doc) if doc is not None else "")
    before = list_namespaces("wfz")
    # --backend tun with an impossible job would need root; a valid file must fail later, at the
    # system check or the build — here we stop right after validation by asking for the dry run.
    if command == "up":
        argv = ["up", str(path), "--dry-run", "--backend", "tc"]
    else:
        argv = [command, str(path)]
    try:
        code, err = _run_cli(argv)
    except SystemExit as exc:  # argparse errors are not what we are testing
        raise AssertionError(f"unexpected SystemExit {exc.code}") from None
    assert list_namespaces("wfz") == before  # nothing touched
    return code, err


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=mutated(VALID_TOPOLOGY))
def test_fuzzed_topologies(tmp_path, monkeypatch, doc):
    monkeypatch.setenv("WANBENCH_PREFIX", "wfz")
    code, err = _check(tmp_path, doc, "up")
    if code != 0:
        assert code == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"wanbench: {tmp_path / 'input.yaml'}"), err
        assert "Traceback" not in err


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=mutated(VALID_SCENARIO))
def test_fuzzed_scenarios(tmp_path, monkeypatch, doc):
    """Scenarios are checked completely by load_scenario before `run` does anything privileged."""
    from harness.scenario import load_scenario
    from emulator.schema import ConfigError

    monkeypatch.setenv("WANBENCH_PREFIX", "wfz")
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc) if doc is not None else "")
    try:
        load_scenario(path)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(str(path)), message
        assert "\n" not in message
