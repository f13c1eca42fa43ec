"""Whether a model keeps packed examples apart: the fact a run with packed rows depends on.

Packed rows (several instruction examples in one block, their position ids restarting at each)
are confined by transformers, not by harness: with no attention mask and no cache, the decoder's
mask builders (`masking_utils.create_causal_mask` and its sliding-window kin) read the position
ids and mask every example off from the others (`find_packed_sequence_indices`). A decoder whose
forward builds its masks without handing them the position ids gets a plain causal mask instead,
and each example attends to the ones packed before it: the run trains, on the wrong attention, and
says nothing. In transformers 5 gpt-oss, AFMoE, GraniteMoeHybrid (their `mask_kwargs` leave
`position_ids` out) and OPT (its decoder's `create_causal_mask` call) are such decoders. Each module's
forward source is read for it once, in pre-flight
(a template on the meta device: no weights, no forward), and the run refused in one line.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn


def _called(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _ignores_positions(cls: type) -> bool:
    """Whether `cls.forward` calls a mask builder and hands none of them the position ids."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    builders = [
        n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n.func).startswith("create_") and _called(n.func).endswith("mask")
    ]
    if not builders:
        return False
    keyword = any(k.arg == "position_ids" for n in builders for k in n.keywords)
    in_kwargs = any(
        isinstance(key, ast.Constant) and key.value == "position_ids" for d in ast.walk(tree) if isinstance(d, ast.Dict) for key in d.keys
    )
    return not (keyword or in_kwargs)


def unconfined_packing(model: nn.Module) -> str | None:
    """Why packed examples would attend to each other in `model` (None: every module of it that
    builds transformers' masks builds them from the position ids, or none builds one)."""
    classes = list(dict.fromkeys(type(m) for m in model.modules() if type(m).__module__.startswith("transformers.")))
    culprit = next((c for c in classes if _ignores_positions(c)), None)
    if culprit is None:
        return None
    return (
        f"{culprit.__name__}'s forward builds its attention masks without the position ids, so packed examples would attend to each other"
    )


__all__ = ["unconfined_packing"]
