"""Packed examples kept apart, or refused (`harness.models.unconfined_packing`).

transformers confines packed examples (position ids restarting inside a row) only where the decoder
hands its mask builders the position ids. The verdict, read from the modules' source on a meta
template, is held against what each family's tiny random model computes: the logits of a row's
second example, packed behind a first, against the same example alone (a leak: differences of ~0.4;
confined: rounding, ~1e-7), for every family the suite builds (four MoE, five dense). A family that
leaks and `data.packing=true` is one line, exit 2, nothing written (gpt-oss in transformers 5).
"""

from __future__ import annotations

import pytest
import torch
from model_families import family_configs, moe_configs, save_moe_families
from transformers import AutoModelForCausalLM

from harness.models import unconfined_packing

CONFIGS = {**moe_configs(), **family_configs()}


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_verdict_is_what_the_model_computes(family: str) -> None:
    config = CONFIGS[family]
    with torch.device("meta"):
        verdict = unconfined_packing(AutoModelForCausalLM.from_config(config))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(15), torch.arange(25)]).unsqueeze(0)  # two examples in one row
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 15:]
        alone = model(input_ids=ids[:, 15:], position_ids=torch.arange(25).unsqueeze(0), use_cache=False).logits[0]
    leak = float((packed - alone).abs().max())
    assert (leak > 1e-3) == (verdict is not None), (family, leak, verdict)


def test_a_family_that_leaks_is_refused_with_packing_in_one_line(tmp_path, monkeypatch, capfd) -> None:
    from launching import call_entry_point, env, instruction_file

    import harness.train

    model = save_moe_families(tmp_path, ("gpt_oss",))["gpt_oss"]
    data = instruction_file(tmp_path / "sft.jsonl", 40)
    out = tmp_path / "out"
    argv = [f"model.name={model}", f"data.source={data}", "data.format=instruction", "data.packing=true", f"output_dir={out}"]
    code, err, _ = call_entry_point(harness.train.main, [*argv, "data.seq_len=32"], env(), monkeypatch, capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "data.packing=true but GptOssModel's forward builds its attention masks without the position ids" in lines[0], lines
    assert lines[0].endswith("set data.packing=false") and not out.exists()
