"""Sequence parallelism's pieces that need no process group: the slices each rank reads, the
loss of a slice, and the refusals before launch (the 2-rank equivalence is
tests/integration/test_sequence_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.config import ConfigError, ParallelLayout, check_run, check_sequence_heads, load_config, load_strategy
from harness.data import BatchSampler, SequenceSlice, split_batches
from harness.data.cache import PackedData
from harness.models import attention_is_swappable, build_model, empty_model
from harness.training import causal_lm_loss, count_targets, sequence_shard_loss, shift_targets
from harness.training.loss import IGNORE_INDEX


def _text(batch: int = 3, seq: int = 12) -> torch.Tensor:
    return torch.arange(batch * seq).reshape(batch, seq) % 97


def _instruction(seq: int = 12) -> torch.Tensor:
    ids = _text(2, seq)
    labels = ids.clone()
    labels[:, :5] = IGNORE_INDEX  # a prompt
    labels[1, 9:] = IGNORE_INDEX  # padding
    positions = torch.arange(seq).expand(2, -1).clone()
    positions[1, 9:] = torch.arange(seq - 9)  # padding's own positions
    return torch.stack([ids, labels, positions], dim=1)


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("kind", ["text", "instruction", "unpositioned"])
def test_slices_cover_every_token_and_target_once(kind, parts):
    """Inputs, positions and next-token targets of the slices, laid end to end, are the whole
    sample's: the targets at each slice's end come from the next slice's first label."""
    batch = {"text": _text(), "instruction": _instruction(), "unpositioned": _instruction()[:, :2]}[kind]
    slices = [SequenceSlice(i, parts)(batch) for i in range(parts)]
    width = batch.shape[-1] // parts
    assert all(s.shape == (batch.shape[0], 3, width + 1) for s in slices)
    ids = batch if batch.dim() == 2 else batch[:, 0]
    labels = batch if batch.dim() == 2 else batch[:, 1]
    positions = batch[:, 2] if kind == "instruction" else torch.arange(batch.shape[-1]).expand(batch.shape[0], -1)
    assert torch.equal(torch.cat([s[:, 0, :-1] for s in slices], dim=1), ids)
    assert torch.equal(torch.cat([s[:, 2, :-1] for s in slices], dim=1), positions)
    targets = torch.cat([shift_targets(s[:, 1])[:, :-1] for s in slices], dim=1)
    assert torch.equal(targets, shift_targets(labels))
    assert sum(count_targets(s) for s in slices) == count_targets(batch)


def test_one_part_is_the_batch_itself():
    batch = _instruction()
    assert SequenceSlice()(batch) is batch


def test_ranks_are_grouped_consecutively_into_a_data_by_sequence_mesh():
    places = [SequenceSlice.of(ParallelLayout(4, 2), rank) for rank in range(4)]
    assert places == [(SequenceSlice(0, 2), 2, 0), (SequenceSlice(1, 2), 2, 0), (SequenceSlice(0, 2), 2, 1), (SequenceSlice(1, 2), 2, 1)]


def _packed(n: int = 40, seq: int = 8) -> PackedData:
    blocks = {split: np.arange(n * seq, dtype=np.int64).reshape(n, seq) % 113 for split in ("train", "eval")}
    return PackedData(blocks=blocks, vocab_size=113, tokenizer_dir=None, cache_dir="", tokens={})


def test_a_sequence_group_reads_one_data_parallel_ranks_samples_each_its_slice():
    """World 4 as 2 data x 2 sequence: ranks 2r and 2r+1 read data-parallel rank r's blocks of a
    world-2 run, cut in two; the global batch is the data-parallel one."""
    data = _packed()
    for rank in range(4):
        piece, world, data_rank = SequenceSlice.of(ParallelLayout(4, 2), rank)
        sampler = BatchSampler(data, 2, 2, world, data_rank, seed=5, piece=piece)
        plain = BatchSampler(data, 2, 2, 2, data_rank, seed=5)
        assert sampler.global_batch == plain.global_batch == 8
        for step, micro in ((0, 0), (1, 1), (6, 0)):
            assert torch.equal(sampler.batch(step, micro), piece(plain.batch(step, micro)))
        evals = list(split_batches(data, "eval", 2, 3, world, data_rank, piece))
        plain_evals = list(split_batches(data, "eval", 2, 3, 2, data_rank))
        assert len(evals) == len(plain_evals) > 0
        assert all(torch.equal(a, piece(b)) and ca == cb for (a, ca), (b, cb) in zip(evals, plain_evals))


def test_the_first_slices_loss_is_the_whole_sequences_loss_on_its_tokens():
    """Causal attention: the first slice's tokens attend only inside it, so its summed loss (one
    process, no exchange) is the whole sample's per-token losses summed over those positions,
    including the target at its end (the second slice's first token)."""
    model = build_model("tiny-llama", vocab_size=97, seed=1)
    batch = _text(2, 16)
    piece = SequenceSlice(0, 2)(batch)
    with torch.no_grad():
        logits = model(input_ids=batch).logits
        per_token = torch.nn.functional.cross_entropy(logits[:, :8].reshape(-1, 97), batch[:, 1:9].reshape(-1), reduction="sum")
        got = sequence_shard_loss(model, piece, num_items=1.0)
        chunked = sequence_shard_loss(model, piece, chunk_size=5, num_items=1.0)
        whole = causal_lm_loss(model, batch, num_items=1.0)
    assert float(got) == pytest.approx(float(per_token), rel=1e-5)
    assert float(chunked) == pytest.approx(float(per_token), rel=1e-5)
    assert float(got) < float(whole)  # the second slice's tokens are not in it


def _cfg(*overrides: str):
    return load_config(None, ["parallel.sequence=2", *overrides])


@pytest.mark.parametrize(
    "strategy, world, overrides, expected",
    [
        ("zero2", 2, ["data.format=instruction", "data.source=x.jsonl", "data.packing=true"], "would cross the packed examples"),
        ("fsdp", 3, [], "must divide the world size (3)"),
        ("fsdp", 2, ["data.seq_len=33"], "must divide data.seq_len=33"),
        ("ddp", 2, ["prune.method=wanda"], "pruning's calibration"),
        ("fsdp", 2, ["memory.optimizer_in_backward=true"], "optimizer_in_backward"),
    ],
)
def test_what_sequence_parallelism_cannot_run_with_is_refused_in_one_line(strategy, world, overrides, expected):
    with pytest.raises(ConfigError) as err:
        check_run(_cfg(*overrides), load_strategy(strategy), world, False)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_what_it_runs_with_passes():
    for strategy, world, overrides in (
        ("fsdp", 2, []),
        ("ddp", 4, ["grad_accum=2"]),
        ("fsdp", 2, ["data.format=instruction", "data.source=x.jsonl", "data.packing=false"]),
        ("ddp", 2, ["data.format=instruction", "data.source=x.jsonl", "data.packing=true"]),  # kept apart by the positions
    ):
        check_run(_cfg(*overrides), load_strategy(strategy), world, False)
    check_run(load_config(None, []), load_strategy("zero2"), 2, False)  # parallel.sequence=1: nothing asked of DeepSpeed
    for strategy, world in (("zero2", 2), ("zero3", 4)):  # DeepSpeed's own Ulysses (ALST), rows of one sequence each
        check_run(_cfg(), load_strategy(strategy), world, False)
        check_run(_cfg("data.format=instruction", "data.source=x.jsonl", "data.packing=false"), load_strategy(strategy), world, False)


@pytest.mark.parametrize(
    "shape, expected",
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads=3"),
        ({"num_attention_heads": 6, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"num_attention_heads": 4, "sliding_window": 512}, "sliding-window"),
        ({"num_attention_heads": 4, "layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
    ],
)
def test_heads_the_sequence_split_cannot_share_are_refused(shape, expected):
    with pytest.raises(ConfigError, match=expected):
        check_sequence_heads(_cfg().parallel, shape)


def test_heads_it_can_share_pass():
    check_sequence_heads(_cfg().parallel, {"num_attention_heads": 4, "num_key_value_heads": 2})
    check_sequence_heads(_cfg().parallel, {"num_attention_heads": 4, "num_key_value_heads": 1})  # replicated over the group
    check_sequence_heads(_cfg().parallel, {"num_attention_heads": 4, "sliding_window": 512, "use_sliding_window": False})
    check_sequence_heads(load_config(None, []).parallel, {"num_attention_heads": 3})


def test_only_models_whose_attention_goes_through_transformers_registry_are_swappable():
    from transformers import BloomConfig, LlamaConfig

    assert attention_is_swappable(
        empty_model(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    )
    assert not attention_is_swappable(empty_model(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=64)))  # eager only


def test_the_planners_search_splits_sequences_under_deepspeed_too_with_offload():
    """DeepSpeed runs `parallel.sequence` with its own ALST (the config checks pass it), whose peak
    the planner's trace predicts (test_planner_accuracy's ALST rows), so `--fastest` searches the
    split under DeepSpeed too, with ZeRO offload as without (its rows there, and the offload run of
    test_sequence_parallel's ALST equivalence)."""
    from harness.config import check_strategy_against_run
    from harness.planner.candidates import runs_with

    check_strategy_against_run(load_strategy("zero3_offload"), _cfg(), False)
    assert runs_with(_cfg(), "zero3", "cuda", 2, 2) and runs_with(_cfg(), "zero2", "cuda", 2, 2)
    assert runs_with(_cfg(), "zero3_offload", "cuda", 2, 2) and runs_with(_cfg(), "zero2_offload", "cuda", 2, 2)
    assert runs_with(_cfg(), "fsdp", "cuda", 2, 2)


def test_a_forward_that_bypasses_the_ulysses_exchange_is_refused(tmp_path, monkeypatch):
    """The engine's guard: Ulysses registered, but the model's attention does not call it (here set
    back to plain sdpa, as a model whose attention bypasses transformers' registry would run): the
    first training forward is refused in one line instead of attending within each slice. At world 1
    the guard is handed to the engine here; the 2-rank runs of tests/integration/test_sequence_parallel.py
    are where the engine installs it itself (and pass it: their attention ran the exchange)."""
    import torch.distributed as dist

    from harness.distributed import DistInfo
    from harness.engine import build_engine, plan_engine
    from harness.models import model_spec

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cfg = load_config(None, ["strategy=ddp"])
        info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
        spec = model_spec("tiny-llama", vocab_size=128)
        plan = plan_engine(cfg, load_strategy("ddp", env={}), 1, info.device, None)
        engine = build_engine(spec, cfg, plan, info, causal_lm_loss)
        from harness.models.ulysses import UlyssesCalls, use_ulysses

        batch = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
        calls = use_ulysses(engine.module, dist.new_group([0]))
        engine.forward_loss(batch)
        assert isinstance(calls, UlyssesCalls) and calls.count == engine.module.config.num_hidden_layers
        calls.check_ran(engine.module)  # it ran: nothing to refuse
        engine.module.set_attn_implementation("sdpa")  # the bypass
        bypassed = UlyssesCalls(2)
        engine._after_first_forward.append(lambda: bypassed.check_ran(engine.module))
        with pytest.raises(ConfigError, match=r"parallel.sequence=2: LlamaForCausalLM's forward ran no Ulysses exchange"):
            engine.forward_loss(batch)
    finally:
        dist.destroy_process_group()
