"""Prune a saved model: `python -m harness.prune`, the command (the stage of a run is
`harness.runner.prune_stage`, which `harness.train` calls after training).

    python -m harness.prune --config run.yaml model.name=runs/x/hf prune.method=wanda
    torchrun --nproc_per_node=2 -m harness.prune --config run.yaml strategy=zero3 ...

The command builds the same run as `harness.train` (the same data, engine, checkpoints and
trainer), prunes the model it loaded, optionally fine-tunes `prune.finetune_steps` steps with
the masks enforced, and exports a Hugging Face directory (`<output_dir>/hf`) through the
checkpoint export, so the saved model is exactly as sparse as the masks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any

if __package__ in (None, ""):  # run as a file by a launcher: make `harness` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness import imports_done  # the package first: as the program, the imports below run with the collector held

# isort: split
from harness.config import PRUNE_METHOD_FACTS, RunConfig, load_config, load_strategy
from harness.distributed import Collectives, DistInfo, exit_process
from harness.engine import EnginePlan
from harness.errors import ConfigError
from harness.models import EXPERT_COUNT_ATTRS, CheckpointWeights, empty_model, model_config
from harness.runner import parse_command_line, preflight, run_command, run_recipe


def exported_zeros(hf_dir: str, params: list[str]) -> dict[str, int]:
    """Exact zeros per pruned parameter in an exported model (the proof it is sparse), read as
    transformers loads it: a stacked expert tensor is made from the family's per-expert files by
    transformers' own conversion (`CheckpointWeights.follow_conversions`), one tensor at a time."""
    template = empty_model(model_config(hf_dir))
    shapes = {name: tuple(p.shape) for name, p in template.named_parameters()}
    weights = CheckpointWeights(hf_dir)
    weights.follow_conversions(template)
    out: dict[str, int] = {}
    for name in params:
        if name in shapes:
            tensor = weights.read([name], shapes[name], 0, math.prod(shapes[name]))
            if tensor is not None:
                out[name] = int((tensor == 0).sum())
    return out


def exported_expert_count(hf_dir: str) -> int | None:
    """The expert count an exported model's config.json gives (None: it names none)."""
    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config = config.get("text_config", config)
    return next((config[a] for a in EXPERT_COUNT_ATTRS if isinstance(config.get(a), int)), None)


def prune_model(cfg: RunConfig, plan: EnginePlan, info: DistInfo) -> dict[str, Any]:
    """The command: build the run as `harness.train` does, prune, fine-tune, export."""
    done = run_recipe(cfg, plan, info, ("prune", "finetune", "export"))
    if done.preempted is not None:
        return done.preempted
    trainer, stats, final = done.trainer, done.pruned, done.final
    assert stats is not None and final is not None
    hf_dir = os.path.join(cfg.output_dir, "hf")
    summary = {
        "prune_achieved_sparsity": stats["achieved_sparsity"],
        "prune_eval_perplexity_before": stats["eval_perplexity_before"],
        "prune_eval_perplexity_after": stats["eval_perplexity_after"],
        "final_eval_perplexity": final["eval/perplexity"],
    }
    experts = stats.get("experts")
    if experts:
        summary["prune_experts_kept_per_layer"] = experts["kept_per_layer"]
    short: list[str] = []
    if info.is_main:  # one reader; every rank learns the verdict so all of them stop together
        zeros = exported_zeros(hf_dir, [x["param"] for x in stats["layers"]])
        short = [x["param"] for x in stats["layers"] if zeros.get(x["param"], -1) < x["pruned"]]
        if experts and (written := exported_expert_count(hf_dir)) != experts["kept_per_layer"]:
            short.append(f"experts: {written} per layer in config.json, {experts['kept_per_layer']} kept")
        summary["exported_zeros"] = sum(zeros.values())
        print(
            f"[harness] pruned model exported to {os.path.abspath(hf_dir)}: {summary['exported_zeros']:,} zero weights in "
            f"{len(zeros)} pruned matrices (pruned {sum(x['pruned'] for x in stats['layers']):,})"
            + (f"; {experts['kept_per_layer']} of {experts['count']} experts per MoE layer" if experts else ""),
            flush=True,
        )
    if Collectives().any([bool(short)])[0]:
        raise RuntimeError(f"the exported model in {hf_dir} does not hold what was pruned ({short[:3] or 'see rank 0'})")
    trainer.observer.log_summary(summary)
    trainer.close()
    return summary


def command_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run config for the command: no training before pruning (the model is loaded),
    the LR schedule spans the fine-tuning steps, and the result is exported to HF."""
    cfg = load_config(path, overrides)
    if not cfg.prune.enabled:
        names = list(PRUNE_METHOD_FACTS)
        raise ConfigError(
            f"python -m harness.prune needs prune.method ({', '.join(names[:-1])} or {names[-1]}) "
            "or prune.experts (a fraction of each MoE layer's experts)"
        )
    if cfg.checkpoint.resume not in ("", "none"):
        raise ConfigError(
            "python -m harness.prune prunes model.name; to prune a checkpoint, export it first "
            "(python -m harness.export <checkpoint> --out <dir>) and set model.name=<dir>"
        )
    check_prune_output(cfg)
    run = dataclasses.replace(cfg, steps=max(1, cfg.prune.finetune_steps), checkpoint=dataclasses.replace(cfg.checkpoint, export_hf=True))
    # a copy records no written keys (every key would count as written, and a DeepSpeed file's own
    # micro-batch would be named a contradiction instead of taken): the user's, and the two set here
    if cfg.given_keys is not None:
        run.given_keys = cfg.given_keys | {"steps", "checkpoint.export_hf"}
    return run


RUN_OUTPUTS = ("hf", "adapter", "checkpoints", "metrics.jsonl")  # what a run leaves in its output_dir


def check_prune_output(cfg: RunConfig) -> None:
    """The command writes a new model, metrics and checkpoints into output_dir: a directory that
    holds another run's (the training config's own output_dir, typically) is refused before
    anything starts, with advice this command accepts; checkpoint.overwrite=true replaces them
    (never the model being pruned)."""
    out = cfg.output_dir
    model = os.path.realpath(cfg.model.name)
    if os.path.isdir(cfg.model.name) and (model + os.sep).startswith(os.path.realpath(out).rstrip(os.sep) + os.sep):
        raise ConfigError(
            f"model.name '{cfg.model.name}' lies inside output_dir '{out}', which the pruned model is written into; "
            f"set output_dir to a new directory (e.g. output_dir={out.rstrip(os.sep)}-pruned)"
        )
    held = [name for name in RUN_OUTPUTS if os.path.exists(os.path.join(out, name))]
    if held and not cfg.checkpoint.overwrite:
        raise ConfigError(
            f"output_dir '{out}' holds another run's outputs ({', '.join(held)}), which the pruned model, its metrics and "
            f"checkpoints would replace; set output_dir to a new directory (e.g. output_dir={out.rstrip(os.sep)}-pruned), "
            f"or checkpoint.overwrite=true to replace them"
        )


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_command_line("harness.prune", __doc__, argv)

    def load() -> tuple[RunConfig, EnginePlan]:
        cfg = command_config(args.config, overrides)
        return cfg, preflight(cfg, load_strategy(cfg.strategy))  # includes the pruning rules at this world size

    return run_command("harness.prune", load, prune_model)


if __name__ == "__main__":
    imports_done()
    exit_process(main())
