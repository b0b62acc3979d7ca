"""Single-process references the distributed algorithms are compared with."""

from __future__ import annotations

import torch
from torch import nn


def make_model() -> nn.Module:
    """A small MLP (two layers of different sizes so several buckets can be formed), fixed init."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))


def global_batches(steps: int, batch_size: int = 32):
    """Deterministic (x, y) union batches of digits-like shape (1x8x8 inputs, 10 classes)."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        yield (torch.randn(batch_size, 1, 8, 8, generator=generator), torch.randint(10, (batch_size,), generator=generator))
