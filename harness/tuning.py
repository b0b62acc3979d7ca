"""Tuned baselines by one protocol (a scenario's `tuning:`): pick each label's candidate on the
tuning seed, by one stated rule, and write the picks to the run's tuning.json.

The protocol (MLPerf's "tune within a stated protocol"): every algorithm label, sync included, runs
the same grid (sync, DDP and the synchronous parameter servers also at the linear-scaling value of
their own lr for their larger global batch: harness/scenario.py TuningGroup) on the tuning seed at
each network point; the pick per (network point, label) is chosen here; the reported seeds then
run each label at its pick, and the summary's ratios against sync are taken among reported jobs
only (harness/results.py sync_reference), each job against sync at sync's own pick.

The rules (`tuning.by`), each with its tie-breaks, in order:

- time_to_target: the shortest time to target; a candidate that never reaches the target ranks
  after every one that does; ties (and those that never reach it) by the higher accuracy at the
  budget, then the lower held-out loss at the budget.
- accuracy_at_budget: the highest accuracy at the run's equal budget (harness/budget.py); ties by
  the shorter time to target, then the lower loss.
- loss: the lowest held-out loss of the last evaluation within the budget; ties by the shorter
  time to target, then the higher accuracy.

A candidate whose job did not end ok, or has no score by the rule's first key, ranks last and is
never picked while one that ended ok has a score; a remaining tie goes to the candidate listed first
(the grid's order, the linear-scaling value last). A label none of whose candidates ended ok has no
pick and no reported jobs (tuning.json and the report say so).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Optional

import pandas as pd

from emulator.files import write_json_atomic

from .budget import STEPS
from .results import RunFrames, accuracy_at, frames_of_jobs, summarize
from .rundir import TUNING_FILE
from .scenario import TUNING_PHASE, Job, NetworkPoint, Scenario, TuningGroup

# rule -> its score columns in order: (column, True where higher is better)
RULE_KEYS = {
    "time_to_target": (("time_to_target_s", False), ("accuracy_at_budget", True), ("loss_at_budget", False)),
    "accuracy_at_budget": (("accuracy_at_budget", True), ("time_to_target_s", False), ("loss_at_budget", False)),
    "loss": (("loss_at_budget", False), ("time_to_target_s", False), ("accuracy_at_budget", True)),
}
TIE_BREAK = {
    "time_to_target": "shortest time to target (one that never reaches it ranks after those that do); "
                      "ties by the higher accuracy at the budget, then the lower held-out loss, then the "
                      "candidate listed first",
    "accuracy_at_budget": "highest accuracy at the equal budget; ties by the shorter time to target, then "
                          "the lower held-out loss, then the candidate listed first",
    "loss": "lowest held-out loss at the equal budget; ties by the shorter time to target, then the "
            "higher accuracy, then the candidate listed first",
}
SCORE_COLUMNS = ("time_to_target_s", "accuracy_at_budget", "loss_at_budget")


def score(value) -> Optional[float]:
    """A score as a float, None where there is none (NaN, None, not a number)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(number) else number


def rank_candidates(candidates: pd.DataFrame, by: str) -> list:
    """The index of `candidates` best first by rule `by` (see the module docstring).

    Args:
        candidates: one row per candidate, in the order they were listed, with `status` and the
            score columns (SCORE_COLUMNS; a missing column counts as no score).
        by: a key of RULE_KEYS.
    """
    keys = RULE_KEYS[by]

    def order(item):
        position, (index, row) = item
        usable = row.get("status") == "ok" and score(row.get(keys[0][0])) is not None
        parts = [0 if usable else 1]
        for column, higher in keys:
            value = score(row.get(column))
            parts += [1, 0.0] if value is None else [0, -value if higher else value]
        return (*parts, position)

    ranked = sorted(enumerate(candidates.iterrows()), key=order)
    return [index for _, (index, _) in ranked]


def pick(candidates: pd.DataFrame, by: str):
    """The index of the picked candidate, or None when none ended ok."""
    ranked = rank_candidates(candidates, by)
    if not ranked:
        return None
    best = candidates.loc[ranked[0]]
    return ranked[0] if best.get("status") == "ok" else None


def loss_at(evals: pd.DataFrame, progress: pd.Series, budget: Optional[float]) -> Optional[float]:
    """Held-out loss of the last evaluation within `budget` (as results.accuracy_at); else None."""
    if "loss" not in evals or not len(evals):
        return None
    return accuracy_at(evals.assign(accuracy=pd.to_numeric(evals["loss"], errors="coerce")), progress, budget)


def candidate_scores(frames: RunFrames, jobs: list[Job]) -> pd.DataFrame:
    """One row per tuning job of `jobs` that the run directory holds (indexed by job id), with its
    status and scores, summarized among these jobs alone: their own equal budget (harness/budget.py's
    default: the furthest every one of them got), and their output_sync_s from the sync candidate
    of the same workload among them."""
    ids = [job.job_id for job in jobs]
    own = frames_of_jobs(frames, ids)
    table = summarize(own)
    budget = own.budget
    rows = []
    for job, summary in zip(own.jobs.to_dict("records"), table.to_dict("records")):
        ev = own.evals[own.evals["job_id"] == job["job_id"]] if len(own.evals) else pd.DataFrame()
        on_steps = budget is None or budget.compared_on == STEPS
        compared = summary["accuracy_at_step_budget"] if on_steps else summary["accuracy_at_time_budget"]
        loss = None
        if len(ev):
            ev = ev.sort_values("step")
            progress = (ev["step"] + 1) if on_steps else ev["train_time_s"]
            loss = loss_at(ev, progress, budget.compared_at() if budget is not None else None)
        rows.append({"job_id": job["job_id"], "status": summary["status"],
                     "time_to_target_s": score(summary["time_to_target_s"]),
                     "accuracy_at_budget": score(compared),
                     "loss_at_budget": score(loss),
                     "final_accuracy": score(summary["final_accuracy"])})
    found = pd.DataFrame(rows, columns=["job_id", "status", *SCORE_COLUMNS, "final_accuracy"]).set_index("job_id")
    return found.reindex([i for i in ids if i in found.index])


@dataclasses.dataclass
class Tuning:
    """The picks made so far in one run, and the file they are written to."""

    scenario: Scenario
    path: Path
    picks: list[dict] = dataclasses.field(default_factory=list)

    def record(self) -> dict:
        """tuning.json: the protocol, and per (network point, label) each candidate's scores and the pick."""
        tuning = self.scenario.spec.tuning
        return {"grid": tuning.grid, "seed": tuning.seed, "by": tuning.by, "tie_break": TIE_BREAK[tuning.by],
                "linear_scaling": tuning.linear_scaling,
                "reported_seeds": [s for s in self.scenario.spec.seeds if s != tuning.seed],
                "picks": self.picks}

    def choose(self, frames: RunFrames, point: NetworkPoint) -> tuple[list[Job], list[dict]]:
        """Pick every label whose candidates ran at `point` (their jobs in `frames`), write
        tuning.json, and give the reported jobs at the picks and the picks' records."""
        reported: list[Job] = []
        made = len(self.picks)
        by = self.scenario.spec.tuning.by
        # scored among every tuning job compared at this point (sync's too: the output_sync_s of a
        # mean-of-replicas output is sync's blocked step, as in the summary)
        compared_here = [job for job in self.scenario.jobs if job.network.key == point.key]
        every = candidate_scores(frames, compared_here)
        for group in [g for g in self.scenario.tuning_groups if g.network == point]:
            jobs = group.tuning_jobs()
            scores = every.reindex([job.job_id for job in jobs if job.job_id in every.index])
            chosen = pick(scores, by)
            values = {job.job_id: job.tuned for job in jobs}
            self.picks.append(_pick_record(group, scores, values, chosen))
            if chosen is not None:
                reported += group.reported_jobs(values[chosen])
        write_json_atomic(self.path, self.record())
        return reported, self.picks[made:]


def _pick_record(group: TuningGroup, scores: pd.DataFrame, values: dict, chosen) -> dict:
    grid_lr = group.maker.spec.tuning.grid.get("lr", [])
    candidates = []
    for job_id, row in scores.iterrows():
        candidate = {"values": values[job_id], "job_id": job_id, "status": row["status"],
                     **{column: score(row[column]) for column in (*SCORE_COLUMNS, "final_accuracy")}}
        lr = values[job_id].get("lr")
        if group.linear_scaled is not None and lr == group.linear_scaled["lr"] and lr not in grid_lr:
            candidate["linear_scaling"] = True  # added for the larger global batch, not in the grid
        candidates.append(candidate)
    record = {"network": group.base_point.key, "label": group.label, "algorithm": group.algorithm,
              "workers_averaged": group.workers, "base_lr": group.base_lr,
              "linear_scaling_value": group.linear_scaled, "candidates": candidates,
              "pick": values[chosen] if chosen is not None else None,
              "pick_job_id": chosen}
    if chosen is None:
        record["why_no_pick"] = "no candidate ended ok"
    return record


def is_tuning(phase) -> bool:
    """Whether a summary row's phase is the tuning phase (False for reported rows and runs without tuning)."""
    return phase == TUNING_PHASE
