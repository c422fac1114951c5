"""The optimizer and the learning-rate schedules (§5.3).

Adam with beta_1 = 0.9, beta_2 = 0.98, eps = 1e-9 (AdamW with decoupled weight decay as an option), and
the paper's schedule, lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), or inverse-sqrt, cosine or
constant after a linear warmup.
"""

from __future__ import annotations

import math

import torch

from tformer_cli.config import TrainConfig


def learning_rate(step: int, cfg: TrainConfig, d_model: int, horizon: float | None = None) -> float:
    """The learning rate for optimizer step ``step`` (1-based).

    noam: lr * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)  (§5.3; lr is a scale factor)
    inverse_sqrt: linear warmup to lr, then lr * sqrt(warmup / step)
    cosine: linear warmup to lr, then cosine decay to min_lr at step ``horizon`` (default max_steps)
    constant: linear warmup to lr, then lr
    """
    step = max(step, 1)
    warmup = cfg.warmup_steps
    if cfg.schedule == "noam":
        return cfg.lr * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
    if warmup and step < warmup:
        return cfg.lr * step / warmup
    if cfg.schedule == "inverse_sqrt":
        return cfg.lr * math.sqrt(max(warmup, 1) / step)
    if cfg.schedule == "cosine":
        end = horizon if horizon is not None else cfg.max_steps
        if end is None:  # bounded by time alone, before its pace is known
            return cfg.lr
        progress = min(1.0, (step - warmup) / max(1, end - warmup))
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))
    return cfg.lr


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """Adam or AdamW; weight decay applies to matrices only (not biases, LayerNorms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    # The fused kernels are numerically the same algorithm, several times faster on CPU and CUDA.
    return cls(groups, lr=0.0, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)


def cosine_horizon(cfg: TrainConfig, total_steps: int | None, step: int, elapsed: float) -> float | None:
    """The step where a cosine schedule reaches min_lr: the step limit (max_steps or epochs), or sooner the
    step at which max_time runs out at the pace so far, so that a run bounded by time also decays fully."""
    ends = [float(total_steps)] if total_steps else []
    if cfg.max_time and elapsed > 0:
        ends.append(max(step, 1) * cfg.max_time / elapsed)
    return min(ends) if ends else None
