"""LoRA and instruction data, in process: what is labelled, what trains, what is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from harness.config import load_config, load_strategy
from harness.config.checks import check_run
from harness.data.instructions import IGNORE, encode_record, to_blocks
from harness.errors import ConfigError
from harness.models import apply_lora, build_model, default_target_modules, trainable_counts
from harness.training import labelled_lm_loss


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: one id per word, so expected ids can be written down."""
    vocab = {w: i for i, w in enumerate("<eos> <unk> user: assistant: what is two plus two four five [U] [A] [/]".split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = chat_template
    return fast


def test_prompt_tokens_are_unlabelled_and_response_ends_with_eos():
    tok = word_tokenizer()
    ids, labels = encode_record({"prompt": "what is two plus two", "response": "four"}, tok, eos=0)
    prompt = tok("what is two plus two")["input_ids"]
    assert ids == prompt + [tok.convert_tokens_to_ids("four"), 0]
    assert labels == [IGNORE] * len(prompt) + ids[len(prompt) :]


def test_chat_messages_label_assistant_turns_through_the_template():
    template = (
        "{% for m in messages %}{% if m.role == 'user' %}[U] {{ m.content }} [/] {% else %}[A] {{ m.content }} [/] {% endif %}{% endfor %}"
    )
    tok = word_tokenizer(template)
    messages = [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "five"},
    ]
    ids, labels = encode_record({"messages": messages}, tok, eos=0)
    words = tok.convert_ids_to_tokens(ids)
    labelled = [w for w, lab in zip(words, labels) if lab != IGNORE]
    assert labelled == ["[A]", "four", "[/]", "[A]", "five", "[/]"]
    assert [lab for lab in labels if lab != IGNORE] == [i for i, lab in zip(ids, labels) if lab != IGNORE]
    # without a template: plain 'role: content' lines, the answer and its EOS labelled, never the 'assistant:' header
    ids, labels = encode_record({"messages": messages[:2]}, word_tokenizer(), eos=0)
    assert tok.convert_ids_to_tokens([i for i, lab in zip(ids, labels) if lab != IGNORE]) == ["four", "<eos>"]


def test_blocks_packed_and_padded():
    examples = [([1, 2, 3], [IGNORE, 2, 3]), ([4, 5, 6, 7, 8], [IGNORE, IGNORE, 6, 7, 8])]
    packed, _ = to_blocks(examples, seq_len=8, packing=True, eos=0)
    assert packed.shape == (1, 3, 8)  # both whole in one block, the longer first
    assert packed[0, 0].tolist() == [4, 5, 6, 7, 8, 1, 2, 3]
    assert packed[0, 1].tolist() == [IGNORE, IGNORE, 6, 7, 8, IGNORE, 2, 3]
    assert packed[0, 2].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    padded, truncated = to_blocks(examples, seq_len=4, packing=False, eos=0)
    assert padded[0, 0].tolist() == [1, 2, 3, 0] and padded[0, 1].tolist() == [IGNORE, 2, 3, IGNORE]
    assert truncated == 1  # the second example's last response token did not fit


def test_loss_counts_response_tokens_only():
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=64)
    ids = torch.randint(1, 64, (2, 16))
    labels = ids.clone()
    labels[:, :10] = IGNORE  # the prompt
    loss = labelled_lm_loss(model, torch.stack([ids, labels], dim=1))
    logits = model(input_ids=ids).logits.float()
    # position t predicts labels[t + 1]: only the predictions of response tokens count
    manual = F.cross_entropy(logits[:, 9:-1].reshape(-1, 64), ids[:, 10:].reshape(-1))
    assert float(loss.detach()) == pytest.approx(float(manual), rel=1e-5)
    full = F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))
    assert abs(float(full) - float(manual)) > 1e-3  # the prompt would have changed it
    # through the harness loss itself: the gradient reaching the logits of prompt positions is zero
    seen = {}

    def keep(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.retain_grad()
        seen["logits"] = out

    model.lm_head.register_forward_hook(keep)
    labelled_lm_loss(model, torch.stack([ids, labels], dim=1)).backward()
    grad = seen["logits"].grad
    assert grad[:, :9].abs().max() == 0 and grad[:, 9:-1].abs().min(dim=-1).values.gt(0).all()


def test_a_block_without_labels_gives_zero_not_nan():
    model = build_model("tiny-llama", vocab_size=64)
    ids = torch.randint(1, 64, (1, 8))
    loss = labelled_lm_loss(model, torch.stack([ids, torch.full_like(ids, IGNORE)], dim=1))
    assert float(loss) == 0.0


def test_lora_freezes_the_base_and_defaults_to_the_block_linears():
    model = build_model("tiny-llama", vocab_size=64)
    assert default_target_modules(model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    cfg = load_config(None, ["lora.enabled=true", "lora.r=4"]).lora
    inner = apply_lora(model, cfg, seed=0)
    trainable, total = trainable_counts(inner)
    h, i, layers = 64, 176, 2  # tiny-llama: hidden, intermediate, blocks; 4 heads, 2 kv heads
    kv = h // 4 * 2
    per_block = 4 * ((h + h) + (h + kv) * 2 + (h + h)) + 4 * ((h + i) * 2 + (i + h))  # r * (in + out) per target
    assert trainable == layers * per_block
    assert all(("lora_" in n) == p.requires_grad for n, p in inner.named_parameters())
    again = apply_lora(build_model("tiny-llama", vocab_size=64), cfg, seed=0)  # seeded: every rank the same adapters
    assert all(torch.equal(a, b) for a, b in zip(inner.state_dict().values(), again.state_dict().values()))
    with pytest.raises(ConfigError, match="does not have"):
        wrong = load_config(None, ["lora.enabled=true", "lora.target_modules=[qproj]"]).lora
        apply_lora(build_model("tiny-llama", vocab_size=64), wrong, 0)


@pytest.mark.parametrize(
    "overrides, accelerator, strategy, message",
    [
        (["lora.enabled=true", "lora.quantize=nf4"], False, "zero2", "only nf4 under ZeRO-3"),
        (["lora.enabled=true", "lora.quantize=int8"], False, "zero3", "only nf4 under ZeRO-3"),
        (["lora.enabled=true", "lora.quantize=int8"], False, "fsdp", "use lora.quantize=nf4 under fsdp"),
        (["lora.enabled=true", "prune.method=magnitude"], False, "ddp", "prune first"),
    ],
)
def test_refused_before_launch_in_one_line(overrides, accelerator, strategy, message):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=message) as err:
        check_run(cfg, load_strategy(strategy), 1, accelerator)
    assert "\n" not in str(err.value)


def test_config_values_refused_on_load():
    with pytest.raises(ConfigError, match="set lora.enabled=true"):
        load_config(None, ["lora.quantize=nf4"])
    with pytest.raises(ConfigError, match="lora.r=0"):
        load_config(None, ["lora.enabled=true", "lora.r=0"])
    with pytest.raises(ConfigError, match="local JSON lines"):
        load_config(None, ["data.format=instruction"])


def test_a_tied_models_lora_checkpoint_holds_the_adapters_only(tmp_path):
    """A tied model's frozen `lm_head.weight` is the embedding under a second name, which
    `named_parameters()` (and so torch's ignore_frozen_params) never lists: it must not be saved."""
    import functools

    import torch.distributed.checkpoint as dcp
    from model_families import save_families

    from harness.distributed import DistInfo
    from harness.engine import build_engine, plan_engine
    from harness.models import model_spec

    qwen2 = save_families(tmp_path)["qwen2"]  # tie_word_embeddings=True
    cfg = load_config(None, [f"model.name={qwen2}", "lora.enabled=true", "lora.r=4", f"output_dir={tmp_path / 'out'}"])
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, load_strategy("ddp"), 1, info.device, None)
    engine = build_engine(model_spec(qwen2, vocab_size=512), cfg, plan, info, functools.partial(labelled_lm_loss, chunk_size=0))
    assert engine.module.get_output_embeddings().weight is engine.module.get_input_embeddings().weight
    engine.save_state(str(tmp_path / "ckpt"))
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    trainable, _ = trainable_counts(engine.module)
    assert model_keys and all(".lora_" in k for k in model_keys), [k for k in model_keys if ".lora_" not in k]
    assert sum(int(torch.Size(saved[k].size).numel()) for k in model_keys) == trainable
    engine.load_state(str(tmp_path / "ckpt"), 1, True)  # and it loads back (the base is rebuilt, not read)


@pytest.mark.parametrize("quantize", ["nf4", "int8"])
def test_qlora_trains_on_cpu_with_the_adapters_only(quantize, tmp_path):
    """bitsandbytes' NF4 and LLM.int8 linears train under peft on CPU, built by the engine's own
    load path (meta device, quantized a tensor at a time): the base's block linears are quantized,
    only the adapters take gradients, the loss falls on a repeated batch, and a checkpoint holds
    the adapters only (not bitsandbytes' quantization state) and loads back."""
    import functools

    import torch.distributed.checkpoint as dcp

    from harness.distributed import DistInfo
    from harness.engine import build_engine, plan_engine
    from harness.models import model_spec, quant_state_tensors, quantized_codes

    overrides = ["lora.enabled=true", "lora.r=4", f"lora.quantize={quantize}", "optim.lr=0.01", "optim.warmup_steps=0"]
    cfg = load_config(None, [*overrides, f"output_dir={tmp_path / 'out'}"])
    info = DistInfo(0, 1, 0, torch.device("cpu"), None)
    plan = plan_engine(cfg, load_strategy("ddp"), 1, info.device, None)
    engine = build_engine(model_spec("tiny-llama", vocab_size=64), cfg, plan, info, functools.partial(labelled_lm_loss, chunk_size=0))
    model = engine.module
    quantized = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("bitsandbytes")}
    assert quantized == {"Linear4bit" if quantize == "nf4" else "Linear8bitLt"}
    assert len(quantized_codes(model)) == 14 and quant_state_tensors(model)  # 7 linears x 2 blocks, each with its scales
    plain = apply_lora(build_model("tiny-llama", vocab_size=64), cfg.lora, 0)
    assert trainable_counts(model) == trainable_counts(plain)  # the same adapters; a quantized weight counts what it encodes
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = torch.stack([ids, ids], dim=1)
    assert float(labelled_lm_loss(model, batch)) == pytest.approx(float(labelled_lm_loss(plain, batch)), rel=0.02)  # ~ the fp32 model
    losses = []
    for _ in range(4):
        loss = engine.forward_loss(batch)
        engine.backward(loss, last_micro=True)
        engine.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.05, losses
    engine.save_state(str(tmp_path / "ckpt"))
    saved = dcp.FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), [k for k in model_keys if ".lora_" not in k][:3]
    engine.load_state(str(tmp_path / "ckpt"), 1, True)


def test_holding_the_frozen_base_in_bf16_keeps_tied_embeddings_one_parameter(tmp_path):
    """FSDP2 bf16 holds a LoRA base in bf16 (`hold_frozen_in`); a head tied to the input embeddings
    must stay that one parameter (two copies would be wrapped, gathered and filled apart)."""
    from model_families import save_families

    from harness.models import empty_lora_model, empty_model, hold_frozen_in, model_spec

    spec = model_spec(save_families(tmp_path)["qwen2"], vocab_size=64)  # tie_word_embeddings=True
    model = empty_lora_model(empty_model(spec.config), load_config(None, ["lora.enabled=true", "lora.r=4"]).lora)
    hold_frozen_in(model, torch.bfloat16)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is embed.weight and embed.weight.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
