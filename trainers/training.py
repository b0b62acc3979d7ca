"""Loss, held-out evaluation and learning-rate schedule shared by every algorithm (same for all)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainers.config import LRScheduleConfig

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of the model's logits against integer targets (per sample or per token)."""
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1024) -> tuple[float, float]:
    """Accuracy (fraction of correct predictions) and mean cross-entropy on held-out (x, y).

    Args:
        model: model to evaluate; put in eval mode for the call and restored afterwards.
        x, y: held-out inputs and targets (CPU tensors).
        device: where to compute.
        batch_size: samples per forward pass.
    """
    was_training = model.training
    model.eval()
    correct, loss_sum, count = 0, 0.0, 0
    try:
        for start in range(0, len(x), batch_size):
            inputs = x[start : start + batch_size].to(device)
            targets = y[start : start + batch_size].to(device)
            logits = model(inputs)
            logits = logits.reshape(-1, logits.shape[-1])
            flat_targets = targets.reshape(-1)
            loss_sum += F.cross_entropy(logits, flat_targets, reduction="sum").item()
            correct += (logits.argmax(dim=1) == flat_targets).sum().item()
            count += flat_targets.numel()
    finally:
        model.train(was_training)
    return correct / count, loss_sum / count


def lr_at(step: int, base_lr: float, schedule: LRScheduleConfig, total_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warm-up, then constant / cosine / step decay.

    Args:
        step: 0-based step index.
        base_lr: peak learning rate.
        schedule: the schedule config.
        total_steps: number of steps of the run (cosine reaches min_lr at the last one).
    """
    if step < schedule.warmup_steps:
        return base_lr * (step + 1) / schedule.warmup_steps
    after = step - schedule.warmup_steps
    if schedule.name == "constant":
        return base_lr
    if schedule.name == "step":
        return base_lr * schedule.gamma ** (after // schedule.step_size)
    span = max(1, total_steps - schedule.warmup_steps - 1)
    progress = min(1.0, after / span)
    return schedule.min_lr + 0.5 * (base_lr - schedule.min_lr) * (1.0 + math.cos(math.pi * progress))
