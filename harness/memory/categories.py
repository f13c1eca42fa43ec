"""The vocabularies of memory, defined once.

Two views of a rank's bytes exist, and every report uses one of them by these names:

- `CATEGORIES`: where device memory goes during a step, as torch's memory trackers
  classify it (the planner's trace, the per-step tracker, the metrics, the plots, the
  experiment tables). `REPORTED` is the subset shown as table columns and dashboard
  panels (buffers and "other" are small and shown only when present).
- `STATE_CATEGORIES`: the model state an engine keeps between steps, counted tensor by
  tensor (`state_bytes/rank*.json`, the proof of sharding).
"""

from __future__ import annotations

from typing import Any

CATEGORIES = ("parameters", "model_buffers", "gradients", "optimizer_state", "activations", "temporaries", "communication", "other")
REPORTED = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication")
STATE_CATEGORIES = ("params", "master_params", "grads", "optim_state")

# torch's tracker reference types (`_RefType` / `_FSDPRefType` values) to our categories
TRACKER_TO_CATEGORY = {
    "Parameter": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "Buffer": "model_buffers",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Optstate": "optimizer_state",
    "OptState": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "All Gather": "communication",
    "Reduce Scatter": "communication",
    "Other": "other",
    "Inputs": "other",
}


def category_of(reftype: Any) -> str | None:
    """Our category for a torch tracker reference type (an enum member or its value)."""
    return TRACKER_TO_CATEGORY.get(getattr(reftype, "value", reftype))
