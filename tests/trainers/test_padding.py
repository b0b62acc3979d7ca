"""pad_layers: a compute profile's step time spread over the layers by multiply-accumulates, on a
fake clock (real compute takes no time there, so every pad is exactly its share)."""

from __future__ import annotations

import pytest
import torch

from trainers import clock
from trainers.config import ConfigError, Config
from trainers.padding import LayerPadding, layer_macs


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    monotonic = perf_counter

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds

    pad = sleep  # a layer's pad: counted by compute_done (the time since the pass started)

    def compute_done(self, started):
        return self.now - started

    def step_done(self):
        pass

    def attach(self, model, layer_shares=None):
        pass


@pytest.fixture
def fake_clock():
    fake = FakeClock()
    previous = clock.install(fake)
    yield fake
    clock.install(previous)


def model_and_macs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(512, 10))
    x = torch.zeros(2, 3, 8, 8)
    conv = layer_macs(model[0], list(model[0].parameters()), model[0](x))
    linear = layer_macs(model[2], list(model[2].parameters()), model[2](model[1](model[0](x))))
    return model, x, conv, linear


def test_each_layer_meets_its_share_and_a_wait_is_not_compute(fake_clock):
    model, x, conv, linear = model_and_macs()
    padding = LayerPadding(model, step_s=0.3)
    seen = {}
    # an algorithm's hooks, registered after the padding (as the runner orders them): p3 waits in a
    # layer's pre-hook for its slices and sends a slice from a gradient hook
    def wait_for_slices(module, inputs):
        seen.setdefault("linear_wait_from", fake_clock.now)
        fake_clock.sleep(1.0)

    model[2].register_forward_pre_hook(wait_for_slices)
    def gradient_seen(name):
        def hook(param):
            seen.setdefault(name, fake_clock.now)
        return hook

    model[0].weight.register_post_accumulate_grad_hook(gradient_seen("conv_grad"))
    model[2].weight.register_post_accumulate_grad_hook(gradient_seen("linear_grad"))

    model(x).sum().backward()  # the first pass measures the layers, pads nothing
    assert fake_clock.now == pytest.approx(1.0) and padding.padded_s == 0.0
    seen.clear()
    fake_clock.now = 0.0
    padding.padded_s = 0.0
    model(x).sum().backward()
    forward = 0.3 / 3
    conv_forward, linear_forward = forward * conv / (conv + linear), forward * linear / (conv + linear)
    assert seen["linear_wait_from"] == pytest.approx(conv_forward)  # the conv layer's forward share
    end_of_forward = conv_forward + 1.0 + linear_forward  # the wait is not part of the linear layer's share
    backward = 0.3 - forward
    # backward runs output-first: the linear layer's gradients, then the conv layer's; a gradient hook
    # of the algorithm sees a parameter's gradient only once its share is spent
    linear_weight = backward * linear / (conv + linear) * model[2].weight.numel() / (model[2].weight.numel() + 10)
    assert seen["linear_grad"] >= end_of_forward + linear_weight - 1e-9
    assert fake_clock.now == pytest.approx(1.0 + 0.3)  # the profile's step, plus the wait
    assert padding.padded_s == pytest.approx(0.3)


def test_pad_layers_needs_min_compute_s():
    with pytest.raises(ConfigError, match="pad_layers"):
        Config(output_dir="/tmp/x", pad_layers=True)
    assert Config(output_dir="/tmp/x", pad_layers=True, min_compute_s=0.2).pad_layers


def test_measured_layer_shares_pad_every_step_from_the_first(fake_clock):
    """layer_shares (a measured profile's) replace the multiply-accumulates and the fixed forward
    fraction: each layer's forward and each gradient padded to its measured share, from step 1."""
    model, x, _, _ = model_and_macs()
    conv_params, linear_params = 8 * 3 * 9 + 8, 512 * 10 + 10
    padding = LayerPadding(model, step_s=1.0, layer_shares=[[conv_params, 0.1, 0.3], [linear_params, 0.2, 0.4]])
    seen = {}
    def at(name):
        def hook(*args):
            seen.setdefault(name, fake_clock.now)  # returns None: a pre-hook's value would replace the input
        return hook

    model[2].register_forward_pre_hook(at("linear_starts"))
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(at(name))
    model(x).sum().backward()
    assert seen["linear_starts"] == pytest.approx(0.1)  # the conv layer's measured forward share
    # backward runs output-first: the linear layer's 0.4 (split by parameter size, in the order
    # autograd hands its gradients over), then the conv layer's 0.3
    first_linear = min(seen["2.weight"], seen["2.bias"]) - 0.3
    assert first_linear == pytest.approx(0.4 * 512 * 10 / linear_params) or first_linear == pytest.approx(0.4 * 10 / linear_params)
    assert max(seen["2.weight"], seen["2.bias"]) == pytest.approx(0.3 + 0.4)
    assert max(seen["0.weight"], seen["0.bias"]) == pytest.approx(0.7 + 0.3)
    assert fake_clock.now == pytest.approx(1.0) and padding.padded_s == pytest.approx(1.0)


def test_measured_layer_shares_must_be_the_models_layers():
    model, _, _, _ = model_and_macs()
    with pytest.raises(ConfigError, match=r"layer_shares: layer 1 \(Linear\) has 5130 parameters, the profile's layer 1 5000"):
        LayerPadding(model, step_s=1.0, layer_shares=[[224, 0.1, 0.3], [5000, 0.2, 0.4]])
    with pytest.raises(ConfigError, match="layer_shares: the profile has 1 layers, the model 2"):
        LayerPadding(model, step_s=1.0, layer_shares=[[224, 0.5, 0.5]])


@pytest.mark.parametrize("shares, where", [([[1, 0.5, 0.6]], "sum to 1.1"), ([[1, 0.5]], r"layer_shares\[0\]"),
                                           ([[-1, 0.5, 0.5]], r"layer_shares\[0\]"), ([], "non-empty")])
def test_layer_shares_are_checked_in_the_config(shares, where):
    with pytest.raises(ConfigError, match=where):
        Config(output_dir="/tmp/x", layer_shares=shares)
