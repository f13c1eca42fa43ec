"""The arithmetic of a training step, engine-agnostic: the fp32 causal-LM loss, optimizers and
LR schedules, precision policies."""

from harness.training.loss import (
    causal_lm_loss,
    chunked_ce_sum,
    count_targets,
    install_loss_forward,
    labelled_lm_loss,
    shift_targets,
    unwrap_model,
)
from harness.training.optim import build_optimizer, build_scheduler, lr_lambda
from harness.training.precision import DTYPES, PrecisionPolicy, bf16_supported, precision_policy

__all__ = [
    "DTYPES",
    "PrecisionPolicy",
    "bf16_supported",
    "build_optimizer",
    "build_scheduler",
    "causal_lm_loss",
    "chunked_ce_sum",
    "count_targets",
    "install_loss_forward",
    "labelled_lm_loss",
    "lr_lambda",
    "precision_policy",
    "shift_targets",
    "unwrap_model",
]
