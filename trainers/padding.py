"""Padding each layer to a compute profile (``pad_layers``): the accelerator's timing, layer by layer.

``min_compute_s`` alone pads a step once, after backward: right for an algorithm that waits for
the whole pass, wrong for one that overlaps communication with it (``p3`` pushes each slice as its
gradient is ready and waits per layer in the next forward pass). :class:`LayerPadding` spreads the
profile's step time over the layers that own parameters, in proportion to their multiply-accumulates
(:func:`layer_macs`, measured in the first forward pass), a ``forward_fraction`` of it in the
forward pass and the rest in the backward pass, and sleeps where this machine computed a layer
faster than its share:

* forward: from the layer's own start (after any algorithm pre-hook, e.g. p3 waiting for the
  layer's slices, so waiting is never counted as compute) to its end;
* backward: from the previous gradient (or the end of the forward pass) to this parameter's
  gradient, before any algorithm hook sees it (so a slice leaves when the profile's layer would
  have produced it).

Sleeping leaves the CPU to the communication threads, as an accelerator would. The step's own
``min_compute_s`` pad (``Algorithm.pad_compute``) still tops up what the layers did not reach.

Measured shares (``layer_shares``, the trainer config's; harness: a scenario's ``layer_profile``):
each layer's share of the step in the forward pass and in the backward pass as an accelerator was
measured spending it (:func:`measured_shares`), in place of the multiply-accumulates and the fixed
``forward_fraction``; the simulator's compute spread (trainers/sim) takes the same shares.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainers import clock

FORWARD_FRACTION = 1 / 3  # as trainers.sim.ComputeModel: backward costs about twice the forward


def layer_macs(module: nn.Module, params: list[nn.Parameter], output) -> int:
    """Multiply-accumulates of one call of ``module`` (estimated): each weight matrix or kernel
    (2 or more dims) once per output position, where a position is one output vector (the
    channel dimension: 1 for a conv kernel, the last otherwise); each vector parameter (bias,
    normalisation) once per output element; an embedding one per output element (a lookup).
    A module with a ``nominal_macs`` attribute (set by its model for the input size the model
    stands for) gets that value instead."""
    nominal = getattr(module, "nominal_macs", None)  # stated by the model (trainers.models.set_nominal_macs)
    if nominal is not None:
        return nominal
    out = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return sum(p.numel() for p in params)
    if isinstance(module, nn.Embedding):
        return out.numel()
    macs = 0
    for param in params:
        if param.dim() >= 2:
            channels = out.shape[1] if param.dim() >= 3 and out.dim() >= 2 else out.shape[-1]
            macs += param.numel() * (out.numel() // max(1, channels))
        else:
            macs += out.numel()
    return macs


def owning_layers(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The modules that own trainable parameters, in ``model.modules()`` order, each with its own
    (the first owner takes a shared parameter)."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    layers = []
    for module in model.modules():
        owned = [p for p in module.parameters(recurse=False) if id(p) in trainable]
        for param in owned:
            del trainable[id(param)]
        if owned:
            layers.append((module, owned))
    return layers


def backward_shares(layers: list[tuple[nn.Module, list[nn.Parameter]]], macs: list[int]) -> dict[int, float]:
    """Each parameter's share of the backward pass (id(param) -> fraction): its layer's share of
    the multiply-accumulates (of the parameters' sizes where no forward pass was seen), split
    within the layer by parameter size."""
    weights = macs if sum(macs) else [sum(p.numel() for p in params) for _, params in layers]
    total = sum(weights) or 1
    share = {}
    for weight, (_, params) in zip(weights, layers):
        size = sum(p.numel() for p in params) or 1
        for param in params:
            share[id(param)] = weight / total * param.numel() / size
    return share


def measured_shares(layers: list[tuple[nn.Module, list[nn.Parameter]]],
                    layer_shares: list) -> tuple[list[float], dict[int, float]]:
    """Measured per-layer shares of a step (the config's ``layer_shares``: per layer that owns
    parameters, in forward order, [parameters, forward share, backward share], the shares of
    every layer summing to 1) for ``layers`` (:func:`owning_layers`): each layer's forward share
    and each parameter's backward share (its layer's, split by parameter size). The model must
    have the profile's layers: as many, each with the profile's parameter count (a measured
    ResNet-50's 107 layers on this repository's ResNet-50); otherwise a ConfigError naming the
    first that differs."""
    from trainers.config import ConfigError

    if len(layer_shares) != len(layers):
        raise ConfigError("layer_shares", f"the profile has {len(layer_shares)} layers, the model "
                          f"{len(layers)} that own parameters")
    forward, backward = [], {}
    for index, ((module, params), (parameters, fwd, bwd)) in enumerate(zip(layers, layer_shares)):
        size = sum(p.numel() for p in params)
        if size != int(parameters):
            raise ConfigError("layer_shares", f"layer {index} ({type(module).__name__}) has {size} parameters, "
                              f"the profile's layer {index} {int(parameters)}: not the measured model")
        forward.append(float(fwd))
        for param in params:
            backward[id(param)] = float(bwd) * param.numel() / (size or 1)
    return forward, backward


class LayerPadding:
    """Pads ``model``'s layers to ``step_s`` seconds per forward + backward (see module docstring).

    Create it before any algorithm registers hooks: its gradient hooks must run first. Its forward
    pre-hooks are registered at the first forward pass, after the algorithm's. With
    ``layer_shares`` (:func:`measured_shares`) every step is padded from the first, by those shares;
    each layer is taken to run once per forward pass (as in the measured models)."""

    def __init__(self, model: nn.Module, step_s: float, forward_fraction: float = FORWARD_FRACTION,
                 layer_shares: Optional[list] = None):
        self.step_s = step_s
        self.forward_fraction = forward_fraction
        self.layers = owning_layers(model)
        self.macs: Optional[list[int]] = None  # per layer, from the first forward pass
        self._forward_shares: Optional[list[float]] = None  # measured, per layer (layer_shares)
        self._first_macs = [0] * len(self.layers)
        self._layer_started: dict[int, float] = {}
        self._last = 0.0  # end of the last padded piece (a layer's forward or a gradient)
        self.padded_s = 0.0  # seconds slept so far (tests, records)
        self._share: dict[int, float] = {}
        self._measuring = False
        for index, (module, params) in enumerate(self.layers):
            module.register_forward_hook(lambda m, inputs, output, index=index: self._forward_done(index, output))
            for param in params:
                param.register_post_accumulate_grad_hook(lambda p: self._gradient_done(p))
        self._late_hooks = model.register_forward_pre_hook(lambda m, inputs: self._register_pre_hooks())
        if layer_shares is not None:
            self._forward_shares, self._share = measured_shares(self.layers, layer_shares)
            self.macs = []  # nothing to measure

    def _register_pre_hooks(self) -> None:
        """At the first forward pass, after the algorithm registered its own pre-hooks."""
        self._late_hooks.remove()
        for index, (module, _) in enumerate(self.layers):
            module.register_forward_pre_hook(lambda m, inputs, index=index: self._forward_starts(index))

    def _forward_starts(self, index: int) -> None:
        self._measuring = False  # the backward pass of the first step is over
        self._layer_started[index] = clock.perf_counter()

    def _forward_done(self, index: int, output) -> None:
        module, params = self.layers[index]
        if self._forward_shares is not None:
            share = self.step_s * self._forward_shares[index]
            self._sleep_until(self._layer_started.get(index, clock.perf_counter()) + share)
        elif self.macs is None:
            self._first_macs[index] += layer_macs(module, params, output)
        else:
            total = sum(self.macs) or 1
            share = self.forward_fraction * self.step_s * layer_macs(module, params, output) / total
            self._sleep_until(self._layer_started.get(index, clock.perf_counter()) + share)
        self._last = clock.perf_counter()

    def _gradient_done(self, param: nn.Parameter) -> None:
        if self.macs is None:
            self._estimate()
            self._measuring = True
        if self._measuring:  # the first step only measures
            self._last = clock.perf_counter()
            return
        backward = 1.0 if self._forward_shares is not None else 1 - self.forward_fraction  # measured: in the share
        self._sleep_until(self._last + backward * self.step_s * self._share[id(param)])
        self._last = clock.perf_counter()

    def _estimate(self) -> None:
        self.macs = self._first_macs
        self._share = backward_shares(self.layers, self.macs)

    def _sleep_until(self, deadline: float) -> None:
        left = deadline - clock.perf_counter()
        if left > 0:
            clock.pad(left)
            self.padded_s += left
