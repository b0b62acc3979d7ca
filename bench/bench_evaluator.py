"""Cost of one look of the off-wire evaluator (``--follow``) as a job's records grow.

One look is what ``run_evaluator`` does every ``--poll-s`` (0.5 s) while it follows a job: decide
whether the ranks have ended (``finished()``), then find the eval points that are complete
(``poll()``). Two ways, measured side by side on the same files in one run:

  * reread (the code before this change): ``finished()`` and ``poll()`` each read and decode every
    ``rank<N>.jsonl`` whole (``trainers.records.read_records``) and ``poll()`` lists every snapshot
    with ``list_snapshots``: a look costs the whole job so far, so a run costs its length squared;
  * incremental (``JobEvaluator``): the records are read once per look and only the lines appended
    since the last look are decoded; the snapshot folders are listed and only new names parsed.

The job is synthetic but written by the trainers' own code: a resolved config (local SGD, MLP on
digits) saved as rank 0 saves it, ``RecordWriter`` records with the runner's fields for
``--world-size`` ranks, and a real ``write_snapshot`` of the model every ``--eval-every`` steps.
The files grow to each of ``--sizes`` step records per rank; at each size ``--looks`` looks of each
way alternate, and between two looks every rank appends ``--steps-per-look`` more steps (the
ranks do not stop while the evaluator looks; appending is not timed). The evaluation of newly
complete eval points is left out (``done_through`` is set past every index): it costs the same
both ways, and what is timed is the bookkeeping of a look. One intra-op thread, as the evaluator
runs; its nice 19 and the ranks competing for the CPU are not reproduced here. Nothing is kept.

    .venv/bin/python bench/bench_evaluator.py
    .venv/bin/python bench/bench_evaluator.py --sizes 500 2000 8000 --looks 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.environment import environment  # noqa: E402
from trainers.config import to_dict  # noqa: E402
from trainers.evaluate import JobEvaluator, RankStates  # noqa: E402
from trainers.loading import load_config  # noqa: E402
from trainers.records import RESOLVED_CONFIG_FILE, RecordWriter, read_records, write_json_atomic  # noqa: E402
from trainers.snapshots import OutputState, list_snapshots, write_snapshot  # noqa: E402

CONFIG = {"seed": 3, "batch_size": 16, "lr": 0.1, "steps": 1_000_000, "model": {"name": "mlp", "params": {"hidden_sizes": [64]}},
          "dataset": {"name": "digits"}, "algorithm": {"name": "local_sgd", "params": {"H": 4}}}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 8000], help="step records per rank")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=10, help="steps between snapshots")
    parser.add_argument("--looks", type=int, default=30, help="timed looks per way and size")
    parser.add_argument("--steps-per-look", type=int, default=5, help="steps each rank appends between two looks")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the job folder is made")
    args = parser.parse_args(argv)
    if sorted(args.sizes) != args.sizes or args.sizes[0] < 1:
        parser.error("--sizes: increasing positive step counts")
    return args


class RereadEvaluator(JobEvaluator):
    """The look of the code before this change: every refresh decodes every rank file whole (as
    its ``rank_states()`` did, through ``read_records``) and the snapshots are listed with
    ``list_snapshots``; ``finished()`` and ``poll()`` each refresh, as they did."""

    def refresh(self) -> RankStates:
        states = RankStates()
        for path in self.job_dir.glob("rank*.jsonl"):
            name = path.name[4:-6]
            if not name.isdigit():
                continue
            rank = int(name)
            rows = read_records(path)  # the bench's files have no cut line: the old fallback never ran
            for row in rows:
                if row["kind"] == "start":
                    states.world_size = row["world_size"]
                elif row["kind"] == "output":
                    states.roles[rank] = row["role"]
                elif row["kind"] == "snapshot":
                    states.snapshot_steps.setdefault(rank, {})[row["eval_index"]] = row["step"]
                elif row["kind"] == "membership" and rank == 0:
                    states.membership.append((row["step"], set(row["live"])))
            if rows and rows[-1]["kind"] == "status":
                states.ended.add(rank)
        self.states = states
        return states

    def snapshots(self):
        return list_snapshots(self.job_dir)


def look_reread(evaluator: RereadEvaluator) -> None:
    """One look of the old ``run_evaluator`` loop."""
    over = evaluator.finished()
    evaluator.poll(job_over=over)


def look_incremental(evaluator: JobEvaluator) -> None:
    """One look of ``run_evaluator`` now (no until-file)."""
    evaluator.refresh()
    over = evaluator.finished(refresh=False)
    evaluator.poll(job_over=over, refresh=False)


class SyntheticJob:
    """``world_size`` ranks' records and snapshots, written by the trainers' own writers."""

    def __init__(self, job_dir: Path, world_size: int, eval_every: int):
        self.job_dir, self.eval_every, self.step = job_dir, eval_every, 0
        config = load_config({**CONFIG, "eval_every": eval_every, "output_dir": str(job_dir)})
        write_json_atomic(job_dir / RESOLVED_CONFIG_FILE, to_dict(config))
        self.state = JobEvaluator(job_dir).model.state_dict()
        self.writers = [RecordWriter(job_dir, rank) for rank in range(world_size)]
        self.bytes_sent = [0] * world_size
        for writer in self.writers:
            writer.write("start", restarts=0, world_size=world_size, algorithm="local_sgd", model="mlp", dataset="digits",
                         host="bench", python="3", torch=torch.__version__, device="cpu", backend="gloo", transport="gloo")
            writer.write("output", role="replica")

    def advance(self, steps: int) -> None:
        """Every rank writes ``steps`` step records (and a snapshot at each eval point)."""
        for _ in range(steps):
            for rank, writer in enumerate(self.writers):
                sent = 52_000 if (self.step + 1) % 4 == 0 else 0
                self.bytes_sent[rank] += sent
                writer.write("step", step=self.step, epoch=self.step * 16 / 1437, loss=0.5 + 1.0 / (self.step + 1), lr=0.1,
                             step_s=0.0123, compute_s=0.0101, compute_unpadded_s=0.0101, comm_blocked_s=0.0022,
                             bytes_sent=sent, bytes_recv=sent, bytes_sent_total=self.bytes_sent[rank],
                             bytes_recv_total=self.bytes_sent[rank], staleness=None)
                if (self.step + 1) % self.eval_every == 0:
                    index = (self.step + 1) // self.eval_every - 1
                    size = write_snapshot(self.job_dir, rank, index, self.step, writer.clock(), writer.clock(),
                                          OutputState("replica", self.state))
                    writer.write("snapshot", eval_index=index, step=self.step, train_time_s=writer.clock(), role="replica",
                                 bytes=size, snapshot_s=0.002, snapshot_s_total=0.002 * (index + 1))
            self.step += 1

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as python -m trainers.evaluate runs
    env = environment()
    print("== bench_evaluator ==")
    for key, value in env.items():
        print(f"{key:>12}: {value}")
    print(f"{'config':>12}: {json.dumps({k: v for k, v in vars(args).items()})}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="wb-evalbench-", dir=args.dir) as folder:
        job_dir = Path(folder) / "job"
        job = SyntheticJob(job_dir, args.world_size, args.eval_every)
        incremental = JobEvaluator(job_dir)  # follows the job from its start, as --follow does
        reread = RereadEvaluator(job_dir)
        incremental.done_through = reread.done_through = 10**9  # time the looks, not evaluations
        try:
            for size in args.sizes:
                while job.step < size:  # grow, with the follower looking about every 5 % of the way
                    job.advance(min(size - job.step, max(1, size // 20)))
                    look_incremental(incremental)
                at_start = job.step
                times: dict[str, list[float]] = {"reread": [], "incremental": []}
                lines_before = incremental.records.lines_parsed
                for look in range(args.looks):
                    job.advance(args.steps_per_look)
                    order = [("reread", reread, look_reread), ("incremental", incremental, look_incremental)]
                    for name, evaluator, look_once in order if look % 2 == 0 else reversed(order):
                        started = time.perf_counter()
                        look_once(evaluator)
                        times[name].append(time.perf_counter() - started)
                files = sorted(job_dir.glob("rank*.jsonl"))
                rows.append({
                    "steps": f"{at_start}-{job.step}",
                    "lines": sum(len(read_records(p)) for p in files),
                    "mib": sum(p.stat().st_size for p in files) / 2**20,
                    "snapshots": sum(len(v) for v in list_snapshots(job_dir).values()),
                    "reread_ms": 1e3 * statistics.median(times["reread"]),
                    "incremental_ms": 1e3 * statistics.median(times["incremental"]),
                    "lines_per_look": (incremental.records.lines_parsed - lines_before) / args.looks,
                })
                assert incremental.refresh() == reread.refresh(), "the two ways disagree on the ranks' states"
        finally:
            job.close()
    print(f"\nmedian ms per look (finished() + poll(), nothing to evaluate), {args.world_size} ranks, "
          f"{args.steps_per_look} steps per rank appended between looks, {args.looks} looks per way (alternating)")
    print(f"{'steps/rank':>12}{'record lines':>14}{'MiB':>7}{'snapshots':>11}{'reread ms':>11}"
          f"{'incremental ms':>16}{'ratio':>8}{'lines decoded/look':>20}")
    for row in rows:
        print(f"{row['steps']:>12}{row['lines']:>14,}{row['mib']:>7.1f}{row['snapshots']:>11,}{row['reread_ms']:>11.2f}"
              f"{row['incremental_ms']:>16.3f}{row['reread_ms'] / row['incremental_ms']:>8.0f}x{row['lines_per_look']:>19.1f}")
    print("\nreread decodes every line twice per look (finished() and poll()); "
          "incremental decodes the lines appended since the last look")
    return 0


if __name__ == "__main__":
    sys.exit(main())
