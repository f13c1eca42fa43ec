"""Tiny random models of five transformers families, saved as checkpoint directories.

Llama (untied; saved in several safetensors shards with an index), Qwen2 (tied embeddings),
OPT (blocks at `model.decoder.layers`, learned positions), GPT-NeoX (blocks at
`gpt_neox.layers`; saved in bf16), GPT-2 (blocks at `transformer.h`, tied, Conv1D).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig, OPTConfig, Qwen2Config

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
