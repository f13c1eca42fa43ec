"""`harness.plan --recommend --fastest` searches sequence parallelism as one more dimension: at a
long sequence, splitting each sample over the ranks can fit where whole sequences need recomputation."""

from __future__ import annotations

from harness.config import check_run, load_config, load_strategy, shipped_facts
from harness.planner import estimate, sequence_degree
from harness.planner.candidates import Candidate, candidates, with_candidate
from harness.planner.recommend import recommend

VOCAB = 2048
LONG = ["model.name=tiny-llama", "precision=bf16", "micro_batch_size=1", "grad_accum=1", "data.seq_len=8192", "memory.loss_chunk_size=1024"]


def _need(cfg, c: Candidate) -> int:
    return estimate(with_candidate(cfg, c), 2, target="cpu", vocab_size=VOCAB).peak.total


def test_the_fastest_search_splits_the_sequence_where_whole_sequences_need_recomputation() -> None:
    cfg = load_config(None, [*LONG, "strategy=ddp"])
    whole = _need(cfg, Candidate("bf16", "none", 1, 1, "ddp"))
    split = _need(cfg, Candidate("bf16", "none", 1, 2, "ddp", sequence=2))
    op_ac = _need(cfg, Candidate("bf16", "op", 1, 1, "ddp"))
    assert split < op_ac < whole  # the premise: at 8K tokens the split saves more than op-level recomputation
    rec = recommend(cfg, 2, (split + op_ac) // 2, target="cpu", vocab_size=VOCAB, max_fits=1)
    best = rec.best.candidate
    assert (best.sequence, best.ac, best.strategy, best.grad_accum) == (2, "none", "ddp", 2)  # the samples per step kept
    assert "parallel.sequence=2" in best.overrides() and "grad_accum=2" in best.overrides()
    assert any(line.startswith("sequence split (ranks per sample) 1 -> 2: without this change") for line in rec.why[best])
    run = with_candidate(cfg, best)
    check_run(run, load_strategy(run.strategy), 2, has_accelerator=False)  # the trainer takes what is written


def test_the_split_is_searched_only_where_the_trainer_runs_it() -> None:
    cfg = load_config(None, [*LONG, "strategy=ddp"])
    found = candidates(cfg, 2, nvme=False, target="cuda", vocab=VOCAB)
    split = [c for c in found if c.sequence > 1]
    assert split and {c.sequence for c in split} == {2}
    facts = [shipped_facts(c.strategy) for c in split]
    assert any(f.kind == "deepspeed" for f in facts)  # DeepSpeed's own Ulysses (ALST) too
    assert any(f.kind == "deepspeed" and (f.offloads_optimizer or f.offloads_params) for f in facts)  # ALST with offload too
    assert any(shipped_facts(c.strategy).kind == "deepspeed" for c in found)  # whole sequences still try every engine
    assert all(c.grad_accum == 2 * next(w.grad_accum for w in found if w.sequence == 1 and w.micro_batch == c.micro_batch) for c in split)
    # refused with it: optimizer-in-backward (steps before the shards' gradients are summed); one rank has no split
    in_backward = load_config(None, [*LONG, "strategy=fsdp", "memory.optimizer_in_backward=true", "optim.grad_clip=0"])
    assert not [c for c in candidates(in_backward, 2, nvme=False, target="cuda", vocab=VOCAB) if c.sequence > 1]
    assert not [c for c in candidates(cfg, 1, nvme=False, target="cuda", vocab=VOCAB) if c.sequence > 1]
    # the user's own split is kept as a choice, and whole sequences offered beside it
    own = load_config(None, [*LONG, "strategy=fsdp", "parallel.sequence=2", "grad_accum=2"])
    mine = candidates(own, 2, nvme=False, target="cuda", vocab=VOCAB)
    assert {c.sequence for c in mine} == {1, 2}
    assert {c.grad_accum for c in mine if c.micro_batch == 1} == {1, 2}  # 2 accumulated split samples = 1 whole one per rank


def test_packed_instruction_rows_are_offered_the_split() -> None:
    """The trainer keeps packed examples apart under Ulysses (a whole-sequence mask on every rank), and the
    planner traces that mask, so the ladder's rung and the fastest search offer the split for them too."""
    packed = load_config(None, [*LONG, "strategy=fsdp", "data.format=instruction", "data.source=x.jsonl", "data.packing=true"])
    assert sequence_degree(packed, 2, VOCAB) == 2
    assert {c.sequence for c in candidates(packed, 2, nvme=False, target="cuda", vocab=VOCAB)} == {1, 2}
