"""The evaluator: held-out accuracy of a job's output model at each eval point, off the wire.

    python -m trainers.evaluate JOB_DIR [--follow] [--until-file PATH] [--stop-at-target] [--parent-pid PID]

Reads the job's resolved config (``config.resolved.json``, or ``config.json`` in older runs: model
and held-out set built by the same code as training) and
the snapshots the ranks wrote (trainers/snapshots.py), and appends one record per eval_index, in
order, to ``JOB_DIR/eval.jsonl``:

    {"kind": "eval", "eval_index", "step", "step_min", "time_s", "time_s_min", "train_time_s",
     "train_time_s_min", "accuracy", "loss", "ranks", "role"}

plus ``perplexity`` (exp of ``loss``) for a language model (a dataset of kind ``tokens``): there
``accuracy`` is next-token accuracy and ``loss`` the mean cross-entropy per token (nats).

``step``, ``time_s`` (training clock since the rank started) and ``train_time_s`` (the same clock
since the rank's first step) are the largest over the snapshots combined, the ``_min`` fields the
smallest; the training clock excludes snapshot writing. The output model of an eval_index is the mean of
the ranks' replicas (role ``replica``), the join of the servers' ranges (a ``param_range``), or
the one copy written (``rank0``, ``centre``, ``global``); per rank the latest snapshot at or before
the index is used. It talks to no rank and never deletes a snapshot. As a program it runs at low
priority (nice 19) with one intra-op thread; ``--follow`` evaluates snapshots as they appear until
every rank's records end with a status record (or ``--until-file`` exists), and
``--stop-at-target`` writes the STOP file when ``target_accuracy`` (or ``target_loss``) of the config is reached (a run
without the harness). ``--parent-pid`` (the harness's): it stops, exit code 3, once that process is
no longer its parent (the harness died, and it was handed to another; the job's ranks are gone or
going and their records would never end): a follower killed with the harness's process group
otherwise polled on, since it runs in a session of its own. Each look reads only what the ranks appended to their records since the last
one (:class:`RankRecords`), so a look costs the same late in a long job as early on. As a library:
:func:`evaluate_job` (after the job) or :class:`JobEvaluator`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from trainers.jsonl import RecordTail, rank_files, read_complete_records
from trainers.snapshots import SnapshotLister

EVAL_FILE = "eval.jsonl"


@dataclass
class RankStates:
    """What the ranks' records say: world size, each rank's snapshot role (None: it writes none),
    the ranks whose records end with a status record, the step of each snapshot (rank ->
    eval_index -> step), and rank 0's membership changes (step, live ranks) on the tcp comm."""

    world_size: Optional[int] = None
    roles: dict[int, Optional[str]] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)
    snapshot_steps: dict[int, dict[int, int]] = field(default_factory=dict)
    membership: list[tuple[int, set[int]]] = field(default_factory=list)

    def live_at(self, step: Optional[int]) -> Optional[set[int]]:
        """The live ranks after the last membership change at or before ``step`` (None: all)."""
        live = None
        for changed_at, ranks in self.membership:
            if step is not None and changed_at <= step:
                live = ranks
        return live


class RankRecords:
    """Follows a job's ``rank<N>.jsonl`` files and keeps their :class:`RankStates` up to date.

    Each :meth:`read` parses only what the ranks appended since the last one
    (:class:`trainers.jsonl.RecordTail`: a byte offset per file, a line cut mid-write left for
    the next read), so following a job costs its new records, not all of them at every look. If a
    file was replaced, shrank or went away, every file is read again from the start: the states
    are always those of reading the files whole at that moment.

    Args:
        job_dir: the job's output_dir.
    """

    def __init__(self, job_dir: str | Path):
        self.job_dir = Path(job_dir)
        self.states = RankStates()  # updated in place by read()
        self.lines_parsed = 0  # lines decoded so far, over every file and every read
        self._tails: dict[int, RecordTail] = {}

    def read(self) -> RankStates:
        """The states after the records appended since the last call (see the class docstring)."""
        paths = rank_files(self.job_dir)
        if set(self._tails) - set(paths):
            self._start_over()
        for rank in sorted(paths):
            tail = self._tails.setdefault(rank, RecordTail(paths[rank]))
            parsed_before = tail.lines_parsed
            rows = tail.read_new()
            self.lines_parsed += tail.lines_parsed - parsed_before
            if tail.restarted:  # this file is not the one read so far: what it said must go too
                self._start_over()
                return self.read()  # once: after a start over no file has an offset to lose
            self._apply(rank, rows)
        return self.states

    def _apply(self, rank: int, rows: list[dict]) -> None:
        states = self.states
        for row in rows:
            kind = row.get("kind")
            if kind == "start":
                states.world_size = row["world_size"]
            elif kind == "output":
                states.roles[rank] = row["role"]
            elif kind == "snapshot":
                states.snapshot_steps.setdefault(rank, {})[row["eval_index"]] = row["step"]
            elif kind == "membership" and rank == 0:
                states.membership.append((row["step"], set(row["live"])))
        if rows:  # ended: the last record is a status record (a restarted rank's start follows one)
            if rows[-1].get("kind") == "status":
                states.ended.add(rank)
            else:
                states.ended.discard(rank)

    def _start_over(self) -> None:
        self.states = RankStates()
        self._tails = {}


class JobEvaluator:
    """Evaluates the eval points of one job directory, each once, in eval_index order.

    Args:
        job_dir: the job's output_dir (config.resolved.json, rank<N>.jsonl, snapshots/).
        device: where to evaluate (default cpu).
    """

    def __init__(self, job_dir: str | Path, device: str = "cpu"):
        from trainers.datasets import load_dataset
        from trainers.loading import load_config
        from trainers.models import build_model
        from trainers.records import RESOLVED_CONFIG_FILE, resolved_config_path

        self.job_dir = Path(job_dir)
        config_path = resolved_config_path(self.job_dir)
        if config_path is None:
            raise FileNotFoundError(f"{self.job_dir / RESOLVED_CONFIG_FILE}: no {RESOLVED_CONFIG_FILE} or config.json "
                                    "(rank 0 writes the first when the job starts)")
        self.config = load_config(json.loads(config_path.read_text()))
        self.device = torch.device(device)
        self.data = load_dataset(self.config.dataset, self.config.seed)
        self.test_inputs = self.data.inputs(self.data.test_x)  # once: every eval point uses them
        self.model = build_model(self.config.model.name, self.config.model.params, self.data.input_shape,
                                 self.data.num_classes, self.config.seed).to(self.device)
        self.trainable = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.done_through = -1  # the largest eval_index evaluated so far
        self.records = RankRecords(self.job_dir)
        self.states = self.records.states  # as of the last refresh()
        self._snapshot_lister = SnapshotLister(self.job_dir)

    # -- what the ranks say about themselves ----------------------------------------------------

    def refresh(self) -> RankStates:
        """Read what the ranks appended to their records since the last refresh (only that: see
        :class:`RankRecords`); returns the updated :attr:`states` (the evaluator's own object,
        changed in place by later refreshes: copy it to keep a moment's states)."""
        self.states = self.records.read()
        return self.states

    def rank_states(self) -> RankStates:
        """What the ranks' records say so far (see :class:`RankStates`): :meth:`refresh`."""
        return self.refresh()

    def finished(self, refresh: bool = True) -> bool:
        """True once every rank's records end with a status record.

        Args:
            refresh: read the records' news first; False: decide on :attr:`states` as they are
                (one read per look when the caller has just refreshed, as :func:`run_evaluator` does).
        """
        states = self.refresh() if refresh else self.states
        return states.world_size is not None and states.ended >= set(range(states.world_size))

    def snapshots(self) -> dict[int, dict[int, Path]]:
        """Every complete snapshot now, {rank: {eval_index: path}} (listed anew each call)."""
        return self._snapshot_lister.list()

    # -- evaluation -----------------------------------------------------------------------------

    def poll(self, job_over: bool = False, refresh: bool = True) -> list[dict]:
        """Evaluate every eval_index that is complete and not evaluated yet; returns the rows.

        An index is complete when every rank taking part has a snapshot at or after it, or has
        ended (``job_over``: treat every rank as ended, e.g. after the job). The ranks taking part
        are those that write snapshots, less those rank 0's ``membership`` records (tcp comm) say
        were not live at the index's step (a crashed rank's last replica is not averaged in).

        The snapshots are listed after the records are read: a rank writes every snapshot before
        the status record that ends it, so a rank seen ended has all of its snapshots listed.

        Args:
            job_over: every rank has ended (after the job, or the harness says so).
            refresh: read the records' news first (False: use :attr:`states` as they are).
        """
        states = self.refresh() if refresh else self.states
        snapshots = self.snapshots()
        if job_over or states.world_size is None or len(states.roles) < states.world_size:
            # Without every rank's output record, those that wrote snapshots are the contributors.
            contributors = sorted(snapshots) if job_over or states.world_size is None else []
        else:
            contributors = sorted(r for r, role in states.roles.items() if role is not None)
        ended = set(contributors) if job_over else states.ended
        indices = sorted({i for r in contributors for i in snapshots.get(r, {})})
        rows = []
        for index in indices:
            if index <= self.done_through:
                continue
            steps = [states.snapshot_steps.get(r, {}).get(index) for r in contributors]
            live = states.live_at(max((s for s in steps if s is not None), default=None))
            taking_part = [r for r in contributors if live is None or r in live]
            chosen = {}
            for rank in taking_part:
                have = snapshots.get(rank, {})
                if rank not in ended and not any(i >= index for i in have):
                    return rows  # this rank may still write a snapshot at or before this index
                earlier = [i for i in have if i <= index]
                if earlier:
                    chosen[rank] = have[max(earlier)]
            self.done_through = index
            if chosen and len(chosen) == len(taking_part):  # else some rank has no snapshot yet
                rows.append(self.evaluate_index(index, chosen))
        return rows

    def evaluate_index(self, index: int, paths: dict[int, Path]) -> dict:
        """Build the output model from the snapshots ``paths`` (rank -> file) and evaluate it."""
        from trainers.snapshots import load_snapshot
        from trainers.training import evaluate

        snaps = {rank: load_snapshot(path) for rank, path in sorted(paths.items())}
        roles = {s["role"] for s in snaps.values()}
        if len(roles) != 1:
            raise ValueError(f"{self.job_dir}: eval_index {index}: snapshots disagree on the role: {sorted(roles)}")
        role = roles.pop()
        self.model.load_state_dict(self.combine(role, snaps))
        accuracy, loss = evaluate(self.model, self.test_inputs, self.data.test_y, self.device)
        steps = [s["step"] for s in snaps.values()]
        times = [s["time_s"] for s in snaps.values()]
        train_times = [s["train_time_s"] for s in snaps.values()]
        row = {"kind": "eval", "eval_index": index, "step": max(steps), "step_min": min(steps),
               "time_s": max(times), "time_s_min": min(times), "train_time_s": max(train_times),
               "train_time_s_min": min(train_times), "accuracy": accuracy, "loss": loss,
               "ranks": sorted(snaps), "role": role}
        if self.data.kind == "tokens":
            row["perplexity"] = perplexity(loss)
        return row

    def combine(self, role: str, snaps: dict[int, dict]) -> dict[str, torch.Tensor]:
        try:
            return combine_snapshots(role, snaps, self.trainable)
        except ValueError as error:
            raise ValueError(f"{self.job_dir}: {error}") from None


def perplexity(loss: float) -> float:
    """exp(loss) of a mean cross-entropy in nats; inf past what a float holds (a diverged model)."""
    return math.exp(loss) if loss < 700 else math.inf


def target_reached(row: dict, target_accuracy: Optional[float], target_loss: Optional[float]) -> bool:
    """Whether eval record ``row`` meets the target: accuracy at or above ``target_accuracy``, or
    loss at or below ``target_loss`` (whichever is given; False when neither is)."""
    if target_accuracy is not None and row.get("accuracy") is not None and row["accuracy"] >= target_accuracy:
        return True
    loss = row.get("loss")
    return target_loss is not None and loss is not None and not math.isnan(loss) and loss <= target_loss


def combine_snapshots(role: str, snaps: dict[int, dict], trainable: list[str]) -> dict[str, torch.Tensor]:
    """The output model's state from the snapshots of one eval point (rank -> loaded snapshot).

    Args:
        role: the snapshots' role (replica: mean of the replicas; else one copy or ranges of it).
        snaps: rank -> snapshot as saved by ``write_snapshot``.
        trainable: names of the trainable parameters in the model's order (the flattening that
            ``param_range`` refers to).
    """
    first = snaps[min(snaps)]["state"]
    ranged = [s for s in snaps.values() if s["param_range"] is not None]
    if ranged:
        return _join_ranges(first, ranged, trainable)
    if role == "replica":
        return _mean_state([s["state"] for s in snaps.values()])
    if len(snaps) != 1:
        raise ValueError(f"role {role!r} has one copy, found snapshots of ranks {sorted(snaps)}")
    return first


def _join_ranges(base: dict, snaps: list[dict], trainable: list[str]) -> dict[str, torch.Tensor]:
    """``base`` with its trainable parameters made of each snapshot's ``param_range`` of them."""
    shapes = [base[name].shape for name in trainable]
    numel = sum(s.numel() for s in shapes)
    flat = torch.empty(numel, dtype=base[trainable[0]].dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for snap in snaps:
        start, stop = snap["param_range"]
        values = torch.cat([snap["state"][name].reshape(-1) for name in trainable])
        flat[start:stop] = values[start:stop]
        covered[start:stop] = True
    if not bool(covered.all()):
        raise ValueError(f"the servers' snapshots cover {int(covered.sum())} of {numel} parameters")
    state, offset = dict(base), 0
    for name, shape in zip(trainable, shapes):
        count = shape.numel()
        state[name] = flat[offset:offset + count].view(shape)
        offset += count
    return state


def _mean_state(states: list[dict]) -> dict[str, torch.Tensor]:
    """Mean over replicas of every floating-point tensor; others (counters) from the first."""
    out = {}
    for name, tensor in states[0].items():
        if tensor.is_floating_point():
            out[name] = torch.stack([s[name].to(torch.float64) for s in states]).mean(dim=0).to(tensor.dtype)
        else:
            out[name] = tensor
    return out


def evaluate_job(job_dir: str | Path, device: str = "cpu") -> list[dict]:
    """Every eval point of a finished job, in eval_index order (writes nothing)."""
    return JobEvaluator(job_dir, device).poll(job_over=True)


class ParentGone(RuntimeError):
    """The process that started the evaluator (``--parent-pid``) has ended."""


def check_parent(parent_pid: Optional[int]) -> None:
    """ParentGone once ``parent_pid`` is no longer this process's parent (it ended: the orphan
    was re-parented). The parent relation, not the PID's existence: a reused PID cannot fool it."""
    if parent_pid is not None and os.getppid() != parent_pid:
        raise ParentGone(f"the process that started it (pid {parent_pid}) is gone: stopped, the job is incomplete")


def run_evaluator(job_dir: str | Path, follow: bool = False, until_file: Optional[str | Path] = None,
                  stop_at_target: bool = False, poll_s: float = 0.5, device: str = "cpu",
                  parent_pid: Optional[int] = None) -> list[dict]:
    """Evaluate a job's eval points and append them to ``JOB_DIR/eval.jsonl`` (resuming after the
    eval_index already there); with ``follow``, as they appear until the ranks are done or
    ``until_file`` exists. Returns the rows written by this call. ``parent_pid``: ParentGone
    (before each look) once that process is no longer the parent."""
    from trainers.stop import stop_step_from_records, write_stop

    check_parent(parent_pid)
    evaluator = JobEvaluator(job_dir, device)
    out_path = Path(job_dir) / EVAL_FILE
    previous = read_complete_records(out_path, kinds=("eval",))  # a cut last line left out
    evaluator.done_through = max((r["eval_index"] for r in previous), default=-1)
    target_accuracy, target_loss = evaluator.config.target_accuracy, evaluator.config.target_loss
    written: list[dict] = []
    stop_written = False
    with open(out_path, "a", buffering=1) as handle:
        while True:
            # The records are read once per look, after the until-file check (so they hold what
            # the ranks wrote before it appeared) and before the snapshots are listed (poll).
            check_parent(parent_pid)
            told_over = until_file is not None and Path(until_file).exists()
            evaluator.refresh()
            over = not follow or told_over or evaluator.finished(refresh=False)
            rows = evaluator.poll(job_over=over, refresh=False)
            for row in rows:
                handle.write(json.dumps(row) + "\n")
                handle.flush()
                written.append(row)
                if stop_at_target and not stop_written and target_reached(row, target_accuracy, target_loss):
                    reason = "target_accuracy" if target_accuracy is not None else "target_loss"
                    write_stop(job_dir, stop_step_from_records(job_dir), reason)
                    stop_written = True
            if over:
                return written
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainers.evaluate",
        description="Evaluate a job's snapshots (its output model at each eval point) on the held-out set; "
        "append the records to JOB_DIR/eval.jsonl. Runs at low priority with one thread; talks to no rank.",
    )
    parser.add_argument("job_dir", help="the job's output_dir (config.resolved.json, rank<N>.jsonl, snapshots/)")
    parser.add_argument("--follow", action="store_true", help="keep evaluating as snapshots appear until the ranks are done")
    parser.add_argument("--until-file", help="with --follow: also stop once this file exists")
    parser.add_argument("--stop-at-target", action="store_true",
                        help="write JOB_DIR/STOP once the config's target_accuracy (or target_loss) is reached "
                        "(runs without the harness)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="seconds between looks for new snapshots")
    parser.add_argument("--parent-pid", type=int, help="stop (exit 3) once this process is no longer our parent "
                        "(the harness passes its own: its evaluator ends with it)")
    args = parser.parse_args(argv)
    os.nice(19)
    torch.set_num_threads(1)
    try:
        rows = run_evaluator(args.job_dir, args.follow, args.until_file, args.stop_at_target, args.poll_s,
                             parent_pid=args.parent_pid)
    except (FileNotFoundError, ValueError) as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 2
    except ParentGone as error:
        print(f"evaluate: {error}", file=sys.stderr)
        return 3
    print(f"evaluate: {len(rows)} eval records appended to {Path(args.job_dir) / EVAL_FILE}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
