"""Workload models: MLP, LeNet-like CNN, CIFAR-style ResNet-20, FC-heavy VGG, tiny Transformer LM, and
the P3 paper's models at their real layer sizes: ResNet-50, VGG-19, Sockeye's RNN translation model.

Each builder takes (params, input_shape, num_classes) and returns an ``nn.Module`` mapping a
batch of inputs to logits over ``num_classes`` (per position for the language model).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Optional

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


# --- the P3 paper's models with their real layer sizes (issue 23) ---------------------------------


def set_nominal_macs(model: nn.Module, input_shape: tuple[int, ...]) -> nn.Module:
    """Record on each module that owns parameters its multiply-accumulates for one sample of
    ``input_shape`` (``module.nominal_macs``; trainers.padding.layer_macs returns it in place of
    the measured value). The paper's image models see 224x224 images; trained here on small
    images their convolutions would cost 49x less against the same fully connected layers, and
    the compute spread over layers (padding, the simulator) would be wrong. Computed on the meta
    device: shapes only, no arithmetic."""
    from trainers.padding import layer_macs, owning_layers

    shadow = copy.deepcopy(model).to("meta")
    layers, shadow_layers = owning_layers(model), owning_layers(shadow)
    macs = [0] * len(layers)
    handles = [module.register_forward_hook(lambda m, i, out, index=index, params=params: macs.__setitem__(
        index, macs[index] + layer_macs(m, params, out))) for index, (module, params) in enumerate(shadow_layers)]
    with torch.no_grad():
        shadow(torch.empty(1, *input_shape, device="meta"))
    for handle in handles:
        handle.remove()
    for (module, _), value in zip(layers, macs):
        module.nominal_macs = value
    return model


def _head_classes(head: Optional[int], dataset_classes: int, model: str) -> int:
    if head is None:
        return dataset_classes
    if head < dataset_classes:
        raise ConfigError("model.params.num_classes", f"{model}: {head} outputs for a dataset of {dataset_classes} classes")
    return head


@dataclass
class ResNet50Params:
    """Args: num_classes: outputs of the last layer (1000, ImageNet's, keeps the real head; None:
    the dataset's); nominal_image_size: side of the image the compute spread is measured for
    (224, the paper's; None: the real inputs)."""

    num_classes: Optional[int] = 1000
    nominal_image_size: Optional[int] = 224

    def __post_init__(self) -> None:
        if self.num_classes is not None:
            require_int("num_classes", self.num_classes, minimum=1)
        if self.nominal_image_size is not None:
            require_int("nominal_image_size", self.nominal_image_size, minimum=32)


class _Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck (torchvision's): 1x1, 3x3 (carries the stride), 1x1 x4, BatchNorm after each."""

    def __init__(self, in_channels: int, width: int, stride: int):
        super().__init__()
        out_channels = 4 * width
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample: Optional[nn.Module] = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                                            nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


def build_resnet50(params: ResNet50Params, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """ResNet-50 v1.5 as torchvision.models.resnet50 defines it (25,557,032 parameters with 1000 classes)."""
    channels, _, _ = _image_shape(input_shape, "resnet50")
    layers: list[nn.Module] = [nn.Conv2d(channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    in_channels = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for block in range(blocks):
            layers.append(_Bottleneck(in_channels, width, stride if block == 0 else 1))
            in_channels = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, _head_classes(params.num_classes, num_classes, "resnet50"))]
    model = nn.Sequential(*layers)
    if params.nominal_image_size:
        set_nominal_macs(model, (channels, params.nominal_image_size, params.nominal_image_size))
    return model


@dataclass
class VGG19Params:
    """Args: num_classes and nominal_image_size as ResNet50Params; dropout: the classifier's
    (torchvision's 0.5)."""

    num_classes: Optional[int] = 1000
    nominal_image_size: Optional[int] = 224
    dropout: float = 0.5

    def __post_init__(self) -> None:
        if self.num_classes is not None:
            require_int("num_classes", self.num_classes, minimum=1)
        if self.nominal_image_size is not None:
            require_int("nominal_image_size", self.nominal_image_size, minimum=32)
        require_float("dropout", self.dropout, minimum=0.0, maximum=1.0)


VGG19_CHANNELS = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


def build_vgg19(params: VGG19Params, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """VGG-19 (configuration E) as torchvision.models.vgg19 defines it: 16 3x3 convolutions, a 7x7
    adaptive average pool (so any image of 32 px or more gives the 25,088 inputs of the real
    classifier), FC 4096, 4096, classes (143,667,240 parameters with 1000 classes)."""
    channels, height, _ = _image_shape(input_shape, "vgg19")
    if height < 32:
        raise ConfigError("model.name", f"vgg19: five 2x2 pools need images of 32 px or more, got {height}")
    features: list[nn.Module] = []
    for width in VGG19_CHANNELS:
        if width == "M":
            features.append(nn.MaxPool2d(2))
        else:
            features += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU()]
            channels = width
    model = nn.Sequential(
        *features, nn.AdaptiveAvgPool2d(7), nn.Flatten(),
        nn.Linear(512 * 7 * 7, 4096), nn.ReLU(), nn.Dropout(params.dropout),
        nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(params.dropout),
        nn.Linear(4096, _head_classes(params.num_classes, num_classes, "vgg19")))
    if params.nominal_image_size:
        set_nominal_macs(model, (input_shape[0], params.nominal_image_size, params.nominal_image_size))
    return model


@dataclass
class SockeyeRNNParams:
    """The RNN translation model P3 trained with Sockeye 1.5 (github.com/anandj91/p3 run_exp.sh:
    ``--encoder rnn --decoder rnn --num-layers 2:2 --rnn-cell-type lstm --rnn-num-hidden 512
    --num-embed 512:512 --attention-type mlp --attention-num-hidden 512``, IWSLT'15 en-vi).

    Args: source_vocab, target_vocab: the tokens of vocab.en and vocab.vi (TF NMT's IWSLT'15
    files: 17,191 and 7,709); hidden: LSTM and attention width; embed: embedding width; layers:
    encoder and decoder layers each."""

    source_vocab: int = 17_191
    target_vocab: int = 7_709
    hidden: int = 512
    embed: int = 512
    layers: int = 2

    def __post_init__(self) -> None:
        for name in ("source_vocab", "target_vocab", "embed", "layers"):
            require_int(name, getattr(self, name), minimum=1)
        require_int("hidden", self.hidden, minimum=2)
        if self.hidden % 2:
            raise ConfigError("hidden", f"must be even (the first encoder layer is bidirectional, half each way), got {self.hidden}")


class SockeyeRNN(nn.Module):
    """Sockeye 1.x's RNN model as configured above: source embedding; encoder of a bidirectional
    LSTM layer (hidden/2 each way) then unidirectional layers; target embedding; decoder LSTMs
    with input feeding (the first layer reads the embedding and the previous attention output);
    MLP attention (source and query projections, a score vector); the attention output
    tanh(W [context; decoder state]); decoder states initialised from the encoder's last state
    through one linear layer per state; the output layer over the target vocabulary.
    Teacher forcing: the same token sequence is the source and the decoder's input (a
    throughput stand-in, the data are not translations)."""

    def __init__(self, params: SockeyeRNNParams, max_target_tokens: int):
        super().__init__()
        h, e = params.hidden, params.embed
        self.source_embedding = nn.Embedding(params.source_vocab, e)
        self.encoder_forward = nn.LSTM(e, h // 2, batch_first=True)
        self.encoder_backward = nn.LSTM(e, h // 2, batch_first=True)
        self.encoder_upper = nn.LSTM(h, h, params.layers - 1, batch_first=True) if params.layers > 1 else None
        self.state_init = nn.ModuleList(nn.Linear(h, h) for _ in range(2 * params.layers))  # (h, c) per layer
        self.target_embedding = nn.Embedding(params.target_vocab, e)
        self.decoder = nn.ModuleList(nn.LSTMCell(e + h if i == 0 else h, h) for i in range(params.layers))
        self.attention_source = nn.Linear(h, h, bias=False)
        self.attention_query = nn.Linear(h, h, bias=False)
        self.attention_score = nn.Linear(h, 1, bias=False)
        self.attention_output = nn.Linear(2 * h, h)
        self.output = nn.Linear(h, params.target_vocab)
        self.target_vocab = params.target_vocab
        self.max_target_tokens = max_target_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        source = self.source_embedding(tokens % self.source_embedding.num_embeddings)
        forward_states, _ = self.encoder_forward(source)
        backward_states, _ = self.encoder_backward(source.flip(1))
        encoded = torch.cat([forward_states, backward_states.flip(1)], dim=-1)
        if self.encoder_upper is not None:
            encoded, _ = self.encoder_upper(encoded)
        last = encoded[:, -1]
        states = [(torch.tanh(self.state_init[2 * i](last)), torch.tanh(self.state_init[2 * i + 1](last)))
                  for i in range(len(self.decoder))]
        keys = self.attention_source(encoded)
        target = self.target_embedding(tokens % self.target_vocab)
        attended = torch.zeros_like(last)
        outputs = []
        for t in range(tokens.shape[1]):
            layer_input = torch.cat([target[:, t], attended], dim=-1)
            for i, cell in enumerate(self.decoder):
                states[i] = cell(layer_input, states[i])
                layer_input = states[i][0]
            query = self.attention_query(layer_input).unsqueeze(1)
            weights = torch.softmax(self.attention_score(torch.tanh(keys + query)).squeeze(-1), dim=1)
            context = (weights.unsqueeze(-1) * encoded).sum(1)
            attended = torch.tanh(self.attention_output(torch.cat([context, layer_input], dim=-1)))
            outputs.append(attended)
        return self.output(torch.stack(outputs, dim=1))


def build_sockeye_rnn(params: SockeyeRNNParams, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The Sockeye RNN model over token sequences of length input_shape[0]; the dataset's classes
    (its vocabulary) must fit the target vocabulary."""
    _head_classes(params.target_vocab, num_classes, "sockeye_rnn")
    return SockeyeRNN(params, max_target_tokens=input_shape[0])


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
    "resnet50": ModelEntry(build_resnet50, ResNet50Params, "features"),
    "vgg19": ModelEntry(build_vgg19, VGG19Params, "features"),
    "sockeye_rnn": ModelEntry(build_sockeye_rnn, SockeyeRNNParams, "tokens"),
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
