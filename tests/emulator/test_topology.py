"""Topology schema: every mistake a user can make is one line naming the file and the field."""

import textwrap

import pytest

from emulator.schema import ConfigError
from emulator.topology import load_topology
from emulator.units import UnitError, parse_fraction, parse_rate_bit_s, parse_size_bytes, parse_time_ms

THREE = """
name: three
regions:
  a: {nodes: 1}
  b: {nodes: 2}
  c: {nodes: 1}
defaults: {rate: 100Mbit}
links:
  - {between: [a, b], rtt: 20ms}
  - {between: [a, c], rtt: 40ms, rate: 50Mbit, loss: 0.5%}
  - {between: [b, c], delay: 15ms, jitter: 1ms}
"""


def test_units():
    assert parse_time_ms("68.1ms") == pytest.approx(68.1)
    assert parse_time_ms("250us") == pytest.approx(0.25)
    assert parse_time_ms("1.5s") == pytest.approx(1500)
    assert parse_rate_bit_s("1Gbit") == 1e9
    assert parse_rate_bit_s("100Mbps") == 1e8
    assert parse_fraction("0.1%") == pytest.approx(0.001)
    assert parse_size_bytes("16MB") == 16_000_000
    assert parse_size_bytes("64KiB") == 65536
    for bad in ("68.1", "fast", "1 parsec", "", None, True):
        with pytest.raises(UnitError):
            parse_time_ms(bad)
    with pytest.raises(UnitError):
        parse_rate_bit_s("100")


def test_valid_file_resolves_matrix(write_yaml):
    topo = load_topology(write_yaml(THREE))
    assert topo.regions == {"a": 1, "b": 2, "c": 1}
    ab, ba = topo.link("a", "b"), topo.link("b", "a")
    assert ab.one_way_delay_ms == pytest.approx(10.0) and ba.one_way_delay_ms == pytest.approx(10.0)
    assert ab.rate_bit_s == 1e8
    ac = topo.link("a", "c")
    assert ac.rate_bit_s == 5e7 and ac.loss_fraction == pytest.approx(0.005)
    assert topo.link("c", "b").one_way_delay_ms == 15.0 and topo.link("c", "b").jitter_ms == 1.0
    assert topo.link("b", "b").rate_bit_s == 10e9  # built-in intra-region default


def test_asymmetric_links_allowed(write_yaml):
    text = THREE.replace("- {between: [a, b], rtt: 20ms}",
                         "- {from: a, to: b, delay: 5ms}\n  - {from: b, to: a, delay: 30ms}")
    topo = load_topology(write_yaml(text))
    assert topo.link("a", "b").one_way_delay_ms == 5.0
    assert topo.link("b", "a").one_way_delay_ms == 30.0


def test_shipped_topologies_load():
    from tests.conftest import ROOT

    aws = load_topology(ROOT / "topologies" / "aws-4region.yaml")
    assert aws.link("london", "tokyo").one_way_delay_ms == pytest.approx(215.7 / 2)
    assert aws.link("oregon", "ohio").one_way_delay_ms == pytest.approx(68.1 / 2)
    assert len(aws.links) == 12
    assert load_topology(ROOT / "topologies" / "lan.yaml").regions == {"lan": 4}


@pytest.mark.parametrize("change, field, words", [
    (("rtt: 20ms", "rtt: 20"), "links[0].rtt", "needs a unit"),
    (("rtt: 20ms", "rtt: 20parsecs"), "links[0].rtt", "unknown duration unit"),
    (("rate: 50Mbit", "rate: -5Mbit"), "links[1].rate", "expected a rate"),
    (("rate: 50Mbit", "rate: 500Tbit"), "links[1].rate", "out of range"),
    (("loss: 0.5%", "loss: 150%"), "links[1].loss", "out of range"),
    (("[a, c]", "[a, mars]"), "links[1]", "unknown region 'mars'"),
    (("  - {between: [b, c], delay: 15ms, jitter: 1ms}\n", ""), "links", "no link between b and c"),
    (("b: {nodes: 2}", "b: {nodes: 0}"), "regions.b.nodes", "greater than or equal to 1"),
    (("b: {nodes: 2}", "b: {nodes: 2, cores: 3}"), "regions.b.cores", "unknown field"),
    (("jitter: 1ms", "jitter: 20ms"), "links[2]", "jitter 20ms larger than the one-way delay"),
    (("name: three", "name: three\naddress_pool: 8.8.0.0/16"), "address_pool", "not a private range"),
    (("rtt: 20ms}", "rtt: 20ms, delay: 10ms}"), "links[0]", "either rtt or delay"),
    (("name: three", "name: three\nnic: {rate: 10}"), "nic.rate", "needs a unit"),
    (("name: three", "name: three\nnic: {rate: 200Gbit}"), "nic.rate", "out of range"),
    (("name: three", "name: three\nnic: 10Gbit"), "nic", "valid dictionary"),
    (("name: three", "name: three\nnic: {rate: 10Gbit, duplex: half}"), "nic.duplex", "unknown field"),
    (("b: {nodes: 2}", "b: {nodes: 2, nic: {rate: fast}}"), "regions.b.nic.rate", "expected a rate"),
])
def test_schema_errors_name_file_and_field(write_yaml, change, field, words):
    path = write_yaml(THREE.replace(*change))
    with pytest.raises(ConfigError) as info:
        load_topology(path)
    message = str(info.value)
    assert message.startswith(f"{path}: {field}:"), message
    assert words in message, message
    assert "\n" not in message


def test_one_direction_only_is_an_asymmetric_matrix_error(write_yaml):
    path = write_yaml(THREE.replace("- {between: [a, b], rtt: 20ms}", "- {from: a, to: b, delay: 5ms}"))
    with pytest.raises(ConfigError, match=r"links: link b->a missing: a->b is given one-way"):
        load_topology(path)


def test_duplicate_pair(write_yaml):
    path = write_yaml(THREE + "  - {from: b, to: a, delay: 1ms}\n")
    with pytest.raises(ConfigError, match=r"links\[3\]: link b->a given twice"):
        load_topology(path)


@pytest.mark.parametrize("content, words", [
    ("", "file is empty"),
    ("- a\n- b\n", "expected a YAML mapping"),
    ("name: [unclosed\n", "invalid YAML"),
    ("a: &x [1]\n" + "".join(f"b{i}: *x\n" for i in range(200)), "aliases"),
    ("x: !!python/object/apply:os.system ['true']\n", "invalid YAML"),
])
def test_files_that_are_not_topologies(write_yaml, content, words):
    with pytest.raises(ConfigError, match=words):
        load_topology(write_yaml(content))


def test_binary_and_missing_files(tmp_path):
    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        load_topology(binary)
    with pytest.raises(ConfigError, match="no such file"):
        load_topology(tmp_path / "missing.yaml")


def test_sweep_scaling(write_yaml):
    topo = load_topology(write_yaml(THREE))
    scaled = topo.scaled(delay_scale=3.0, rate_bit_s=1e6)
    assert scaled.link("a", "b").one_way_delay_ms == pytest.approx(30.0)
    assert scaled.link("a", "b").rate_bit_s == 1e6
    assert scaled.link("b", "b") == topo.link("b", "b")  # intra-region untouched


def test_defaults_with_a_delay_cover_unlisted_pairs(write_yaml):
    path = write_yaml("name: c\nregions: {a: {}, b: {}, c: {}}\ndefaults: {rtt: 2ms, rate: 50Mbit}\n"
                      "links: [{between: [a, b], rtt: 10ms}]\n")
    topo = load_topology(path)
    assert topo.link("a", "b").one_way_delay_ms == 5.0
    assert topo.link("c", "a").one_way_delay_ms == 1.0 and topo.link("b", "c").rate_bit_s == 50e6


def test_every_node_has_a_nic_each_way_the_default_a_region_can_override(write_yaml):
    from emulator.plan import make_plan
    from emulator.topology import DEFAULT_NIC_RATE_BIT_S

    default = load_topology(write_yaml(THREE))
    assert DEFAULT_NIC_RATE_BIT_S == 10e9
    assert default.nic_rate_bit_s == {"a": 10e9, "b": 10e9, "c": 10e9}
    topo = load_topology(write_yaml(THREE.replace("name: three", "name: three\nnic: {rate: 25Gbit}").replace(
        "b: {nodes: 2}", "b: {nodes: 2, nic: {rate: 1Gbit}}")))
    assert topo.nic_rate_bit_s == {"a": 25e9, "b": 1e9, "c": 25e9}
    plan = make_plan(topo)
    assert [n.nic_rate_bit_s for n in plan.nodes] == [25e9, 1e9, 1e9, 25e9]
    # plain data: the plan's JSON carries it and reads back; a dilated plan slows the NIC as its links
    assert type(plan).from_json(plan.to_json()) == plan
    slowed = make_plan(topo, time_dilation=4.0)
    assert [n.nic_rate_bit_s for n in slowed.nodes] == [6.25e9, 0.25e9, 0.25e9, 6.25e9]
    assert slowed.emulated_nic_bit_s(slowed.nodes[1]) == 1e9
    assert topo.with_nic(2e9).nic_rate_bit_s == {"a": 2e9, "b": 2e9, "c": 2e9}
    # a NIC binds where its pairs' rates sum to more: b's 1 Gbit/s under its 10 Gbit/s intra-region
    # pair, not a's or c's 25 Gbit/s (a: 2 x 100 Mbit/s to b + 50 to c)
    assert [n.name for n in plan.nodes if plan.nic_can_bind(n)] == ["b-0", "b-1"]
    tight = make_plan(topo.with_nic(250e6))   # a: exactly 250 out and in: cannot pass it
    assert [n.name for n in tight.nodes if tight.nic_can_bind(n)] == ["b-0", "b-1"]
    tighter = make_plan(topo.with_nic(249e6))
    assert [n.name for n in tighter.nodes if tighter.nic_can_bind(n)] == ["a-0", "b-0", "b-1", "c-0"]


def test_a_plan_written_before_nodes_had_nics_reads_as_no_nic(write_yaml):
    import json
    from emulator.plan import Plan, make_plan

    data = json.loads(make_plan(load_topology(write_yaml(THREE))).to_json())
    for node in data["nodes"]:
        del node["nic_rate_bit_s"]
    assert all(n.nic_rate_bit_s is None for n in Plan.from_json(json.dumps(data)).nodes)
