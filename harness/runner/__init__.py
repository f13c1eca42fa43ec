"""One run's lifecycle, shared by the entry points: the pre-flight gate, everything built before
step 1, the trainer and evaluation, the pruning stage, the recipe that runs the stages in order, and the supervised command around them."""

from harness.runner.build import build_run, prepare
from harness.runner.check import run_check
from harness.runner.command import parse_command_line, run_command
from harness.runner.preflight import preflight
from harness.runner.prune_stage import HOLDOUT_SPLIT, PruneStats, calibration_batches, calibration_split, prune_and_measure, run_prune_stage
from harness.runner.recipe import STAGES, RecipeResult, run_recipe
from harness.runner.trainer import Trainer, evaluate, write_state_bytes

__all__ = [
    "HOLDOUT_SPLIT",
    "PruneStats",
    "RecipeResult",
    "STAGES",
    "Trainer",
    "build_run",
    "calibration_batches",
    "calibration_split",
    "evaluate",
    "parse_command_line",
    "preflight",
    "prune_and_measure",
    "prepare",
    "run_check",
    "run_command",
    "run_prune_stage",
    "run_recipe",
    "write_state_bytes",
]
