"""Checkpoint tensors transformers converts on load, read a piece at a time by transformers' own
conversion mapping (`transformers.conversion_mapping.get_model_conversion_mapping`: the
`WeightRenaming`s and `WeightConverter`s registered for the model's family), never a table of ours.

- A renamed key (GPT-NeoX's `embed_out` is `lm_head`; Mixtral's `block_sparse_moe` is `mlp`) is
  read under the model's name.
- A converted tensor (an MoE layer's `experts.gate_up_proj`, stacked from one checkpoint tensor
  per expert and projection, `experts.E.gate_proj.weight` and `experts.E.up_proj.weight`) is
  made by the converter's own operations, run here on the checkpoint tensors it names. When the
  operations stack along dim 0 first and touch no dim 0 after (`MergeModulelist(dim=0)`, then
  `Concatenate`/`Interleave` along a later dim: every MoE family of transformers 5), each row of
  dim 0 (an expert) is converted from that row's checkpoint tensors alone, so a rank reads only
  the experts its range covers and holds one expert's tensors beyond its part. Any other chain
  is converted whole and the range sliced (the last conversion kept, for its other targets).

Checked before any tensor is read (headers only): each source pattern names as many checkpoint
tensors as the model's dim 0 (an expert count that disagrees with config.json is one
`ConfigError`), and the conversion run on the meta device gives the model's shape.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from harness.errors import ConfigError

Load = Callable[[str], torch.Tensor]  # a checkpoint key -> its whole tensor (or a meta tensor of its shape)


@dataclass
class Converted:
    """One model tensor (and its siblings, when a converter makes several) and where it comes from."""

    converter: Any  # transformers' WeightConverter; a fresh copy runs each conversion
    target: str  # the model's name transformers keys the conversion by (its first target)
    sources: dict[str, list[str]] = field(default_factory=dict)  # source pattern -> checkpoint keys, in transformers' order
    by_rows: bool = False  # dim 0 of the result is dim 0 of the stacked checkpoint tensors, row by row


def _stacks_by_rows(operations: Sequence[Any], merge_class: type, per_row_classes: tuple[type, ...]) -> bool:
    """The chain stacks the checkpoint tensors along dim 0 first, and nothing after acts on dim 0."""
    if not operations or type(operations[0]) is not merge_class or operations[0].dim != 0:
        return False
    return all(type(op) in per_row_classes and getattr(op, "dim", 0) >= 1 for op in operations[1:])


def _span(keys: Sequence[str]) -> str:
    return "none" if not keys else keys[0] if len(keys) == 1 else f"{keys[0]} ... {keys[-1]}"


class Conversions:
    """transformers' renamings and converters of `template`'s family, matched against `keys` (a
    checkpoint's tensor names) as `from_pretrained` matches them."""

    def __init__(self, template: nn.Module, keys: Sequence[str], directory: str):
        self.directory = directory
        self.renamed: dict[str, str] = {}  # model name -> checkpoint key
        self.converted: dict[str, Converted] = {}  # model name -> its conversion (siblings share one)
        self.config = getattr(template, "config", None)
        self.template = template
        meta = template.state_dict()
        self.shapes = {name: tuple(t.shape) for name, t in meta.items()}
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None
        try:
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import (
                Concatenate,
                Interleave,
                MergeModulelist,
                WeightRenaming,
                dot_natural_key,
                rename_source_key,
            )
        except ImportError:  # transformers 4: no conversions
            return
        transforms = get_model_conversion_mapping(template)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        prefix = getattr(template, "base_model_prefix", None)
        for key in sorted(keys, key=dot_natural_key):  # transformers' order: the stacking order
            renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta)
            if renamed not in meta and key in meta:
                continue  # already the model's name
            if renamed not in meta:
                continue  # a tensor this model does not have (transformers: unexpected)
            if pattern is None:
                if renamed != key:
                    self.renamed[renamed] = key
                continue
            if renamed not in self.converted:
                converter = by_pattern[pattern]
                group = Converted(converter, renamed, {p: [] for p in converter.source_patterns})
                group.by_rows = _stacks_by_rows(converter.operations, MergeModulelist, (Concatenate, Interleave))
                for target in converter.target_patterns:  # one-to-many: each sibling by its own name
                    self.converted.setdefault(renamed.replace(converter.target_patterns[0], target), group)
            self.converted[renamed].sources[pattern].append(key)

    def group_for(self, names: Sequence[str], prefix: str) -> tuple[str, Converted] | None:
        """(model name, conversion) of the first of `names` that transformers makes by a converter."""
        for name in names:
            for candidate in (name, name.removeprefix(prefix), prefix + name):
                if candidate in self.converted:
                    return candidate, self.converted[candidate]
        return None

    def _convert(self, group: Converted, load: Load, row: int | None = None) -> dict[str, torch.Tensor]:
        """The converter's operations on its checkpoint tensors (only those of dim-0 row `row`)."""
        converter = copy.deepcopy(group.converter)  # transformers, too, gives each target its own copy
        for pattern, keys in group.sources.items():
            for key in keys if row is None else keys[row : row + 1]:
                converter.add_tensor(group.target, key, pattern, functools.partial(load, key))
        try:
            return converter.convert(group.target, model=self.template, config=self.config)
        except (RuntimeError, ValueError) as exc:  # e.g. torch.cat of tensors whose shapes disagree
            ops = [type(op).__name__ for op in converter.operations]
            why = (str(exc).splitlines() or [""])[0][:160]
            raise ConfigError(
                f"{self.directory}: transformers' {ops} cannot make {group.target} from "
                f"{_span(next(iter(group.sources.values())))} ({why}): its config.json describes another model than "
                "its weights; fix config.json or download the model again"
            ) from None

    def _check_rows(self, name: str, group: Converted, shape: Sequence[int]) -> None:
        for keys in group.sources.values():
            if len(keys) != shape[0]:
                raise ConfigError(
                    f"{self.directory} holds {len(keys)} checkpoint tensors ({_span(keys)}) that transformers stacks "
                    f"into {name}, whose dim 0 config.json makes {shape[0]} (shape {list(shape)}): its config.json describes "
                    "another model than its weights (e.g. its expert count); fix config.json or download the model again"
                )

    def _check_result(self, name: str, found: Sequence[int], shape: Sequence[int]) -> None:
        if tuple(found) != tuple(shape):
            raise ConfigError(
                f"{self.directory}: transformers' conversion of its checkpoint tensors gives {name} the shape {list(found)}, "
                f"the model expects {list(shape)}: its config.json describes another model than its weights; fix config.json "
                "or download the model again"
            )

    def read(self, name: str, group: Converted, shape: Sequence[int], start: int, end: int, load: Load) -> torch.Tensor:
        """Elements [start, end) of the flattened converted tensor `name`."""
        if not group.by_rows:
            if self._cached is None or self._cached[0] != group.target:
                self._cached = None  # one conversion alive at a time
                self._cached = (group.target, self._convert(group, load))
            tensor = self._cached[1][name]
            self._check_result(name, tensor.shape, shape)
            return tensor.reshape(-1)[start:end]
        self._check_rows(name, group, shape)
        row = 1
        for d in shape[1:]:
            row *= int(d)
        out: torch.Tensor | None = None
        for r in range(start // row, -(-end // row)):
            slab = self._convert(group, load, r)[name]  # this expert's tensors stacked: [1, *shape[1:]]
            self._check_result(name, (shape[0], *slab.shape[1:]), shape)
            lo, hi = max(start, r * row), min(end, (r + 1) * row)
            if out is None:
                out = torch.empty(end - start, dtype=slab.dtype)
            out[lo - start : hi - start] = slab.reshape(-1)[lo - r * row : hi - r * row]
            del slab
        return out if out is not None else torch.empty(0)

    def check_shapes(self, header_shape: Callable[[str], Sequence[int]]) -> None:
        """Every converted tensor gets the model's shape: the counts per source pattern, then the
        conversion itself on meta tensors of the checkpoint's header shapes (nothing is read)."""

        def meta(key: str) -> torch.Tensor:
            return torch.empty(tuple(header_shape(key)), device="meta")

        done: set[str] = set()
        for name, group in self.converted.items():
            if group.target in done:
                continue
            done.add(group.target)
            if group.by_rows:
                self._check_rows(name, group, self.shapes[group.target])
                slab = self._convert(group, meta, 0)[group.target]
                self._check_result(group.target, (self.shapes[group.target][0], *slab.shape[1:]), self.shapes[group.target])
                continue
            for target, tensor in self._convert(group, meta).items():
                if target in self.shapes:
                    self._check_result(target, tensor.shape, self.shapes[target])
