"""Tiny random models of five transformers families, saved as checkpoint directories.

Llama (untied; saved in several safetensors shards with an index), Qwen2 (tied embeddings),
OPT (blocks at `model.decoder.layers`, learned positions), GPT-NeoX (blocks at
`gpt_neox.layers`; saved in bf16), GPT-2 (blocks at `transformer.h`, tied, Conv1D).

Mixture-of-experts families apart (`moe_configs`, `save_moe_families`): Qwen3-MoE, Mixtral and
OLMoE, which transformers 5 holds as one stacked tensor per projection and `save_pretrained` writes
one tensor per expert (the Hub's layout), and gpt-oss, whose experts are stacked on disk too.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    OPTConfig,
    Qwen2Config,
    Qwen3MoeConfig,
)

VOCAB = 512


def family_configs() -> dict:
    small = dict(num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)
    return {
        "llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=False, **small),
        "qwen2": Qwen2Config(hidden_size=64, intermediate_size=128, num_key_value_heads=2, tie_word_embeddings=True, **small),
        "opt": OPTConfig(hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, **small),
        "gpt_neox": GPTNeoXConfig(hidden_size=64, intermediate_size=128, **small),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0),
    }


def save_families(root: Path) -> dict[str, str]:
    """Each family's tiny random model saved as a transformers checkpoint directory."""
    dirs = {}
    for name, config in family_configs().items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        if name == "gpt_neox":
            model = model.to(torch.bfloat16)  # a bf16 file trained with fp32 masters
        kwargs = {"max_shard_size": "100KB"} if name == "llama" else {}  # several shards and an index
        model.save_pretrained(root / name, **kwargs)
        dirs[name] = str(root / name)
    return dirs


def moe_configs(experts: int = 4) -> dict:
    small = dict(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, hidden_size=64
    )
    moe = dict(num_experts_per_tok=2, **small)
    return {
        "qwen3_moe": Qwen3MoeConfig(moe_intermediate_size=32, num_experts=experts, head_dim=16, **moe),
        "mixtral": MixtralConfig(intermediate_size=32, num_local_experts=experts, **moe),
        "olmoe": OlmoeConfig(intermediate_size=32, num_experts=experts, eos_token_id=None, pad_token_id=None, **moe),
        "gpt_oss": GptOssConfig(
            intermediate_size=32,
            num_local_experts=experts,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **moe,
        ),
    }


def save_moe_families(root: Path, names: tuple[str, ...] | None = None, experts: int = 4) -> dict[str, str]:
    """Each MoE family's tiny random model (or those in `names`) saved by `save_pretrained`."""
    dirs = {}
    for name, config in moe_configs(experts).items():
        if names is not None and name not in names:
            continue
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs
