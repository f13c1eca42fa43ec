"""The one place an engine kind picks its engine class; each class builds itself whole from the plan."""

from __future__ import annotations

from torch import nn

from harness.config import EngineKind, RunConfig
from harness.distributed import DistInfo
from harness.engine.base import Engine, LossFn
from harness.engine.deepspeed_engine import DeepSpeedEngine
from harness.engine.plan import EnginePlan
from harness.engine.torch_engine import DDPEngine, FSDPEngine, TorchEngine
from harness.faults import fault_seconds, hold
from harness.log import get_logger
from harness.models import ModelSpec

log = get_logger(__name__)

ENGINES: dict[EngineKind, type[Engine]] = {"single": TorchEngine, "ddp": DDPEngine, "fsdp": FSDPEngine, "deepspeed": DeepSpeedEngine}


def load_model(spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> nn.Module:
    """The load phase: the model built, its memory techniques applied, sharded where the engine
    shards, and filled, without any rank holding more than its part plus one tensor."""
    return ENGINES[plan.kind].load_model(spec, cfg, plan, info)


def build_engine(spec: ModelSpec, cfg: RunConfig, plan: EnginePlan, info: DistInfo, loss_fn: LossFn) -> Engine:
    """Load the model, then the engine around it (AC -> compile -> shard); `engine.startup_s` says how long each took."""
    if plan.world_size != info.world_size:
        raise ValueError(f"the engine plan is for world size {plan.world_size}, this process group has {info.world_size}")
    pause = fault_seconds("load_pause", 0)
    if pause:  # a drill's slow load (HARNESS_FAULT)
        log.info(f"HARNESS_FAULT: the model's load is held for {pause:g} s")
        hold(pause)
    return ENGINES[plan.kind].build(spec, cfg, plan, info, loss_fn)
