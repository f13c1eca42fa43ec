"""harness with its defaults side by side with HF Trainer (+ peft) on the real model, in one invocation.

    python benchmarks/peers.py [--rows fp32 bf16 lora fsdp2 moe] [--steps 12] [--seq-len 256] [--micro-batch 2]

What a user comparing the two would run: the same model (SmolLM2-135M, `benchmarks/real_model.py`),
the same blocks of tokens (harness prepares the embedded corpus with the model's tokenizer;
Trainer is handed those blocks as `input_ids`/`labels`), the same micro-batch per process, the
same number of steps and learning rate, and otherwise each tool's own defaults (harness: its
config defaults, memory tracking included; Trainer: `TrainingArguments` defaults, AdamW torch).
W&B is off for both (no network). Each side runs as a fresh process, harness first, then Trainer,
row by row, so both see the same machine state.

Rows: `fp32` one process; `bf16` one process (harness `precision=bf16`, Trainer `bf16=True`);
`lora` one process, r=8 alpha=16 on every linear layer of the decoder blocks (harness
`lora.enabled=true`; Trainer + peft `LoraConfig` with the same targets); `fsdp2` two processes
(harness `strategy=fsdp` under torchrun; Trainer under `accelerate launch` with FSDP2 requested,
which accelerate drops on CPU: the worker records what Trainer wrapped the model in); `moe` one
process on a random Qwen3-MoE (`moe_model`: 16 experts top-4, the real model's tokenizer), the
router's load-balancing loss on both sides (harness: its default; Trainer: the model config's
`output_router_logits=True`, how transformers adds it).

Reported per row: the median step time after the first step and `--warmup` more, tokens/s (global), the ratio
harness / Trainer in tokens/s (target >= 0.97), and each side's time to first step. A step's time
is the interval between the ends of consecutive steps, on both sides: everything each loop does
per step (fetching the batch, forward, backward, clipping, the optimizer, logging). Each tool's own
step timer covers different parts (Trainer's `on_step_begin` fires after the batch is fetched and
collated; harness's `perf/step_time_s` includes fetching it), so neither is used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from harness.config import DataConfig
from harness.data import prepare_data

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "benchmarks"))
import real_model  # noqa: E402

ROWS = {
    "fp32": {"world": 1, "harness": {}, "trainer": {}},
    "bf16": {"world": 1, "harness": {"precision": "bf16"}, "trainer": {"bf16": True}},
    "lora": {"world": 1, "harness": {"lora": {"enabled": True}}, "trainer": {"lora": True}},
    "fsdp2": {"world": 2, "harness": {"strategy": "fsdp"}, "trainer": {"fsdp": True}},
    "moe": {"world": 1, "harness": {}, "trainer": {"router_loss": True}, "moe": True},
}


def moe_model(real: Path, tmp: Path) -> Path:
    """A random Qwen3-MoE with the real model's tokenizer (seed 0), saved under `tmp`."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    out = tmp / "qwen3_moe"
    vocab = len(AutoTokenizer.from_pretrained(real))
    config = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        moe_intermediate_size=256, num_experts=16, num_experts_per_tok=4, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in (p for p in os.listdir(real) if p.startswith(("tokenizer", "special_tokens"))):
        shutil.copy2(real / name, out / name)
    return out


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run(cmd: list[str]) -> str:
    """Run `cmd` from the repository root, W&B and the Hub off; its stdout (finetune.py's runs too)."""
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def _env() -> dict[str, str]:
    return dict(os.environ, WANDB_MODE="disabled", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))


def _data_config(args: argparse.Namespace, tmp: Path) -> DataConfig:
    return DataConfig(seq_len=args.seq_len, max_tokens=args.max_tokens, cache_dir=str(tmp / "data"))


def harness_side(row: dict, model: Path, args: argparse.Namespace, work: Path) -> dict:
    out = work / "harness"
    data = _data_config(args, work.parent)
    cfg = {
        "model": {"name": str(model)},
        "data": {"seq_len": data.seq_len, "max_tokens": data.max_tokens, "cache_dir": data.cache_dir},
        "micro_batch_size": args.micro_batch,
        "steps": args.steps,
        "optim": {"lr": args.lr},  # the rate Trainer gets (harness's own default depends on what is trained)
        "eval_batches": 1,
        "logging": {"wandb": False},
        "output_dir": str(out),
        **row["harness"],
    }
    config = work / "harness-run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    train = ["-m", "harness.train"] if row["world"] == 1 else [str(REPO / "harness" / "train.py")]
    launcher = [sys.executable] if row["world"] == 1 else [str(BIN / "torchrun"), f"--nproc_per_node={row['world']}"]
    launched = time.time()
    _run([*launcher, *train, "--config", str(config)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    ends = [r["time"] for r in records if "perf/step_time_s" in r]
    # from the launch to the first step's record, as for Trainer: interpreter, imports, build, step
    return {"step_times": end_to_end(ends), "first_step_s": ends[0] - launched}


def trainer_side(row: dict, model: Path, args: argparse.Namespace, work: Path, data_cache: str) -> dict:
    spec = work / "trainer.json"
    result = work / "trainer_result.json"
    spec.write_text(
        json.dumps(
            {
                "model": str(model),
                "data": data_cache,
                "steps": args.steps,
                "micro_batch": args.micro_batch,
                "lr": args.lr,
                "out": str(work / "trainer"),
                "result": str(result),
                **row["trainer"],
            }
        )
    )
    worker = [str(Path(__file__).resolve()), "--trainer-worker", str(spec)]
    if row["world"] == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [
            str(BIN / "accelerate"),
            "launch",
            "--num_processes",
            str(row["world"]),
            "--use_fsdp",
            "--fsdp_version",
            "2",
            *worker,
        ]
    launched = time.time()
    _run(cmd)
    out = json.loads(result.read_text())
    out["first_step_s"] = out.pop("first_step_at") - launched
    return out


def trainer_worker(spec_path: str) -> None:
    """One Trainer run (a process of its own; under accelerate launch, one per rank)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from harness.data import load_packed

    spec = json.loads(Path(spec_path).read_text())
    blocks = load_packed(spec["data"]).blocks["train"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = spec["steps"] * spec["micro_batch"] * world
    rows = [torch.from_numpy(np.asarray(blocks[i % len(blocks)], dtype=np.int64)) for i in range(n)]
    dataset = [{"input_ids": r, "labels": r.clone()} for r in rows]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    model.config.output_router_logits = bool(spec.get("router_loss"))  # transformers adds the aux loss only so
    if spec.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS))
    kwargs = {}
    if spec.get("fsdp"):
        kwargs = {"fsdp": "full_shard", "fsdp_config": {"version": 2}}
    training_args = TrainingArguments(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["micro_batch"],
        max_steps=spec["steps"],
        learning_rate=spec["lr"],
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=bool(spec.get("bf16")),
        dataloader_num_workers=0,
        disable_tqdm=True,
        **kwargs,
    )
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append(time.time())

    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[StepEnds()])
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        wrapped = type(trainer.model_wrapped).__name__
        Path(spec["result"]).write_text(json.dumps({"step_times": end_to_end(ends), "first_step_at": ends[0], "wrapped_in": wrapped}))


def end_to_end(ends: list[float]) -> list[float]:
    """Step times from the moments consecutive steps ended (the first step's own time is unknown
    this way: it is the time to first step, reported apart)."""
    return [b - a for a, b in zip(ends, ends[1:])]


def median_after(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200_000, help="cap on the train split harness prepares")
    parser.add_argument("--lr", type=float, default=3e-3, help="the learning rate of both sides (speed does not depend on it)")
    parser.add_argument("--trainer-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_worker:
        trainer_worker(args.trainer_worker)
        return
    model = real_model.prepare()
    columns = ["row", "harness s/step", "Trainer s/step", "harness tok/s", "Trainer tok/s", "ratio", "1st step h / T s", "Trainer wraps"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        # Tokenized once, before either side's clock starts; harness's runs find the same cache ready.
        data_cache = prepare_data(str(model), _data_config(args, Path(tmp)), progress=False)
        moe = moe_model(model, Path(tmp)) if any(ROWS[n].get("moe") for n in args.rows) else None
        for name in args.rows:
            row = ROWS[name]
            work = Path(tmp) / name
            work.mkdir(parents=True)
            used, cache = (
                (moe, prepare_data(str(moe), _data_config(args, Path(tmp)), progress=False)) if row.get("moe") else (model, data_cache)
            )
            ours = harness_side(row, used, args, work)
            theirs = trainer_side(row, used, args, work, cache)
            tokens = args.micro_batch * args.seq_len * row["world"]
            h, t = median_after(ours["step_times"], args.warmup), median_after(theirs["step_times"], args.warmup)
            print(
                f"| {name} | {h:.3f} | {t:.3f} | {tokens / h:.1f} | {tokens / t:.1f} | {t / h:.3f} | "
                f"{ours['first_step_s']:.1f} / {theirs['first_step_s']:.1f} | {theirs['wrapped_in']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
