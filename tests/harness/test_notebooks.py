"""The seed-paper notebooks: valid, outputs stripped, and one executed end to end with nbclient
against a synthetic results folder (passed through WANBENCH_RESULTS_DIR) and against none."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.harness.test_report import sync_and_dts, write_run

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat (pip install -e '.[test]')")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
NAMES = ["dts_speedup_vs_latency", "p3_throughput_vs_bandwidth", "swarmsgd_time_to_accuracy",
         "eawild_async_vs_sync"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_valid_stripped_and_uses_emulator_plots(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    assert f"results/examples/{name}/" in code[0].source and "WANBENCH_RESULTS_DIR" in code[0].source
    source = "\n".join(cell.source for cell in code)
    assert "plots." in source and "import matplotlib.pyplot" not in source and ".plot(" not in source


def execute(name: str, results_dir: str, monkeypatch):
    pytest.importorskip("nbclient", reason="notebook execution needs nbclient and ipykernel")
    pytest.importorskip("ipykernel", reason="notebook execution needs ipykernel")
    from nbclient import NotebookClient

    monkeypatch.setenv("WANBENCH_RESULTS_DIR", results_dir)  # the kernel inherits the environment
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]


def test_dts_notebook_draws_its_figure_from_a_results_folder(tmp_path, monkeypatch):
    jobs = [job for scale in (0.5, 1.0, 2.0) for job in sync_and_dts(delay_scale=scale)]
    write_run(tmp_path / "runs", jobs)
    outputs = execute("dts_speedup_vs_latency", str(tmp_path / "runs"), monkeypatch)
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
    assert "1 run(s), 6 job(s)" in "".join(o.get("text", "") for o in outputs)


def test_notebook_without_results_stops_gracefully(tmp_path, monkeypatch):
    outputs = execute("eawild_async_vs_sync", str(tmp_path / "nothing-here"), monkeypatch)
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if "image/png" in o.get("data", {})]
    assert "No run directories under" in "".join(o.get("text", "") for o in outputs)


EXAMPLES = Path(__file__).resolve().parents[2] / "results" / "examples"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_on_the_committed_example_results(name, monkeypatch):
    """Each notebook regenerates its figure from the real run committed under results/examples/."""
    folder = EXAMPLES / name
    if not folder.is_dir():
        pytest.skip(f"no committed example results in {folder}")
    monkeypatch.delenv("WANBENCH_RESULTS_DIR", raising=False)  # the notebook's own default path
    outputs = execute(name, str(folder), monkeypatch)
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 1
