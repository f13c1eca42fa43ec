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

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.config import RunConfig, load_config, load_strategy
from harness.distributed import DistInfo, exit_process
from harness.engine import EnginePlan
from harness.runner import parse_command_line, preflight, run_check, run_command, run_recipe


def train(cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> dict[str, float]:
    stages = ("train", "prune", "finetune", "export") if cfg.prune.enabled else ("train", "export")
    done = run_recipe(cfg, plan, info, stages)  # build, then each stage (prune: masks enforced while fine-tuning)
    if done.preempted is not None:
        return done.preempted
    trainer, final = done.trainer, done.final
    summary = {"final_train_loss": trainer.loss_mean}
    if final is not None:  # None: no eval split (a few documents), said when the run was built
        summary |= {"final_eval_loss": final["eval/loss"], "final_eval_perplexity": final["eval/perplexity"]}
    summary["skipped_steps"] = trainer.skipped
    trainer.observer.log_summary(summary)
    trainer.close()
    if info.is_main:
        evaluated = f"final eval perplexity {final['eval/perplexity']:.2f}" if final is not None else "no eval split"
        print(
            f"[harness] {evaluated}; outputs in {os.path.abspath(cfg.output_dir)}; {trainer.ckpt.result_line()}",
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
    imports_done()
    exit_process(main())
