"""The probe passes replay the blocks below the probed ones from the first pass that computed
them: bit-exact, recomputed after any write below, and never used where a replay could be wrong
(a model whose blocks are not a plain chain, a compiled model)."""

from __future__ import annotations

import torch
from torch import nn

from harness.config import PruneConfig
from harness.distributed import Collectives
from harness.memory import apply_activation_checkpointing
from harness.models import build_model, decoder_blocks
from harness.pruning import build_views, run_pruning
from harness.pruning.calibration import Runner, gradient_max

LAYERS = 3


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def steps() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [[torch.randint(0, 2048, (2, 16), generator=g)] for _ in range(3)]


def model_and_views(block: int):
    model = build_model("tiny-llama", config_overrides={"num_hidden_layers": LAYERS})
    model.eval()
    views = [v for v in build_views(model, "decoder_linears", Collectives()) if v.target.unit == block]
    return model, views


def reference(model: nn.Module, views, calib) -> dict[str, torch.Tensor]:
    return gradient_max(Runner(model, lm_loss, probed_only=False), calib, views, torch.float32)


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b) and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_replayed_passes_are_bit_exact_and_a_write_below_recomputes() -> None:
    calib = steps()
    model, views = model_and_views(block=2)
    runner = Runner(model, lm_loss)
    first = gradient_max(runner, calib, views, torch.float32)  # computes blocks 0-1 and keeps block 1's outputs
    assert runner.prefix.replays == 0 and len(runner.prefix.outputs) == len(calib)
    again = gradient_max(runner, calib, views, torch.float32)  # blocks 0-1 not run
    assert runner.prefix.replays == len(calib) and runner.prefix.verified
    assert_equal(first, again)
    assert_equal(again, reference(model, views, calib))
    # a write to block 0 through the engine's shard: the next pass computes the prefix again
    below = next(v for v in build_views(model, "decoder_linears", Collectives()) if v.target.unit == 0)
    mask = torch.zeros(below.local_numel, dtype=torch.bool)
    mask[::3] = True
    below.write(mask, 0.0, master=True)
    changed = gradient_max(runner, calib, views, torch.float32)
    assert runner.prefix.replays == len(calib)  # nothing replayed in that pass
    assert_equal(changed, reference(model, views, calib))
    assert not all(torch.equal(changed[k], first[k]) for k in first)
    # probing a different lowest block captures anew
    block1 = [v for v in build_views(model, "decoder_linears", Collectives()) if v.target.unit == 1]
    gradient_max(runner, calib, block1, torch.float32)
    assert runner.prefix.key is not None and runner.prefix.key[0] == 1


def test_a_model_whose_blocks_are_not_a_chain_is_caught_and_computed_in_full() -> None:
    """Block 0's output also feeds the final norm: replaying block 1's output for block 0 would
    change the loss. The first replay's check catches it, and the run goes on unreplayed."""
    calib = steps()
    model, views = model_and_views(block=2)
    kept: dict[str, torch.Tensor] = {}
    decoder_blocks(model)[0].register_forward_hook(lambda _m, _a, out: kept.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    model.model.norm.register_forward_hook(lambda _m, _a, out: out + 0.5 * kept["h"])
    runner = Runner(model, lm_loss)
    gradient_max(runner, calib, views, torch.float32)
    got = gradient_max(runner, calib, views, torch.float32)
    assert not runner.prefix.enabled and runner.prefix.replays == 0 and not runner.prefix.outputs
    assert_equal(got, reference(model, views, calib))


def test_compiled_models_and_the_reference_path_never_replay() -> None:
    model, _ = model_and_views(block=2)
    assert Runner(model, lm_loss).prefix.enabled
    model.compile(backend="eager")  # compile sets the call wrapper now, traces at the first call
    assert not Runner(model, lm_loss).prefix.enabled
    model, views = model_and_views(block=2)
    runner = Runner(model, lm_loss, probed_only=False)
    for _ in range(2):
        gradient_max(runner, steps(), views, torch.float32)
    assert runner.prefix.replays == 0 and not runner.prefix.outputs


def test_activation_checkpointing_changes_neither_names_nor_masks() -> None:
    """Blocks wrapped for activation checkpointing: the targets keep the model's own names (the
    names of the exported HF weights), the lower blocks are still replayed, the masks are the same."""
    g = torch.Generator().manual_seed(11)
    calib = [torch.randint(0, 2048, (2, 16), generator=g) for _ in range(3)]
    cfg = PruneConfig(method="gradprobe", base="magnitude", decision="original", sparsity=0.5)
    plain = run_pruning(build_model("tiny-llama"), calib, cfg, lm_loss)
    model = build_model("tiny-llama")
    apply_activation_checkpointing(model, "full")
    assert "_checkpoint_wrapped_module" in next(n for n, _ in model.named_parameters() if "layers.0" in n)
    wrapped = run_pruning(model, calib, cfg, lm_loss)
    assert list(wrapped.masks.masks) == list(plain.masks.masks) == [x.name for x in plain.layers]
    assert all(torch.equal(wrapped.masks.masks[k], plain.masks.masks[k]) for k in plain.masks.masks)
    assert wrapped.replayed_passes == plain.replayed_passes == 13
