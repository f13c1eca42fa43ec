"""Engines: the one interface the loop, checkpoints, reports and pruning use over every strategy.

    plan = plan_engine(cfg, strategy, world_size, device, hidden_size)  # once, in pre-flight
    engine = build_engine(spec, cfg, plan, info, loss_fn)   # AC -> compile -> shard
    with engine.micro_batch(last):   # each micro-batch; only the last reduces over ranks
        loss = engine.forward_loss(batch); engine.backward(loss, last_micro=last)
    engine.step()
    engine.save_state(dir); engine.load_state(dir, saved_world_size, is_main)
    engine.state_bytes()   # per-rank bytes held: the proof of sharding

    for shard in engine.shards(): ...   # this rank's part of each parameter, however stored

To add a strategy: a strategy file (`harness/config/ds_configs/`), and, if it needs a new
engine, a subclass of `Engine` here (its `build` and `load_model`), chosen in `build.ENGINES`.
"""

from __future__ import annotations

import torch
from torch import nn

from harness.distributed import is_deepspeed_engine, unwrap  # re-exported: pruning reaches them through the engine
from harness.engine import deepspeed_engine, torch_engine
from harness.engine.base import Engine, LossFn, StepResult
from harness.engine.build import build_engine, load_model
from harness.engine.deepspeed_engine import DeepSpeedEngine, train_collectives_only
from harness.engine.experts import ExpertGradients, split_for
from harness.engine.finite import weights_finite
from harness.engine.parallelize import fsdp_wrap
from harness.engine.plan import EnginePlan, hidden_size_of, plan_engine
from harness.engine.probe import DeepSpeedProbe, GradientProbe, gradient_probe
from harness.engine.shard_base import ParamShard
from harness.engine.shards import memory_storage, shard_of
from harness.engine.storage import local_part
from harness.engine.torch_engine import TorchEngine


def read_model_weights(
    directory: str, checkpoint_format: str, zero_stage: int, model: nn.Module, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """The whole model weights of a checkpoint's engine state, read in one process by the
    engine that wrote it (`Engine.checkpoint_format`); `model` gives keys, shapes and dtypes.
    `trainable_only`: the checkpoint holds the trainable parameters only (`Engine.trainable_only`)."""
    if checkpoint_format == "deepspeed":
        return deepspeed_engine.read_model_weights(directory, zero_stage, trainable_only)
    return torch_engine.read_model_weights(directory, model, trainable_only)


__all__ = [
    "DeepSpeedEngine",
    "Engine",
    "DeepSpeedProbe",
    "EnginePlan",
    "ExpertGradients",
    "GradientProbe",
    "LossFn",
    "ParamShard",
    "StepResult",
    "TorchEngine",
    "build_engine",
    "fsdp_wrap",
    "gradient_probe",
    "hidden_size_of",
    "is_deepspeed_engine",
    "load_model",
    "local_part",
    "memory_storage",
    "plan_engine",
    "read_model_weights",
    "weights_finite",
    "shard_of",
    "split_for",
    "train_collectives_only",
    "unwrap",
]
