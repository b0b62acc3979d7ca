"""`wanbench clean` (emulator/clean.py): what it removes, what it must leave alone, and which
prefixes it can find leftovers under."""

import os
import re
import subprocess
import sys
import time

import pytest

from emulator import clean, helpers, netns
from harness import cli
from emulator.backends.base import Backend
from emulator.plan import TEST_PREFIX_PATTERN
from emulator.processes import alive, wait_gone

pytestmark = pytest.mark.integration


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def test_a_live_runs_helper_is_left_alone_and_ended_once_its_run_is_gone(test_prefix):
    """A sim job's process recorded for clean while its harness still runs is no leftover: `clean`
    ending it failed a live run (seen: a `wanbench clean` in another terminal ended two jobs)."""
    harness, helper = _sleeper(), _sleeper()
    try:
        assert helpers.register(test_prefix, helper.pid, helper.args, owner=harness.pid) is not None
        assert helpers.owner_of(test_prefix, helper.pid) == harness.pid
        removed = clean.clean(test_prefix)
        assert not any(str(helper.pid) in item for item in removed), removed
        time.sleep(0.2)
        assert alive(helper.pid)
        assert helpers.leftover_helpers(test_prefix) == [helper.pid]  # its record kept for a later clean
        harness.kill()
        harness.wait(timeout=10)
        assert helpers.owner_of(test_prefix, helper.pid) is None
        removed = clean.clean(test_prefix)
        assert f"process {helper.pid} (a run's helper)" in removed
        assert wait_gone([helper.pid], 5.0) == []
        assert not Backend.state_dir(test_prefix).exists()
    finally:
        for proc in (harness, helper):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_a_live_runs_network_is_left_alone_and_removed_once_its_run_is_gone(test_prefix, caplog, capsys):
    """`clean` in another terminal tore down a running emulated run's network under it; now the
    run records itself as the network's owner, and clean leaves the prefix alone while it runs."""
    namespace = f"{test_prefix}-n0"
    harness = _sleeper()
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        assert helpers.claim_network(test_prefix, owner=harness.pid) is not None
        assert helpers.network_owner(test_prefix) == harness.pid
        with caplog.at_level("WARNING"):
            assert clean.clean(test_prefix) == []
        assert namespace in netns.all_namespaces()
        assert cli.main(["down"]) != 0   # `wanbench down` refuses it too, naming the run
        assert f"belongs to run process {harness.pid}, which still runs" in capsys.readouterr().err
        assert f"left alone: prefix {test_prefix}, the network of run process {harness.pid}" in caplog.text
        harness.kill()
        harness.wait(timeout=10)
        assert helpers.network_owner(test_prefix) is None
        assert cli.main(["down"]) == 0   # no network recorded up: nothing to do (the namespace is clean's)
        assert clean.clean(test_prefix) == [f"namespace {namespace}"]
        assert namespace not in netns.all_namespaces() and not Backend.state_dir(test_prefix).exists()
        helpers.claim_network(test_prefix)  # this process: released, the prefix is anyone's again
        assert helpers.network_owner(test_prefix) == os.getpid()
        helpers.release_network(test_prefix)
        assert helpers.network_owner(test_prefix) is None
    finally:
        if harness.poll() is None:
            harness.kill()
        harness.wait(timeout=10)
        helpers.release_network(test_prefix)
        clean.clean(test_prefix)


def test_leftover_prefixes_finds_a_test_prefixs_namespace_and_state_folder_and_clean_empties_it(test_prefix):
    namespace = f"{test_prefix}-n0"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        assert test_prefix in clean.leftover_prefixes(TEST_PREFIX_PATTERN)
        other = "wz" + test_prefix[2:]   # another prefix's leftovers are not a test prefix's
        Backend.state_dir(other).mkdir(parents=True)
        try:
            assert other not in clean.leftover_prefixes(TEST_PREFIX_PATTERN)
            assert other in clean.leftover_prefixes(re.compile(r"wz[0-9a-f]{4}"))
        finally:
            Backend.state_dir(other).rmdir()
        assert clean.clean(test_prefix) == [f"namespace {namespace}"]
        assert namespace not in netns.all_namespaces()
        assert test_prefix not in clean.leftover_prefixes(TEST_PREFIX_PATTERN)
        Backend.state_dir(test_prefix).mkdir(parents=True)
        assert test_prefix in clean.leftover_prefixes(TEST_PREFIX_PATTERN)  # a state folder alone counts
    finally:
        clean.clean(test_prefix)
    assert test_prefix not in clean.leftover_prefixes(TEST_PREFIX_PATTERN)


def test_the_cli_cleans_the_prefix_it_is_given_and_refuses_a_bad_one(test_prefix, monkeypatch, capsys):
    from harness import cli

    namespace = f"{test_prefix}-n0"
    subprocess.run(["ip", "netns", "add", namespace], check=True)
    try:
        monkeypatch.setenv("WANBENCH_PREFIX", "wz" + test_prefix[2:])  # another prefix in force
        assert cli.main(["clean", "--prefix", test_prefix]) == 0
        assert namespace not in netns.all_namespaces()
        assert cli.main(["clean", "--prefix", "Bad-1"]) == 2
        assert "--prefix: 'Bad-1'" in capsys.readouterr().err
    finally:
        clean.clean(test_prefix)
