"""The seed-paper notebooks: valid, outputs stripped, pointed at the committed evidence
(results/papers/), and executed end to end with nbclient: each on its own default folders, one
against a synthetic results folder (passed through WANBENCH_RESULTS_DIR) and one against none."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.harness.test_report import sync_and_dts, write_run

nbformat = pytest.importorskip("nbformat", reason="notebook tests need nbformat (pip install -e '.[test]')")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ROOT = NOTEBOOKS.parent
# notebook -> (the folders its RESULTS_DIRS names by default, the figures it draws from them:
# DTS: dts-90x's speedup vs latency and its two network points' curves, dts-fmnist's, dts-fmnist-wide's, dts-fmnist-long's and dts-lm's
# curves; EA-wild: the crossover, the same with the TCP window kept, and 16 workers re-tuned)
DEFAULTS = {
    "dts_speedup_vs_latency": (["results/papers/dts-90x/", "results/papers/dts-fmnist/", "results/papers/dts-fmnist-wide/",
                                "results/papers/dts-fmnist-long/", "results/papers/dts-lm/"], 7),
    "p3_throughput_vs_bandwidth": (["results/papers/p3/"], 1),
    # SwarmSGD: one figure per run with a label of >= 3 seeds, a run's "-controls" with it, then bytes, per
    # folder: 16 nodes (main, -edge, -outstanding, -long, -dc with -dc-controls, -bbr), 4 and 8 nodes
    # (n4, n8, their local_only at its moved pick, n4 on tun, n4 with BBR)
    "swarmsgd_time_to_accuracy": (["results/papers/swarmsgd-fmnist16/", "results/papers/swarmsgd-fmnist-nodes/"], 14),
    "eawild_async_vs_sync": ([f"results/papers/eawild-sweep/{run}" for run in (
        "20261126-182918", "20261126-184521", "20261126-185917", "20261126-185842", "20261126-185844")], 3),
    # DiLoCo: one figure per folder's main run, and one for the runs made again on a second VM (-rerun)
    "diloco_loss_vs_tokens": (["results/papers/diloco-lm/", "results/papers/diloco-lm-warm/",
                               "results/papers/diloco-lm-b64/"], 4),
}
NAMES = list(DEFAULTS)
# labels a notebook's tables must show from its default folders: runs made apart from a main run
# (its controls, later variants against the same baseline) are drawn with it
LABELS = {"diloco_loss_vs_tokens": ["localsgd-H50", "avgonce", "diloco-H50-int8-ring", "diloco-H50-int8-ring-shared",
                                    "streaming-H50-F2-t1-int8-ring-shared", "streaming-H50-F2-t4-int4-shared",
                                    "diloco-H50-int8-ring-shared-om0.8", "streaming-F2-t1-int8-ring-shared-om0.8",
                                    "localsgd-H50-shared", "avgonce-shared", "streaming-H50-F2-t4-int4-shared-om0.8",
                                    "streaming-F2-t1-int8-ring-shared-om0.95", "streaming-F2-t1-int8-ring-shared-om0.98",
                                    "streaming-H50-F2-t4-int4-shared-om0.98", "streaming-H50-F2-t4-int4-shared-om0.99"],
          "swarmsgd_time_to_accuracy": ["swarmsgd-out16", "sync-lr0.025", "averages_per_node_median",
                                        "local_only-lr0.0125", "20261128-170048-n4-tun"]}


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_valid_stripped_and_uses_emulator_plots(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    assert "parameters" in code[0].metadata.get("tags", [])
    folders, _ = DEFAULTS[name]
    assert f'"{":".join(folders)}"' in code[0].source and "WANBENCH_RESULTS_DIR" in code[0].source
    assert all((ROOT / folder).is_dir() for folder in folders)
    assert all(folder.startswith("results/papers/") for folder in folders)
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
    # the speedup against latency, then one figure of training curves per network point
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 1 + 3
    assert "1 run(s), 6 job(s)" in "".join(o.get("text", "") for o in outputs)


def test_notebook_without_results_stops_gracefully(tmp_path, monkeypatch):
    outputs = execute("eawild_async_vs_sync", str(tmp_path / "nothing-here"), monkeypatch)
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if "image/png" in o.get("data", {})]
    assert "No run directories under" in "".join(o.get("text", "") for o in outputs)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_on_the_committed_evidence(name, monkeypatch):
    """Each notebook, on its own default folders (no WANBENCH_RESULTS_DIR), redraws its figures
    from the committed evidence and names every folder it drew."""
    folders, figures = DEFAULTS[name]
    monkeypatch.delenv("WANBENCH_RESULTS_DIR", raising=False)
    pytest.importorskip("nbclient", reason="notebook execution needs nbclient and ipykernel")
    pytest.importorskip("ipykernel", reason="notebook execution needs ipykernel")
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == figures
    text = "".join(o.get("text", "") for o in outputs)
    assert "No run directories" not in text and "Nothing to draw" not in text
    assert all(Path(folder).name in text for folder in folders), text[:500]
    shown = "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    assert all(label in shown for label in LABELS.get(name, [])), shown[-1000:]
