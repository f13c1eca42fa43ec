"""Model FLOPs utilisation: FLOPs per token of a causal LM and peak FLOP/s per GPU type.

MFU = (tokens/s per device × model FLOPs per token) / (peak FLOP/s of one device).

FLOPs per token (training, forward + backward), the PaLM paper's appendix B formula as
torchtitan uses it:

    flops_per_token = 6 · N  +  12 · L · H · d · S

- `N`: parameters that take part in a matmul: every parameter except embedding lookups
  (token and learned position embeddings), plus the output projection when it is tied to
  the token embedding (the weight is shared, the matmul still happens). A matmul with a
  weight of N elements costs 2N FLOPs per token forward and 4N backward: 6N in all.
- `12 · L · H · d · S`: attention scores and the weighted sum (QKᵀ and AV) over a sequence
  of length S in each of L layers with H query heads of size d: 2 matmuls × 2 FLOPs × S ×
  H·d forward, ×3 with backward. Like PaLM and torchtitan we count the full S×S square
  (no discount for the causal mask), and the full S for sliding-window models.

This is *model* FLOPs: recomputation by activation checkpointing is not counted (that
would be hardware FLOPs utilisation), so checkpointing lowers MFU, as it should.

N is counted exactly by building the model from its config on the `meta` device (no
memory, milliseconds even for 8B), so any HF causal LM works without per-architecture code.

Peak FLOP/s are dense (no 2:4 sparsity) tensor-core numbers from NVIDIA's datasheets and
architecture whitepapers. GeForce cards run bf16/fp16 with fp32 accumulation (what PyTorch
uses) at half their headline rate; the table has the fp32-accumulate number. `fp32` is the
CUDA-core rate, used when TF32 matmuls are off (PyTorch's default); with TF32 on
(`torch.set_float32_matmul_precision("high")`) the `tf32` rate applies.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

TFLOPS = 1e12

# Dense peak FLOP/s per device, by precision.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
    "h100-pcie": {"bf16": 756.0 * TFLOPS, "fp16": 756.0 * TFLOPS, "tf32": 378.0 * TFLOPS, "fp32": 51.2 * TFLOPS},
    "h100-nvl": {"bf16": 835.5 * TFLOPS, "fp16": 835.5 * TFLOPS, "tf32": 417.5 * TFLOPS, "fp32": 60.0 * TFLOPS},
    "h200-sxm": {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
    "h200-nvl": {"bf16": 835.5 * TFLOPS, "fp16": 835.5 * TFLOPS, "tf32": 417.5 * TFLOPS, "fp32": 60.0 * TFLOPS},
    "gh200": {"bf16": 989.4 * TFLOPS, "fp16": 989.4 * TFLOPS, "tf32": 494.7 * TFLOPS, "fp32": 66.9 * TFLOPS},
    "a100": {"bf16": 312.0 * TFLOPS, "fp16": 312.0 * TFLOPS, "tf32": 156.0 * TFLOPS, "fp32": 19.5 * TFLOPS},
    "a6000": {"bf16": 154.8 * TFLOPS, "fp16": 154.8 * TFLOPS, "tf32": 77.4 * TFLOPS, "fp32": 38.7 * TFLOPS},
    "rtx6000-ada": {"bf16": 364.2 * TFLOPS, "fp16": 364.2 * TFLOPS, "tf32": 182.1 * TFLOPS, "fp32": 91.1 * TFLOPS},
    "l40s": {"bf16": 362.05 * TFLOPS, "fp16": 362.05 * TFLOPS, "tf32": 183.0 * TFLOPS, "fp32": 91.6 * TFLOPS},
    "l40": {"bf16": 181.05 * TFLOPS, "fp16": 181.05 * TFLOPS, "tf32": 90.5 * TFLOPS, "fp32": 90.5 * TFLOPS},
    "l4": {"bf16": 121.0 * TFLOPS, "fp16": 121.0 * TFLOPS, "tf32": 60.0 * TFLOPS, "fp32": 30.3 * TFLOPS},
    "a40": {"bf16": 149.7 * TFLOPS, "fp16": 149.7 * TFLOPS, "tf32": 74.8 * TFLOPS, "fp32": 37.4 * TFLOPS},
    "a10": {"bf16": 125.0 * TFLOPS, "fp16": 125.0 * TFLOPS, "tf32": 62.5 * TFLOPS, "fp32": 31.2 * TFLOPS},
    "rtx4090": {"bf16": 165.2 * TFLOPS, "fp16": 165.2 * TFLOPS, "tf32": 82.6 * TFLOPS, "fp32": 82.6 * TFLOPS},
    "rtx3090": {"bf16": 71.0 * TFLOPS, "fp16": 71.0 * TFLOPS, "tf32": 35.6 * TFLOPS, "fp32": 35.6 * TFLOPS},
    # Volta and Turing have no bf16 and no tf32.
    "v100-sxm": {"fp16": 125.0 * TFLOPS, "fp32": 15.7 * TFLOPS},
    "v100-pcie": {"fp16": 112.0 * TFLOPS, "fp32": 14.0 * TFLOPS},
    "t4": {"fp16": 65.0 * TFLOPS, "fp32": 8.1 * TFLOPS},
}

# `torch.cuda.get_device_name()` -> table key. Ordered: the first match wins, so the more
# specific names come first ("GH200" contains "H200", "A100" contains "A10", "L40S" "L40").
_GPU_PATTERNS: list[tuple[str, str]] = [
    (r"GH200", "gh200"),
    (r"H200.*NVL", "h200-nvl"),
    (r"H200", "h200-sxm"),
    (r"H100.*NVL", "h100-nvl"),
    (r"H100.*PCIe", "h100-pcie"),
    (r"H100", "h100-sxm"),  # "NVIDIA H100 80GB HBM3" is the SXM part
    (r"A100", "a100"),
    (r"RTX 6000 Ada", "rtx6000-ada"),
    (r"RTX A6000|\bA6000\b", "a6000"),
    (r"L40S", "l40s"),
    (r"\bL40\b", "l40"),
    (r"\bL4\b", "l4"),
    (r"\bA40\b", "a40"),
    (r"\bA10\b", "a10"),
    (r"RTX 4090", "rtx4090"),
    (r"RTX 3090(?! Ti)", "rtx3090"),
    (r"V100.*PCIe", "v100-pcie"),
    (r"V100", "v100-sxm"),
    (r"\bT4\b", "t4"),
]


def detect_gpu(device_name: str) -> str | None:
    """The PEAK_FLOPS key for a CUDA device name, or None for a GPU not in the table."""
    for pattern, key in _GPU_PATTERNS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return key
    return None


def current_device_name(device: str = "auto") -> str | None:
    """The name of the CUDA device this process trains on; None when training on CPU."""
    if device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def _tf32_enabled() -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores.

    torch >= 2.9 has `matmul.fp32_precision` ("tf32" | "ieee", "none" when unset); older
    code sets `allow_tf32` / `set_float32_matmul_precision`. Reading the legacy flag after
    the new API was used raises, so the new one is asked first.
    """
    matmul = torch.backends.cuda.matmul
    try:
        precision = getattr(matmul, "fp32_precision", None)
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def peak_flops(device_name: str | None, precision: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device for `precision` (fp32 | bf16 | fp16).

    `override` (`logging.peak_flops`) wins. Without it: None on CPU (there is no honest
    table for CPUs) and for a GPU not in the table, so MFU is then left out, never guessed.
    """
    if override is not None:
        return float(override)
    if device_name is None:
        return None
    key = detect_gpu(device_name)
    if key is None:
        return None
    table = PEAK_FLOPS[key]
    if precision == "fp32" and _tf32_enabled() and "tf32" in table:
        return table["tf32"]
    return table.get(precision)


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def matmul_params(config: Any) -> int:
    """N of the formula: parameters used in matmuls (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in embedding_ids)
    output = model.get_output_embeddings()
    if output is not None and id(output.weight) in embedding_ids:
        n += output.weight.numel()  # tied: the lookup table is also the output matmul
    return n


def flops_per_token(config: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token: 6N + 12·L·H·d·S."""
    text = _text_config(config)
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 6.0 * matmul_params(config) + 12.0 * layers * heads * head_dim * seq_len


def mfu(tokens_per_s_per_device: float, flops_per_token_: float, peak_flops_: float) -> float:
    """Fraction of one device's peak the model's FLOPs achieve."""
    return tokens_per_s_per_device * flops_per_token_ / peak_flops_
