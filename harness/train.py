"""Train a causal LM under any strategy: the recipe, readable end to end.

accelerate launch harness/train.py --config <file> [key=value ...]
deepspeed --num_gpus=8 harness/train.py --config <file> [key=value ...]
torchrun --nproc_per_node=2 harness/train.py --config <file>
python -m harness.train --config <file>

Any of these with --check: first check, in seconds, that the run computes what it should (a
small twin of the model, 2 steps, compared with the same batch at world 1; exit 7 names the
first parameter that differs).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file by a launcher: make `harness` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.config import RunConfig, load_config, load_strategy
from harness.distributed import DistInfo, exit_process
from harness.engine import EnginePlan
from harness.runner import build_run, evaluate, parse_command_line, preflight, run_check, run_command, run_prune_stage


def train(cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> dict[str, float]:
    trainer, resumed = build_run(cfg, plan, info)
    engine, data, observer, ckpt = trainer.engine, trainer.data, trainer.observer, trainer.ckpt
    last = cfg.steps
    if not trainer.train(resumed.step, cfg.steps):
        return {"preempted_at_step": trainer.stopped_at, "skipped_steps": trainer.skipped}
    if cfg.prune.enabled:  # prune, then fine-tune with the masks enforced
        if resumed.step <= cfg.steps:  # the trained model on disk first: a stop or crash while pruning loses no step
            ckpt.ensure_saved(cfg.steps, {"skipped_steps": trainer.skipped})
        run_prune_stage(engine, data, cfg, info, observer, cfg.steps, ckpt=ckpt, resumed=resumed)  # masks enforced from here on
        last = cfg.steps + cfg.prune.finetune_steps
        if not trainer.train(max(resumed.step, cfg.steps), last):
            return {"preempted_at_step": trainer.stopped_at, "skipped_steps": trainer.skipped}
    final = evaluate(engine, data, cfg, info)
    observer.log_eval(last, final)
    summary = {
        "final_train_loss": trainer.loss_mean,
        "final_eval_loss": final["eval/loss"],
        "final_eval_perplexity": final["eval/perplexity"],
        "skipped_steps": trainer.skipped,
    }
    ckpt.finish(last, {"skipped_steps": trainer.skipped})  # the final checkpoint and HF export, if configured
    observer.log_summary(summary)
    trainer.close()
    if info.is_main:
        print(
            f"[harness] final eval perplexity {final['eval/perplexity']:.2f}; outputs in {os.path.abspath(cfg.output_dir)}; "
            f"{ckpt.result_line()}",
            flush=True,
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    check = ("--check", "check the run's results against the same batch at world 1 on a small twin of the model, then exit")
    args, overrides = parse_command_line("harness.train", __doc__, argv, flags=(check,))
    if args.check:
        return run_check(args.config, overrides)

    def load() -> tuple[RunConfig, EnginePlan]:
        cfg = load_config(args.config, overrides)
        return cfg, preflight(cfg, load_strategy(cfg.strategy))  # the engine plan, made once

    return run_command("harness", load, train)


if __name__ == "__main__":
    exit_process(main())
