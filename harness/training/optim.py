"""Optimizers, their state bytes, and the learning-rate schedule, shared by every engine so they
train identically and the planner counts what they hold.

The low-precision optimizers are the libraries' own: torchao's ``AdamW8bit``/``AdamW4bit``
(block-quantized moments, tensor subclasses that FSDP2's DTensor shards carry), torchao's
``_AdamW`` for bf16 moments with stochastic rounding of bf16 weights, bitsandbytes'
``PagedAdamW8bit``. Both libraries are imported inside ``build_optimizer``, the one function that
needs them: importing them costs seconds and prints import-time notices, and an fp32 AdamW run
must not pay for either. ``optimizer_state_bytes`` is the one account of what each keeps; the
planner and the tests read it, and the tests compare it with the storage each optimizer holds.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from harness.config import OPTIMIZER_LIBRARY, OPTIMIZER_NAMES, OptimConfig
from harness.distributed import local_tensor
from harness.log import get_logger

log = get_logger(__name__)

# torchao rounds the fp32 update into a bf16 weight stochastically (an update below half a bf16
# step survives in expectation); torch's AdamW and bitsandbytes round to nearest, so such updates
# are lost: only torchao's optimizers can train precision=bf16_pure (BF16_WEIGHT_OPTIMIZERS).
TORCHAO = tuple(n for n in OPTIMIZER_NAMES if OPTIMIZER_LIBRARY[n] == "torchao")
BITSANDBYTES = tuple(n for n in OPTIMIZER_NAMES if OPTIMIZER_LIBRARY[n] == "bitsandbytes")

# torchao quantizes a state tensor only when its (local) element count is >= this and a multiple
# of the block size; smaller ones keep full-precision state (it follows bitsandbytes' rule).
_TORCHAO_MIN_QUANT = 4096
_TORCHAO_BLOCK = {"adamw_8bit": 256, "adamw_4bit": 128}
_TORCHAO_QMAP = {"adamw_8bit": 256, "adamw_4bit": 16}  # fp32 code book entries, one per state tensor
_BNB_MIN_8BIT = 4096  # bitsandbytes' min_8bit_size
_BNB_BLOCK = 256  # bitsandbytes' blockwise absmax block
_SAID = {"paged_on_cpu": False}  # one-time notices of this process


def _full_precision(numel: int, param_dtype: torch.dtype) -> int:
    """Two moments in the parameter's dtype (torch's AdamW, and every library's small tensors)."""
    return 2 * numel * torch.empty((), dtype=param_dtype).element_size()


def optimizer_state_bytes(name: str, numel: int, param_dtype: torch.dtype) -> int:
    """Bytes of the state one parameter tensor of ``numel`` local elements holds under optimizer
    ``name`` (its DTensor shard's numel under FSDP2), exact to the byte after the first step.

    Counted: the moments and, for the quantized optimizers, their codes, block scales and code
    books. Not counted here: the per-tensor ``step`` counter (``optimizer_step_bytes``) and the
    code books bitsandbytes shares across one optimizer's tensors (``optimizer_shared_bytes``).
    """
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"unknown optimizer {name!r}; one of {', '.join(OPTIMIZER_NAMES)}")
    if numel <= 0 or name == "sgd":  # SGD without momentum keeps no state
        return 0
    if name in ("adamw", "adam"):
        return _full_precision(numel, param_dtype)
    if name == "adamw_bf16":  # bf16 moments above torchao's size threshold (see build_optimizer)
        return 2 * numel * 2 if numel >= _TORCHAO_MIN_QUANT else _full_precision(numel, param_dtype)
    if name in _TORCHAO_BLOCK:
        block = _TORCHAO_BLOCK[name]
        if numel < _TORCHAO_MIN_QUANT or numel % block:
            return _full_precision(numel, param_dtype)
        codes = numel if name == "adamw_8bit" else numel // 2  # 4-bit codes are packed two per byte
        return 2 * (codes + 4 * (numel // block) + 4 * _TORCHAO_QMAP[name])
    # paged_adamw_8bit: uint8 moments and an fp32 absmax per 256-element block (the last one partial)
    if numel < _BNB_MIN_8BIT:
        return 2 * numel * 4  # bitsandbytes keeps fp32 state for small tensors, whatever the parameter dtype
    return 2 * (numel + 4 * math.ceil(numel / _BNB_BLOCK))


def optimizer_step_bytes(name: str) -> int:
    """The per-tensor ``step`` counter: a 0-dim fp32 tensor on the host for torch's and torchao's
    Adam family, a Python int for bitsandbytes, nothing for SGD."""
    return 0 if name == "sgd" or name in BITSANDBYTES else 4


def optimizer_shared_bytes(name: str, numels: list[int]) -> int:
    """Bytes one optimizer object over tensors of these local numels holds once for all of them:
    bitsandbytes' two fp32 code books (256 entries each), made when its first tensor is quantized."""
    return 2 * 256 * 4 if name in BITSANDBYTES and any(n >= _BNB_MIN_8BIT for n in numels) else 0


def _mixes_dtensors(params: list[torch.nn.Parameter]) -> bool:
    """DTensors beside plain tensors (experts split over ranks under DDP): a fused or foreach step
    takes one kind per call, so those runs step tensor by tensor. One parameter group all the same:
    the optimizer's and the schedule's state do not depend on the layout (a checkpoint resumes at
    any world)."""
    kinds = {isinstance(p, DTensor) for p in params}
    return len(kinds) == 2


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, fused: bool = True) -> torch.optim.Optimizer:
    """The optimizer ``cfg.name`` names over the trainable ``params`` (see ``OptimName``).
    ``fused=False``: torch's Adam/AdamW as the single-tensor loop (what DeepSpeed's ZeRO is handed:
    its flat master partitions are stepped as the planner's ZeRO models count)."""
    params = [p for p in params if p.requires_grad]
    kwargs = {"lr": cfg.lr, "betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
    if cfg.cpu_offload:
        return _cpu_offload(params, cfg, kwargs)
    if cfg.name in ("adamw", "adam"):
        # fused: one kernel per tensor updating in place, so the step allocates nothing (the
        # single-tensor loop makes two to three temporaries the size of the tensor it steps, the
        # foreach one those of every tensor at once). It is ~5x faster than the single-tensor loop
        # on CPU (SmolLM2-135M: 0.045 vs 0.22 s a step) and one launch instead of ~10 per tensor
        # on a GPU; elementwise, so a shard steps to the same bits as the whole tensor.
        cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
        fused = fused and not _mixes_dtensors(params)
        return cls(params, fused=True, **kwargs) if fused else cls(params, foreach=False, **kwargs)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=False)
    if cfg.name in TORCHAO:
        return _torchao_class(cfg.name)(params, **kwargs)
    import bitsandbytes  # function-local: see the module docstring

    if params and params[0].device.type == "cpu" and not _SAID["paged_on_cpu"]:
        # bitsandbytes warns at its first step that it cannot page on CPU; said once here instead (once
        # per process: optimizer-in-backward builds one optimizer per parameter).
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        log.info("optim.name=paged_adamw_8bit on CPU: paging is a CUDA feature, so this is bitsandbytes' plain 8-bit AdamW")
        _SAID["paged_on_cpu"] = True
    return bitsandbytes.optim.PagedAdamW8bit(params, **kwargs)


def compiles_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step runs through torch.compile: torchao's optimizers compile each
    tensor's update themselves (``fullgraph=True``) unless dynamo is switched off
    (``TORCHDYNAMO_DISABLE=1``). Under a non-infra TorchDispatchMode (torch's MemTracker) dynamo
    compiles nothing and fullgraph raises "found no compiled frames"; eager, the 8-bit update of
    SmolLM2-135M takes minutes on two CPU cores. A memory tracker must not wrap such a step in a
    dispatch mode (`harness.memory.tracking.StepMemoryTracker`)."""
    return type(optimizer).__module__.split(".")[0] == "torchao" and _dynamo_enabled()


def name_compiles_step(name: str) -> bool:
    """`compiles_step` for the optimizer ``optim.name`` will build, known before it is built (a
    measurement must choose how to measure before the model and its optimizer exist)."""
    return name in TORCHAO and _dynamo_enabled()


def _dynamo_enabled() -> bool:
    return os.environ.get("TORCHDYNAMO_DISABLE", "") != "1" and not torch._dynamo.config.disable


def _torchao_class(name: str) -> Callable[..., torch.optim.Optimizer]:
    """torchao's optimizer for ``name``. Stochastic rounding is asked for always: torchao applies it
    only to bf16 parameters (``precision=bf16_pure``), fp32 ones take the fp32 update as it is."""
    import torchao.optim as ao  # function-local: see the module docstring

    if name == "adamw_8bit":
        return lambda params, **kw: ao.AdamW8bit(params, bf16_stochastic_round=True, **kw)
    if name == "adamw_4bit":
        return lambda params, **kw: ao.AdamW4bit(params, bf16_stochastic_round=True, **kw)

    def bf16_moments(params, **kw) -> torch.optim.Optimizer:
        # torchao's _AdamW keeps moments in the parameter's dtype. Its buffer factory is pointed at
        # bf16 for every tensor above its size threshold (block size 1: every such size qualifies),
        # so fp32 weights get bf16 moments too; the step itself is torchao's.
        opt = ao._AdamW(params, bf16_stochastic_round=True, **kw)
        opt.block_size = 1
        opt._subclass_zeros = lambda p, signed, block: torch.zeros_like(p, dtype=torch.bfloat16)
        # torch's load_state_dict casts every state to its parameter's dtype; the saved moments were
        # bf16, so casting them back after a load is exact (a resume continues bit for bit).
        opt.register_load_state_dict_post_hook(_moments_back_to_bf16)
        return opt

    return bf16_moments


def _moments_back_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state.get(key)
            if isinstance(value, torch.Tensor) and local_tensor(value).numel() >= _TORCHAO_MIN_QUANT and value.dtype != torch.bfloat16:
                state[key] = value.to(torch.bfloat16)


def _cpu_offload(params: list[torch.nn.Parameter], cfg: OptimConfig, kwargs: dict) -> torch.optim.Optimizer:
    """torchao's CPUOffloadOptimizer (CUDA only; refused before launch elsewhere): the state and the
    step of every tensor of >= 4096 elements on the host, the rest on the device."""
    from torchao.optim import CPUOffloadOptimizer  # function-local: see the module docstring

    base = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}.get(cfg.name)
    if base is None:
        base = _torchao_class(cfg.name)
    return CPUOffloadOptimizer(params, base, **kwargs)


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
