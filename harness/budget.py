"""One definition of "equal budget": where the accuracies of a run's jobs are compared.

`EqualBudget.from_stop(stop)` is made from the scenario's stop rule (a `StopRule`, or scenario.json's
`stop` as a dict) and is what all three users read:

- the stop rule (harness/jobs.py StopDecider, through the JobSpec's StopBudgets): a job stops at
  the target accuracy only once it has passed every *stated* budget (`waits_for`);
- the summary (harness/results.py): `accuracy_at_step_budget`, `accuracy_at_time_budget` and
  `accuracy_delta_vs_sync` are read at the budget `resolved` over the run's jobs, and a job that
  did not get there has an empty delta and a reason (`missed`);
- the report (harness/report.py budget_sentence): `sentence()`.

The default, where the scenario states no `budget_steps` / `budget_time_s`: the furthest point
every job that ended ok got to (the smallest, over those jobs, of the steps done at their last
evaluation, and likewise of training time). It costs no extra training: a job stopping at the
target still stops there, and every such job has an evaluation at the default by construction,
so the comparison is like with like. A scenario that wants a later point states it; the stop
rule then runs every job at least that far.

`accuracy_delta_vs_sync` is taken on one axis for the whole run (`compared_on`): steps when
budget_steps is stated or neither is, training time when only budget_time_s is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

STEPS = "steps"
TIME = "time"


@dataclass(frozen=True)
class EqualBudget:
    """Where accuracy is compared: `steps` done and `time_s` seconds of training (a rank's clock).

    Args:
        steps: the step budget (stated, or the default once resolved); None: not known yet.
        time_s: the training-time budget, likewise.
        steps_stated: `steps` came from the scenario's budget_steps (the stop rule waits for it).
        time_stated: `time_s` came from budget_time_s.
    """

    steps: Optional[int] = None
    time_s: Optional[float] = None
    steps_stated: bool = False
    time_stated: bool = False

    @classmethod
    def from_stop(cls, stop) -> "EqualBudget":
        """From a stop rule: a StopRule, a StopBudgets, or a dict (scenario.json's `stop`)."""
        get = stop.get if isinstance(stop, dict) else (lambda name: getattr(stop, name, None))
        steps, time_s = get("budget_steps"), get("budget_time_s")
        return cls(steps, time_s, steps is not None, time_s is not None)

    @property
    def stated(self) -> bool:
        return self.steps_stated or self.time_stated

    @property
    def compared_on(self) -> str:
        """The axis of accuracy_delta_vs_sync: STEPS, or TIME where only a time budget is stated."""
        return TIME if self.time_stated and not self.steps_stated else STEPS

    def waits_for(self, steps_done: int, train_time_s: float) -> bool:
        """The stop rule: True once a job at this point has passed every stated budget (a job
        reaching the target stops only then; the default needs no waiting)."""
        return ((not self.steps_stated or steps_done >= self.steps)
                and (not self.time_stated or train_time_s >= self.time_s))

    def resolved(self, reached: Iterable[tuple[int, float]]) -> "EqualBudget":
        """The budget with its unstated axes set to the default: the furthest every job got.

        `reached`: per job that ended ok, (steps done, training time) at its last evaluation."""
        reached = list(reached)
        steps = self.steps if self.steps_stated else (min(s for s, _ in reached) if reached else None)
        time_s = self.time_s if self.time_stated else (min(t for _, t in reached) if reached else None)
        return dataclasses.replace(self, steps=steps, time_s=time_s)

    def compared_at(self) -> Optional[float]:
        """The budget on the axis accuracy_delta_vs_sync is taken on."""
        return self.steps if self.compared_on == STEPS else self.time_s

    def missed(self, steps_done: Optional[int], train_time_s: Optional[float], status: Optional[str],
               stop_reason: Optional[str] = None) -> str:
        """Why a job has no accuracy at the compared budget ("" if it got there): it failed, or
        ended at its limits first. Arguments: its last evaluation's steps done and training time,
        its status and rank 0's stop reason."""
        if self.compared_at() is None:
            return "no job of the run ended ok with an evaluation: no budget to compare at"
        if steps_done is None or train_time_s is None:
            return f"no evaluation (job {status or 'unfinished'})"
        if self.compared_on == STEPS and steps_done >= self.steps:
            return ""
        if self.compared_on == TIME and train_time_s >= self.time_s:
            return ""
        where = f"last evaluation after {steps_done} steps ({train_time_s:.3g} s of training)"
        if status not in (None, "ok"):
            why = f"job {status}"
        elif stop_reason == "time_budget":
            why = "ended at its time limit (time_budget_s)"
        elif stop_reason:
            why = f"ended ({stop_reason})"
        else:
            why = "ended" if status == "ok" else "job unfinished"
        return f"{why} before the budget of {self.describe_compared()}: {where}"

    def describe_compared(self) -> str:
        return f"{self.steps} steps" if self.compared_on == STEPS else f"{self.time_s:g} s of training"

    def sentence(self) -> str:
        """The report's words for where this run compared accuracy (a resolved budget): the same
        numbers the summary read, and what the stop rule waited for."""
        if self.compared_at() is None:
            return "no budget stated and no job ended ok with an evaluation: accuracy not compared"
        stated = [f"{self.steps} steps"] if self.steps_stated else []
        stated += [f"{self.time_s:g} s of training"] if self.time_stated else []
        default = [f"{self.steps} steps"] if not self.steps_stated and self.steps is not None else []
        default += [f"{self.time_s:.3g} s of training"] if not self.time_stated and self.time_s is not None else []
        if stated:
            wait = "both" if len(stated) == 2 else "it"
            parts = [" and ".join(stated) + f" (stated; a job stops at the target only after {wait})"]
        else:
            parts = []
        if default:
            parts.append(" and ".join(default) + ", the furthest every job that ended ok got"
                         + ("" if stated else " (no budget stated)"))
        return (f"accuracy compared at equal budgets of {' and '.join(parts)}; "
                f"accuracy_delta_vs_sync at {self.describe_compared()}")
