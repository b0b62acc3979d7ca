"""`wanbench evidence RUN_DIR --figure NAME`: the committed evidence of a headline (issue 21 §11).

A run directory is large (every rank's step records); a headline of docs/RESULTS.md needs only
what its numbers are computed from. `write_evidence` copies into
`results/papers/<figure>/<run-id>/`:

- the run's `summary.csv`, `scenario.json` and `environment.json` as they are;
- `across_seeds.csv`: the summary aggregated over seeds (`results.across_seeds`);
- per job, `jobs/<job-id>/job.json` as it is, `eval.jsonl` thinned (`thin_evals`: the rule is
  below), `first_syncs.jsonl`: per rank, the first step record that applied a synchronisation
  (`syncs_applied` > 0), the record `first_sync_step` comes from, and for an algorithm with a
  data-parallel warm-up (`warmup_steps` in the job's params: DiLoCo, local SGD) also the first
  after it (its own mechanism's first sync, which `first_sync_step`, at the warm-up's step 0,
  does not show), and `steps.jsonl`: rank 0's step records at the kept evaluations' steps and
  at its last step (bytes sent so far, blocked time, lr at those points);
- `MANIFEST.json` and `README.md`: the command, the date, the machine and its load, the git commit,
  the thinning rule and what each file holds.

The thinning rule (`thin_evals`), on the job's evaluations in step order: keep the first and the
last, every `every`-th, the first with the best accuracy, the first at or over the target accuracy
and the one before it (time_to_target interpolates between those two), the same pair for a loss
target, and the last within the step budget and the last within the time budget (the equal-budget
accuracy). Every number the summary derives from evaluations (final and best accuracy, time to
target before output_sync_s, accuracy at either budget, the last evaluation's step and time) is
then the same from the thinned file (tests/harness/test_papers.py recomputes them).

Not committed: the rank records beyond those (steps/s, bytes, blocked time, output_sync_s and
syncs_before_target are read from summary.csv, the run's own), config.json, snapshots, logs.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pandas as pd

from emulator.files import write_text_atomic
from emulator.schema import ConfigError

from .environment import environment
from .paths import RESULTS
from .results import across_seeds
from .rundir import EVAL_FILE, RunDir

PAPERS_ROOT = RESULTS / "papers"   # committed evidence of docs/RESULTS.md's headlines
EVERY_KTH = 10                     # thinning: every 10th evaluation (plus the ones the numbers need)
FIRST_SYNCS_FILE = "first_syncs.jsonl"
STEPS_FILE = "steps.jsonl"
RUN_FILES = ("summary.csv", "scenario.json", "environment.json")
# copied where the run has it: a tuned run's protocol, candidates, scores and picks (harness/tuning.py)
OPTIONAL_RUN_FILES = ("tuning.json",)
THINNING_RULE = ("evaluations in step order: the first, the last, every {every}th, the first with the best "
                 "accuracy, the first at or over the target accuracy and the one before it, the same pair "
                 "for a loss target, the last within the step budget and the last within the time budget")


def thin_evals(records: list[dict], every: int = EVERY_KTH, target_accuracy: Optional[float] = None,
               target_loss: Optional[float] = None, budget_steps: Optional[int] = None,
               budget_time_s: Optional[float] = None) -> list[dict]:
    """The evaluations kept by the thinning rule (module docstring), in step order.

    Args:
        records: one job's eval records (eval.jsonl: `step` the last step's index, `accuracy`,
            `train_time_s`, `loss` where measured).
        every: keep every `every`-th evaluation (>= 1).
        target_accuracy, target_loss: the run's targets (stop.target_accuracy / target_loss).
        budget_steps, budget_time_s: the run's equal budgets (steps done; seconds of training).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    ordered = sorted(records, key=lambda r: r.get("step", -1))
    if not ordered:
        return []
    keep = {0, len(ordered) - 1, *range(0, len(ordered), every)}
    accuracies = [r.get("accuracy") for r in ordered]
    known = [(a, i) for i, a in enumerate(accuracies) if a is not None]
    if known:
        best = max(a for a, _ in known)
        keep.add(next(i for a, i in known if a == best))

    def crossing(reached) -> None:
        first = next((i for i, r in enumerate(ordered) if reached(r)), None)
        if first is not None:
            keep.update({first, max(first - 1, 0)})

    if target_accuracy is not None:
        crossing(lambda r: r.get("accuracy") is not None and r["accuracy"] >= target_accuracy)
    if target_loss is not None:
        crossing(lambda r: r.get("loss") is not None and r["loss"] <= target_loss)

    def last_within(progress, budget) -> None:
        within = [i for i, r in enumerate(ordered) if progress(r) is not None and progress(r) <= budget]
        if within:
            keep.add(within[-1])

    if budget_steps is not None:
        last_within(lambda r: None if r.get("step") is None else r["step"] + 1, budget_steps)
    if budget_time_s is not None:
        last_within(lambda r: r.get("train_time_s"), budget_time_s)
    return [ordered[i] for i in sorted(keep)]


def first_syncs(rank_records: list[tuple[Path, list[dict]]], after_step: int = 0) -> list[dict]:
    """Per rank file, its first step record with `syncs_applied` > 0 (none for a rank that
    applied none, or records that do not count them); with `after_step` > 0 also its first at or
    after that step (a warm-up's end), where that is another record."""
    out = []
    for _, records in rank_records:
        syncs = [r for r in records if r.get("kind") == "step" and (r.get("syncs_applied") or 0) > 0]
        if syncs:
            out.append(syncs[0])
        later = next((r for r in syncs if r.get("step", -1) >= after_step), None) if after_step > 0 else None
        if later is not None and later is not syncs[0]:
            out.append(later)
    return out


def rank0_steps_at(rank_records: list[tuple[Path, list[dict]]], steps: set) -> list[dict]:
    """Rank 0's step records at `steps` and its last step record, in step order."""
    for path, records in rank_records:
        if path.name == "rank0.jsonl":
            step_records = [r for r in records if r.get("kind") == "step"]
            last = step_records[-1:]
            return [r for r in step_records if r.get("step") in steps or r is (last[0] if last else None)]
    return []


def _in_band_evals(rank_records: list[tuple[Path, list[dict]]]) -> list[dict]:
    """A run made before the evaluator: rank 0's own eval records (load_run reads the same)."""
    for _, records in rank_records:
        if records and records[0].get("rank") == 0:
            return [r for r in records if r.get("kind") == "eval"]
    return []


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


@dataclass
class Evidence:
    folder: Path         # results/papers/<figure>/<run-id>
    jobs: int
    bytes: int           # everything written


def _check_folder_name(value: str, option: str) -> None:
    """ConfigError naming `option` unless `value` is one plain folder name."""
    if not value or not all(c.isalnum() or c in "-_." for c in value) or value.startswith("."):
        raise ConfigError("", f"a folder name (letters, digits, '-', '_', '.'), got {value!r}", source=option)


def write_evidence(run_dir, figure: str, papers_root: Path = PAPERS_ROOT, every: int = EVERY_KTH,
                   command: Optional[str] = None, note: str = "", name: Optional[str] = None) -> Evidence:
    """Copy a complete run's evidence into `papers_root/<figure>/<run-id>/` (module docstring).
    Evidence made again from the same run replaces its folder; a folder holding another run's
    evidence (two runs started in the same second share a run id) is refused: give `name`.

    Args:
        run_dir: results/runs/<scenario>/<run-id> (complete, with its summary.csv).
        figure: the headline's name (a folder name: letters, digits, '-', '_', '.').
        papers_root: where the figures' folders are (default results/papers).
        every: the thinning's every-k-th evaluation.
        command: the command line that made the run, for the manifest (default: unknown).
        note: a sentence for the README (what was reduced, the machine's load during the run).
        name: the folder's name under the figure (default the run id).
    """
    run = RunDir(run_dir)
    run.scenario  # noqa: B018 - ConfigError for a folder that is not a run directory
    _check_folder_name(figure, "--figure")
    if not run.complete:
        raise ConfigError("", "the run is not complete (no COMPLETE file): no evidence from a partial run",
                          source=str(run_dir))
    missing = [name for name in RUN_FILES if not (run.path / name).is_file()]
    if missing:
        raise ConfigError("", f"missing {', '.join(missing)}", source=str(run_dir))
    if name is not None:
        _check_folder_name(name, "--name")
    out = Path(papers_root) / figure / (name or run.path.name)
    if out.exists():
        held = RunDir(out).scenario.get("name") if (out / "scenario.json").is_file() else None
        if held != run.scenario.get("name"):
            raise ConfigError("", f"{out} holds the evidence of another run ({held!r}, not "
                                  f"{run.scenario.get('name')!r}): give the folder another name (--name)",
                              source=str(run_dir))
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in RUN_FILES:
        shutil.copyfile(run.path / name, out / name)
    for name in OPTIONAL_RUN_FILES:
        if (run.path / name).is_file():
            shutil.copyfile(run.path / name, out / name)
    summary = pd.read_csv(run.path / "summary.csv")
    across_seeds(summary).to_csv(out / "across_seeds.csv", index=False)
    stop = run.stop
    budget_steps, budget_time_s = stop.get("budget_steps"), stop.get("budget_time_s")
    kept_total, evals_total = 0, 0
    for job in run.jobs:
        job_out = out / "jobs" / job.job_id
        job_out.mkdir(parents=True)
        shutil.copyfile(job.path / "job.json", job_out / "job.json")
        evals = job.evals or _in_band_evals(job.rank_records)
        kept = thin_evals(evals, every, stop.get("target_accuracy"), stop.get("target_loss"),
                          budget_steps, budget_time_s)
        kept_total, evals_total = kept_total + len(kept), evals_total + len(evals)
        (job_out / EVAL_FILE).write_text(_jsonl(kept))
        warmup = (job.info.get("params") or {}).get("warmup_steps") or 0
        syncs = first_syncs(job.rank_records, after_step=int(warmup))
        if syncs:
            (job_out / FIRST_SYNCS_FILE).write_text(_jsonl(syncs))
        steps = rank0_steps_at(job.rank_records, {r.get("step") for r in kept})
        if steps:
            (job_out / STEPS_FILE).write_text(_jsonl(steps))
    env = run.environment
    made = environment()
    manifest = {
        "figure": figure,
        "run": f"{run.path.parent.name}/{run.path.name}",
        "run_command": command or "unknown",
        "run_date": env.get("date"),
        "run_machine": {key: env.get(key) for key in ("host", "cpu", "cpu_id", "torch_cpu_capability", "cpu_count",
                                                       "memory_gib", "kernel", "python", "torch", "gpu")},
        "run_load_avg_1m_at_start": env.get("load_avg_1m"),
        "run_git_commit": env.get("git_commit"), "run_git_dirty": env.get("git_dirty"),
        "backend": env.get("backend"),
        "jobs": len(run.jobs), "evaluations": evals_total, "evaluations_kept": kept_total,
        "thinning": {"every": every, "rule": THINNING_RULE.format(every=every)},
        "evidence_made": {key: made.get(key) for key in ("date", "load_avg_1m", "git_commit", "git_dirty")},
        "evidence_command": " ".join(shlex.quote(a) for a in ["wanbench", "evidence", str(run_dir), "--figure", figure,
                                                              "--every", str(every)]),
        "note": note,
    }
    write_text_atomic(out / "MANIFEST.json", json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(_readme(manifest))
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return Evidence(out, len(run.jobs), size)


def _readme(manifest: dict) -> str:
    machine = manifest["run_machine"]
    return "\n".join([
        f"# Evidence: {manifest['figure']}, run `{manifest['run']}`",
        "",
        f"- run: `{manifest['run_command']}` on {manifest['run_date']} ({manifest['backend']} backend), "
        f"commit {str(manifest['run_git_commit'])[:12]}{' (dirty)' if manifest['run_git_dirty'] else ''}",
        f"- machine: {machine.get('cpu')} ({machine.get('cpu_count')} cores, {machine.get('memory_gib')} GiB), "
        f"kernel {machine.get('kernel')}, Python {machine.get('python')}, torch {machine.get('torch')}; "
        f"load average {manifest['run_load_avg_1m_at_start']} at the run's start",
        f"- {manifest['jobs']} jobs; {manifest['evaluations_kept']} of {manifest['evaluations']} evaluations kept "
        f"({manifest['thinning']['rule']})",
        f"- made by `{manifest['evidence_command']}` on {manifest['evidence_made']['date']}",
        *([f"- {manifest['note']}"] if manifest["note"] else []),
        "",
        "Files: `summary.csv`, `scenario.json`, `environment.json` and, for a tuned run, `tuning.json` "
        "(the run's own), `across_seeds.csv` "
        "(harness/results.py `across_seeds` of summary.csv), `jobs/<job-id>/job.json` (the job's own), "
        "`jobs/<job-id>/eval.jsonl` (thinned), `jobs/<job-id>/first_syncs.jsonl` (per rank, the first step "
        "record that applied a synchronisation, and the first after a data-parallel warm-up where the "
        "algorithm has one), `jobs/<job-id>/steps.jsonl` (rank 0's step records at the kept evaluations' "
        "steps and its last). docs/RESULTS.md's numbers are recomputed from these by "
        "tests/harness/test_papers.py (results/papers/table.yaml says which number comes from where).",
        "",
    ])


def evidence_size(papers_root: Path = PAPERS_ROOT) -> int:
    """Bytes of every committed evidence file (tests/harness/test_papers.py caps the total)."""
    return sum(p.stat().st_size for p in Path(papers_root).rglob("*") if p.is_file())

