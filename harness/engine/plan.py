"""The engine plan: every decision about which engine a run gets, made once, before any process group.

Pre-flight (`harness.runner.preflight`) makes the plan; the engine builder and the planner
read it. Nothing downstream re-derives the engine kind, re-resolves the DeepSpeed config or
re-picks the precision policy, so the trainer, the planner and the checkpoint metadata cannot
disagree about them (they once did: the planner and the builder decided "single vs ddp" by
different rules, and the DeepSpeed dict was resolved three times per run).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from harness.config import (
    CheckpointFormat,
    ConfigError,
    EngineKind,
    OptimConfig,
    ParallelLayout,
    RunConfig,
    Strategy,
    adopt_settings,
    checkpoint_format,
    engine_kind,
    launcher_settings,
    resolve_deepspeed_config,
)
from harness.training import PrecisionPolicy, precision_policy

CPU_ADAM_OPTIMIZERS = ("adam", "adamw")  # what DeepSpeedCPUAdam steps (adamw_mode on or off)


@dataclass(frozen=True)
class EnginePlan:
    """What an engine is built from, besides the model and the run config's training values."""

    kind: EngineKind
    strategy: Strategy
    layout: ParallelLayout  # the world's ranks as data x sequence: every consumer reads this one
    precision: PrecisionPolicy
    # The run config the plan was made from: the user's, with what the launcher and a DeepSpeed file
    # set taken in (`adopt_settings`); every component of the run builds itself from its sections.
    config: RunConfig = field(default_factory=RunConfig, compare=False)
    # DeepSpeed's config dict with every "auto" filled from the run config (None for torch engines).
    # Read-only by convention: `deepspeed_config()` hands out a copy for DeepSpeed to mutate.
    deepspeed: dict[str, Any] | None = field(default=None, compare=False)
    deepspeed_filled: tuple[str, ...] = ()  # one entry per value filled, logged once when the engine starts
    deepspeed_ignored: tuple[str, ...] = ()  # keys of the file DeepSpeed ignores, warned once when the engine starts
    taken: tuple[str, ...] = ()  # run config values taken from the launcher or the DeepSpeed file (`adopt_settings`)
    # `accelerate launch` settings harness does its own way (`launcher_settings`), said once at start-up
    launcher_said: tuple[str, ...] = ()
    optimizer_in_backward: bool = False  # the torch engine steps each parameter's optimizer inside backward
    activation_offload: bool = False  # saved activations go to host memory (memory.activation_offload)
    offload_checkpoint_inputs: bool = False  # only the checkpointed blocks' inputs do (memory.offload_checkpoint_inputs)
    # Checkpoints keep the trainable parameters only (LoRA: the adapters); the frozen base is rebuilt
    # from model.name on resume and export, so a checkpoint is the adapters' size.
    trainable_only: bool = False
    # DeepSpeed steps the offloaded optimizer with its own DeepSpeedCPUAdam (`host_adam`)
    cpu_adam: bool = False

    @property
    def world_size(self) -> int:
        return self.layout.world

    @property
    def checkpoint_format(self) -> CheckpointFormat:
        return checkpoint_format(self.kind)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of a DeepSpeed plan (0 for torch engines)."""
        if self.deepspeed is None:
            return 0
        return int(self.deepspeed.get("zero_optimization", {}).get("stage", 0))

    @property
    def cpu_adam_forced(self) -> bool:
        """DeepSpeedCPUAdam because the file asks for it (`zero_force_ds_cpu_optimizer: true`), on any machine."""
        return self.cpu_adam and self.strategy.raw.get("zero_force_ds_cpu_optimizer") is True

    @property
    def host_optimizer(self) -> str:
        """What steps the offloaded optimizer, for the start-up line ("" when nothing is said)."""
        if not self.cpu_adam:
            return ""
        if self.cpu_adam_forced:
            return f"DeepSpeedCPUAdam, as {self.strategy.name}'s zero_force_ds_cpu_optimizer asks"
        return "DeepSpeedCPUAdam on the host"

    def deepspeed_config(self) -> dict[str, Any]:
        """A private copy of the resolved DeepSpeed dict: `deepspeed.initialize` and the client
        optimizer's host rule write into the dict they are given."""
        if self.deepspeed is None:
            raise ValueError(f"a {self.kind} plan has no DeepSpeed config")
        return copy.deepcopy(self.deepspeed)


def plan_engine(
    user: RunConfig,
    strategy: Strategy,
    world_size: int,
    device: torch.device,
    hidden_size: int | None,
    env: dict[str, str] | None = None,
    has_accelerator: bool | None = None,
) -> EnginePlan:
    """The plan for `strategy` at `world_size` on `device`. First the run config takes what the
    launcher (`env`, default the process's) and a DeepSpeed file set and it leaves to defaults
    (`adopt_settings`, into a copy: the plan's `config`; `user` stays as written); then the file is
    resolved. Every problem found on the way is one ConfigError, one line each.
    `hidden_size` fills DeepSpeed's "auto" bucket sizes; `has_accelerator` (default: `device` is
    not the CPU) is whether the run's machine has a GPU, which fp16 under DeepSpeed needs."""
    env = dict(os.environ) if env is None else env
    accelerator = device.type != "cpu" if has_accelerator is None else has_accelerator
    kind = engine_kind(strategy.kind, world_size)
    said, problems = launcher_settings(env, world_size, strategy.kind)
    cfg, taken, adopt_problems = adopt_settings(user, strategy, world_size, accelerator, env)
    problems += adopt_problems
    filled: list[str] = []
    ignored: list[str] = []
    ds = None
    if kind == "deepspeed":
        problems += forced_cpu_adam_problems(cfg.optim, strategy)
        ds = resolve_deepspeed_config(
            strategy,
            cfg,
            world_size,
            hidden_size,
            filled=filled,
            has_accelerator=accelerator,
            env=env,
            problems=problems,
            warnings=ignored,
        )
    elif problems:
        raise ConfigError(problems[0] if len(problems) == 1 else f"{len(problems)} problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return EnginePlan(
        kind=kind,
        strategy=strategy,
        layout=ParallelLayout.of(cfg.parallel, world_size),
        precision=precision_policy(cfg.precision, device, kind),
        config=cfg,
        deepspeed=ds,
        deepspeed_filled=tuple(filled),
        deepspeed_ignored=tuple(ignored),
        taken=tuple(taken),
        launcher_said=tuple(said),
        optimizer_in_backward=cfg.memory.optimizer_in_backward,
        activation_offload=cfg.memory.activation_offload,
        offload_checkpoint_inputs=cfg.memory.offload_checkpoint_inputs,
        trainable_only=cfg.lora.enabled,
        cpu_adam=ds is not None and host_adam(cfg.optim, strategy, ds, accelerator, env),
    )


def forced_cpu_adam_problems(optim: OptimConfig, strategy: Strategy) -> list[str]:
    """A file's `zero_force_ds_cpu_optimizer: true` with the optimizer offloaded asks for DeepSpeed's
    CPU optimizer, which is Adam/AdamW: any other optimizer is refused here, not by DeepSpeed's
    traceback after the model is loaded."""
    forced = strategy.raw.get("zero_force_ds_cpu_optimizer") is True and strategy.offload_optimizer != "none"
    if not forced or "optimizer" in strategy.raw or optim.name in CPU_ADAM_OPTIMIZERS:
        return []
    return [
        f"zero_force_ds_cpu_optimizer: true asks for DeepSpeed's CPU optimizer (DeepSpeedCPUAdam: Adam/AdamW) but optim.name="
        f"{optim.name!r}; use optim.name=adamw, or set it false to step {optim.name} on the host"
    ]


def host_adam(optim: OptimConfig, strategy: Strategy, ds: dict[str, Any], accelerator: bool, env: dict[str, str]) -> bool:
    """Whether DeepSpeed steps the offloaded optimizer with DeepSpeedCPUAdam (built from the run's
    AdamW settings): where the file asks for it (`zero_force_ds_cpu_optimizer: true`), and by
    default on a GPU machine, where it is the fast path (`HARNESS_DS_CPU_ADAM=0` turns the default
    off). On a CPU-only machine without the key, torch's AdamW steps on the host: the model and its
    optimizer already share it, and the op costs minutes of JIT build."""
    if strategy.offload_optimizer == "none" or "optimizer" in ds or optim.name not in CPU_ADAM_OPTIMIZERS:
        return False
    if strategy.raw.get("zero_force_ds_cpu_optimizer") is True:
        return True
    return accelerator and env.get("HARNESS_DS_CPU_ADAM", "1") == "1"


def hidden_size_of(shape: dict[str, Any] | Any) -> int | None:
    """The model width a config (a dict or a transformers config) gives under any of its usual names."""
    get = shape.get if isinstance(shape, dict) else lambda k: getattr(shape, k, None)
    for key in ("hidden_size", "n_embd", "d_model"):
        value = get(key)
        if isinstance(value, int):
            return value
    return None
