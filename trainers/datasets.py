"""Datasets (held in memory as tensors), seeded train/test splits, and IID / Dirichlet sharding.

Every loader returns a :class:`DataBundle`. ``kind`` says what the inputs are: ``features``
(float tensors of any shape, one class label per sample) or ``tokens`` (int64 sequences, one
target token per position). Image datasets of CIFAR's size keep their pixels as uint8 (a quarter
of float32's memory: 150 MB instead of 600 MB for 50,000 images) and scale each batch as it is
taken (:meth:`DataBundle.inputs`). ``source`` says in one line where the samples came from; every
rank writes it in its ``data`` record. Nothing is downloaded: file-based datasets read a user-given
path and fail with a message saying what was expected there (``cifar10`` can fall back to
generated CIFAR-shaped data, ``synthetic_cifar``, when asked to).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import pickle
import platform
import struct
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F

from trainers.config import ConfigError, DatasetConfig, from_dict, require_float, require_int


@dataclass(frozen=True)
class PixelScaling:
    """How stored uint8 pixels become model inputs: x / 255, then (x - mean) / std per channel."""

    mean: tuple[float, ...]
    std: tuple[float, ...]


@dataclass
class DataBundle:
    """Train and held-out test tensors plus the shapes a model needs.

    ``train_x`` / ``test_x`` are the stored samples: model inputs as they are, or uint8 pixels
    when ``pixels`` is set; :meth:`inputs` turns a batch of either into model inputs. ``source``
    says where the samples came from, in one line (a path, or the generator and its seed).
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    input_shape: tuple[int, ...]
    num_classes: int
    kind: Literal["features", "tokens"]
    source: str = ""
    pixels: Optional[PixelScaling] = None

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Model inputs for stored samples ``x`` (a batch of train_x or test_x, on any device)."""
        if self.pixels is None:
            return x
        mean = torch.tensor(self.pixels.mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        std = torch.tensor(self.pixels.std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
        return (x.float() / 255.0 - mean) / std


@dataclass
class DatasetEntry:
    """Registry entry: loader, its Params dataclass, and the kind of input it provides."""

    load: Callable[[DatasetConfig, object, int], DataBundle]
    Params: type
    kind: str


# ---------------------------------------------------------------------------------------------
# Parameters of each dataset (dataset.params in the config).


@dataclass
class NoParams:
    """This dataset takes no parameters."""


@dataclass
class SyntheticParams:
    """Seeded Gaussian-cluster classification.

    Args:
        n_samples: total samples before the test split.
        n_features: input dimension.
        n_classes: number of classes (one cluster centre each).
        noise: standard deviation of samples around their class centre (centres have norm ~3).
    """

    n_samples: int = 4000
    n_features: int = 32
    n_classes: int = 10
    noise: float = 1.0

    def __post_init__(self) -> None:
        require_int("n_samples", self.n_samples, minimum=20)
        require_int("n_features", self.n_features, minimum=1)
        require_int("n_classes", self.n_classes, minimum=2)
        require_float("noise", self.noise, minimum=0.0)


@dataclass
class TokenParams:
    """Seeded synthetic token stream from a sparse random Markov chain (learnable structure).

    Args:
        vocab_size: number of distinct tokens.
        seq_len: tokens per training sequence (targets are the next tokens).
        n_sequences: total sequences before the test split.
        branching: successors each token can have; lower is easier to predict.
    """

    vocab_size: int = 64
    seq_len: int = 32
    n_sequences: int = 2000
    branching: int = 4

    def __post_init__(self) -> None:
        require_int("vocab_size", self.vocab_size, minimum=2)
        require_int("seq_len", self.seq_len, minimum=2)
        require_int("n_sequences", self.n_sequences, minimum=20)
        require_int("branching", self.branching, minimum=1, maximum=self.vocab_size)


@dataclass
class TextCorpusParams:
    """Byte-level language modelling on text files (see :func:`load_text_corpus`).

    Args:
        seq_len: bytes per training sequence (the targets are the next bytes).
        pattern: which files of the folder make the corpus (``Path.glob``; ``**/*.txt`` to recurse).
            The default, ``*.py``, is the Python standard library's own top-level modules when
            dataset.path is unset.
        max_files: use only the first this many files of the sorted list (None: all).
    """

    seq_len: int = 64
    pattern: str = "*.py"
    max_files: Optional[int] = None

    def __post_init__(self) -> None:
        require_int("seq_len", self.seq_len, minimum=2, maximum=4096)
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ConfigError("pattern", f"must be a non-empty glob pattern, got {self.pattern!r}")
        if self.max_files is not None:
            require_int("max_files", self.max_files, minimum=1)


@dataclass
class ImageFolderParams:
    """Folder of class sub-folders of images (PIL needed).

    Args:
        image_size: images are resized to image_size x image_size pixels, RGB.
        max_per_class: cap on images read per class (None: all).
    """

    image_size: int = 32
    max_per_class: Optional[int] = None

    def __post_init__(self) -> None:
        require_int("image_size", self.image_size, minimum=4)
        if self.max_per_class is not None:
            require_int("max_per_class", self.max_per_class, minimum=1)


@dataclass
class SyntheticCifarParams:
    """Generated images of CIFAR-10's shape (3x32x32), learnable by a convnet but not at a glance.

    Each class has ``modes_per_class`` smooth colour templates (seeded random fields on a
    ``template_cells`` x ``template_cells`` grid, upsampled). A sample is one of its class's
    templates, cropped at a random offset of up to ``max_shift`` pixels and mirrored half the
    time, at a random contrast, over a class-independent smooth background field and per-pixel
    noise, stored as uint8. Shifts and clutter keep a linear model on the pixels far from 100%;
    a convnet's pooled features see through them over several epochs.

    Args:
        n_train: training images (CIFAR-10: 50,000; 150 MB as uint8).
        n_test: held-out images (CIFAR-10: 10,000).
        n_classes: classes (CIFAR-10: 10); the labels are balanced.
        modes_per_class: templates per class (more: more variety within a class).
        template_cells: grid of the templates' random field; more cells: finer texture.
        max_shift: largest crop offset in pixels, each way.
        background: amplitude of the clutter field, relative to a template's.
        noise: standard deviation of the per-pixel noise, relative to a template's.
        seed: the generator's seed; None: the run's seed.
    """

    n_train: int = 50_000
    n_test: int = 10_000
    n_classes: int = 10
    modes_per_class: int = 6
    template_cells: int = 6
    max_shift: int = 8
    background: float = 0.6
    noise: float = 0.5
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        require_int("n_train", self.n_train, minimum=10, maximum=2_000_000)
        require_int("n_test", self.n_test, minimum=10, maximum=1_000_000)
        require_int("n_classes", self.n_classes, minimum=2, maximum=1000)
        require_int("modes_per_class", self.modes_per_class, minimum=1, maximum=100)
        require_int("template_cells", self.template_cells, minimum=2, maximum=32)
        require_int("max_shift", self.max_shift, minimum=0, maximum=16)
        require_float("background", self.background, minimum=0.0, maximum=100.0)
        require_float("noise", self.noise, minimum=0.0, maximum=100.0)
        if self.seed is not None:
            require_int("seed", self.seed, minimum=0)


@dataclass
class Cifar10Params:
    """Args:
        fallback: none: a missing path or batch file is an error; generated: use generated
            CIFAR-shaped images (synthetic_cifar, with ``generated``'s settings) instead when
            dataset.path is unset or lacks the batches. The ranks' ``data`` records and the
            report say which data a job trained on.
        generated: synthetic_cifar's parameters, used only by the fallback.
    """

    fallback: Literal["none", "generated"] = "none"
    generated: SyntheticCifarParams = field(default_factory=SyntheticCifarParams)


# ---------------------------------------------------------------------------------------------
# Loaders.


def _split(x: torch.Tensor, y: torch.Tensor, test_fraction: float, seed: int):
    """Seeded shuffle and split into (train_x, train_y, test_x, test_y)."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(x), generator=generator)
    n_test = max(1, int(round(len(x) * test_fraction)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def load_digits(cfg: DatasetConfig, params: NoParams, seed: int) -> DataBundle:
    """sklearn's 8x8 digits (1797 images, shipped with scikit-learn), scaled to [0, 1]."""
    from sklearn.datasets import load_digits as sk_load_digits

    digits = sk_load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    return DataBundle(*_split(x, y, cfg.test_fraction, seed), input_shape=(1, 8, 8), num_classes=10, kind="features",
                      source="scikit-learn's digits (8x8, 1797 images)")


FASHION_MNIST_DEFAULT = "/usr/share/datasets/fashion-mnist"
# x / 255 and nothing more: the scaling the loader has always applied
FASHION_MNIST_PIXELS = PixelScaling(mean=(0.0,), std=(1.0,))


def _read_idx(path_stem: Path) -> np.ndarray:
    """Read an IDX file, gzipped (``<stem>.gz``) or not (``<stem>``)."""
    for candidate, opener in ((path_stem, open), (path_stem.with_name(path_stem.name + ".gz"), gzip.open)):
        if candidate.is_file():
            with opener(candidate, "rb") as handle:
                data = handle.read()
            break
    else:
        raise FileNotFoundError(f"{path_stem}[.gz] not found")
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path_stem}: not an unsigned-byte IDX file")
    shape = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_fashion_mnist(cfg: DatasetConfig, params: NoParams, seed: int) -> DataBundle:
    """Fashion-MNIST from IDX files (Debian package dataset-fashion-mnist by default): the 60,000
    training images of the train-* files, and as the test set the 10,000 images of the t10k-*
    files (the published test split, not a split of the training images: ``test_fraction`` is
    not used). Pixels stay uint8 (a quarter of float32's memory) and become x / 255 per batch."""
    root = Path(cfg.path or FASHION_MNIST_DEFAULT)
    try:
        arrays = {
            name: _read_idx(root / f"{name}-idx{3 if 'images' in name else 1}-ubyte")
            for name in ("train-images", "train-labels", "t10k-images", "t10k-labels")
        }
    except FileNotFoundError as error:
        raise ConfigError(
            "dataset.path",
            f"Fashion-MNIST IDX files not found under {root} ({error}); install the Debian package "
            "dataset-fashion-mnist or point dataset.path at a folder holding "
            "train-images-idx3-ubyte[.gz] and the three other files",
        ) from None

    def images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.copy()).unsqueeze(1)

    return DataBundle(
        images(arrays["train-images"]),
        torch.from_numpy(arrays["train-labels"].astype(np.int64)),
        images(arrays["t10k-images"]),
        torch.from_numpy(arrays["t10k-labels"].astype(np.int64)),
        input_shape=(1, 28, 28),
        num_classes=10,
        kind="features",
        source=(f"Fashion-MNIST from {root} ({len(arrays['train-labels'])} train images, "
                f"{len(arrays['t10k-labels'])} test images of the t10k files)"),
        pixels=FASHION_MNIST_PIXELS,
    )


def load_synthetic(cfg: DatasetConfig, params: SyntheticParams, seed: int) -> DataBundle:
    """Gaussian clusters around seeded random class centres."""
    generator = torch.Generator().manual_seed(seed + 1)
    centres = torch.randn(params.n_classes, params.n_features, generator=generator)
    centres *= 3.0 / centres.norm(dim=1, keepdim=True).clamp_min(1e-6)
    y = torch.randint(params.n_classes, (params.n_samples,), generator=generator)
    x = centres[y] + params.noise * torch.randn(params.n_samples, params.n_features, generator=generator)
    return DataBundle(
        *_split(x, y, cfg.test_fraction, seed),
        input_shape=(params.n_features,),
        num_classes=params.n_classes,
        kind="features",
        source=f"generated Gaussian clusters (synthetic, seed {seed})",
    )


def load_synthetic_tokens(cfg: DatasetConfig, params: TokenParams, seed: int) -> DataBundle:
    """Sequences sampled from a seeded Markov chain where each token has ``branching`` successors."""
    rng = np.random.default_rng(seed + 2)
    successors = np.stack([rng.choice(params.vocab_size, params.branching, replace=False) for _ in range(params.vocab_size)])
    length = params.seq_len + 1
    tokens = np.empty((params.n_sequences, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(params.vocab_size, size=params.n_sequences)
    for position in range(1, length):
        pick = rng.integers(params.branching, size=params.n_sequences)
        tokens[:, position] = successors[tokens[:, position - 1], pick]
    data = torch.from_numpy(tokens)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return DataBundle(
        *_split(x, y, cfg.test_fraction, seed),
        input_shape=(params.seq_len,),
        num_classes=params.vocab_size,
        kind="tokens",
        source=f"generated Markov-chain tokens (synthetic_tokens, seed {seed})",
    )


# Byte-level: the vocabulary is the 256 byte values. Nothing to fit or download, the same for
# any corpus (UTF-8 or not), and a small output layer for a small model.
BYTE_VOCABULARY = 256


def stdlib_folder() -> Path:
    """The running Python's standard library folder (its ``.py`` files are the default corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, pattern: str, max_files: Optional[int] = None) -> list[Path]:
    """The corpus's files: regular files under ``root`` matching ``pattern``, sorted by their path
    relative to ``root`` (the same list on every machine holding the same files); ``root`` itself
    when it is a file."""
    if root.is_file():
        return [root]
    files = sorted((p for p in root.glob(pattern) if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
    return files[:max_files]


def validation_file(name: str, test_fraction: float) -> bool:
    """Whether the file of relative path ``name`` is held out: a hash of the name, not of the seed
    or of the list, so the validation files stay the same across seeds and when files are added."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < test_fraction


def _sequences(data: bytes, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping windows of seq_len + 1 bytes: inputs (n, seq_len) and next-byte targets."""
    window = seq_len + 1
    count = len(data) // window
    tokens = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, count=count * window).astype(np.int64))
    tokens = tokens.view(count, window)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def load_text_corpus(cfg: DatasetConfig, params: TextCorpusParams, seed: int) -> DataBundle:
    """Byte-level sequences from text files: the Python standard library's own ``.py`` files
    (``dataset.path`` unset) or a user's folder or file (``dataset.path``).

    Files are split by name into training and validation (:func:`validation_file`, about
    ``test_fraction`` of them held out; at least one each side); a single file is split by bytes
    (its last ``test_fraction``). ``source`` names the folder, the file count, the Python version
    for the standard library, and the SHA-256 of the corpus (each file's relative path and bytes,
    in order), so a run says exactly what it trained on.
    """
    root = Path(cfg.path) if cfg.path else stdlib_folder()
    if not root.exists():
        raise ConfigError("dataset.path", f"text_corpus: {root} does not exist (a folder of text files, or one file)")
    files = corpus_files(root, params.pattern, params.max_files)
    if not files:
        raise ConfigError("dataset.path", f"text_corpus: no files matching {params.pattern!r} under {root}")
    corpus_hash = hashlib.sha256()
    train_parts: list[bytes] = []
    test_parts: list[bytes] = []
    held_out = []
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        content = file.read_bytes()
        corpus_hash.update(name.encode("utf-8") + b"\0" + len(content).to_bytes(8, "big") + content)
        held_out.append(validation_file(name, cfg.test_fraction))
        (test_parts if held_out[-1] else train_parts).append(content)
    if len(files) == 1:
        content = (train_parts + test_parts)[0]
        cut = len(content) - max(params.seq_len + 1, int(len(content) * cfg.test_fraction))
        train_parts, test_parts = [content[:cut]], [content[cut:]]
    elif not test_parts or not train_parts:  # few files: the split by hash may leave a side empty
        contents = train_parts + test_parts
        train_parts, test_parts = contents[:-1], contents[-1:]
    train_x, train_y = _sequences(b"".join(train_parts), params.seq_len)
    test_x, test_y = _sequences(b"".join(test_parts), params.seq_len)
    if len(train_x) == 0 or len(test_x) == 0:
        raise ConfigError("dataset.path", f"text_corpus: {root} holds too little text for sequences of "
                          f"{params.seq_len + 1} bytes on both sides of the split")
    where = (f"the Python {platform.python_version()} standard library ({root})" if not cfg.path else str(root))
    files_said = "1 file" if len(files) == 1 else f"{len(files)} files ({sum(held_out)} held out)"
    return DataBundle(
        train_x, train_y, test_x, test_y, input_shape=(params.seq_len,), num_classes=BYTE_VOCABULARY,
        kind="tokens",
        source=(f"text_corpus: bytes of {files_said} matching {params.pattern!r} from {where}, "
                f"sha256 {corpus_hash.hexdigest()}"),
    )


CIFAR10_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)
CIFAR10_PIXELS = PixelScaling(mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))


def _missing_cifar10(path: Optional[str]) -> Optional[str]:
    """Why dataset.path holds no CIFAR-10 python batches, or None when all six are there."""
    if not path:
        return "cifar10 needs dataset.path, the folder holding data_batch_1..5 and test_batch"
    root = Path(path)
    missing = [n for n in CIFAR10_BATCHES if not (root / n).is_file()]
    if missing:
        return (f"CIFAR-10 python batches missing under {root}: {missing} (expected the extracted "
                "cifar-10-batches-py folder; nothing is downloaded at run time)")
    return None


def load_cifar10(cfg: DatasetConfig, params: Cifar10Params, seed: int) -> DataBundle:
    """CIFAR-10 from the python pickle batches (data_batch_1..5, test_batch) under dataset.path;
    with ``fallback: generated``, generated CIFAR-shaped images when they are not there."""
    missing = _missing_cifar10(cfg.path)
    if missing is not None:
        if params.fallback != "generated":
            raise ConfigError("dataset.path", missing + "; or set dataset.params.fallback: generated to train on "
                              "generated CIFAR-shaped images (synthetic_cifar) instead")
        bundle = load_synthetic_cifar(cfg, params.generated, seed)
        bundle.source += f" instead of CIFAR-10 (fallback: generated): {missing}"
        return bundle
    root = Path(cfg.path)

    def read(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        with open(root / name, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        x = torch.from_numpy(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        return x, torch.tensor(batch[b"labels"], dtype=torch.int64)

    train = [read(n) for n in CIFAR10_BATCHES[:5]]
    test_x, test_y = read("test_batch")
    return DataBundle(
        torch.cat([t[0] for t in train]), torch.cat([t[1] for t in train]), test_x, test_y,
        input_shape=(3, 32, 32), num_classes=10, kind="features", source=f"CIFAR-10 from {root}",
        pixels=CIFAR10_PIXELS,
    )


# Generated images are made this many at a time (bounded temporary memory); fixed, so that the
# images of a seed do not depend on it.
_CIFAR_CHUNK = 2048
CIFAR_SIZE = 32
# Background fields are windows of this many smooth fields, twice an image's size each way.
_BACKGROUND_FIELDS = 256
_UNIFORM_BYTE_STD = 73.9  # standard deviation of a byte drawn uniformly from 0..255


def _stream(seed: int, purpose: int) -> np.random.Generator:
    """An independent random stream per (seed, purpose): changing n_train leaves the test set as it is."""
    return np.random.default_rng(np.random.SeedSequence([seed, purpose]))


def _smooth_fields(count: int, cells: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` random colour fields (count, 3, size, size), float32: normal noise on a cells x
    cells grid, upsampled bicubically, each scaled to zero mean and unit standard deviation."""
    coarse = torch.from_numpy(rng.standard_normal((count, 3, cells, cells), dtype=np.float32))
    fields = F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=False).numpy()
    fields -= fields.mean(axis=(1, 2, 3), keepdims=True)
    fields /= np.maximum(fields.std(axis=(1, 2, 3), keepdims=True), 1e-6)
    return fields


def _windows(fields: np.ndarray) -> np.ndarray:
    """Every 32x32 window of each field, as a view (..., 3, rows, columns, 32, 32)."""
    return np.lib.stride_tricks.sliding_window_view(fields, (CIFAR_SIZE, CIFAR_SIZE), axis=(-2, -1))


def _generate_images(templates: np.ndarray, labels: np.ndarray, params: SyntheticCifarParams,
                     rng: np.random.Generator) -> torch.Tensor:
    """uint8 images (n, 3, 32, 32) of ``labels`` from ``templates`` (classes x modes, 3, S, S)."""
    n = len(labels)
    out = np.empty((n, 3, CIFAR_SIZE, CIFAR_SIZE), dtype=np.uint8)
    # a template's windows, and its mirror image's: a sample is one window of one of them
    shapes = _windows(np.stack([templates, templates[..., ::-1]]))       # (2, C*M, 3, span, span, 32, 32)
    span = shapes.shape[3]
    background = _windows(_smooth_fields(_BACKGROUND_FIELDS, 5, 2 * CIFAR_SIZE, rng))  # (F, 3, 33, 33, 32, 32)
    # about 3.2 standard deviations of the sum either side of mid-grey: little is clipped
    scale = 40.0 / float(np.sqrt(1.0 + params.background ** 2 + params.noise ** 2))
    for start in range(0, n, _CIFAR_CHUNK):
        chunk = labels[start:start + _CIFAR_CHUNK]
        b = len(chunk)
        template = chunk * params.modes_per_class + rng.integers(params.modes_per_class, size=b)
        mirror = rng.integers(2, size=b)
        top, left = rng.integers(span, size=b), rng.integers(span, size=b)
        contrast = rng.uniform(0.6, 1.4, size=(b, 1, 1, 1)).astype(np.float32)
        image = shapes[mirror, template, :, top, left] * contrast                 # (b, 3, 32, 32)
        if params.background:
            clutter = background[rng.integers(_BACKGROUND_FIELDS, size=b), :,
                                 rng.integers(background.shape[2], size=b), rng.integers(background.shape[3], size=b)]
            image += np.float32(params.background) * clutter
        if params.noise:
            noise = rng.integers(0, 256, size=image.shape, dtype=np.uint8).astype(np.float32)
            noise -= 127.5
            image += np.float32(params.noise / _UNIFORM_BYTE_STD) * noise
        image *= np.float32(scale)
        image += np.float32(128.5)  # then truncated: rounded to the nearest level
        np.clip(image, 0, 255, out=image)
        out[start:start + b] = image
    return torch.from_numpy(out)


def generate_cifar_shaped(params: SyntheticCifarParams, seed: int):
    """(train_x, train_y, test_x, test_y): uint8 images and int64 labels, the same for the same seed."""
    size = CIFAR_SIZE + 2 * params.max_shift
    templates = _smooth_fields(params.n_classes * params.modes_per_class, params.template_cells, size,
                               _stream(seed, 0))

    def split(n: int, purpose: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = _stream(seed, purpose)
        labels = rng.permutation(np.arange(n) % params.n_classes)
        return _generate_images(templates, labels, params, rng), torch.from_numpy(labels.astype(np.int64))

    return (*split(params.n_train, 1), *split(params.n_test, 2))


def load_synthetic_cifar(cfg: DatasetConfig, params: SyntheticCifarParams, seed: int) -> DataBundle:
    """Generated CIFAR-shaped images (see :class:`SyntheticCifarParams`), normalised per channel
    with the training images' own mean and standard deviation."""
    data_seed = seed if params.seed is None else params.seed
    train_x, train_y, test_x, test_y = generate_cifar_shaped(params, data_seed)
    sample = train_x[:_CIFAR_CHUNK].float() / 255.0
    pixels = PixelScaling(mean=tuple(sample.mean(dim=(0, 2, 3)).tolist()),
                          std=tuple(sample.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist()))
    return DataBundle(
        train_x, train_y, test_x, test_y, input_shape=(3, CIFAR_SIZE, CIFAR_SIZE), num_classes=params.n_classes,
        kind="features", pixels=pixels,
        source=(f"generated CIFAR-shaped (synthetic_cifar, seed {data_seed}, {params.n_train} train / "
                f"{params.n_test} test images)"),
    )


def load_imagefolder(cfg: DatasetConfig, params: ImageFolderParams, seed: int) -> DataBundle:
    """ImageNet-style folder: ``<path>/<class>/<image>``, or ``<path>/train`` + ``<path>/val``."""
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("dataset.name", "imagefolder needs Pillow (PIL), which is not installed") from None
    if not cfg.path or not Path(cfg.path).is_dir():
        raise ConfigError("dataset.path", f"imagefolder needs an existing folder of class sub-folders, got {cfg.path!r}")
    root = Path(cfg.path)
    size = params.image_size

    def read_tree(folder: Path, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = [], []
        for label, name in enumerate(classes):
            files = sorted(p for p in (folder / name).iterdir() if p.is_file())[: params.max_per_class]
            for file in files:
                with Image.open(file) as image:
                    array = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.uint8)
                images.append(torch.from_numpy(array.copy()).permute(2, 0, 1))
                labels.append(label)
        if not images:
            raise ConfigError("dataset.path", f"no images found under {folder}")
        return torch.stack(images).float() / 255.0, torch.tensor(labels, dtype=torch.int64)

    if (root / "train").is_dir() and (root / "val").is_dir():
        classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
        train_x, train_y = read_tree(root / "train", classes)
        test_x, test_y = read_tree(root / "val", classes)
    else:
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if not classes:
            raise ConfigError("dataset.path", f"{root} has no class sub-folders")
        train_x, train_y, test_x, test_y = _split(*read_tree(root, classes), cfg.test_fraction, seed)
    return DataBundle(train_x, train_y, test_x, test_y, input_shape=(3, size, size), num_classes=len(classes),
                      kind="features", source=f"image folder {root} ({size}x{size})")


DATASETS: dict[str, DatasetEntry] = {
    "digits": DatasetEntry(load_digits, NoParams, "features"),
    "fashion_mnist": DatasetEntry(load_fashion_mnist, NoParams, "features"),
    "synthetic": DatasetEntry(load_synthetic, SyntheticParams, "features"),
    "synthetic_tokens": DatasetEntry(load_synthetic_tokens, TokenParams, "tokens"),
    "text_corpus": DatasetEntry(load_text_corpus, TextCorpusParams, "tokens"),
    "cifar10": DatasetEntry(load_cifar10, Cifar10Params, "features"),
    "synthetic_cifar": DatasetEntry(load_synthetic_cifar, SyntheticCifarParams, "features"),
    "imagefolder": DatasetEntry(load_imagefolder, ImageFolderParams, "features"),
}


def get_dataset_entry(name: str) -> DatasetEntry:
    """Registry lookup; KeyError names the known datasets."""
    if name not in DATASETS:
        raise KeyError(f"unknown dataset {name!r} (known: {sorted(DATASETS)})")
    return DATASETS[name]


# Set by shared_datasets(): (config, seed) -> the bundle every caller gets.
_shared: Optional[dict] = None


@contextlib.contextmanager
def shared_datasets():
    """Within it, :func:`load_dataset` loads each (config, seed) once and hands every caller the
    same bundle: the ranks of a simulated job share one process (``trainers.sim``), and 1,024
    copies of a data set would be 1,024 times its memory. Nothing writes into a bundle."""
    global _shared
    previous, _shared = _shared, {}
    try:
        yield
    finally:
        _shared = previous


def load_dataset(cfg: DatasetConfig, seed: int) -> DataBundle:
    """Load dataset ``cfg.name`` with its resolved params; the test split is capped by max_test_samples."""
    if _shared is not None:
        key = (repr(cfg), seed)
        if key not in _shared:
            _shared[key] = _load_dataset(cfg, seed)
        return _shared[key]
    return _load_dataset(cfg, seed)


def _load_dataset(cfg: DatasetConfig, seed: int) -> DataBundle:
    entry = get_dataset_entry(cfg.name)
    bundle = entry.load(cfg, from_dict(entry.Params, cfg.params, "dataset.params"), seed)
    if cfg.max_test_samples is not None:
        bundle.test_x = bundle.test_x[: cfg.max_test_samples]
        bundle.test_y = bundle.test_y[: cfg.max_test_samples]
    return bundle


# ---------------------------------------------------------------------------------------------
# Sharding and batches.


def shard_indices(
    labels: torch.Tensor, world_size: int, shard: str, alpha: float, seed: int
) -> list[torch.Tensor]:
    """Split sample indices over ranks; every rank computes the same split from the same seed.

    Args:
        labels: class label per training sample (for tokens: any per-sample key, e.g. first token).
        world_size: number of shards.
        shard: iid (random equal shards) | dirichlet (per class, proportions ~ Dirichlet(alpha)).
        alpha: Dirichlet concentration (smaller: each rank sees fewer classes).
        seed: seed of the split.
    """
    n = len(labels)
    if n < world_size:
        raise ConfigError("batch_size", f"{n} training samples cannot be split over {world_size} ranks")
    generator = torch.Generator().manual_seed(seed + 3)
    if shard == "iid":
        order = torch.randperm(n, generator=generator)
        return [order[r::world_size].sort().values for r in range(world_size)]
    rng = np.random.default_rng(seed + 3)
    labels_np = labels.numpy()
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for cls in np.unique(labels_np):
        members = rng.permutation(np.flatnonzero(labels_np == cls))
        proportions = rng.dirichlet([alpha] * world_size)
        cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(int)
        for rank, part in enumerate(np.split(members, cuts)):
            shards[rank].extend(part.tolist())
    # A tiny alpha can leave a rank with nothing; give it a few samples from the largest shard
    # rather than fail, so every rank can take steps.
    for rank in range(world_size):
        if not shards[rank]:
            donor = max(range(world_size), key=lambda r: len(shards[r]))
            take = max(1, len(shards[donor]) // (2 * world_size))
            shards[rank], shards[donor] = shards[donor][:take], shards[donor][take:]
    return [torch.tensor(sorted(s), dtype=torch.int64) for s in shards]


class BatchSampler:
    """Endless seeded batches from one rank's shard; reshuffles every epoch (a pass over the shard).

    Args:
        indices: this rank's sample indices.
        batch_size: samples per batch.
        seed: base seed (combine with the rank so ranks draw differently).
    """

    def __init__(self, indices: torch.Tensor, batch_size: int, seed: int):
        self.indices = indices
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self._order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
        self._position = 0

    def next_indices(self) -> torch.Tensor:
        """Indices of the next batch (wraps into a new epoch; a batch never mixes epochs)."""
        if self._position + self.batch_size > len(self._order):
            self.epoch += 1
            self._order = self.indices[torch.randperm(len(self.indices), generator=self.generator)]
            self._position = 0
        end = min(self._position + self.batch_size, len(self._order))
        batch = self._order[self._position : end]
        self._position = end
        return batch

    @property
    def epoch_float(self) -> float:
        """Passes over the shard so far, fractional."""
        return self.epoch + self._position / max(1, len(self._order))
