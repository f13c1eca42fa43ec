"""A real instruction fine-tune: SmolLM2-135M-Instruct with LoRA under FSDP2 at world 2, beside
HF Trainer + peft on the same blocks, settings and initial adapters.

    python benchmarks/finetune.py [--steps 30] [--seq-len 256] [--micro-batch 2] [--grad-accum 2] [--records 1200]

The data is made here: chat records ("Sort these words alphabetically: ..."), rendered with the
model's own chat template, labels on the assistant content and its end-of-turn token, packed whole
(best-fit decreasing, positions per example). harness runs `torchrun --nproc_per_node=2
harness/train.py strategy=fsdp lora.enabled=true` with its defaults (lr 2e-4 for LoRA, cosine,
warmup 5, clip 1.0). Trainer runs in one process on the same global batches, in the same order
(harness's seeded sampler at world 1, no shuffling), micro-batch x accumulation = the same global
batch, peft's `LoraConfig` with the same targets and the same seeded adapter init, torch AdamW with
harness's betas and the same schedule function; Trainer weights every labelled token of a step
equally (`num_items_in_batch`), as harness does.

Reported: held-out loss (token-weighted over the eval split) before and after, a greedy sample for a
held-out prompt before and after (the after model: the base + `<output_dir>/adapter`, which the run
leaves), harness's median step time, and the per-step loss of both with their largest relative
difference. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402
from peers import _run  # noqa: E402  (the same runner: repository root, W&B and the Hub off)

WORDS = (
    "apple river stone cloud maple tiger ocean pencil garden silver planet candle harbor meadow violin "
    "lantern falcon copper desert orchid glacier saddle thunder walnut basket crystal ember fossil"
).split()
HELD_OUT_PROMPT = "Sort these words alphabetically: walnut, ember, copper, lantern"


def records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.sample(WORDS, rng.randint(3, 6))
        out.append(
            {
                "messages": [
                    {"role": "user", "content": "Sort these words alphabetically: " + ", ".join(words)},
                    {"role": "assistant", "content": ", ".join(sorted(words))},
                ]
            }
        )
    return out


def run_config(model: Path, data: Path, args: argparse.Namespace, work: Path) -> dict:
    return {
        "model": {"name": str(model)},
        "data": {
            "source": str(data),
            "format": "instruction",
            "seq_len": args.seq_len,
            "eval_fraction": 0.1,
            "cache_dir": str(work / "data"),
        },
        "lora": {"enabled": True},
        "strategy": "fsdp",
        "micro_batch_size": args.micro_batch,
        "grad_accum": args.grad_accum,
        "steps": args.steps,
        "eval_batches": 10_000,  # the whole eval split
        "logging": {"wandb": False, "progress": False, "plots": False},
        "output_dir": str(work / "harness"),
    }


def eval_loss(model, blocks) -> float:
    """Token-weighted loss over the eval blocks (harness's evaluation, one process)."""
    import torch

    from harness.training import count_targets, labelled_lm_loss

    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(blocks), 8):
            batch = torch.from_numpy(blocks[i : i + 8].astype("int64"))
            total += float(labelled_lm_loss(model, batch, num_items=1))
            count += count_targets(batch)
    return total / count


def greedy(model, tok, prompt: str) -> str:
    import torch

    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def trainer_losses(model_dir: Path, cfg_path: Path, args: argparse.Namespace, work: Path) -> list[float]:
    """HF Trainer + peft on harness's global batches, in harness's order (see the module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from harness.config import load_config
    from harness.data import BatchSampler, load_packed, prepare_data
    from harness.models import apply_lora, init_adapters
    from harness.training import lr_lambda

    cfg = load_config(str(cfg_path))
    data = load_packed(prepare_data(cfg.model.name, cfg.data, progress=False))
    global_batch = args.micro_batch * args.grad_accum * 2
    sampler = BatchSampler(data, global_batch, 1, 1, 0, cfg.data.seed)
    rows = [row for step in range(args.steps) for row in sampler.batch(step, 0)]
    dataset = [{"input_ids": r[0], "labels": r[1], "position_ids": r[2]} for r in rows]
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = apply_lora(base, cfg.lora, cfg.model.seed)  # the same peft LoraConfig as the run
    init_adapters(model, cfg.model.seed)  # and the same adapter init
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(o, cfg.steps))
    micro_losses: list[float] = []  # what Trainer backpropagates per micro-batch: its share of the step's loss

    targs = TrainingArguments(
        output_dir=str(work / "trainer"),
        per_device_train_batch_size=global_batch // args.grad_accum,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        max_grad_norm=o.grad_clip,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class InOrder(Trainer):
        """Harness's batch order, and the unrounded loss (Trainer's log rounds it to 4 decimals)."""

        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, *a, **k):
            loss = super().training_step(*a, **k)
            micro_losses.append(float(loss))
            return loss

    def collate(batch: list[dict]) -> dict:
        return {k: torch.stack([b[k] for b in batch]) for k in batch[0]}

    InOrder(model=model, args=targs, train_dataset=dataset, data_collator=collate, optimizers=(optimizer, scheduler)).train()
    # with num_items_in_batch each micro-batch's loss is its share of the step's token mean: their sum is the step's loss
    return [sum(micro_losses[i : i + args.grad_accum]) for i in range(0, len(micro_losses), args.grad_accum)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--records", type=int, default=1200)
    args = parser.parse_args()

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.config import load_config
    from harness.data import load_packed, prepare_data

    model_dir = real_model.prepare()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "sort.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records(args.records)))
        cfg_path = work / "run.yaml"
        cfg_path.write_text(yaml.safe_dump(run_config(model_dir, data, args, work)))
        cfg = load_config(str(cfg_path))
        packed = load_packed(prepare_data(cfg.model.name, cfg.data, progress=False))
        eval_blocks = packed.blocks["eval"]
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        before = {"eval_loss": eval_loss(base, eval_blocks), "sample": greedy(base, tok, HELD_OUT_PROMPT)}

        started = time.time()
        stdout = _run([str(BIN / "torchrun"), "--nproc_per_node=2", str(REPO / "harness" / "train.py"), "--config", str(cfg_path)])
        wall = time.time() - started
        rows = [json.loads(line) for line in (work / "harness" / "metrics.jsonl").read_text().splitlines() if line.strip()]
        ours = [r["train/loss"] for r in rows if "train/loss" in r]
        step_times = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r]
        tuned = PeftModel.from_pretrained(base, str(work / "harness" / "adapter")).eval()
        after = {"eval_loss": eval_loss(tuned, eval_blocks), "sample": greedy(tuned, tok, HELD_OUT_PROMPT)}
        run_eval = [r["eval/loss"] for r in rows if "eval/loss" in r][-1]

        theirs = trainer_losses(model_dir, cfg_path, args, work)

    diffs = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    print("| step | harness FSDP2 x2 loss | Trainer + peft loss | rel. diff |")
    print("|---:|---:|---:|---:|")
    for i, (a, b, d) in enumerate(zip(ours, theirs, diffs), 1):
        print(f"| {i} | {a:.6f} | {b:.6f} | {d:.1e} |")
    print(f"held-out loss: before {before['eval_loss']:.4f}, after {after['eval_loss']:.4f} (the run's own final eval: {run_eval:.4f})")
    print(f"expected: {', '.join(sorted(HELD_OUT_PROMPT.split(': ')[1].split(', ')))}")
    print(f"sample before: {before['sample']!r}")
    print(f"sample after:  {after['sample']!r}")
    print(
        f"harness: median step {statistics.median(step_times[2:]):.2f} s, run wall {wall:.0f} s; "
        f"last line: {stdout.strip().splitlines()[-1]}"
    )
    print(
        json.dumps(
            {
                "steps": args.steps,
                "seq_len": args.seq_len,
                "global_batch": args.micro_batch * args.grad_accum * 2,
                "eval_loss_before": before["eval_loss"],
                "eval_loss_after": after["eval_loss"],
                "run_eval_loss": run_eval,
                "sample_before": before["sample"],
                "sample_after": after["sample"],
                "median_step_s": statistics.median(step_times[2:]),
                "harness_losses": ours,
                "trainer_losses": theirs,
                "max_rel_diff": max(diffs),
            }
        )
    )


if __name__ == "__main__":
    main()
