"""The longest-sequence search: the exact boundary, found in a handful of traced steps."""

from __future__ import annotations

from types import SimpleNamespace

from harness.config import load_config
from harness.planner import long_context
from harness.planner.report import Verdict

GIB = 1 << 30


def _search(monkeypatch, device_bytes, host_bytes=lambda s: 0, gpu=80 * GIB, cpu=None, step=256, start=4096, extra=()):
    """`max_seq_len` over a stand-in for the traced estimate: bytes as functions of seq_len, the verdict's rule."""

    def fake_verdict(est, gpu_mem, cpu_mem, per_node):
        dev, host = device_bytes(est.seq), host_bytes(est.seq) * per_node
        fits = dev <= gpu_mem and (cpu_mem is None or host <= cpu_mem)
        return Verdict(fits, dev, host, "fits" if fits else "over")

    monkeypatch.setattr(long_context, "verdict", fake_verdict)
    monkeypatch.setattr(long_context, "trainer_limit", lambda cfg, vocab_size: None)  # a model of unbounded positions
    calls: list[int] = []

    def fake_estimate(cfg, world, target, vocab_size):
        calls.append(cfg.data.seq_len)
        return SimpleNamespace(seq=cfg.data.seq_len)

    cfg = load_config(None, [f"data.seq_len={start}", *extra])
    search = long_context.max_seq_len(cfg, 1, gpu, cpu_mem=cpu, step=step, estimate_fn=fake_estimate)
    assert [p.seq_len for p in search.probes] == calls  # every probe is one estimate, none repeated
    return search


def _brute(fits, step, limit=1 << 21):
    return max((s for s in range(step, limit, step) if fits(s)), default=0)


def test_a_linear_step_is_found_to_the_step_in_few_probes(monkeypatch) -> None:
    need = lambda s: 30 * GIB + 180_000 * s  # model state + activations linear in the sequence
    search = _search(monkeypatch, need)
    assert search.longest == _brute(lambda s: need(s) <= 80 * GIB, 256)
    assert search.longest % 256 == 0 and need(search.longest + 256) > 80 * GIB
    assert len(search.probes) <= 8, [p.seq_len for p in search.probes]
    assert search.first_too_long().seq_len == search.longest + 256


def test_a_curved_step_falls_back_to_bisection_and_stays_exact(monkeypatch) -> None:
    need = lambda s: 10 * GIB + 4 * s * s  # an s x s term: the line overshoots
    search = _search(monkeypatch, need, step=128)
    assert search.longest == _brute(lambda s: need(s) <= 80 * GIB, 128)
    assert len(search.probes) <= 20


def test_a_flat_stretch_does_not_send_a_probe_millions_of_tokens_out(monkeypatch) -> None:
    """The peak is the optimizer step's (model state) until activations outgrow it: the first probes
    barely differ, and the line through them crosses the budget millions of tokens out. The search
    grows at most 4x per probe and still lands on the exact boundary."""
    need = lambda s: max(2 * GIB + 8 * s, GIB + 300_000 * s)  # flat (8 B/token), then activations dominate
    search = _search(monkeypatch, need, gpu=int(2.4 * GIB), start=256)
    assert search.longest == _brute(lambda s: need(s) <= int(2.4 * GIB), 256)
    grown = [p.seq_len for p in search.probes]
    assert max(grown) <= 4 * search.longest, grown
    assert len(grown) <= 12, grown


def test_host_memory_bounds_the_answer_too(monkeypatch) -> None:
    device, host = (lambda s: 20 * GIB + 1000 * s), (lambda s: 8 * GIB + 50_000 * s)  # offloaded bytes grow on the host
    search = _search(monkeypatch, device, host, cpu=64 * GIB)
    assert search.longest == _brute(lambda s: device(s) <= 80 * GIB and host(s) <= 64 * GIB, 256)


def test_under_sequence_parallelism_every_probe_splits_evenly(monkeypatch) -> None:
    """`parallel.sequence=3`: each probe a multiple of 3 (the trainer refuses others), the answer's step lcm(256, 3)."""
    need = lambda s: 30 * GIB + 60_000 * s
    search = _search(monkeypatch, need, start=4608, extra=["parallel.sequence=3"])
    assert search.step == 768 and all(p.seq_len % 768 == 0 for p in search.probes)
    assert search.longest == _brute(lambda s: need(s) <= 80 * GIB, 768)


def test_nothing_fits_and_a_too_long_start(monkeypatch) -> None:
    assert _search(monkeypatch, lambda s: 90 * GIB).longest == 0
    need = lambda s: 1000 * s * 1000
    search = _search(monkeypatch, need, start=1 << 20)  # the config's own length is over: search below it
    assert search.longest == _brute(lambda s: need(s) <= 80 * GIB, 256)


def test_the_trace_costs_the_tiled_mlp_and_the_checkpoint_input_offload() -> None:
    """The planner traces both knobs through the trainer's own code (tiny model, intermediates dominant)."""
    from harness.planner import estimate
    from harness.planner.ladder import relative_time

    base = ["model.name=tiny-llama", "micro_batch_size=1", "memory.activation_checkpointing=full", "memory.loss_chunk_size=256"]
    base += ["data.seq_len=1536", "precision=fp32"]

    def planned(*extra: str):
        cfg = load_config(None, [*base, *extra])
        return estimate(cfg, 1, target="cuda", vocab_size=256), relative_time(cfg)

    (plain, t0), (tiled, t1) = planned(), planned("memory.tiled_mlp=8")
    offloaded, t2 = planned("memory.offload_checkpoint_inputs=true")
    assert tiled.peak.categories["activations"] < plain.peak.categories["activations"]
    assert t1 > t0 and t2 > t0  # each costs step time
    block_input = 1536 * 64 * 4  # one block's input: seq x hidden, fp32 (384 KiB)
    # tiny-llama's two blocks, each a pinned block of 512 KiB (torch's caching host allocator rounds up)
    assert block_input == 384 * 1024 and offloaded.host == {"checkpoint_inputs": 2 * 512 * 1024}
    assert offloaded.peak.categories["activations"] < plain.peak.categories["activations"]
    cpu = estimate(load_config(None, [*base, "memory.offload_checkpoint_inputs=true"]), 1, target="cpu", vocab_size=256)
    assert cpu.host == {} and cpu.total == estimate(load_config(None, base), 1, target="cpu", vocab_size=256).total


def test_the_answer_stops_at_the_models_positions_as_the_trainer_does(monkeypatch) -> None:
    """llama3-8b's 8,192 positions: with memory to spare the answer is 8,192 (not the 700k tokens
    memory alone allows), said in the answer with what extends it; 8,192 runs, one step more is
    refused by pre-flight's rule (the same `sequence_limit`); model.max_seq_len caps it lower."""
    import pytest

    from harness.config import check_sequence_length
    from harness.errors import ConfigError
    from harness.models import model_config

    probed: list[int] = []

    def fake_estimate(cfg, world, target, vocab_size):
        probed.append(cfg.data.seq_len)
        return SimpleNamespace(seq=cfg.data.seq_len)

    monkeypatch.setattr(long_context, "verdict", lambda est, gpu_mem, cpu_mem, per_node: Verdict(est.seq <= 700_000, est.seq, 0, "fits"))
    cfg = load_config(None, ["model.name=llama3-8b", "data.seq_len=4096"])
    search = long_context.max_seq_len(cfg, 8, 80 * GIB, estimate_fn=fake_estimate)
    capped = load_config(None, ["model.name=llama3-8b", "data.seq_len=4096", "model.max_seq_len=6000"])
    lower = long_context.max_seq_len(capped, 8, 80 * GIB, estimate_fn=fake_estimate)
    monkeypatch.undo()
    assert search.longest == 8192 and max(probed) == 8192 and search.capped()
    text = long_context.format_search(search, 80 * GIB, "t")
    assert "8,192 positions (max_position_embeddings)" in text and "rope_scaling" in text
    shape = model_config("llama3-8b").to_dict()
    check_sequence_length(load_config(None, ["model.name=llama3-8b", "data.seq_len=8192"]), shape)
    with pytest.raises(ConfigError, match="exceeds the model's 8192 positions"):
        check_sequence_length(load_config(None, ["model.name=llama3-8b", "data.seq_len=8448"]), shape)
    assert lower.longest == 5888 and lower.capped() and "model.max_seq_len=6,000" in long_context.format_search(lower, GIB, "t")
