"""Pre-flight validation: every check that can fail before a process group starts.

Each failure is a ConfigError with one actionable line; `harness.train` prints it and
exits non-zero, so nothing is launched and nothing of the user's is touched.
"""
from __future__ import annotations

import os

import torch

from harness.config import ConfigError, RunConfig
from harness.distributed import launch_env
from harness.models import is_preset
from harness.strategies import Strategy, check_strategy_against_run, resolve_deepspeed_config


def has_accelerator(cfg: RunConfig) -> bool:
    return cfg.device != "cpu" and torch.cuda.is_available()


def preflight(cfg: RunConfig, strategy: Strategy) -> None:
    _, world, _ = launch_env()
    check_strategy_against_run(strategy, cfg, has_accelerator(cfg))
    if cfg.global_batch_size is not None and cfg.global_batch_size != cfg.micro_batch_size * cfg.grad_accum * world:
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} != micro_batch_size*grad_accum*world "
            f"({cfg.micro_batch_size}*{cfg.grad_accum}*{world}={cfg.micro_batch_size * cfg.grad_accum * world})"
        )
    if strategy.kind == "deepspeed":
        resolve_deepspeed_config(strategy, cfg, world, hidden_size=1)  # contradictions and 'auto' holes
    amp = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if amp in ("bf16", "fp16") and amp != cfg.precision:
        raise ConfigError(f"accelerate launch --mixed_precision {amp} contradicts the run config's precision={cfg.precision}; set precision={amp}")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no GPU is visible; use device=auto or device=cpu")
    if cfg.precision == "bf16" and has_accelerator(cfg) and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision=bf16 but {torch.cuda.get_device_name()} has no bf16 support; use precision=fp16 or fp32")
    if not is_preset(cfg.model.name) and not os.path.isdir(cfg.model.name) and os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ConfigError(f"model.name '{cfg.model.name}' is not a preset or a local directory, and HF_HUB_OFFLINE=1")
    if cfg.data.source != "embedded" and not os.path.exists(cfg.data.source) and os.sep in cfg.data.source:
        raise ConfigError(f"data.source '{cfg.data.source}' does not exist")
