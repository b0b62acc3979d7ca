"""Workload models: MLP, LeNet-like CNN, CIFAR-style ResNet-20, FC-heavy VGG, tiny Transformer LM.

Each builder takes (params, input_shape, num_classes) and returns an ``nn.Module`` mapping a
batch of inputs to logits over ``num_classes`` (per position for the language model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from trainers.config import ConfigError, from_dict, require_float, require_int


def _flat_size(features: nn.Module, input_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return features(torch.zeros(1, *input_shape)).numel()


def _with_classifier(features: nn.Module, input_shape, fc_sizes: list[int], num_classes: int) -> nn.Sequential:
    """`features` followed by fully connected layers of `fc_sizes` (ReLU) and the output layer."""
    layers: list[nn.Module] = [features]
    width = _flat_size(features, input_shape)
    for hidden in fc_sizes:
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


@dataclass
class MLPParams:
    """Args: hidden_sizes: width of each hidden layer (ReLU between)."""

    hidden_sizes: list[int] = field(default_factory=lambda: [64])

    def __post_init__(self) -> None:
        for i, width in enumerate(self.hidden_sizes):
            require_int(f"hidden_sizes[{i}]", width, minimum=1)


def build_mlp(params: MLPParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, then Linear+ReLU per hidden size, then a Linear classifier."""
    return _with_classifier(nn.Flatten(), input_shape, params.hidden_sizes, num_classes)


@dataclass
class LeNetParams:
    """Args: channels: output channels of the two 5x5 conv layers; fc_sizes: hidden FC widths."""

    channels: list[int] = field(default_factory=lambda: [6, 16])
    fc_sizes: list[int] = field(default_factory=lambda: [120, 84])

    def __post_init__(self) -> None:
        if len(self.channels) != 2:
            raise ConfigError("channels", f"must list exactly 2 widths, got {self.channels!r}")
        for name, values in (("channels", self.channels), ("fc_sizes", self.fc_sizes)):
            for i, width in enumerate(values):
                require_int(f"{name}[{i}]", width, minimum=1)


def _image_shape(input_shape: tuple[int, ...], model: str) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ConfigError("model.name", f"{model} needs image inputs (C, H, W), got shape {input_shape}")
    return input_shape  # type: ignore[return-value]


def build_lenet(params: LeNetParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two padded 5x5 conv + max-pool stages, then FC layers (works from 8x8 inputs upwards)."""
    channels, _, _ = _image_shape(input_shape, "lenet")
    c1, c2 = params.channels
    features = nn.Sequential(
        nn.Conv2d(channels, c1, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
    )
    return _with_classifier(features, input_shape, params.fc_sizes, num_classes)


@dataclass
class ResNetParams:
    """Args: blocks_per_stage: residual blocks in each of the 3 stages (3 -> ResNet-20); width: first stage channels."""

    blocks_per_stage: int = 3
    width: int = 16

    def __post_init__(self) -> None:
        require_int("blocks_per_stage", self.blocks_per_stage, minimum=1)
        require_int("width", self.width, minimum=1)


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def build_resnet(params: ResNetParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """CIFAR-style ResNet (He et al. 2016, sec. 4.2): 6n+2 layers, stages of width w, 2w, 4w."""
    channels, _, _ = _image_shape(input_shape, "resnet20")
    w = params.width
    layers: list[nn.Module] = [nn.Conv2d(channels, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU()]
    in_channels = w
    for stage, out_channels in enumerate((w, 2 * w, 4 * w)):
        for block in range(params.blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(_BasicBlock(in_channels, out_channels, stride))
            in_channels = out_channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*layers)


@dataclass
class VGGParams:
    """Args: conv_channels: 3x3 conv widths, each followed by 2x2 max-pool; fc_sizes: hidden FC widths.

    The defaults put most parameters in the FC layers (as in VGG), the case where bucketed,
    overlapped all-reduce matters: the last layers' gradients are ready first.
    """

    conv_channels: list[int] = field(default_factory=lambda: [32, 64])
    fc_sizes: list[int] = field(default_factory=lambda: [512, 512])

    def __post_init__(self) -> None:
        for name, values in (("conv_channels", self.conv_channels), ("fc_sizes", self.fc_sizes)):
            for i, width in enumerate(values):
                require_int(f"{name}[{i}]", width, minimum=1)


def build_vgg(params: VGGParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """conv3x3+ReLU+maxpool stages, then large FC layers with dropout-free ReLU."""
    channels, height, _ = _image_shape(input_shape, "vgg")
    if height < 2 ** len(params.conv_channels):
        raise ConfigError("model.params.conv_channels", f"{len(params.conv_channels)} pooling stages shrink {height}px below 1")
    stages: list[nn.Module] = []
    for width in params.conv_channels:
        stages += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        channels = width
    features = nn.Sequential(*stages, nn.Flatten())
    return _with_classifier(features, input_shape, params.fc_sizes, num_classes)


@dataclass
class TransformerParams:
    """Args: d_model: embedding width; n_heads: attention heads; n_layers: blocks; ff_mult: MLP width / d_model."""

    d_model: int = 64
    n_heads: int = 2
    n_layers: int = 2
    ff_mult: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require_int("d_model", self.d_model, minimum=1)
        require_int("n_heads", self.n_heads, minimum=1)
        require_int("n_layers", self.n_layers, minimum=1)
        require_int("ff_mult", self.ff_mult, minimum=1)
        require_float("dropout", self.dropout, minimum=0.0, maximum=1.0)
        if self.d_model % self.n_heads:
            raise ConfigError("d_model", f"must be divisible by n_heads={self.n_heads}, got {self.d_model}")


class TinyTransformerLM(nn.Module):
    """Decoder-only LM: token + learned position embeddings, causal pre-norm encoder blocks, tied-free head."""

    def __init__(self, params: TransformerParams, seq_len: int, vocab_size: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, params.d_model)
        self.position_embedding = nn.Embedding(seq_len, params.d_model)
        layer = nn.TransformerEncoderLayer(
            params.d_model, params.n_heads, params.ff_mult * params.d_model,
            dropout=params.dropout, batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(layer, params.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(params.d_model)
        self.head = nn.Linear(params.d_model, vocab_size)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device)
        hidden = self.token_embedding(tokens) + self.position_embedding(positions)
        hidden = self.blocks(hidden, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(self.norm(hidden))


def build_transformer(params: TransformerParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Tiny Transformer LM over sequences of length input_shape[0] and vocabulary num_classes."""
    return TinyTransformerLM(params, seq_len=input_shape[0], vocab_size=num_classes)


@dataclass
class ModelEntry:
    """Registry entry: builder, its Params dataclass, and the input kind it accepts."""

    build: Callable[..., nn.Module]
    Params: type
    input_kind: str


MODELS: dict[str, ModelEntry] = {
    "mlp": ModelEntry(build_mlp, MLPParams, "features"),
    "lenet": ModelEntry(build_lenet, LeNetParams, "features"),
    "resnet20": ModelEntry(build_resnet, ResNetParams, "features"),
    "vgg": ModelEntry(build_vgg, VGGParams, "features"),
    "transformer": ModelEntry(build_transformer, TransformerParams, "tokens"),
}


def get_model_entry(name: str) -> ModelEntry:
    """Registry lookup; KeyError names the known models."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r} (known: {sorted(MODELS)})")
    return MODELS[name]


def build_model(name: str, params: dict, input_shape: tuple[int, ...], num_classes: int, seed: int) -> nn.Module:
    """Build model ``name`` with parameters initialised from ``seed`` (same on every rank)."""
    entry = get_model_entry(name)
    resolved = from_dict(entry.Params, params, "model.params")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return entry.build(resolved, input_shape, num_classes)
