"""`p3`: Priority-based Parameter Propagation (Jayarajan et al., SysML 2019) on a sharded parameter server.

Same math as `sync` (every step applies the gradient averaged over all ranks, with the configured
optimizer); only the transport and the schedule differ, as in the paper:

* **Slices.** The trainable parameters, concatenated in the order the first forward pass calls
  their layers, are cut into slices of ``slice_elements`` (P3's code uses 40,000). Slice ``k``'s
  priority is ``k``: the next forward pass needs the input layer's slices first. Every slice is
  the same size (the last one padded), so every message is the same size: a receiver can post
  all of a step's receives up front without knowing which slice comes next, and a layer smaller
  than a slice shares one with its neighbours instead of costing a message of its own.
* **Sharded parameter server on the workers**, as MXNet's KVStore that P3 was built on: slice
  ``k`` is owned by rank ``k mod n``. When backward has produced a slice's gradient, the rank
  queues a PUSH of it to the owner; the owner sums the n contributions in rank order (its own
  included), averages, and queues the averaged slice to every other rank (PULL). Each rank sends
  and receives about 2(n-1)/n of the model per step, as a ring all-reduce does.
* **Priority queues with preemption.** Messages travel on :class:`trainers.comm.MessageStreams`:
  one persistent stream per ordered pair of ranks, one message at a time in flight per
  destination, the next one the queue's highest priority (smallest (step, slice)). A slice near
  the input whose gradient is ready late overtakes the queued slices of the big layers near the
  output; a message already handed to the transport is not recalled (as in the paper). There is
  no window of several messages in flight: a pair's messages go one after another on its
  connection anyway, and each extra one in flight is one a later slice could no longer overtake.
  The strict order has a cost where compute is negligible: the last slice's push waits behind the
  other slices' pulls and its own pull then takes another hop, about one message per step
  (docs/RESULTS.md, P3).
* **Overlap with the next forward.** The optimizer step is deferred: a forward pre-hook on each
  layer waits only for that layer's slices and applies that layer's update right before it
  runs, so later layers' slices are still arriving while earlier layers compute.

No collective per slice and no readiness flags: a message names itself (its key encodes the step,
PUSH or PULL, and the slice), and every (slice, source) pair is known, so each rank posts a
step's receives from each peer at the start of that step (pushes of the slices it owns, pulls of
the slices the peer owns). An earlier version sent each slice as its own all-reduce plus "probe"
all-reduces carrying readiness flags (so that every rank issued the same collectives): 0.35-0.94x
of sync on the emulator (docs/RESULTS.md).

`ps_sync` (``ps_sync.py``) is this exchange without priority: the same streams and shards, FIFO
order, DDP-style buckets, every layer updated before the forward pass; the baseline that isolates
prioritisation.

Assumptions: each parameter is read by the forward of the module that owns it (true for the
models in trainers/models.py); all trainable parameters share a dtype. Transport: gloo (CUDA
tensors staged through the CPU) or the simulator; TcpComm has no tagged messages and NCCL no
point-to-point from background threads, so both are refused when the streams open.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
from torch import nn

from trainers import clock
from trainers.algorithms.base import Algorithm, AlgorithmContext, StepResult
from trainers.comm import MessageStreams
from trainers.config import require_int

PUSH, PULL = 0, 1


@dataclass
class P3Params:
    """Args: slice_elements: elements per slice and message (P3's default 40,000); broadcast_buffers:
    copy rank 0's buffers (BatchNorm statistics) to all ranks every step, before the forward
    pass, as `sync` does."""

    slice_elements: int = 40_000
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        require_int("slice_elements", self.slice_elements, minimum=1)


@dataclass
class Slice:
    """Elements [start, start + numel) of the forward-ordered concatenation of the parameters.

    segments: (param_index, first element in the parameter, end, offset in the slice).
    """

    start: int
    numel: int
    owner: int
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class _Owned:
    """The owner's side of one slice: contributions of the step being summed (one row per rank)."""

    contributions: torch.Tensor
    count: int = 0
    step: int = -1


@dataclass
class P3State:
    """round: the step whose exchange is in progress (None between a flush and the next backward);
    rounds: steps whose updates were applied; forward_order: layer indices in the order the
    first forward pass called them; waiting_left: per slice, parameters whose gradient this step
    has not produced yet; gradient_ready: per parameter, whether it has; done: per slice, whether this step's average is in ``reduced``
    (done_count of them); layer_left: per layer, its slices not done yet;
    applied: per layer, whether this step's update was applied."""

    round: Optional[int] = None
    rounds: int = 0
    forward_order: list[int] = field(default_factory=list)
    waiting_left: list[int] = field(default_factory=list)
    gradient_ready: list[bool] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    done_count: int = 0
    layer_left: list[int] = field(default_factory=list)
    applied: list[bool] = field(default_factory=list)


class P3(Algorithm):
    """Synchronous data parallelism through a sharded parameter server: sliced, prioritised,
    overlapped with backward and with the next forward pass."""

    name = "p3"
    Params = P3Params
    # The schedule (ps_sync overrides all three): message order on the streams, whether a layer
    # waits only for its own slices in the next forward (else every layer is updated before it).
    order = "priority"
    per_layer = True

    def __init__(self, params, ctx: AlgorithmContext):
        super().__init__(params, ctx)
        self.state = P3State()
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.trainable}
        if len(dtypes) > 1:
            raise ValueError(f"{self.name} needs one dtype for all trainable parameters, got {sorted(map(str, dtypes))}")
        self.dtype = self.trainable[0].dtype
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
        # Optimizer state is per parameter, so one optimizer per layer gives the same math as one for all.
        self.layer_optimizers = [self.make_optimizer([self.trainable[i] for i in owned]) for owned in self.layer_params]
        self.reduced = [torch.zeros_like(p) for p in self.trainable]
        self.slices: list[Slice] = []
        self.slices_of_layer: list[list[int]] = []
        self.layers_of_slice: list[list[int]] = []
        self.slices_of_param: list[list[int]] = []
        self.owned: dict[int, _Owned] = {}
        self.owned_by: list[int] = []  # slices per rank
        self.streams: Optional[MessageStreams] = None
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
        with self._streams_closed_on_error():
            return self._train_step(batch)

    def _train_step(self, batch: tuple) -> StepResult:
        first = self.streams is None
        if first:
            for param in self.trainable:
                if param.grad is not None:
                    param.grad.zero_()
        else:
            # .grad still holds last step's local gradients; each layer's are zeroed when its update
            # is applied, so all are zero before this step's backward.
            self._expect_round()  # this step's receives, before the forward pass: nothing waits for them
            if not self.per_layer:
                self.flush()
        # Before the forward pass, as sync and DDP do. Not between forward and backward: BatchNorm's
        # backward reads the running statistics the forward saved, and a copy into them there
        # fails autograd's in-place check.
        if self.params.broadcast_buffers and self._buffers:
            self.broadcast_tensors(self._buffers, src=0)
        self._recording_order = first
        started = clock.perf_counter()
        loss = self.ctx.loss_fn(self.model, batch)  # pre-hooks apply last step's updates layer by layer
        self._recording_order = False
        self.flush()  # layers the forward pass did not call
        if first:
            self._open()
            self._expect_round()
        self._begin_round()
        loss.backward()  # gradient hooks push the slices whose gradients are complete
        self.pad_compute(started)  # a compute profile's step time; the messages in flight overlap it
        for i, param in enumerate(self.trainable):
            if self._waiting_for(i):  # not used by this batch: push a zero gradient, as sync does
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._gradient_ready(i)
        return StepResult(loss=loss.item())

    def deployable_model(self) -> nn.Module:
        """The local replica once every pending update is applied (replicas are identical)."""
        with self._streams_closed_on_error():
            self.flush()
        return self.model

    def finish(self) -> None:
        with self._streams_closed_on_error():
            self.flush()
            if self.streams is not None:
                self.streams.close()  # every message handed over: peers may still be receiving them
                self.streams = None

    def flush(self) -> None:
        """Wait for this step's averages and apply every layer's update not yet applied."""
        if self.state.round is None:
            return
        # counters, not all(done): the predicate is evaluated at every message, and a model of
        # thousands of slices made that quadratic (minutes per step for ResNet-50 on the simulator)
        total = len(self.slices)
        self.streams.wait_until(lambda: self.state.done_count == total)
        for layer in range(len(self.layers)):
            self._apply_layer(layer)
        self.state.round = None
        self.state.rounds += 1
        self.note_sync()  # the round's average is now in every layer

    @contextmanager
    def _streams_closed_on_error(self) -> Iterator[None]:
        """Whatever fails inside (this rank's step, or a stream), the streams are closed before
        the error goes on (their threads told to end and waited for, briefly), and the error is
        the one raised: closing on an error never raises (``MessageStreams.close(drain=False)``)."""
        try:
            yield
        except BaseException:
            if self.streams is not None:
                self.streams.close(drain=False)
                self.streams = None
            raise

    # -- hooks ----------------------------------------------------------------------------------

    def _make_pre_hook(self, layer: int):
        def pre_hook(module, inputs):
            if self._recording_order and layer not in self.state.forward_order:
                self.state.forward_order.append(layer)
            if self.per_layer:
                self._apply_layer(layer)

        return pre_hook

    def _make_grad_hook(self, param_index: int):
        def grad_hook(param):
            if self._waiting_for(param_index):
                self._gradient_ready(param_index)

        return grad_hook

    # -- the exchange ---------------------------------------------------------------------------

    def _open(self) -> None:
        """Cut the slices (forward order, recorded by the first forward pass) and open the streams."""
        n, rank, size = self.comm.world_size, self.comm.rank, self.params.slice_elements
        order = self.state.forward_order + [i for i in range(len(self.layers)) if i not in self.state.forward_order]
        params_in_order = [i for layer in order for i in self.layer_params[layer]]
        self.slices = self._cut_slices(params_in_order)
        self.owned_by = [sum(1 for piece in self.slices if piece.owner == r) for r in range(n)]
        self.slices_of_param = [[] for _ in self.trainable]
        for k, piece in enumerate(self.slices):
            for i, *_ in piece.segments:
                self.slices_of_param[i].append(k)
        layer_of = {i: layer for layer, owned in enumerate(self.layer_params) for i in owned}
        self.slices_of_layer = [[] for _ in self.layers]
        self.layers_of_slice = [list(dict.fromkeys(layer_of[i] for i, *_ in piece.segments)) for piece in self.slices]
        for k, layers in enumerate(self.layers_of_slice):
            for layer in layers:
                self.slices_of_layer[layer].append(k)
        self.owned = {k: _Owned(torch.zeros(n, size, dtype=self.dtype))
                      for k, piece in enumerate(self.slices) if piece.owner == rank}
        self.streams = MessageStreams(self.comm, size, self.dtype, self._on_message, order=self.order)

    def _cut_slices(self, params_in_order: list[int]) -> list[Slice]:
        """P3's slices: the concatenation of ``params_in_order`` cut every ``slice_elements``
        (a slice may span parameters), slice k owned by rank k mod n."""
        n, size = self.comm.world_size, self.params.slice_elements
        total = sum(self.trainable[i].numel() for i in params_in_order)
        slices = [Slice(start, min(size, total - start), owner=k % n) for k, start in enumerate(range(0, total, size))]
        offset = 0
        for i in params_in_order:
            numel = self.trainable[i].numel()
            for k in range(offset // size, (offset + numel - 1) // size + 1 if numel else 0):
                piece = slices[k]
                lo, hi = max(offset, piece.start), min(offset + numel, piece.start + piece.numel)
                piece.segments.append((i, lo - offset, hi - offset, lo - piece.start))
            offset += numel
        return slices

    def _expect_round(self) -> None:
        """Post one step's receives: from each peer, a push of every slice this rank owns and a
        pull of every slice that peer owns."""
        for src in range(self.comm.world_size):
            if src != self.comm.rank:
                self.streams.expect(src, self.owned_by[self.comm.rank] + self.owned_by[src])

    def _begin_round(self) -> None:
        self.state.round = self.state.rounds
        self.state.waiting_left = [len(piece.segments) for piece in self.slices]
        self.state.gradient_ready = [False] * len(self.trainable)
        self.state.done = [False] * len(self.slices)
        self.state.done_count = 0
        self.state.layer_left = [len(wanted) for wanted in self.slices_of_layer]
        self.state.applied = [False] * len(self.layers)

    def _waiting_for(self, param_index: int) -> bool:
        """Whether this step's exchange waits for ``param_index``'s gradient."""
        return self.state.round is not None and not self.state.gradient_ready[param_index]

    def _gradient_ready(self, param_index: int) -> None:
        self.state.gradient_ready[param_index] = True
        for k in self.slices_of_param[param_index]:
            self.state.waiting_left[k] -= 1
            if self.state.waiting_left[k] == 0:
                self._slice_ready(k)

    def _slice_ready(self, k: int) -> None:
        """Slice ``k``'s gradient is complete on this rank: push it to its owner (ps_sync buckets)."""
        self._push(k)

    def _push(self, k: int) -> None:
        piece = self.slices[k]
        message = self.streams.new_message()  # gathered into the message itself: one copy of each gradient
        for i, lo, hi, at in piece.segments:
            message.payload[at : at + hi - lo].copy_(self.trainable[i].grad.detach().reshape(-1)[lo:hi])
        message.payload[piece.numel :].zero_()  # the last slice's padding
        self.streams.put([piece.owner], self._key(self.state.round, PUSH, k), message, priority=(self.state.round, k))

    def _key(self, step: int, kind: int, k: int) -> int:
        return (2 * step + kind) * len(self.slices) + k

    def _on_message(self, src: int, key: int, payload: torch.Tensor) -> None:
        """A push to this owner, or a pull from a slice's owner (under the streams' lock)."""
        step, k = divmod(key, len(self.slices))
        step, kind = divmod(step, 2)
        piece = self.slices[k]
        if kind == PULL:
            if step != self.state.round or self.state.done[k]:
                raise RuntimeError(f"{self.name}: rank {self.comm.rank} got slice {k} of step {step} from rank {src} "
                                   f"during step {self.state.round} (schedule bug)")
            self._slice_done(k, payload)
            return
        owned = self.owned[k]
        if owned.count and owned.step != step:
            raise RuntimeError(f"{self.name}: rank {self.comm.rank} got step {step}'s push of slice {k} from rank {src} "
                               f"while summing step {owned.step}'s (schedule bug)")
        owned.step = step
        owned.contributions[src].copy_(payload)
        owned.count += 1
        if owned.count < self.comm.world_size:
            return
        owned.count = 0
        message = self.streams.new_message()  # the average is summed in the message it is sent in
        average = message.payload.copy_(owned.contributions[0])
        for row in owned.contributions[1:]:  # in rank order: the same bits whatever the arrival order
            average.add_(row)
        average.div_(self.comm.world_size)
        self._slice_done(k, average)
        others = [r for r in range(self.comm.world_size) if r != self.comm.rank]
        self.streams.put(others, self._key(step, PULL, k), message, priority=(step, k))

    def _slice_done(self, k: int, average: torch.Tensor) -> None:
        for i, lo, hi, at in self.slices[k].segments:
            self.reduced[i].view(-1)[lo:hi].copy_(average[at : at + hi - lo])
        self.state.done[k] = True
        self.state.done_count += 1
        for layer in self.layers_of_slice[k]:
            self.state.layer_left[layer] -= 1

    def _apply_layer(self, layer: int) -> None:
        """Wait for this layer's slices, then take its optimizer step (once per step)."""
        if self.state.round is None or self.state.applied[layer]:
            return
        self.streams.wait_until(lambda: self.state.layer_left[layer] == 0)
        with torch.no_grad():
            for param_index in self.layer_params[layer]:
                param = self.trainable[param_index]
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                param.grad.copy_(self.reduced[param_index])
            self.layer_optimizers[layer].step()
            for param_index in self.layer_params[layer]:
                self.trainable[param_index].grad.zero_()
        self.state.applied[layer] = True
