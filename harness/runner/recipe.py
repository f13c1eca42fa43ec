"""One run's stages, assembled once: build → train → prune → fine-tune → export.

`harness.train` and `harness.prune` are two tables of contents over `run_recipe`, each naming
its stages: training runs `train` (then `prune` and `finetune` when `prune.method` is set) and
`export`; the prune command runs `prune`, `finetune` and `export` on the model it loaded. Steps
are numbered across stages: pruning happens at the last trained step (0 without `train`), and
fine-tuning continues from there for `prune.finetune_steps` steps with the masks enforced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.checkpoint import ResumeState
from harness.config import RunConfig
from harness.distributed import DistInfo
from harness.engine import EnginePlan
from harness.errors import StopRequested
from harness.runner.build import build_run
from harness.runner.prune_stage import PruneStats, run_prune_stage
from harness.runner.trainer import Trainer, evaluate

STAGES = ("train", "prune", "finetune", "export")


@dataclass
class RecipeResult:
    """What the stages left: the trainer (for the command's summary and `close`), the pruning
    stage's numbers, the final evaluation and the last step; `preempted` when a stop ended it."""

    trainer: Trainer
    resumed: ResumeState
    last: int = 0  # the step the final checkpoint and evaluation are of
    pruned: PruneStats | None = None
    final: dict[str, float] | None = None  # None: the run has no eval split
    preempted: dict[str, Any] | None = None


def run_recipe(cfg: RunConfig, plan: EnginePlan, info: DistInfo, stages: Sequence[str]) -> RecipeResult:
    """Build the run, then run `stages` (a subsequence of STAGES) in order. Collective."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage {unknown[0]!r} (stages: {', '.join(STAGES)})")
    trainer, resumed = build_run(cfg, plan, info)
    out = RecipeResult(trainer, resumed, last=resumed.step)
    pruned_at = 0
    if "train" in stages:
        pruned_at = out.last = cfg.steps
        if not trainer.train(resumed.step, cfg.steps):
            return _preempted(out, with_skipped=True)
    if "prune" in stages:
        if "train" in stages and resumed.step <= cfg.steps:  # the trained model on disk first: a stop or crash while pruning loses no step
            trainer.ckpt.ensure_saved(cfg.steps, {"skipped_steps": trainer.skipped})
        out.pruned = _prune(cfg, info, trainer, resumed, pruned_at, loaded="train" not in stages)
        out.last = pruned_at
    if "finetune" in stages:
        out.last = pruned_at + cfg.prune.finetune_steps
        if out.last > pruned_at and not trainer.train(max(resumed.step, pruned_at), out.last):
            return _preempted(out, with_skipped="train" in stages)
    if not trainer.data.n_blocks("eval"):  # no eval split (said when the run was built): no final evaluation
        out.final = None
    elif "train" in stages or out.last > pruned_at or out.pruned is None:
        out.final = evaluate(trainer.engine, trainer.data, cfg, info)
    else:  # the loaded model, pruned: nothing changed it since the stage measured it
        out.final = {"eval/loss": out.pruned["eval_loss_after"], "eval/perplexity": out.pruned["eval_perplexity_after"]}
    if out.final is not None:
        trainer.observer.log_eval(out.last, out.final)
    if "export" in stages:
        trainer.ckpt.finish(out.last, {"skipped_steps": trainer.skipped})  # the final checkpoint and HF export, if configured
    return out


def _prune(cfg: RunConfig, info: DistInfo, trainer: Trainer, resumed: ResumeState, step: int, loaded: bool) -> PruneStats:
    """The pruning stage at `step`. `loaded`: the model came from `model.name`, not this run's
    training: a stop in the stage leaves this run's metrics in output_dir, which a relaunch
    may only replace with checkpoint.overwrite=true, and the advice says so."""
    try:
        return run_prune_stage(trainer.engine, trainer.data, cfg, info, trainer.observer, step, ckpt=trainer.ckpt, resumed=resumed)
    except StopRequested as stop:
        if not loaded or cfg.checkpoint.overwrite:
            raise
        raise StopRequested(
            f"{stop}, with checkpoint.overwrite=true: output_dir now holds this run's metrics.jsonl, which a new run "
            "would otherwise refuse to replace"
        ) from None


def _preempted(out: RecipeResult, with_skipped: bool) -> RecipeResult:
    out.preempted = {"preempted_at_step": out.trainer.stopped_at}
    if with_skipped:
        out.preempted["skipped_steps"] = out.trainer.skipped
    return out
