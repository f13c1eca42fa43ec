"""Optimizer and learning-rate schedule, shared by every engine so they train identically."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from harness.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if cfg.name in ("adamw", "adam"):
        # foreach=False keeps the step's transient memory per-parameter (what the planner assumes).
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
    return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)


def lr_lambda(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at a step: linear warmup, then cosine/linear decay or constant."""

    def factor(step: int) -> float:
        if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1.0 - progress
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
