"""`p3`: Priority-based Parameter Propagation (Jayarajan et al., SysML 2019), over all-reduce.

Same math as `sync` (every step applies the gradient averaged over all ranks, with the configured
optimizer); only the schedule differs:

* Parameters are cut into slices of at most ``slice_elements`` elements (P3's MXNet code uses
  40,000). Each slice has a priority: the earlier its layer runs in the forward pass, the higher
  (the order is recorded during the first forward pass; layers never called come last).
* During backward, a slice becomes ready when its parameter's gradient is accumulated; at most
  ``max_in_flight`` asynchronous all-reduces (one slice each) run at a time, and whenever one more
  may start, the highest-priority ready slice goes next, so a layer near the input that becomes
  ready late overtakes the queued slices of layers near the output.
* The optimizer step is deferred to the next forward pass: a forward pre-hook on each layer waits
  only for that layer's slices and applies that layer's update right before the layer runs, so
  the slices of later layers are still moving while earlier layers compute.

Every rank must issue the same all-reduces in the same order, but hooks fire at different times on
different ranks. So the choice of what operation ``n`` carries depends only on data all ranks
share: each all-reduce also carries this rank's per-parameter "gradient ready" flags (summed, they
say which parameters are ready on every rank), and operation ``n`` sends the highest-priority
unsent slice that was ready everywhere according to operation ``n - max_in_flight``. When no such
slice exists yet, operation ``n`` is a probe that carries only the flags. Timing only decides
*when* a rank launches operation ``n``, never *what* it carries.

Assumptions: each parameter is read by the forward of the module that owns it (true for the
models in trainers/models.py); all trainable parameters share a dtype. Other collectives (buffer
broadcast, evaluation) run only when no slice is in flight, so they stay in step on all ranks.
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers import clock
from trainers.comm import Work
from trainers.config import require_int


@dataclass
class P3Params:
    """Args: slice_elements: elements per slice (P3's default 40,000); max_in_flight: asynchronous
    all-reduces running at once (the preemption window); broadcast_buffers: copy rank 0's buffers
    (BatchNorm statistics) to all ranks every step, as `sync` does (here after the forward pass)."""

    slice_elements: int = 40_000
    max_in_flight: int = 2
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        require_int("slice_elements", self.slice_elements, minimum=1)
        require_int("max_in_flight", self.max_in_flight, minimum=1)


@dataclass
class _Slice:
    """Elements [start, stop) of parameter ``param_index`` (flattened); its id is its priority."""

    param_index: int
    start: int
    stop: int


@dataclass
class _Op:
    """One launched all-reduce: ``slice_id`` None for a probe."""

    index: int
    slice_id: Optional[int]
    buffer: torch.Tensor
    work: Work


@dataclass
class P3Round:
    """Exchange of one step's gradients, from backward until every layer applied its update.

    Args:
        ready: this rank's per-parameter flags (1.0 once its gradient is accumulated).
        consensus: per operation index, which parameters its summed flags showed ready on every rank.
        in_flight: launched operations not yet retired, oldest first.
        next_op: index of the next operation to launch.
        sent / done: slice ids launched / reduced.
        applied: per layer, whether its update was applied.
    """

    ready: torch.Tensor
    consensus: dict[int, list[bool]] = field(default_factory=dict)
    in_flight: list[_Op] = field(default_factory=list)
    next_op: int = 0
    sent: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    applied: list[bool] = field(default_factory=list)


@dataclass
class P3State:
    """round: the exchange in progress (None between a flush and the next backward); rounds: steps
    whose updates were applied; probes: operations that carried only flags; forward_order: layer
    indices in the order the first forward pass called them."""

    round: Optional[P3Round] = None
    rounds: int = 0
    probes: int = 0
    forward_order: list[int] = field(default_factory=list)


class P3(Algorithm):
    """Synchronous data parallelism with sliced, prioritised, backward- and forward-overlapped all-reduce."""

    name = "p3"
    Params = P3Params

    def __init__(self, params: P3Params, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = P3State()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.trainable}
        if len(dtypes) > 1:
            raise ValueError(f"p3 needs one dtype for all trainable parameters, got {sorted(map(str, dtypes))}")
        index_of = {id(p): i for i, p in enumerate(self.trainable)}
        # A layer is a module that directly owns trainable parameters (first owner wins if tied).
        self.layers: list[nn.Module] = []
        self.layer_params: list[list[int]] = []
        claimed: set[int] = set()
        for module in self.model.modules():
            owned = [index_of[id(p)] for p in module.parameters(recurse=False) if id(p) in index_of]
            owned = [i for i in owned if i not in claimed]
            if owned:
                claimed.update(owned)
                self.layers.append(module)
                self.layer_params.append(owned)
        self.layer_of_param = {i: layer for layer, owned in enumerate(self.layer_params) for i in owned}
        # Optimizer state is per parameter, so one optimizer per layer gives the same math as one for all.
        self.layer_optimizers = [self.make_optimizer([self.trainable[i] for i in owned]) for owned in self.layer_params]
        self.reduced = [torch.zeros_like(p) for p in self.trainable]
        self.slices: list[_Slice] = []
        self.slices_of_layer: list[list[int]] = []
        self._buffers = list(self.model.buffers())
        self._recording_order = False
        self._handles = [layer.register_forward_pre_hook(self._make_pre_hook(i)) for i, layer in enumerate(self.layers)]
        self._handles += [p.register_post_accumulate_grad_hook(self._make_grad_hook(i)) for i, p in enumerate(self.trainable)]

    # -- the interface the runner calls ---------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        super().set_lr(lr)
        for optimizer in self.layer_optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr

    def train_step(self, step: int, batch: tuple) -> StepResult:
        if self.state.round is None:
            for param in self.trainable:
                if param.grad is not None:
                    param.grad.zero_()
        # Otherwise .grad still holds last step's local gradients, some not yet sent; each layer's are
        # zeroed when its update is applied, so all are zero before this step's backward.
        self._recording_order = not self.slices
        started = clock.perf_counter()
        loss = self.ctx.loss_fn(self.model, batch)  # pre-hooks apply last step's updates layer by layer
        self._recording_order = False
        self.flush()  # layers the forward pass did not call
        if not self.slices:
            self._build_slices()
        if self.params.broadcast_buffers and self._buffers:
            self.broadcast_tensors(self._buffers, src=0)
        self.state.round = P3Round(
            ready=torch.zeros(len(self.trainable), dtype=self.trainable[0].dtype, device=self.trainable[0].device),
            applied=[False] * len(self.layers),
        )
        loss.backward()  # gradient hooks mark parameters ready and launch slices
        self.pad_compute(started)  # a compute profile's step time; the slices in flight overlap it
        for i, param in enumerate(self.trainable):
            if self.state.round.ready[i] == 0:  # not used by this batch: reduce a zero gradient, as sync does
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self.state.round.ready[i] = 1.0
        self._pump()
        return StepResult(loss=loss.item())

    def deployable_model(self) -> nn.Module:
        """The local replica once every pending update is applied (replicas are identical)."""
        self.flush()
        return self.model

    def finish(self) -> None:
        self.flush()

    def flush(self) -> None:
        """Finish the exchange in progress and apply every layer's update (all ranks call it together)."""
        current = self.state.round
        if current is None:
            return
        for layer in range(len(self.layers)):
            self._apply_layer(layer)
        self._wait_until(lambda: not current.in_flight)
        self.state.round = None
        self.state.rounds += 1

    # -- hooks ----------------------------------------------------------------------------------

    def _make_pre_hook(self, layer: int):
        def pre_hook(module, inputs):
            if self._recording_order and layer not in self.state.forward_order:
                self.state.forward_order.append(layer)
            self._apply_layer(layer)

        return pre_hook

    def _make_grad_hook(self, param_index: int):
        def grad_hook(param):
            current = self.state.round
            if current is not None and current.ready[param_index] == 0:
                current.ready[param_index] = 1.0
                self._pump()

        return grad_hook

    # -- schedule -------------------------------------------------------------------------------

    def _build_slices(self) -> None:
        order = self.state.forward_order + [i for i in range(len(self.layers)) if i not in self.state.forward_order]
        self.slices_of_layer = [[] for _ in self.layers]
        for layer in order:
            for param_index in self.layer_params[layer]:
                numel = self.trainable[param_index].numel()
                for start in range(0, numel, self.params.slice_elements):
                    self.slices_of_layer[layer].append(len(self.slices))
                    self.slices.append(_Slice(param_index, start, min(start + self.params.slice_elements, numel)))

    def _apply_layer(self, layer: int) -> None:
        """Wait for this layer's slices, then take its optimizer step (once per round)."""
        current = self.state.round
        if current is None or current.applied[layer]:
            return
        wanted = self.slices_of_layer[layer]
        self._wait_until(lambda: all(s in current.done for s in wanted))
        with torch.no_grad():
            for param_index in self.layer_params[layer]:
                param = self.trainable[param_index]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.copy_(self.reduced[param_index])
            self.layer_optimizers[layer].step()
            for param_index in self.layer_params[layer]:
                self.trainable[param_index].grad.zero_()
        current.applied[layer] = True
        self._pump()  # keep later layers' slices moving while this layer computes

    def _wait_until(self, condition) -> None:
        current = self.state.round
        while True:
            self._pump()
            if condition():
                return
            if not current.in_flight:
                raise RuntimeError("p3: waiting for slices but nothing is in flight (schedule bug)")
            self._retire(current.in_flight[0], block=True)

    def _pump(self) -> None:
        """Retire finished operations and launch as many as the window allows, without blocking."""
        current = self.state.round
        if current is None:
            return
        for op in list(current.in_flight):
            self._retire(op, block=False)
        while len(current.in_flight) < self.params.max_in_flight and len(current.sent) < len(self.slices):
            n = current.next_op
            basis = n - self.params.max_in_flight
            if basis >= 0 and basis not in current.consensus:
                return  # operation n - window still running: decide later
            agreed = current.consensus.get(basis, [False] * len(self.trainable))
            choice = next(
                (i for i, piece in enumerate(self.slices) if i not in current.sent and agreed[piece.param_index]), None
            )
            # A probe only helps once this rank has news beyond what all ranks agreed on.
            if choice is None and not any(r and not a for r, a in zip(current.ready.tolist(), agreed)):
                return
            self._launch(n, choice)

    def _launch(self, n: int, slice_id: Optional[int]) -> None:
        current = self.state.round
        flags = current.ready.clone()
        if slice_id is None:
            buffer = flags
            self.state.probes += 1
        else:
            piece = self.slices[slice_id]
            grad = self.trainable[piece.param_index].grad.detach().reshape(-1)
            buffer = torch.cat([grad[piece.start : piece.stop], flags])
            current.sent.add(slice_id)
        work = self.comm.allreduce_async(buffer, op="sum")
        current.in_flight.append(_Op(n, slice_id, buffer, work))
        current.next_op += 1

    def _retire(self, op: _Op, block: bool) -> None:
        if not block and not op.work.is_completed():
            return
        result = op.work.wait()
        current = self.state.round
        count = len(self.trainable)
        current.consensus[op.index] = (result[-count:] == self.comm.world_size).tolist()
        if op.slice_id is not None:
            piece = self.slices[op.slice_id]
            target = self.reduced[piece.param_index].view(-1)[piece.start : piece.stop]
            target.copy_(result[:-count]).div_(self.comm.world_size)
            current.done.add(op.slice_id)
        current.in_flight.remove(op)
