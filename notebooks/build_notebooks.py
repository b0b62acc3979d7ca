"""Write the seed-paper notebooks (outputs stripped): `.venv/bin/python notebooks/build_notebooks.py`.

Each notebook redraws one paper's headline figure from a results folder with the functions of
harness.plots — no plotting code lives in a notebook. Edit the cells here, not in the .ipynb
files, and re-run this script so the four stay alike.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

PARAMETERS = '''\
# Parameters. RESULTS_DIR: a run directory (results/runs/<scenario>/<run-id>) or a folder of them
# (results/runs/<scenario>/); relative paths are from the repository root.
# The environment variable WANBENCH_RESULTS_DIR overrides it (the tests use it).
import os

RESULTS_DIR = os.environ.get("WANBENCH_RESULTS_DIR", "results/examples/{name}/")'''

SETUP = '''\
import io
import sys
from pathlib import Path

from IPython.display import Image, display

ROOT = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "harness" / "plots.py").is_file())
sys.path.insert(0, str(ROOT))

from harness import plots  # noqa: E402
from harness.report import find_run_dirs, incomplete_message, load_results  # noqa: E402


def show(figure):
    """Display a Figure as PNG (the figure functions use a headless Agg canvas)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=plots.DPI, bbox_inches="tight")
    display(Image(buffer.getvalue()))


results_dir = Path(RESULTS_DIR).expanduser()
results_dir = results_dir if results_dir.is_absolute() else ROOT / results_dir
run_dirs = find_run_dirs(results_dir) if results_dir.is_dir() else []
results = None
if not run_dirs:
    print(f"No run directories under {{results_dir}}.\\n"
          "Make some with:  wanbench run {scenario_hint}\\n"
          "then set RESULTS_DIR (or WANBENCH_RESULTS_DIR) to results/runs/<scenario>/. "
          "Nothing to draw: the cells below do nothing.")
else:
    results = load_results(run_dirs)
    for run in results.incomplete:
        print("WARNING:", incomplete_message(run))
    print(f"{{len(results.runs)}} run(s), {{len(results.summary)}} job(s):",
          ", ".join(run.name for run in results.runs))'''

NOTEBOOKS = {
    "dts_speedup_vs_latency": {
        "title": "DTS: speedup over synchronous SGD as the network latency grows",
        "intro": ("The DTS paper's main plot: how much faster than synchronous all-reduce each algorithm "
                  "reaches the target accuracy (left) and how many more steps per second it takes "
                  "(right), as the inter-region round-trip time grows. Sweep `delay_scale` in the "
                  "scenario to get more than one point."),
        "scenario_hint": "scenarios/<a scenario sweeping sweep.delay_scale>.yaml",
        "figure": "show(plots.speedup_vs_latency(results.comparable()))",
        "table": ["delay_scale", "mean_rtt_ms", "label", "seed", "time_to_target_s", "speedup_vs_sync",
                  "throughput_speedup_vs_sync"],
        "look_for": ("Above the dashed line an algorithm beats sync. The gap should widen with RTT for "
                     "algorithms that overlap or skip communication; a time-to-target line below its "
                     "throughput line means it pays for its speed with slower convergence."),
    },
    "p3_throughput_vs_bandwidth": {
        "title": "P3: training throughput against link bandwidth",
        "intro": ("P3's plot: training throughput of each algorithm against the inter-region link rate "
                  "(log scale). Sweep `rate` in the scenario. When the delay is swept too, each delay "
                  "gets its own line so different networks are never averaged together."),
        "scenario_hint": "scenarios/<a scenario sweeping sweep.rate>.yaml",
        "figure": "show(plots.throughput_vs_bandwidth(results.comparable()))",
        "table": ["rate", "rate_bit_s", "delay_scale", "label", "seed", "steps_per_s", "throughput_speedup_vs_sync",
                  "bytes_per_step_per_node"],
        "look_for": ("Where the lines flatten, computation is the bottleneck; where they climb, the link "
                     "is. An algorithm that hides communication (P3's slicing and priorities) should "
                     "reach its plateau at a lower rate than sync."),
    },
    "swarmsgd_time_to_accuracy": {
        "title": "SwarmSGD: accuracy against wall-clock time, and against bytes on the wire",
        "intro": ("SwarmSGD's comparison: test accuracy against training wall-clock per algorithm "
                  "(one figure per network point), then final accuracy against the bytes each node sent "
                  "(gossip and quantized methods trade traffic for accuracy)."),
        "scenario_hint": "scenarios/<a scenario comparing sync, swarmsgd, dpsgd, ...>.yaml",
        "figure": '''\
complete = {run.name for run in results.runs if run.complete}
steps = results.steps[results.steps["run"].isin(complete)] if len(results.steps) else results.steps
evals = results.evals[results.evals["run"].isin(complete)] if len(results.evals) else results.evals
target = next((run.target_accuracy for run in results.runs if run.target_accuracy is not None), None)
for network in sorted(set(evals["network"]) if len(evals) else []):
    show(plots.loss_accuracy_vs_time(steps[steps["network"] == network], evals[evals["network"] == network],
                                     title=f"Time to accuracy at {network}", target_accuracy=target))
show(plots.accuracy_vs_bytes(results.comparable()))''',
        "table": ["network", "label", "seed", "final_accuracy", "time_to_target_s", "speedup_vs_sync",
                  "bytes_sent_per_node"],
        "look_for": ("The curve that reaches the dotted target line first wins on time to accuracy; in "
                     "the second figure, up and to the left is better (more accuracy for fewer bytes)."),
    },
    "eawild_async_vs_sync": {
        "title": "EA-wild: when does asynchrony beat synchronous SGD?",
        "intro": ("The EA-wild paper's conclusion: asynchronous methods win when communication dominates. "
                  "x is sync's own compute time over its time blocked on communication (from its step "
                  "records, per network point and seed); y is each other algorithm's speedup over sync."),
        "scenario_hint": "scenarios/<a scenario comparing sync, eawild, async_ps, ... over sweep.delay_scale>.yaml",
        "figure": "show(plots.async_vs_sync(results.comparable(), results.steps))",
        "table": ["network", "label", "seed", "comm_blocked_fraction", "speedup_vs_sync",
                  "throughput_speedup_vs_sync", "mean_staleness"],
        "look_for": ("Left of the dotted line (ratio < 1) sync spends more time waiting than computing: "
                     "that is where the asynchronous points should sit above the dashed line at 1."),
    },
}


def notebook(name: str, spec: dict) -> nbformat.NotebookNode:
    cells = [
        new_markdown_cell(f"# {spec['title']}\n\n{spec['intro']}\n\n"
                          "Set `RESULTS_DIR` below (or the `WANBENCH_RESULTS_DIR` environment variable) to the "
                          "results to draw. The figure comes from `harness.plots`, the same function "
                          "`wanbench report` uses; incomplete runs are flagged and left out."),
        new_code_cell(PARAMETERS.format(name=name), metadata={"tags": ["parameters"]}),
        new_code_cell(SETUP.format(scenario_hint=spec["scenario_hint"])),
        new_markdown_cell("## The figure"),
        new_code_cell("if results is not None:\n" + "\n".join("    " + line for line in spec["figure"].splitlines())),
        new_markdown_cell("## The numbers behind it"),
        new_code_cell("if results is not None:\n"
                      f"    columns = {spec['table']!r}\n"
                      "    table = results.comparable()\n"
                      "    display(table[[c for c in columns if c in table.columns]].sort_values(columns[:2]))"),
        new_markdown_cell(f"## What to look for\n\n{spec['look_for']}"),
    ]
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"}})
    nbformat.validate(nb)
    return nb


def main() -> None:
    for name, spec in NOTEBOOKS.items():
        path = HERE / f"{name}.ipynb"
        nbformat.write(notebook(name, spec), path)
        print(path)


if __name__ == "__main__":
    main()
