"""`harness.train --check` under torchrun (2 gloo ranks): a correct run passes, and each of four
bugs that leave a run training without an error is named (exit 7). The bugs are planted in the
launched ranks by `planted_check.py` (`HARNESS_TEST_PLANT`); one config has every feature they
need: a tied model whose vocabulary (515) shards unevenly over 2 ranks, packed instruction data,
grad_accum 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from launching import BIN, TESTS, instruction_file, run, tiny_config

from harness.distributed import free_port
from harness.errors import EXIT_OK, EXIT_WRONG_RESULTS

pytestmark = pytest.mark.integration
PLANTED = str(TESTS / "integration" / "planted_check.py")


@pytest.fixture(scope="module")
def check_config(tmp_path_factory: pytest.TempPathFactory, data_cache: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("check")
    model = root / "tied-llama"
    config = LlamaConfig(
        hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=515, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(model)
    data = {"source": str(instruction_file(root / "sft.jsonl", 240)), "format": "instruction", "packing": True}
    return tiny_config(
        root / "run.yaml",
        data_cache,
        root / "out",
        **{"model.name": str(model), "data.seq_len": 64, **{f"data.{k}": v for k, v in data.items()}},
    )


CASES = {  # plant: (overrides, what the check must name)
    "none": (["strategy=fsdp"], None),
    # sequence parallelism at data-parallel size 1 (2 ranks, one sequence group): the gradients never reduced
    "unreduced": (["strategy=ddp", "parallel.sequence=2", "data.packing=false"], "step 1 gradient of model.embed_tokens.weight"),
    "accum_scale": (["strategy=fsdp"], "step 1 gradient of model.embed_tokens.weight"),
    "tied_not_updated": (["strategy=fsdp"], "step 1 update of model.embed_tokens.weight"),
    "packing_leak": (["strategy=ddp"], "step 1 gradient of model.embed_tokens.weight"),
}


@pytest.mark.parametrize("plant", list(CASES))
def test_check_names_each_planted_bug(plant: str, check_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides, named = CASES[plant]
    monkeypatch.setenv("HARNESS_TEST_PLANT", plant)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node=2", f"--master_port={free_port()}", PLANTED, "--config", str(check_config), "--check"]
    proc = run([*cmd, *overrides, f"output_dir={check_config.parent / ('out-' + plant)}"], check=False)
    out = proc.stdout + proc.stderr
    if named is None:
        assert proc.returncode == EXIT_OK, out[-4000:]
        assert "check passed: fsdp (fsdp) x2, fp32, micro-batch 2 x grad_accum 2, instruction data packed" in out
        return
    assert proc.returncode != 0 and f"(exitcode: {EXIT_WRONG_RESULTS})" in out, out[-4000:]  # torchrun: 1, naming each rank's code
    line = next(x for x in out.splitlines() if x.startswith("[harness] check failed"))
    assert named in line, line
    assert os.path.isdir(check_config.parent / f"out-{plant}" / "check" / "run")
