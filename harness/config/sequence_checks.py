"""The rules of a run's sequences: how long `data.seq_len` may be for the model (`sequence_limit`,
the one definition pre-flight refuses with and the planner's longest-sequence search stops at),
and what splitting each sequence over ranks (`parallel.sequence`: Ulysses, DeepSpeed's ALST)
runs with. Called from `checks.check_run` and pre-flight, where the model's shape is known."""

from __future__ import annotations

import importlib.metadata
import itertools
import math
from dataclasses import dataclass

from harness.config.layout import ParallelLayout
from harness.config.schema import ModelConfig, ParallelConfig, RunConfig
from harness.config.strategies import Strategy
from harness.errors import ConfigError


def check_sequence_parallel(cfg: RunConfig, strategy: Strategy, world: int) -> None:
    """What Ulysses sequence parallelism (`parallel.sequence`) runs with; the model's heads are
    checked against it where the model's shape is known (`check_sequence_heads`)."""
    n = cfg.parallel.sequence
    if n == 1:
        return
    what = f"parallel.sequence={n}"  # the engine: `check_sequence_engine`, through check_strategy_against_run
    ParallelLayout.of(cfg.parallel, world)  # the world must be laid out as data x sequence
    if cfg.data.seq_len % n:
        raise ConfigError(f"{what} must divide data.seq_len={cfg.data.seq_len}: each rank holds an equal slice of every sample")
    if cfg.prune.enabled:
        raise ConfigError(f"{what} with {cfg.prune.named}: pruning's calibration runs whole sequences; set parallel.sequence=1")
    if cfg.memory.optimizer_in_backward:
        raise ConfigError(
            f"{what} with memory.optimizer_in_backward: that optimizer steps before the sequence shards' gradients are reduced"
        )


# The first DeepSpeed whose `UlyssesSPAttentionHF.register_with_transformers` takes the call
# harness makes (no `max_length`: required from 0.17.0, where ALST arrived, until 0.18.2);
# setup.cfg's floor is this version.
ALST_MIN_DEEPSPEED = "0.18.2"


def version_tuple(text: str) -> tuple[int, ...]:
    """The leading numeric release of a version string ("0.19.8+cu128" -> (0, 19, 8))."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def installed_version(package: str) -> tuple[int, ...] | None:
    """The installed distribution's version (None when it is not installed)."""
    try:
        return version_tuple(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def check_sequence_engine(cfg: RunConfig, strategy: Strategy) -> None:
    """Sequence parallelism is harness's own Ulysses under the torch engines and DeepSpeed's ALST
    (`UlyssesSPAttentionHF`) under DeepSpeed. ALST runs sdpa causal over the whole gathered row and
    discards every mask: packed examples would attend to each other, so a DeepSpeed run that packs
    them is refused (harness's own Ulysses attends each example apart)."""
    n = cfg.parallel.sequence
    if n > 1 and strategy.kind == "deepspeed":
        installed = installed_version("deepspeed")
        if installed is not None and installed < version_tuple(ALST_MIN_DEEPSPEED):
            raise ConfigError(
                f"parallel.sequence={n} under DeepSpeed ({strategy.name}) runs ALST's UlyssesSPAttentionHF as harness calls it, "
                f"which needs deepspeed>={ALST_MIN_DEEPSPEED} (installed: {'.'.join(map(str, installed))}); "
                f"pip install 'deepspeed>={ALST_MIN_DEEPSPEED}', or use strategy=fsdp or ddp (harness's own Ulysses)"
            )
    if n > 1 and strategy.kind == "deepspeed" and cfg.data.packs_examples:
        raise ConfigError(
            f"parallel.sequence={n} under DeepSpeed ({strategy.name}) runs DeepSpeed's ALST, whose sdpa attention would cross "
            "the packed examples of a row: set data.packing=false, or use strategy=fsdp or ddp (harness's Ulysses keeps them apart)"
        )


@dataclass(frozen=True)
class SequenceLimit:
    """The longest `data.seq_len` a run of this model takes, and what sets it."""

    tokens: int
    source: str  # "model.max_seq_len", or the model config's key: "max_position_embeddings" (GPT-2's "n_positions")

    def refusal(self, seq: int) -> str:
        """The line a run with `data.seq_len=seq` over the limit is refused with."""
        if self.source == "model.max_seq_len":
            return f"data.seq_len={seq} exceeds model.max_seq_len={self.tokens}; lower data.seq_len"
        return f"data.seq_len={seq} exceeds the model's {self.tokens} positions ({self.source}); set data.seq_len <= {self.tokens}"


def sequence_limit(model: ModelConfig, shape: dict) -> SequenceLimit | None:
    """The tighter of `model.max_seq_len` and the model's positions (`shape`: its config's values);
    None when neither is known. The positions are the config's `max_position_embeddings` as written:
    a model extended by RoPE scaling (`rope_scaling`, `rope_parameters`) states its extended length
    there (Llama 3.1's 131,072), so that key, not the scaling factor, is what a longer run raises."""
    limits = []
    if model.max_seq_len is not None:
        limits.append(SequenceLimit(model.max_seq_len, "model.max_seq_len"))
    key = next((k for k in ("max_position_embeddings", "n_positions") if shape.get(k)), None)
    if key is not None:
        limits.append(SequenceLimit(int(shape[key]), key))
    return min(limits, key=lambda limit: limit.tokens) if limits else None


def check_sequence_length(cfg: RunConfig, shape: dict) -> None:
    """`data.seq_len` within the model's `sequence_limit`."""
    limit = sequence_limit(cfg.model, shape)
    if limit is not None and cfg.data.seq_len > limit.tokens:
        raise ConfigError(limit.refusal(cfg.data.seq_len))


def check_sequence_heads(parallel: ParallelConfig, shape: dict) -> None:
    """Ulysses gives each rank of a sequence group a whole share of the attention heads; the
    key/value heads of grouped-query attention are shared too, or, when fewer than the group,
    replicated over it (harness's Ulysses and DeepSpeed's alike: the group must be a multiple of
    them); and runs them with sdpa: a model whose attention windows slide cannot (sdpa is given a
    plain causal mask)."""
    n = parallel.sequence
    if n == 1:
        return
    heads = shape.get("num_attention_heads")
    kv_heads = shape.get("num_key_value_heads") or heads
    if heads and heads % n:
        raise ConfigError(
            f"parallel.sequence={n} must divide the model's num_attention_heads={heads}: each rank takes a whole share of the heads"
        )
    if kv_heads and kv_heads % n and n % kv_heads:
        raise ConfigError(
            f"parallel.sequence={n} and the model's num_key_value_heads={kv_heads}: one must divide the other (the key/value "
            f"heads are shared over the group, or replicated when fewer); try parallel.sequence={math.gcd(n, kv_heads)}"
        )
    sliding = shape.get("sliding_window") and shape.get("use_sliding_window", True)
    if sliding or "sliding_attention" in (shape.get("layer_types") or ()):
        raise ConfigError(
            f"parallel.sequence={n}: the model uses sliding-window attention, which harness's Ulysses (sdpa, causal) does not "
            "apply; set parallel.sequence=1"
        )
