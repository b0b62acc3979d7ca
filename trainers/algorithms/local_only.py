"""`local_only`: the control that removes the mechanism. Each rank trains on its own shard and
never communicates; the output model is the replicas' mean, formed once, by the evaluator.

Any scenario can list it beside the algorithms it compares: an algorithm whose speedup a
`local_only` job matches did not get it from its synchronisation ("train apart, average once").
The harness charges the one average a user would have to make (one all-reduce of the model:
`output_sync_s` in harness/results.py, as for every output that is the replicas' mean).

No start-up broadcast either: every rank builds the model from the same seed, so the replicas
start equal without a message (as the runner's AlgorithmContext promises), and the job sends
nothing at all. With the same seeds and shards, its output equals the mean of replicas trained
in separate processes, bit for bit (tests/trainers/test_sync_evidence.py).
"""

from __future__ import annotations

from torch import nn

from trainers.algorithms.base import Algorithm, StepResult
from trainers.snapshots import OutputState


class LocalOnly(Algorithm):
    """Independent training on each shard; the output is the replicas' mean (never a sync)."""

    name = "local_only"

    def setup(self) -> None:
        """Nothing to send: the replicas are built equal from the config's seed."""

    def train_step(self, step: int, batch: tuple) -> StepResult:
        loss = self.forward_backward(batch)
        self.optimizer.step()
        return StepResult(loss=loss)

    def output_state(self) -> OutputState:
        """Every rank's replica (no communication); the evaluator averages them."""
        return self.replica_state()

    def deployable_model(self) -> nn.Module:
        """The mean of the replicas now (one all_reduce: the one average the output needs)."""
        return self.averaged_copy()
