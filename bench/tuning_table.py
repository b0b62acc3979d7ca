"""A tuning protocol's candidates as one table (label by grid value), from runs' tuning.json.

Reads the tuning.json of each run or evidence folder given (a scenario's `tuning:`,
harness/tuning.py) and prints, per network point and label, every candidate's score on the tuning
seed: time to target (or "never" with the accuracy at the budget, where the candidate did not reach
it), the pick in bold, and whether the pick sits at an edge of the grid (where the protocol asks for
one step past it). Several folders: their labels side by side in one table (e.g. a stage that tuned
one parameter, then one that tuned another at the first's pick).

A folder without tuning.json (a run whose entries differ in their lr, e.g. one step past a grid's
edge: `eawild-t1-a0.9-c150-lr0.1`) is read from its summary.csv and scenario.json: the entries that
differ only in their workload's lr form one row, ranked by the rule of harness/tuning.py (time to
target, then accuracy at the step budget), marked "ranked here".

    .venv/bin/python bench/tuning_table.py results/papers/eawild-sweep/20261207-162714-tune-w16 [...]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness, run from anywhere

from harness.rundir import TUNING_FILE  # noqa: E402
from harness.tuning import pick as rank_pick, score  # noqa: E402

SUMMARY_FILE, SCENARIO_FILE = "summary.csv", "scenario.json"


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


def stated_lr_tuning(folder: Path, by: str = "time_to_target") -> dict:
    """A run without `tuning:` whose entries differ in their lr, as a tuning.json would hold it: per
    network point and algorithm entry less its lr (name, params, the rest of its workload: what the
    scenario says, not what its label says) its jobs on the first seed as candidates, the pick by
    harness/tuning.py's rule `by` (accuracy compared at the step budget every job shares). A group
    is named by its first label without a `-lr<value>` suffix, where it has one."""
    spec = json.loads((folder / SCENARIO_FILE).read_text())["spec"]
    entries = {}
    for entry in spec["algorithms"]:
        workload = dict(entry.get("workload") or {})
        lr = workload.pop("lr", spec["workload"]["lr"])
        identity = json.dumps([entry["name"], entry.get("params") or {}, workload], sort_keys=True)
        entries[entry.get("label") or entry["name"]] = (lr, identity)
    summary = pd.read_csv(folder / SUMMARY_FILE)
    summary = summary[summary["seed"] == summary["seed"].min()]
    groups: dict = {}
    for record in summary.to_dict("records"):
        lr, identity = entries[record["label"]]
        group = groups.setdefault((record["network"], identity),
                                  {"label": record["label"].removesuffix(f"-lr{lr:g}"), "candidates": []})
        group["candidates"].append(
            {"values": {"lr": lr}, "job_id": f"{record['network']}-{record['label']}-seed{record['seed']}",
             "status": record["status"], "time_to_target_s": score(record["time_to_target_s"]),
             "accuracy_at_budget": score(record["accuracy_at_step_budget"]), "loss_at_budget": None})
    picks = []
    for (network, _), group in groups.items():
        candidates = group["candidates"]
        chosen = rank_pick(pd.DataFrame(candidates), by)
        picks.append({"network": network, "label": group["label"], "candidates": candidates, "ranked_here": True,
                      "pick": candidates[chosen]["values"] if chosen is not None else None})
    return {"grid": {}, "by": by, "picks": picks}


def tuning_of(folder: Path) -> dict:
    """The folder's tuning.json, or for a run without one its stated-lr jobs ranked here."""
    if (folder / TUNING_FILE).is_file():
        return json.loads((folder / TUNING_FILE).read_text())
    return stated_lr_tuning(folder)


def picks(folders: list[Path]) -> pd.DataFrame:
    """One row per (network, label), as rows() merges them: its pick's values and the picked
    candidate's scores."""
    out = []
    for folder_names, _, group in _merged(folders):
        chosen = [c for c in group["candidates"] if c["values"] == group["pick"]]
        scores = {key: chosen[0].get(key) if chosen else None
                  for key in ("status", "time_to_target_s", "accuracy_at_budget", "loss_at_budget")}
        out.append({"folder": folder_names, "network": group["network"], "label": group["label"],
                    **(group["pick"] or {}), **scores})
    return pd.DataFrame(out)


def _merged(folders: list[Path]) -> list[tuple[str, dict, dict]]:
    """(folder names, grid, group) per (network, label): a label tuned in several folders (a grid,
    then one step past its edge) is one group, its candidates together and its pick made again over
    all of them by the rule (`by`) every folder's own pick used; folders tuned by different rules
    are refused (one pick cannot honour two)."""
    merged: dict = {}
    for folder in folders:
        tuning = tuning_of(folder)
        for group in tuning["picks"]:
            key = (group["network"], group["label"])
            if key not in merged:
                merged[key] = ([folder.name], dict(tuning["grid"]), tuning["by"],
                               dict(group, candidates=list(group["candidates"])))
                continue
            names, _, by, first = merged[key]
            if tuning["by"] != by:
                raise SystemExit(f"{group['label']} is tuned by {by} in {names[0]} and by {tuning['by']} in "
                                 f"{folder.name}: one pick cannot follow two rules")
            names.append(folder.name)
            first["candidates"] += group["candidates"]
            first["ranked_here"] = True
    out = []
    for names, grid, by, group in merged.values():
        if len(names) > 1:
            chosen = rank_pick(pd.DataFrame(group["candidates"]), by)
            group["pick"] = group["candidates"][chosen]["values"] if chosen is not None else None
            group["merged"] = len(names)
        out.append((" + ".join(names), grid, group))
    return out


def rows(folders: list[Path]) -> list[dict]:
    """One row per (network, label): its candidates' cells by grid value, its pick and edge (a label
    in several folders: one row, its candidates from all of them)."""
    out = []
    for folder_names, grid, group in _merged(folders):
        cells = {_value(c["values"]): cell(c) for c in group["candidates"]}
        pick = group.get("pick")
        picked = _value(pick) if pick else None
        if picked in cells:
            cells[picked] = f"**{cells[picked]}**"
        edge = []
        own = grid  # a label ranked here (merged, or no tuning.json): the values its candidates tried
        if group.get("ranked_here"):
            own = {key: sorted({c["values"][key] for c in group["candidates"] if key in c["values"]})
                   for key in dict.fromkeys(k for c in group["candidates"] for k in c["values"])}
        for key, values in own.items():
            if pick and key in pick and pick[key] in (min(values), max(values)) and len(values) > 1:
                edge.append(f"{key} at the grid's {'lower' if pick[key] == min(values) else 'upper'} edge")
        if group.get("merged"):
            edge.append(f"ranked here over {group['merged']} runs")
        elif group.get("ranked_here"):
            edge.append("ranked here (no tuning.json)")
        out.append({"folder": folder_names, "network": group["network"], "label": group["label"],
                    "cells": cells, "pick": picked, "edge": "; ".join(edge)})
    return out


def _order(column: str) -> tuple:
    """A column ("lr 0.1, H 4") as its numbers in order, for sorting; unparsable values last."""
    parts = []
    for part in column.split(", "):
        key, _, value = part.partition(" ")
        try:
            parts.append((key, 0, float(value)))
        except ValueError:
            parts.append((key, 1, 0.0))
    return tuple(parts)


def markdown(table: list[dict]) -> str:
    columns = []
    for row in table:
        columns += [c for c in row["cells"] if c not in columns]
    columns.sort(key=_order)  # lr 0.005 before lr 0.02, whichever folder listed it first
    networks = len({row["network"] for row in table}) > 1  # one network point: no column for it
    lines = ["| " + ("network | " if networks else "") + "label | " + " | ".join(columns) + " | pick | edge |",
             "|---|" + "---|" * (len(columns) + 2 + networks)]
    for row in table:
        lines.append("| " + (f"{row['network']} | " if networks else "") + f"{row['label']} | "
                     + " | ".join(row["cells"].get(c, "") for c in columns)
                     + f" | {row['pick'] or 'none'} | {row['edge'] or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="run or evidence folders holding tuning.json")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders
               if not (f / TUNING_FILE).is_file() and not (f / SUMMARY_FILE).is_file()]
    if missing:
        parser.error(f"neither {TUNING_FILE} nor {SUMMARY_FILE} in: {', '.join(missing)}")
    print(markdown(rows(args.folders)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
