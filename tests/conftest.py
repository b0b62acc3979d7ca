"""Test tiers: unit (no root), integration (root + namespaces + TUN), gpu. Skips say why."""

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from emulator.plan import TEST_PREFIX_PATTERN

ROOT = Path(__file__).resolve().parent.parent


def integration_skip_reason():
    if os.geteuid() != 0:
        return "integration tests need root (network namespaces)"
    if not Path("/dev/net/tun").exists():
        return "integration tests need /dev/net/tun"
    if shutil.which("ip") is None:
        return "integration tests need iproute2 (`ip`)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = integration_skip_reason()
    if reason:
        for item in items:
            if "integration" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def bench_module(name: str):
    """bench/<name>.py loaded as a module (the bench scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_wanbench(*args, check: bool = True, timeout: float = 300):
    """`wanbench ARGS` as a subprocess (python -m harness.cli); AssertionError with its stderr on a
    non-zero exit when `check`."""
    result = subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"wanbench {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result


@contextlib.contextmanager
def prefix_env(prefix: str):
    """WANBENCH_PREFIX=prefix for the block (module-scoped fixtures cannot use monkeypatch)."""
    previous = os.environ.get("WANBENCH_PREFIX")
    os.environ["WANBENCH_PREFIX"] = prefix
    try:
        yield prefix
    finally:
        if previous is None:
            os.environ.pop("WANBENCH_PREFIX", None)
        else:
            os.environ["WANBENCH_PREFIX"] = previous


@contextlib.contextmanager
def network_up(backend):
    """The backend up (after removing leftovers of an interrupted earlier run); always torn down."""
    try:
        backend.down()
        backend.up()
        yield backend
    finally:
        backend.down()


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """Every test ends with torch's intra-op thread count it began with: a test that sets it (a
    single-threaded reference) leaked it into the tests after it in the process, and a reduction
    order changes training numerics (LeNet on Fashion-MNIST: 0.758 at 1 thread, 0.824 at 2)."""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def test_prefix(monkeypatch):
    """A prefix of our own, so a test never touches a user's network or a parallel test's."""
    value = "wt" + uuid.uuid4().hex[:4]
    assert TEST_PREFIX_PATTERN.fullmatch(value)  # what `wanbench clean --test-prefixes` sweeps
    monkeypatch.setenv("WANBENCH_PREFIX", value)
    yield value
    from emulator.clean import clean

    clean(value)


@pytest.fixture
def write_yaml(tmp_path):
    def write(text: str, name: str = "topo.yaml") -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return write
