"""Instruction data, in process: whole-example packing that keeps examples apart, chat labels
equal to HF's assistant mask, and the tokenizer's leading specials kept."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, processors

from harness.data.instructions import IGNORE, best_fit_decreasing, encode_record, to_blocks
from harness.data.tokenizer import leading_specials, train_bpe_tokenizer
from harness.models import build_model

SEQ = 64


def random_examples(n: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Examples of 4..40 tokens whose last part (the response) is labelled."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length, prompt = rng.randint(4, 40), rng.randint(1, 3)
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        out.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def unpack(blocks) -> list[tuple[list[int], list[int]]]:
    """The examples of packed blocks, cut where the positions restart. The padding (EOS 0, no label)
    continues the last example's positions: cut off there (an example's tokens are never 0)."""
    out = []
    for ids, labels, positions in blocks.tolist():
        starts = [i for i, p in enumerate(positions) if p == 0] + [SEQ]
        end = SEQ
        while end and ids[end - 1] == 0 and labels[end - 1] == IGNORE:
            end -= 1
        for a, b in zip(starts, [*starts[1:-1], end]):
            out.append((ids[a:b], labels[a:b]))
    return out


def test_packing_keeps_every_example_whole_in_few_blocks():
    examples = random_examples(300, 500)
    blocks, truncated = to_blocks(examples, SEQ, packing=True, eos=0)
    assert truncated == 0 and blocks.shape[1:] == (3, SEQ)
    expected = sorted((ids, [IGNORE, *labels[1:]]) for ids, labels in examples)  # a first token is never a target
    assert sorted(unpack(blocks)) == expected  # none cut at a boundary, none dropped
    tokens = sum(len(ids) for ids, _ in examples)
    assert blocks.shape[0] <= 1.02 * -(-tokens // SEQ) + 1  # best-fit decreasing: within ~2% of the bound


def test_an_unpacked_row_runs_mask_free_and_its_loss_is_unchanged(monkeypatch):
    """A row of one example and its padding: positions 0..S-1, no restart, so transformers builds no
    mask (a restart at the padding made it build the packed-sequence (B, 1, S, S) mask, off the
    planner's books); the labelled tokens' logits and the loss are those of the old layout."""
    from transformers import masking_utils
    from transformers.models.llama import modeling_llama

    from harness.training import labelled_lm_loss

    examples = random_examples(6, 128, seed=2)
    blocks, _ = to_blocks(examples, SEQ, packing=False, eos=0)
    batch = torch.from_numpy(blocks.astype("int64"))
    assert (batch[:, 2] == torch.arange(SEQ)).all()
    restarted = batch.clone()  # the old layout: the padding's positions restart at 0
    lengths = [len(ids) for ids, _ in examples]
    for row, n in enumerate(lengths):
        restarted[row, 2, n:] = torch.arange(SEQ - n)
    assert masking_utils.find_packed_sequence_indices(batch[:, 2]) is None
    assert masking_utils.find_packed_sequence_indices(restarted[:, 2]) is not None
    masks = []
    create = modeling_llama.create_causal_mask
    monkeypatch.setattr(modeling_llama, "create_causal_mask", lambda *a, **k: masks.append(create(*a, **k)) or masks[-1])
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=128).eval()
    with torch.no_grad():
        logits = [model(input_ids=b[:, 0], position_ids=b[:, 2], use_cache=False).logits for b in (batch, restarted)]
        losses = [float(labelled_lm_loss(model, b)) for b in (batch, restarted)]
    assert masks[0] is None and masks[1] is not None and masks[1].dim() == 4  # continuous: no mask; restarted: (B, 1, S, S)
    for row, n in enumerate(lengths):
        torch.testing.assert_close(logits[0][row, :n], logits[1][row, :n], rtol=1e-5, atol=1e-5)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_best_fit_puts_each_example_in_the_fullest_block_it_fits():
    assert best_fit_decreasing([5, 3, 2, 6, 1, 4], 6) == [[3], [0, 4], [5, 2], [1]]


def _per_example_loss(model, ids, labels, positions=None) -> torch.Tensor:
    kwargs = {"position_ids": positions[None]} if positions is not None else {}
    logits = model(input_ids=ids[None], use_cache=False, **kwargs).logits[0].float()
    return F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="none")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_examples_loss_equals_the_example_alone(attn):
    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=128, config_overrides={"attn_implementation": attn}).eval()
    blocks, _ = to_blocks(random_examples(12, 128, seed=1), SEQ, packing=True, eos=0)
    blocks = torch.from_numpy(blocks.astype("int64"))
    compared = leaked = 0
    with torch.no_grad():
        for ids, labels, positions in blocks:
            packed = _per_example_loss(model, ids, labels, positions)
            crossed = _per_example_loss(model, ids, labels)  # no positions: attention crosses examples
            starts = [int(i) for i in torch.nonzero(positions == 0)] + [SEQ]
            for a, b in zip(starts, starts[1:]):
                if (labels[a:b] == IGNORE).all():
                    continue  # padding
                alone = _per_example_loss(model, ids[a:b], labels[a:b])
                assert packed[a : b - 1].sum() == pytest.approx(float(alone.sum()), rel=1e-5, abs=1e-5)
                compared += 1
                leaked += a > 0 and abs(float(crossed[a : b - 1].sum() - alone.sum())) > 1e-3
    assert compared == 12 and leaked > 0  # every example checked; without positions they see each other


# The generation marks where TRL's training templates put them (trl/chat_templates: qwen2_5_training
# for ChatML, llama3_training): ChatML labels `\n` + answer + `<|im_end|>` + `\n`, Llama 3 the answer
# and `<|eot_id|>`. Harness must label the same on the shipped templates, which have no marks.
CHATML = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{% generation %}{{ '\\n' + m['content'] + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [
    {"role": "system", "content": "You sort words."},
    {"role": "user", "content": "Sort: pear apple"},
    {"role": "assistant", "content": "apple pear"},
    {"role": "user", "content": "Sort: fig date"},
    {"role": "assistant", "content": "date fig"},
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    texts = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant sort words"] * 20
    tok = train_bpe_tokenizer([texts], 300, str(tmp_path_factory.mktemp("bpe")))
    tok.add_special_tokens({"additional_special_tokens": SPECIALS, "bos_token": "<|begin_of_text|>"})
    return tok


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_chat_labels_equal_trls(bpe, template):
    """HF's mask comes from the template's {% generation %} marks, placed as TRL's training templates
    place them; ours, from the same template without them (as shipped templates are)."""
    bpe.chat_template = template
    hf = bpe.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    expected = [t if m else IGNORE for t, m in zip(hf["input_ids"], hf["assistant_masks"])]
    bpe.chat_template = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, labels = encode_record({"messages": CONVERSATION}, bpe, eos=bpe.eos_token_id)
    assert ids == list(hf["input_ids"])
    assert labels == expected
    labelled = bpe.decode([t for t in labels if t != IGNORE])
    assert "assistant" not in labelled and labelled.count("apple pear") == 1
    bpe.chat_template = template  # with the marks: HF's own mask
    assert encode_record({"messages": CONVERSATION}, bpe, eos=bpe.eos_token_id)[1] == expected


def test_the_plain_chat_fallback_never_labels_the_role_header(bpe):
    """Without a template: `role: content` lines; labelled are each answer and what follows it up to EOS."""
    bpe.chat_template = None
    ids, labels = encode_record({"messages": CONVERSATION}, bpe, eos=bpe.eos_token_id, prefix=[bpe.bos_token_id])
    assert ids[0] == bpe.bos_token_id and labels[0] == IGNORE
    assert bpe.decode(ids[1:]) == "".join(
        f"{m['role']}: {m['content']}\n" + ("<|endoftext|>" if m["role"] == "assistant" else "") for m in CONVERSATION
    )
    spans, current = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == t
            current.append(t)
        elif current:
            spans.append(bpe.decode(current))
            current = []
    spans += [bpe.decode(current)] if current else []
    assert spans == [" apple pear\n<|endoftext|>", " date fig\n<|endoftext|>"]


def test_a_tokenizers_bos_is_kept(bpe, tmp_path):
    """A tokenizer that puts BOS before every text keeps it on every example."""
    assert leading_specials(bpe) == []  # this one adds nothing
    backend: Tokenizer = bpe.backend_tokenizer
    bos = bpe.bos_token_id
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    try:
        assert leading_specials(bpe) == [bos]
        ids, labels = encode_record({"prompt": "Sort: fig date", "response": " date fig"}, bpe, 0, leading_specials(bpe))
        assert ids[0] == bos and labels[0] == IGNORE and ids[1:].count(bos) == 0
    finally:
        backend.post_processor = None


def test_the_chunked_loss_sees_the_packed_positions_too():
    """`memory.loss_chunk_size` runs the model body inside its own forward: the positions must reach it."""
    from harness.training import labelled_lm_loss

    torch.manual_seed(0)
    model = build_model("tiny-llama", vocab_size=128).eval()
    blocks, _ = to_blocks(random_examples(12, 128, seed=1), SEQ, packing=True, eos=0)
    batch = torch.from_numpy(blocks.astype("int64"))
    with torch.no_grad():
        plain = labelled_lm_loss(model, batch)
        chunked = labelled_lm_loss(model, batch, chunk_size=16)
        crossing = labelled_lm_loss(model, batch[:, :2])  # (input_ids, labels) only: examples see each other
    assert float(chunked) == pytest.approx(float(plain), rel=1e-6)
    assert abs(float(crossing) - float(plain)) > 1e-4
