"""What every engine's load path applies, in torchtitan's order: activation checkpointing →
compile → sharding (FSDP2 here; DeepSpeed's `zero.Init`/`initialize` in its engine).

Each engine owns its load path (`TorchEngine.load_model`, `DeepSpeedEngine.load_model`) and
builds itself from the `EnginePlan`; the pieces they share live here: the memory techniques,
FSDP2's wrapping, a LoRA base, and the weights written into whatever part of each parameter
a rank stores. The model code is never edited; everything wraps it from outside.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from harness.config import LoraConfig, RunConfig, Strategy
from harness.engine.experts import ExpertGradients
from harness.engine.storage import local_part
from harness.memory import prepare_model
from harness.models import (
    LoraWeights,
    ModelSpec,
    QuantizedWeights,
    build_run_model,
    cast_except_quantized,
    decoder_blocks,
    empty_lora_model,
    empty_model,
    fill,
    hold_frozen_in,
    quantize_empty,
)
from harness.training import DTYPES, PrecisionPolicy


def fsdp_wrap(
    model: nn.Module, strategy: Strategy, policy: PrecisionPolicy, mesh: DeviceMesh, experts: ExpertGradients | None = None
) -> nn.Module:
    """FSDP2: shard the embeddings, each decoder block, the LM head, and the root.

    The head is its own unit (kept gathered after forward: backward needs it at once), so
    its large weight is not gathered with the root's small leftovers (final norm, rotary
    buffers). Those leftovers are kept gathered after forward too, as torch does for a root
    by default: backward begins with the root's group, so resharding it would only gather the
    same few bytes again, one more collective per micro-batch. A head tied to the input
    embeddings shares one weight, which one group must own: the root's (the weight is used
    at the start and at the end of the forward anyway); that root follows the strategy, so
    the whole embedding is not held through the loss.
    Called on the meta model: each rank then allocates only its shards. One module per
    `fully_shard` call: torch's FSDPMemTracker instruments each
    module's parameter group once, and a group shared by two modules breaks its tracking.
    `experts`: the experts split over ranks (bound to `model`): each experts module is its own
    group on the replica mesh (the ranks holding the same experts), in the same mixed precision, its
    gradients summed over the replicas and divided by the world (`harness.engine.experts`); the
    blocks' groups then leave them out.
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": strategy.reshard_after_forward}
    reduce = DTYPES[strategy.reduce_dtype]
    if policy.mode == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    elif policy.mode == "bf16_pure":
        # The sharded parameters are bf16 themselves (no fp32 master); only the gradient reduction may
        # run in fp32, each shard's gradient then stored in bf16 like its parameter.
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce)
    if strategy.offload_params != "none":
        # pinned host memory needs CUDA; on a CPU run the "device" is the host, and the policy runs
        # the same shard moves and host step (no memory saved: a correctness run)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    if experts is not None:
        for module in experts.modules(model):
            fully_shard(module, **{**kwargs, "mesh": experts.replica_mesh})
            module.set_gradient_divide_factor(float(experts.world))
            if experts.replicas > 1:
                # a sum, then the division: gloo has no pre-multiplied sum. (Not on a replica group of one:
                # torch 2.13 then divides the copy and the result both, halving the gradient at world 2.)
                module.set_force_sum_reduction_for_comms(True)
        experts.sharded = True
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None and not tied:  # tied input/output embeddings: one weight, left to the root's group
        fully_shard(embed, **kwargs)
    for block in decoder_blocks(model):
        fully_shard(block, **kwargs)
    if head is not None and not tied:
        fully_shard(head, **{**kwargs, "reshard_after_forward": False})
    leftovers_only = embed is not None and head is not None and not tied
    fully_shard(model, **({**kwargs, "reshard_after_forward": False} if leftovers_only else kwargs))
    return model


def empty_model_to_train(spec: ModelSpec, lora: LoraConfig, policy: PrecisionPolicy) -> nn.Module:
    """The model a run trains, on the meta device in the policy's parameter dtype (a LoRA base:
    its frozen dtype, `PrecisionPolicy.frozen_dtype`): the spec's,
    its linears made bitsandbytes' quantized ones (`lora.quantize`: codes stored in the compute
    dtype, which FSDP2 never casts), with LoRA adapters injected (`lora.enabled`) before anything
    is allocated. Fill it with `WeightsToLoad(spec, lora.enabled, model)` once materialized (sharded or not)."""
    model = empty_model(spec.config)
    if lora.quantize != "none":
        model.to(dtype=policy.param_dtype)
        quantize_empty(model, lora.quantize, policy.compute_dtype)
    if lora.enabled:
        model = empty_lora_model(model, lora)
    cast_except_quantized(model, policy.param_dtype)
    if lora.enabled and policy.frozen_dtype != policy.param_dtype:  # FSDP2 bf16: the base needs no fp32 master
        hold_frozen_in(model, policy.frozen_dtype)
    return model


def lora_base(spec: ModelSpec, cfg: RunConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The frozen base built whole with its adapters, on `device` in `dtype`, AC and compile
    applied: DeepSpeed's LoRA path at ZeRO-0/1/2, which keep the working weights whole anyway,
    and its QLoRA path at ZeRO-3 (built on the host, then partitioned onto the device a tensor at
    a time; ZeRO-3's plain LoRA builds its base partitioned, `DeepSpeedEngine.load_model`)."""
    # a quantized base's codes are stored in `dtype`: DeepSpeed casts every floating weight to it
    model = build_run_model(cfg, spec.config.vocab_size, dtype if cfg.lora.quantize != "none" else torch.float32, spec=spec)
    model.to(device=device)
    cast_except_quantized(model, dtype)
    prepare_model(model, cfg.memory)
    return model


class WeightsToLoad:
    """The spec's weights (a checkpoint or the seeded init) written into whatever part of each
    parameter this rank stores, read from a template of the model kept on the meta device.
    `lora`: the model has adapters (`empty_lora_model`): the base's weights plus the adapters'
    seeded init. `model`: the skeleton to be filled, when its linears are quantized
    (`quantize_empty`): each is quantized whole by bitsandbytes, this rank's part of its codes
    kept and its quantization state attached."""

    def __init__(self, spec: ModelSpec, lora: bool = False, model: nn.Module | None = None):
        self.template = empty_model(spec.config)
        self.source = spec.source(self.template)
        self.fallback = spec.fallback(self.template)
        self.quantized: QuantizedWeights | None = None
        if model is not None and hasattr(model, "hf_quantizer"):  # set by `quantize_empty`
            self.quantized = self.source = QuantizedWeights(self.source, model, self.fallback)
        if lora:
            self.source, self.fallback = LoraWeights(self.source, spec.seed), LoraWeights(self.fallback, spec.seed)

    def fill(self, model: nn.Module) -> None:
        fill(model, self.source, part_of=local_part, fallback=self.fallback)
        if self.quantized is not None:
            self.quantized.attach(model)
