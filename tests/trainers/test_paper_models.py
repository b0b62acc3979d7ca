"""The P3 paper's models at their real layer sizes (trainers/models.py: resnet50, vgg19,
sockeye_rnn): parameter counts against the published totals, per-layer sizes, and the compute
spread measured at the paper's 224x224 images whatever size the data are."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainers.config import ConfigError
from trainers.models import build_model
from trainers.padding import layer_macs, owning_layers


def _sizes(model):
    return {name: p.numel() for name, p in model.named_parameters()}


def test_resnet50_has_torchvisions_parameters_and_compute():
    """torchvision.models.resnet50 (v1.5): 25,557,032 parameters in 161 arrays (53 convolutions,
    53 BatchNorms with a scale and a shift each, the classifier's weight and bias); 4.09 G
    multiply-accumulates per 224x224 image in its convolutions and classifier (torchvision's
    "GFLOPS 4.09")."""
    model = build_model("resnet50", {}, (3, 32, 32), 10, seed=0)
    sizes = _sizes(model)
    assert sum(sizes.values()) == 25_557_032 and len(sizes) == 161
    assert sizes["0.weight"] == 64 * 3 * 7 * 7
    assert sizes["19.conv2.weight"] == 512 * 512 * 3 * 3  # the last block's 3x3 (v1.5: it carries the stride)
    assert sizes["22.weight"] == 2048 * 1000 and sizes["22.bias"] == 1000
    layers = owning_layers(model)
    assert len(layers) == 107
    heavy = sum(module.nominal_macs for module, _ in layers if isinstance(module, (nn.Conv2d, nn.Linear)))
    assert heavy == pytest.approx(4.09e9, rel=1e-3)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 1000)


def test_vgg19_has_torchvisions_parameters_and_compute():
    """torchvision.models.vgg19: 143,667,240 parameters, 102,760,448 of them in the first fully
    connected layer (25,088 x 4,096: the 7x7 pool gives it its real size on small images too);
    19.6 G multiply-accumulates per 224x224 image (torchvision's "GFLOPS 19.63"; with the biases)."""
    model = build_model("vgg19", {}, (3, 32, 32), 10, seed=0)
    sizes = _sizes(model)
    assert sum(sizes.values()) == 143_667_240 and len(sizes) == 38
    linear = [m for m in model if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linear] == [(25_088, 4096), (4096, 4096), (4096, 1000)]
    assert linear[0].weight.numel() == 102_760_448
    assert sum(m.nominal_macs for m, _ in owning_layers(model)) == pytest.approx(19.63e9, rel=2e-3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 1000)


def test_sockeye_rnn_layer_sizes_follow_the_p3_configuration():
    """Sockeye 1.5's RNN model with P3's settings: every array's size from the configuration
    (embeddings 17,191 and 7,709 x 512; a bidirectional first encoder layer of 256 each way, one
    more of 512; decoder layers of 512, the first reading embedding and attention output; MLP
    attention of 512; the output layer), 27,733,021 in all."""
    model = build_model("sockeye_rnn", {}, (6,), 100, seed=0)
    sizes = _sizes(model)

    def lstm(inputs, hidden):  # weights, and MXNet's and torch's two bias vectors
        return 4 * hidden * (inputs + hidden) + 8 * hidden

    expected = {
        "source_embedding": 17_191 * 512, "encoder_forward": lstm(512, 256), "encoder_backward": lstm(512, 256),
        "encoder_upper": lstm(512, 512), "state_init": 4 * (512 * 512 + 512), "target_embedding": 7_709 * 512,
        "decoder.0": lstm(1024, 512), "decoder.1": lstm(512, 512), "attention_source": 512 * 512,
        "attention_query": 512 * 512, "attention_score": 512, "attention_output": 1024 * 512 + 512,
        "output": 512 * 7_709 + 7_709,
    }
    for prefix, count in expected.items():
        assert sum(n for name, n in sizes.items() if name.startswith(prefix + ".")) == count, prefix
    assert sum(sizes.values()) == sum(expected.values()) == 27_733_021
    assert model(torch.randint(100, (2, 6))).shape == (2, 6, 7_709)


def test_the_compute_spread_is_the_nominal_images_not_the_data():
    """On 32x32 data a VGG-19's convolutions cost 49x less than at 224x224 against the same
    classifier; the layers state their 224x224 multiply-accumulates, and layer_macs returns them."""
    model = build_model("vgg19", {}, (3, 32, 32), 10, seed=0)
    first_conv = model[0]
    assert first_conv.nominal_macs == 64 * 3 * 9 * 224 * 224 + 64 * 224 * 224
    assert layer_macs(first_conv, list(first_conv.parameters()), torch.zeros(1, 64, 32, 32)) == first_conv.nominal_macs
    measured = build_model("vgg19", {"nominal_image_size": None}, (3, 32, 32), 10, seed=0)
    assert not hasattr(measured[0], "nominal_macs")


@pytest.mark.parametrize("name, params, field", [
    ("resnet50", {"num_classes": 5}, "model.params.num_classes"),
    ("vgg19", {"nominal_image_size": 8}, "model.params.nominal_image_size"),
    ("sockeye_rnn", {"hidden": 511}, "model.params.hidden"),
])
def test_bad_settings_name_the_field(name, params, field):
    with pytest.raises(ConfigError, match=f"^{field}"):
        build_model(name, params, (3, 32, 32) if name != "sockeye_rnn" else (6,), 10, seed=0)
