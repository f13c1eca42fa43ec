"""QLoRA's frozen base: bitsandbytes' NF4 (or LLM.int8) linears, built on the meta device and
quantized one tensor at a time, so a sharded run loads like a full fine-tune.

transformers' own bitsandbytes quantizer decides the skeleton (`preprocess_model`: every
linear becomes `bnb.nn.Linear4bit`/`Linear8bitLt` except the output embeddings, as
`from_pretrained(quantization_config=...)` does); the weights are then quantized by
bitsandbytes itself (`Params4bit`/`Int8Params`), a whole tensor at a time from the same
`WeightSource` every run reads, and each rank keeps only its part of the packed storage.
No rank holds the whole base, in any precision: the load peak is a rank's part plus one
tensor and its quantized form (the quantization of a tensor is deterministic, so every
rank derives the same packed bytes and the same scales).

The FSDP-QLoRA recipe: the 4-bit codes are stored in a tensor of the compute dtype
(`bnb_4bit_quant_storage`, float32 or bfloat16 here, two or four codes per element), a
floating tensor FSDP2 shards and all-gathers like any other frozen weight and never casts
(its dtype is FSDP2's compute dtype). FSDP2 hands `Linear4bit` a plain tensor where its
`Params4bit` was, without its quantization state; `Linear4bit.forward` rebuilds it from the
module's own `quant_state` (bitsandbytes' FSDP path), which `QuantizedWeights.attach` sets
on every rank. The scales (absmax, double-quantized) are replicated: small next to the codes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from harness.errors import ConfigError
from harness.log import get_logger
from harness.models.weights import WeightSource, clean_name, strip_base_layer

log = get_logger(__name__)

BNB_LINEARS = ("Linear4bit", "Linear8bitLt")
BLOCKSIZE = 64  # bitsandbytes' 4-bit block: one absmax per 64 weights


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Importing bitsandbytes (and transformers' quantizers, which import torchao) logs warnings
    about optional compiled kernels that are absent (an AVX512-BF16 inference kernel, torchao's
    CUDA extensions); training never uses them. Imports of these libraries go through here."""
    loggers = [logging.getLogger(name) for name in ("bitsandbytes", "torchao")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def bitsandbytes() -> Any:
    """The bitsandbytes module, or one actionable line when it is not installed."""
    try:
        with _quiet_import():
            import bitsandbytes as bnb
    except ImportError:
        raise ConfigError("lora.quantize needs the bitsandbytes package: pip install bitsandbytes (a dependency of harness)") from None
    return bnb


def quantization_config(quantize: str, compute_dtype: torch.dtype) -> Any:
    """transformers' `BitsAndBytesConfig` of a run: LLM.int8, or NF4 with double quantization
    (the QLoRA paper's choice) computing in `compute_dtype` and storing its codes in it."""
    from transformers import BitsAndBytesConfig

    if quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_quant_storage=compute_dtype,
    )


def is_quantized_linear(module: nn.Module) -> bool:
    """A bitsandbytes linear (not peft's wrapper of one, which has the same class name)."""
    return type(module).__name__ in BNB_LINEARS and type(module).__module__.startswith("bitsandbytes")


def quantize_empty(model: nn.Module, quantize: str, compute_dtype: torch.dtype) -> None:
    """Turn `model` (on the meta device, in `compute_dtype`) into its quantized skeleton in place:
    transformers' bitsandbytes quantizer swaps the linears, and each 4-bit weight takes the shape
    of its packed codes (asked of bitsandbytes on the meta device), which is what FSDP2 shards."""
    bnb = bitsandbytes()
    with _quiet_import():
        from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(quantization_config(quantize, compute_dtype), pre_quantized=False)
    quantizer.preprocess_model(model, dtype=compute_dtype, device_map={"": "cpu"})
    model.hf_quantizer = quantizer
    setattr(model, "is_loaded_in_4bit" if quantize == "nf4" else "is_loaded_in_8bit", True)  # what peft dispatches on
    for module in model.modules():
        if is_quantized_linear(module) and type(module).__name__ == "Linear4bit":
            # the packed shape only (no double quantization: its code book would be cached on meta)
            codes, _ = bnb.functional.quantize_4bit(
                torch.empty(module.weight.shape, device="meta", dtype=compute_dtype),
                blocksize=BLOCKSIZE,
                compress_statistics=False,
                quant_type="nf4",
                quant_storage=compute_dtype,
            )
            module.weight = bnb.nn.Params4bit(
                codes,
                requires_grad=False,
                blocksize=BLOCKSIZE,
                compress_statistics=True,
                quant_type="nf4",
                quant_storage=compute_dtype,
                bnb_quantized=True,
                module=module,
            )
            module.support_avx512bf16_for_cpu = False  # its eval path repacks the weight in place
        elif is_quantized_linear(module):
            codes = torch.empty(module.weight.shape, device="meta", dtype=torch.int8)
            module.weight = bnb.nn.Int8Params(codes, requires_grad=False, has_fp16_weights=False)
    if quantize == "nf4":
        log.info(
            f"lora.quantize=nf4: 4-bit codes stored in {str(compute_dtype).removeprefix('torch.')} tensors "
            "(bnb_4bit_quant_storage = the compute dtype), so FSDP2 can shard the frozen base"
        )


def quantized_codes(model: nn.Module) -> dict[int, int]:
    """`id` of each quantized linear's weight (its packed codes, however sharded) -> the number of
    weights it encodes (in x out). The codes are not numbers: counts and finiteness checks skip them."""
    return {id(m.weight): m.in_features * m.out_features for m in model.modules() if is_quantized_linear(m)}


def cast_except_quantized(model: nn.Module, dtype: torch.dtype) -> None:
    """`model.to(dtype)` for every module but the quantized linears, whose storage dtype is their packing."""
    for module in model.modules():
        if not is_quantized_linear(module):
            module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every frozen floating parameter of a skeleton (meta or fake storage: values are
    filled afterwards) `dtype`, except the quantized linears' codes, whose dtype is their packing.
    A parameter two modules share (tied input and output embeddings) stays one parameter."""
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old) -> (old, new): the old kept alive, its id unique
    for module in model.modules():
        if is_quantized_linear(module):
            continue
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in replaced:
                    replaced[id(p)] = (p, nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False))
                module._parameters[name] = replaced[id(p)][1]


def _weight_name(module_name: str) -> str:
    """A quantized linear's weight by its checkpoint name (no wrapper's, no peft's segment)."""
    return strip_base_layer(clean_name(f"{module_name}.weight"))


class QuantizedWeights:
    """A `WeightSource` for a quantized skeleton: the quantized linears' weights are read whole
    from `base` (else `fallback`), quantized by bitsandbytes, and the part asked for returned from the packed
    codes; their quantization states are kept (one per tensor, the same on every rank) for
    `attach`. Every other tensor is `base`'s, read as asked."""

    def __init__(self, base: WeightSource, model: nn.Module, fallback: WeightSource | None = None):
        self.base, self.fallback = base, fallback
        # the weights' names in the checkpoint (a quantized skeleton's linears, before any wrapper)
        self.linears = {_weight_name(n): m for n, m in model.named_modules() if is_quantized_linear(m)}
        self.states: dict[str, Any] = {}

    def _quantize(self, name: str) -> torch.Tensor:
        """The packed codes of weight `name` (flat), its state kept."""
        bnb = bitsandbytes()
        module = self.linears[name]
        shape = (module.out_features, module.in_features)
        whole = self.base.read([name], shape, 0, shape[0] * shape[1])
        if whole is None and self.fallback is not None:
            log.warning(f"{name} is not in the checkpoint: quantized from random init")
            whole = self.fallback.read([name], shape, 0, shape[0] * shape[1])
        if whole is None:
            raise KeyError(f"no weights for {name}")
        whole = whole.view(shape).float()  # quantized from fp32 whatever the compute dtype: the same codes and scales in any run
        if type(module).__name__ == "Linear4bit":
            storage = module.weight.dtype
            codes, state = bnb.functional.quantize_4bit(
                whole, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4", quant_storage=storage
            )
        else:
            quantized = bnb.nn.Int8Params(whole.float(), requires_grad=False, has_fp16_weights=False)._quantize(whole.device)
            codes, state = quantized.data, quantized.SCB
        self.states[name] = state
        return codes.reshape(-1)

    def read(self, names: Sequence[str], shape: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        name = next((n for n in names if n in self.linears), None)
        if name is None:
            return self.base.read(names, shape, start, end)
        return self._quantize(name)[start:end]

    def attach(self, model: nn.Module) -> None:
        """Give every quantized linear of `model` (filled from this source) its quantization state.
        A weight FSDP2 shards stays its DTensor (`Linear4bit.forward` rebuilds the `Params4bit`
        from the module's state on the gathered codes); a whole one becomes a `Params4bit`/
        `Int8Params` again (`to_empty` leaves a plain parameter)."""
        bnb = bitsandbytes()
        for module_name, module in model.named_modules():
            if not is_quantized_linear(module):
                continue
            name = _weight_name(module_name)
            if name not in self.states:  # an empty shard on this rank: the state is still needed for forward
                self._quantize(name)
            state, weight = self.states[name], module.weight
            if type(module).__name__ == "Linear4bit":
                module.quant_state = state
                if not isinstance(weight, DTensor):
                    module.weight = bnb.nn.Params4bit(
                        weight.data,
                        requires_grad=False,
                        quant_state=state,
                        blocksize=BLOCKSIZE,
                        compress_statistics=True,
                        quant_type="nf4",
                        quant_storage=weight.dtype,
                        bnb_quantized=True,
                        module=module,
                    )
            elif isinstance(weight, DTensor):
                raise ConfigError("lora.quantize=int8 cannot be sharded (its row scales are not); use lora.quantize=nf4")
            else:
                module.weight = bnb.nn.Int8Params(weight.data, requires_grad=False, has_fp16_weights=False, CB=weight.data, SCB=state)
                # its state dict adds `<module>.SCB` and `.weight_format`, which torch's distributed
                # state-dict helpers resolve as attributes of the module (a checkpoint drops them again)
                module.SCB, module.weight_format = state, torch.tensor(0, dtype=torch.uint8)


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every quantized linear's quantization state (absmax, the nested absmax, the
    code books; int8: the row scales): held by every rank next to its part of the codes."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        if not is_quantized_linear(module):
            continue
        if type(module).__name__ == "Linear4bit" and module.quant_state is not None:
            state = module.quant_state
            out += [state.absmax, state.code]
            if state.nested:
                out += [state.offset, state.state2.absmax, state.state2.code]
        elif type(module).__name__ == "Linear8bitLt":
            out += [t for t in (module.weight.SCB, module.state.SCB) if isinstance(t, torch.Tensor)]
    return out


def move_quantization_state(model: nn.Module, device: torch.device) -> None:
    """Every quantized linear's quantization state to `device` (bitsandbytes keeps it beside the
    weight, on the `Params4bit` and on the module, not as a parameter or buffer: `model.to`
    does not see it)."""
    for module in model.modules():
        if not is_quantized_linear(module):
            continue
        states = (getattr(module.weight, "quant_state", None), getattr(module, "quant_state", None))
        for state in {id(s): s for s in states if s is not None}.values():  # often one object, held twice
            state.to(device)


@contextlib.contextmanager
def without_quantization_state(model: nn.Module) -> Iterator[None]:
    """State dicts of `model` taken meanwhile leave out the quantized linears' quantization state
    (`Linear4bit` adds `<weight>.absmax`, `.quant_map`, ... beside the weight). An adapters-only
    checkpoint (DeepSpeed's `exclude_frozen_parameters` drops frozen parameters, not these
    entries) then holds the adapters only: the base and its state are rebuilt on resume."""

    def drop(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for key in [k for k in state_dict if k.startswith(f"{prefix}weight.")]:
            del state_dict[key]

    handles = [m.register_state_dict_post_hook(drop) for m in model.modules() if is_quantized_linear(m)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def dequantize(model: nn.Module) -> nn.Module:
    """`model` with plain linears holding its quantized weights dequantized in fp32 (transformers'
    `dequantize`): the base a QLoRA adapter was trained on, for a merged export."""
    with _quiet_import():
        return model.dequantize(dtype=torch.float32)


__all__ = [
    "QuantizedWeights",
    "bitsandbytes",
    "cast_except_quantized",
    "dequantize",
    "hold_frozen_in",
    "is_quantized_linear",
    "move_quantization_state",
    "quant_state_tensors",
    "quantized_codes",
    "quantization_config",
    "quantize_empty",
    "without_quantization_state",
]
