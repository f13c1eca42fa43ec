"""Packed examples kept apart in every decoder transformers ships, including those whose forward
forgets to say where the examples are.

Packed rows (several instruction examples in one block, their position ids restarting at each)
are confined by transformers, not by harness: with no attention mask and no cache, the decoder's
mask builders (`masking_utils.create_causal_mask` and its sliding-window kin) read the position
ids and mask every example off from the others (`find_packed_sequence_indices`). A decoder whose
forward calls the builders without the position ids it was given gets a plain causal mask, and
each example attends to the ones packed before it: the run trains on the wrong attention and
says nothing. In transformers 5.24 gpt-oss, AFMoE, GraniteMoeHybrid (their `mask_kwargs` leave
`position_ids` out) and OPT (its decoder's `create_causal_mask` call) are such decoders; found by
`--check` on a packed gpt-oss run (its loss 8.7e-4 off, the attention sinks' gradient 0.61).

`confine_packing`, applied to every model harness constructs, reads each module class's forward
source once; where it calls a builder and hands none the position ids, the builders that forward
calls are wrapped (in the class's own modeling module, where its forward looks them up) to receive
the position ids that forward was given, kept for the length of the forward by a pair of hooks.
A builder handed position ids, or a forward given none, is left as transformers wrote it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from torch import nn

_RUNNING: list[Any] = []  # the position ids of each hooked forward running now, innermost last
_WRAPPED: set[tuple[str, str]] = set()  # (modeling module, builder) already handed the position ids


def _called(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


@functools.cache
def unpositioned_builders(cls: type) -> list[str]:
    """The mask builders `cls.forward` calls, if it hands none of them the position ids ([] otherwise);
    read once per class (every model harness builds asks, the check's reference and the planner's too)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    calls = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n.func).startswith("create_") and _called(n.func).endswith("mask")
    ]
    keyword = any(k.arg == "position_ids" for n in calls for k in n.keywords)
    in_kwargs = any(
        isinstance(key, ast.Constant) and key.value == "position_ids" for d in ast.walk(tree) if isinstance(d, ast.Dict) for key in d.keys
    )
    return [] if keyword or in_kwargs else sorted({_called(n.func) for n in calls})


def _handed_positions(builder: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(builder)

    @functools.wraps(builder)
    def with_positions(*args: Any, **kwargs: Any) -> Any:
        if _RUNNING and _RUNNING[-1] is not None and "position_ids" not in signature.bind_partial(*args, **kwargs).arguments:
            kwargs["position_ids"] = _RUNNING[-1]
        return builder(*args, **kwargs)

    return with_positions


def _leave(*_: Any) -> None:
    _RUNNING.pop()


def confine_packing(model: nn.Module) -> list[str]:
    """Hand the position ids to the mask builders of every module of `model` whose forward leaves
    them out (module docstring). Returns those modules' class names ([]: every decoder confines
    packed examples itself)."""
    fixed: dict[type, list[str]] = {}
    for cls in dict.fromkeys(type(m) for m in model.modules() if type(m).__module__.startswith("transformers.")):
        if "position_ids" in inspect.signature(cls.forward).parameters and (builders := unpositioned_builders(cls)):
            fixed[cls] = builders
    for cls, builders in fixed.items():
        family = sys.modules[cls.__module__]
        for name in builders:
            if (cls.__module__, name) not in _WRAPPED and callable(getattr(family, name, None)):
                setattr(family, name, _handed_positions(getattr(family, name)))
                _WRAPPED.add((cls.__module__, name))
        signature = inspect.signature(cls.forward)

        def enter(module: nn.Module, args: tuple, kwargs: dict, signature: inspect.Signature = signature) -> None:
            _RUNNING.append(signature.bind_partial(module, *args, **kwargs).arguments.get("position_ids"))

        for module in model.modules():
            if type(module) is cls:
                module.register_forward_pre_hook(enter, with_kwargs=True)
                module.register_forward_hook(_leave, always_call=True)
    return [cls.__name__ for cls in fixed]


__all__ = ["confine_packing", "unpositioned_builders"]
