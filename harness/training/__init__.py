"""The arithmetic of a training step, engine-agnostic: the fp32 causal-LM loss, a
mixture-of-experts router's load-balancing loss (`router`), optimizers and LR schedules,
precision policies."""

from harness.config import BF16_WEIGHT_OPTIMIZERS, OPTIMIZER_NAMES
from harness.training.loss import (
    IGNORE_INDEX,
    causal_lm_loss,
    ce_sum,
    chunked_ce_sum,
    count_targets,
    install_loss_forward,
    labelled_lm_loss,
    loss_for,
    sequence_shard_loss,
    shift_targets,
)
from harness.training.optim import (
    build_optimizer,
    build_scheduler,
    compiles_step,
    lr_lambda,
    name_compiles_step,
    optimizer_shared_bytes,
    optimizer_state_bytes,
    optimizer_step_bytes,
)
from harness.training.precision import DTYPE_BYTES, DTYPE_NAMES, DTYPES, PrecisionPolicy, bf16_supported, precision_policy
from harness.training.router import AUX_LOSS, EXPERT_LOAD, RouterLoss, base_model, model_class, router_class, router_refusal

__all__ = [
    "AUX_LOSS",
    "EXPERT_LOAD",
    "IGNORE_INDEX",
    "BF16_WEIGHT_OPTIMIZERS",
    "DTYPES",
    "DTYPE_BYTES",
    "DTYPE_NAMES",
    "OPTIMIZER_NAMES",
    "PrecisionPolicy",
    "RouterLoss",
    "base_model",
    "bf16_supported",
    "build_optimizer",
    "build_scheduler",
    "compiles_step",
    "causal_lm_loss",
    "ce_sum",
    "chunked_ce_sum",
    "count_targets",
    "install_loss_forward",
    "labelled_lm_loss",
    "loss_for",
    "sequence_shard_loss",
    "lr_lambda",
    "model_class",
    "name_compiles_step",
    "optimizer_shared_bytes",
    "optimizer_state_bytes",
    "optimizer_step_bytes",
    "precision_policy",
    "router_class",
    "router_refusal",
    "shift_targets",
]
