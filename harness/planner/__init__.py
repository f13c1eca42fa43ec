"""The memory planner: per-rank peak memory of a run config, predicted before launch.

- ``trace``: forward + backward of the real (fake-storage) model under the trainer's own
  wrapping, loss and activation checkpointing, on a fake process group; a per-op timeline.
- ``model_states``: what the trace does not run - optimizer state and step, DDP buckets,
  DeepSpeed ZeRO-1/2/3 buffers and offload - in formulas named after each engine buffer.
- ``estimate``: the two combined into the worst rank's peak, by category, with its moment.
- ``report``: the text the CLI prints, the GPU allowance and the per-dtype table.
- ``recommend``: the fastest configuration that fits (the memory decision tree, walked by expected speed);
  ``candidates``: its search space (precision x AC x micro-batch x strategy x sequence split) and step-time factors.
- ``ladder``: the memory ladder ``--recommend`` walks: one rung per technique, in memory order, the first that fits.
- ``lora``: LoRA traced as its own model; QLoRA's quantized base in formulas over that trace.
- ``moe``: mixtures of experts: the grouped GEMM's fake output as the trainer's kernels make it (any precision),
  the routing cases a plan states (worst, balanced).
- ``measure``: the ground truth - real CPU steps measured with MemTracker - for tests.

The command line is ``python -m harness.plan`` (``harness/plan.py``).
"""

from harness.planner.estimate import estimate
from harness.planner.long_context import sequence_degree
from harness.planner.recommend import Recommendation, recommend
from harness.planner.report import format_estimate, parse_size, verdict
from harness.planner.result import Estimate, Moment
from harness.planner.trace import PlanError

__all__ = [
    "Estimate",
    "Moment",
    "PlanError",
    "Recommendation",
    "estimate",
    "format_estimate",
    "parse_size",
    "recommend",
    "sequence_degree",
    "verdict",
]
