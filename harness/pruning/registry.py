"""The pruning methods, by name: the one catalogue `run_pruning` dispatches through.

Each entry pairs the method's facts (`harness.config.PRUNE_METHOD_FACTS`: what the config
checks and pre-flight read) with its `run`. To add a method: its module with a
`run(MethodRun) -> MaskSet`, its row of facts, its entry here, and its name in the config's
`PruneMethod` vocabulary.
"""

from __future__ import annotations

from harness.config import PRUNE_METHOD_FACTS, PruneConfig, method_facts
from harness.pruning import baselines, fit, gradprobe
from harness.pruning.method_run import Method

_RUNS = {
    "magnitude": baselines.magnitude,
    "wanda": baselines.wanda,
    "sparsegpt": baselines.sparsegpt,
    "sparsegpt_fit": fit.run,
    "gradprobe": gradprobe.run,
}

METHODS: dict[str, Method] = {name: Method(PRUNE_METHOD_FACTS[name], run) for name, run in _RUNS.items()}


def method_of(cfg: PruneConfig) -> Method:
    """The entry of `cfg.method` (ValueError naming the methods for `none` or an unknown name)."""
    method_facts(cfg)  # the one refusal of a name with no facts
    if cfg.method not in METHODS:
        raise ValueError(f"prune.method={cfg.method!r} has facts but no implementation in harness.pruning.registry")
    return METHODS[cfg.method]
