"""A tuning protocol's candidates as one table (label by grid value), from runs' tuning.json.

Reads the tuning.json of each run or evidence folder given (a scenario's `tuning:`,
harness/tuning.py) and prints, per network point and label, every candidate's score on the tuning
seed: time to target (or "never" with the accuracy at the budget, where the candidate did not reach
it), the pick in bold, and whether the pick sits at an edge of the grid (where the protocol asks for
one step past it). Several folders: their labels side by side in one table (e.g. a stage that tuned
one parameter, then one that tuned another at the first's pick).

    .venv/bin/python bench/tuning_table.py results/papers/eawild-sweep/20261207-162714-tune-w16 [...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness, run from anywhere

from harness.rundir import TUNING_FILE  # noqa: E402


def _value(values: dict) -> str:
    return ", ".join(f"{key} {value:g}" for key, value in values.items())


def cell(candidate: dict) -> str:
    """A candidate's score: time to target, or "never" with its accuracy at the budget."""
    time = candidate.get("time_to_target_s")
    if candidate.get("status") != "ok":
        return candidate.get("status") or "?"
    if time is None or (isinstance(time, float) and math.isnan(time)):
        accuracy = candidate.get("accuracy_at_budget")
        return "never" + (f" ({accuracy * 100:.1f} %)" if accuracy is not None else "")
    return f"{time:.1f} s"


def rows(folders: list[Path]) -> list[dict]:
    """One row per (folder, network, label): its candidates' cells by grid value, its pick and edge."""
    out = []
    for folder in folders:
        tuning = json.loads((folder / TUNING_FILE).read_text())
        grid = tuning["grid"]
        for group in tuning["picks"]:
            cells = {_value(c["values"]): cell(c) for c in group["candidates"]}
            pick = group.get("pick")
            picked = _value(pick) if pick else None
            if picked in cells:
                cells[picked] = f"**{cells[picked]}**"
            edge = []
            for key, values in grid.items():
                if pick and key in pick and pick[key] in (min(values), max(values)) and len(values) > 1:
                    edge.append(f"{key} at the grid's {'lower' if pick[key] == min(values) else 'upper'} edge")
            out.append({"folder": folder.name, "network": group["network"], "label": group["label"],
                        "cells": cells, "pick": picked, "edge": "; ".join(edge)})
    return out


def markdown(table: list[dict]) -> str:
    columns = []
    for row in table:
        columns += [c for c in row["cells"] if c not in columns]
    lines = ["| label | " + " | ".join(columns) + " | pick | edge |",
             "|---|" + "---|" * (len(columns) + 2)]
    for row in table:
        lines.append(f"| {row['label']} | " + " | ".join(row["cells"].get(c, "") for c in columns)
                     + f" | {row['pick'] or 'none'} | {row['edge'] or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run or evidence folders holding tuning.json")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not (f / TUNING_FILE).is_file()]
    if missing:
        parser.error(f"no {TUNING_FILE} in: {', '.join(missing)}")
    print(markdown(rows(args.folders)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
