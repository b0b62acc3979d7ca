"""`streaming_diloco`: Streaming DiLoCo (Douillard et al. 2025, "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512), after torchft's ``torchft/local_sgd.py`` (``DiLoCo`` with
``_StreamingDiLoCoFragment``).

DiLoCo (trainers/algorithms/diloco.py) with the parameters split into ``fragments`` (F) parts,
each synchronised once every ``H`` inner steps, the fragments staggered by H/F steps: fragment p
(0-based) is applied after inner steps (p+1) H/F, (p+1) H/F + H, ... So a round's pseudo-gradient
crosses the network in F pieces spread over the round (peak bandwidth / F) instead of one burst.
A fragment's sync is *launched* ``overlap`` (tau) inner steps before it is applied, and those
steps run while it is in flight:

* launch (after step s - tau): delta_p = theta_global_p - theta_local_p, averaged over the ranks
  asynchronously (diloco_common.launch_average: fp32 all-reduce, or bf16/int8/int4 payloads
  all-gathered and averaged in float32, ``outer_precision``, or with ``outer_reduce: ring`` the
  coded ring all-reduce, every message encoded, as diloco's);
* apply (after step s): wait; the fragment's outer Nesterov SGD steps theta_global_p with the
  mean delta; the replica's fragment merges: theta_local_p <- alpha theta_local_p +
  (1 - alpha) theta_global_p, keeping part of the tau steps it took meanwhile (torchft's
  ``_merge_parameters``: ``lerp`` of the new global towards the local copy by
  ``fragment_update_alpha``). tau = 0 launches and applies at once (blocking).

What is the paper's and torchft's, and what is this file's own:

* Schedule: torchft counts H/F steps per fragment, prepares (launches) the current fragment
  ``fragment_sync_delay`` steps before the count is reached and performs it at the count,
  fragment index = outer step mod F: the same staggering as here. torchft requires
  tau < H/F (one fragment in flight); here tau may be up to H - 1 (a fragment is never launched
  again before it is applied), so fragments may be in flight together. A fragment whose first
  launch would fall before step 1 (tau >= (p+1) H/F) first syncs one round later.
* Fragments: the paper's are groups of transformer blocks; torchft takes them from the caller
  (lists of modules). Here: the parameter tensors
  in module order, cut into F contiguous runs of about equal element count (a tensor is never
  split; each fragment gets at least one), the paper's "sequential" pattern; its "strided"
  pattern (layer i to fragment i mod F), which it reports slightly better, is not implemented.
* One outer optimizer per fragment (torchft accepts one per fragment too); the inner AdamW and
  its state are shared and never reset, as in DiLoCo.
* Outer-gradient precision: the paper sends outer gradients as 4-bit floats and accumulates
  in float32; torchft's ``should_quantize`` quantizes the all-reduce. Here: a
  uniform per-chunk grid (int8, int4; trainers/compression.py) or bf16, all-gathered, averaged
  in float32, or (``outer_reduce: ring``) summed along the coded ring all-reduce, each hop's
  partial sum re-encoded, closer to torchft's quantized all-reduce. Not the paper's float format.
* BatchNorm-style float buffers are averaged (blocking, float32) whenever the last fragment is
  applied, as DiLoCo does at its outer step; the paper and torchft leave buffers alone.
* Warm start (``warmup_steps``, ``warmup_lr``, ``bucket_cap_mb``): diloco's, from their base
  class: the first ``warmup_steps`` steps are data-parallel (as `sync`), theta_g is the replica
  at their end, and the fragments' schedule counts inner steps from there (the first fragment
  is applied ``warmup_steps + H/F`` steps in). Neither the paper nor torchft has one; the DiLoCo
  paper's runs start from a pretrained checkpoint, which this stands for.
* ``finish()`` waits for syncs still in flight after the last step and applies them.
* Not crash tolerant (diloco is): a rank lost mid-flight would leave fragments half applied.

With F = 1, tau = 0, alpha = 0 this is DiLoCo step for step (tests/trainers/test_streaming_diloco.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn

from trainers.algorithms.base import AlgorithmContext, StepResult
from trainers.algorithms.diloco_common import (
    OUTER_PRECISIONS, GlobalModelAlgorithm, OuterPrecision, check_outer_reduce, check_outer_sgd,
    float_buffers, launch_average, outer_compressor, outer_step, pseudo_gradient,
)
from trainers.comm import Work
from trainers.config import ConfigError, check_warmup, require_choice, require_float, require_int
from trainers.snapshots import OutputState


@dataclass
class StreamingDiLoCoParams:
    """Args: H: inner steps between two syncs of one fragment; fragments: F, parts of the model
    synchronised at staggered times (must divide H); overlap: tau, inner steps between a
    fragment's launch and its application (0: blocking; at most H - 1); alpha: merge factor,
    local <- alpha local + (1 - alpha) global (0: take the global fragment); outer_lr,
    outer_momentum, nesterov: the outer SGD, as diloco; outer_precision: fp32 (all-reduced) or
    bf16 | int8 | int4 (encoded); outer_reduce: how encoded fragments are averaged, allgather
    (every payload to every rank, averaged in float32) or ring (the coded ring all-reduce,
    2 (n-1)/n payloads a rank, re-encoded at every hop), as diloco's; warmup_steps, warmup_lr,
    bucket_cap_mb: the data-parallel warm start, as diloco's."""

    H: int = 50
    fragments: int = 2
    overlap: int = 1
    alpha: float = 0.5
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    outer_precision: OuterPrecision = "fp32"
    outer_reduce: Literal["allgather", "ring"] = "allgather"
    warmup_steps: int = 0
    warmup_lr: Optional[float] = None
    bucket_cap_mb: float = 25.0

    def __post_init__(self) -> None:
        require_int("H", self.H, minimum=1)
        require_int("fragments", self.fragments, minimum=1)
        if self.H % self.fragments:
            raise ConfigError("fragments", f"must divide H ({self.H}); got {self.fragments}")
        require_int("overlap", self.overlap, minimum=0, maximum=self.H - 1)
        require_float("alpha", self.alpha, minimum=0.0, maximum=1.0)
        require_choice("outer_precision", self.outer_precision, OUTER_PRECISIONS)
        check_outer_reduce(self.outer_reduce, self.outer_precision)
        check_outer_sgd(self.outer_lr, self.outer_momentum, self.nesterov)
        check_warmup(self.warmup_steps, self.warmup_lr, self.bucket_cap_mb)


def split_fragments(sizes: list[int], count: int) -> list[range]:
    """Cut tensors of ``sizes`` elements (in order) into ``count`` contiguous runs of about equal
    total size, each at least one tensor; returns the index range of each run.

    A run ends at the first tensor boundary where the running total reaches its share,
    (k + 1) / count of the whole, but always leaves a tensor for each later run.
    """
    if count > len(sizes):
        raise ConfigError("fragments", f"the model has {len(sizes)} parameter tensors; got {count} fragments")
    total, runs, start, running = sum(sizes), [], 0, 0
    for k in range(count - 1):
        end = start + 1
        running += sizes[start]
        while end < len(sizes) - (count - 1 - k) and running < total * (k + 1) / count:
            running += sizes[end]
            end += 1
        runs.append(range(start, end))
        start = end
    runs.append(range(start, len(sizes)))
    return runs


@dataclass
class _InFlight:
    """A fragment's sync between launch and application."""

    work: Work
    pseudo_gradient: torch.Tensor  # averaged in place once work is done
    apply_after: int  # the inner step count after which it is applied


@dataclass
class StreamingDiLoCoState:
    """inner_steps: inner steps taken since the warm-up (if any); syncs: syncs applied per
    fragment; warm: the warm-up is over (always True without one)."""

    inner_steps: int = 0
    syncs: list[int] = field(default_factory=list)
    warm: bool = True


class StreamingDiLoCo(GlobalModelAlgorithm):
    """DiLoCo whose fragments sync at staggered steps, each overlapped with ``overlap`` inner steps."""

    name = "streaming_diloco"
    Params = StreamingDiLoCoParams

    def __init__(self, params: StreamingDiLoCoParams, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        local = list(self.model.parameters())
        self.fragment_ranges = split_fragments([p.numel() for p in local], params.fragments)
        self.state = StreamingDiLoCoState(syncs=[0] * params.fragments, warm=params.warmup_steps == 0)
        self.outer_code = outer_compressor(params.outer_precision)
        self.in_flight: dict[int, _InFlight] = {}
        period = params.H // params.fragments
        # fragment p is applied when inner_steps = (p+1) H/F mod H, launched tau steps earlier
        self.launch_phase = [((p + 1) * period - params.overlap) % params.H for p in range(params.fragments)]

    def outer_groups(self) -> list[range]:
        """One outer SGD per fragment (torchft accepts one per fragment too)."""
        return self.fragment_ranges

    def fragment_params(self, model: nn.Module, fragment: int) -> list[torch.nn.Parameter]:
        """The parameters of ``fragment`` in ``model`` (the replica or the global model)."""
        params = list(model.parameters())
        return [params[i] for i in self.fragment_ranges[fragment]]

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if not self.state.warm:
            return self.warmup_step(step, batch)
        loss = self.forward_backward(batch)
        self.optimizer.step()
        self.state.inner_steps += 1
        done = self.state.inner_steps
        # launch before applying: with overlap 0 a fragment is launched and applied at once
        for fragment, phase in enumerate(self.launch_phase):
            if done % self.params.H == phase:
                self._launch(fragment)
        for fragment in sorted(self.in_flight):
            if self.in_flight[fragment].apply_after == done:
                self._apply(fragment)
        return StepResult(loss=loss)

    def end_warmup(self) -> None:
        super().end_warmup()
        self.state = StreamingDiLoCoState(syncs=[0] * self.params.fragments)

    def deployable_model(self) -> nn.Module:
        """theta_g; during the warm-up the replica (identical on every rank), theta_g's start."""
        return self.global_model if self.state.warm else self.model

    def output_state(self) -> Optional[OutputState]:
        return OutputState("global", self.deployable_model().state_dict()) if self.comm.rank == 0 else None

    def _launch(self, fragment: int) -> None:
        assert fragment not in self.in_flight, "a fragment is launched again before it was applied"
        global_params = self.fragment_params(self.global_model, fragment)
        local_params = self.fragment_params(self.model, fragment)
        delta = pseudo_gradient(global_params, local_params)
        work = launch_average(self.comm, delta, self.outer_code, outer_reduce=self.params.outer_reduce)
        self.in_flight[fragment] = _InFlight(work, delta, self.state.inner_steps + self.params.overlap)

    def _apply(self, fragment: int) -> None:
        sync = self.in_flight.pop(fragment)
        sync.work.wait()
        global_params = self.fragment_params(self.global_model, fragment)
        outer_step(global_params, sync.pseudo_gradient, self.outer_optimizers[fragment])
        alpha = self.params.alpha
        with torch.no_grad():
            for local, global_param in zip(self.fragment_params(self.model, fragment), global_params):
                # torchft's merge: the new global moved alpha of the way back to the local copy
                # (alpha 0: exactly the global; alpha 1: the local copy unchanged)
                local.copy_(global_param + alpha * (local - global_param))
        if fragment == self.params.fragments - 1:
            self._average_buffers()
        self.state.syncs[fragment] += 1
        self.note_sync()

    def _average_buffers(self) -> None:
        """BatchNorm statistics are not trained by gradients: averaged as they are (as diloco)."""
        local_buffers = float_buffers(self.model)
        if not local_buffers:
            return
        self.average_tensors(local_buffers)
        self.global_buffers_from_replica()

    def finish(self) -> None:
        """Wait for the syncs launched in the last ``overlap`` steps and apply them (fragment order)."""
        for fragment in sorted(self.in_flight):
            self._apply(fragment)
