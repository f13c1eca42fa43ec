"""Where a model's weights come from, read one piece of one tensor at a time.

A sharded engine asks for the flat range ``[start, end)`` of each row-major tensor that its
rank holds (FSDP2: whole rows; ZeRO-3: any range), so no rank ever holds another rank's part,
and never more than one tensor beyond its own shard:

- `CheckpointWeights`: a Hugging Face checkpoint directory (one safetensors file, shards
  with an index, or legacy ``pytorch_model*.bin``). safetensors reads only the rows asked for;
  a tensor transformers converts on load (one MoE tensor stacked from a checkpoint tensor per
  expert) is made by transformers' own converters, an expert at a time (`harness.models.conversions`).
- `InitWeights`: a seeded random init that does not depend on the world size. Each module's
  tensors are generated whole, from a seed of their own (the run's seed and the module's
  name), by the model's own `_init_weights`, and each rank keeps its range: world 1 and
  world 2 start from the same weights bit for bit, and a rank's peak is one module's tensors.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from harness.distributed import WRAPPER_ATTRS
from harness.errors import ConfigError
from harness.log import get_logger
from harness.models.conversions import Conversions

log = get_logger(__name__)


class WeightSource(Protocol):
    def read(self, names: Sequence[str], shape: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        """Elements ``[start, end)`` of the flattened tensor known by any of `names` (1-D), or
        None when the source does not have it."""


def _flat_range(rows_slice, shape: Sequence[int], start: int, end: int) -> torch.Tensor:
    """Elements [start, end) of a row-major tensor, reading only the rows that hold them."""
    if len(shape) == 0:
        return rows_slice[...].reshape(-1)[start:end]
    row = 1
    for d in shape[1:]:
        row *= int(d)
    r0, r1 = start // row, -(-end // row)
    return rows_slice[r0:r1].reshape(-1)[start - r0 * row : end - r0 * row]


class CheckpointWeights:
    """A Hugging Face checkpoint directory, read lazily by tensor name.

    Names are the model's parameter names; a checkpoint saved from the base model (without
    the causal LM's prefix, e.g. ``model.`` or ``transformer.``) is matched too.
    """

    def __init__(self, directory: str, prefix: str = ""):
        self.directory = directory
        self.prefix = prefix + "." if prefix else ""
        self._where: dict[str, str] = {}
        self._conversions: Conversions | None = None  # transformers' renamings and converters (follow_conversions)
        self._handles: dict[str, object] = {}
        self._bins: dict[str, dict[str, torch.Tensor]] = {}
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = os.path.join(directory, index_name)
            if os.path.exists(index):
                with open(index) as f:
                    for key, file in json.load(f)["weight_map"].items():
                        self._where[key] = os.path.join(directory, file)
                return
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors"))) or sorted(
            glob.glob(os.path.join(directory, "pytorch_model*.bin"))
        )
        if not files:
            raise FileNotFoundError(f"{directory} holds no model.safetensors, safetensors shards or pytorch_model.bin")
        for file in files:
            for key in self._open(file).keys():
                self._where[key] = file

    def follow_conversions(self, template: nn.Module) -> None:
        """Read the checkpoint as transformers (5.x) loads it into `template` (the model on the meta
        device): keys it renames by the model's names, tensors it converts (per-expert MoE tensors
        stacked) made by its own converters, a piece at a time (`harness.models.conversions`)."""
        self._conversions = Conversions(template, list(self._where), self.directory)

    def _open(self, file: str):
        if file.endswith(".bin"):
            if file not in self._bins:  # memory-mapped: slicing reads only the pages asked for
                self._bins[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            return self._bins[file]
        if file not in self._handles:
            self._handles[file] = safe_open(file, framework="pt", device="cpu")
        return self._handles[file]

    def keys(self) -> set[str]:
        return set(self._where)

    def key_for(self, names: Sequence[str]) -> str | None:
        """The checkpoint key of the first of `names` stored as one tensor (under that name or the
        one transformers renames it from); None when none is (absent, or converted)."""
        renamed = self._conversions.renamed if self._conversions is not None else {}
        for name in names:
            for key in (name, name.removeprefix(self.prefix), self.prefix + name):
                if key in self._where:
                    return key
                if key in renamed:
                    return renamed[key]
        return None

    def read(self, names: Sequence[str], shape: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        key = self.key_for(names)
        if key is not None:
            sliced = self._slice(key)
            self._check_shape(key, sliced, shape)
            return _flat_range(sliced, shape, start, end)
        found = self._conversions.group_for(names, self.prefix) if self._conversions is not None else None
        if found is None:
            return None
        return self._conversions.read(*found, shape, start, end, self._whole)

    def _whole(self, key: str) -> torch.Tensor:
        sliced = self._slice(key)
        return sliced if isinstance(sliced, torch.Tensor) else sliced[...]

    def _slice(self, key: str):
        """The stored tensor, or safetensors' lazy slice of it (its shape read from the header)."""
        handle = self._open(self._where[key])
        return handle[key] if isinstance(handle, dict) else handle.get_slice(key)

    def _header_shape(self, key: str) -> tuple[int, ...]:
        sliced = self._slice(key)
        return tuple(sliced.shape) if isinstance(sliced, torch.Tensor) else tuple(sliced.get_shape())

    def _check_shape(self, key: str, sliced, shape: Sequence[int]) -> None:
        found = tuple(sliced.shape) if isinstance(sliced, torch.Tensor) else tuple(sliced.get_shape())
        if found != tuple(shape):
            raise ConfigError(
                f"{key} in {self.directory} has shape {list(found)}, the model expects {list(shape)}: its config.json "
                "describes another model than its weights; fix config.json or download the model again"
            )

    def check_shapes(self, template: nn.Module) -> None:
        """Every parameter of `template` (the model config.json builds, on the meta device) that the
        checkpoint holds has the checkpoint's shape: a config that disagrees with its weights is one
        line before any process group starts (headers only, no tensor is read). Converted tensors
        first: a checkpoint with another expert count says so, not the router's shape."""
        if self._conversions is not None:
            self._conversions.check_shapes(self._header_shape)
        for name, p in template.named_parameters(remove_duplicate=False):
            key = self.key_for([clean_name(name)])
            if key is not None:
                self._check_shape(key, self._slice(key), p.shape)


def module_seed(seed: int, module_name: str) -> int:
    """A seed of the module's own: the same on every rank and for every world size."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{module_name}".encode()).digest()[:8], "little") >> 1


class InitWeights:
    """Seeded random init by the model's own `_init_weights`, one module at a time.

    `template` is the model built on the meta device (`models.build.empty_model`): it gives
    each parameter's module, and that module is copied with real storage (its children left
    out) and initialised under `module_seed`. The module last generated is kept, so a module's
    weight and bias come from one generation.
    """

    def __init__(self, template: nn.Module, seed: int):
        self.template = template
        self.seed = seed
        self._modules = dict(template.named_modules())
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None

    def _generate(self, module_name: str) -> dict[str, torch.Tensor]:
        if self._cached is not None and self._cached[0] == module_name:
            return self._cached[1]
        self._cached = None  # one module's tensors alive at a time
        module = self._modules[module_name]
        scratch = copy.copy(module)
        scratch._modules = {}
        scratch._parameters = {
            k: None if p is None else nn.Parameter(torch.empty(p.shape, dtype=torch.float32)) for k, p in module._parameters.items()
        }
        scratch._buffers = dict(module._buffers)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(module_seed(self.seed, module_name))
            for p in scratch._parameters.values():  # what a module outside `_init_weights`' cases gets
                if p is not None:
                    nn.init.normal_(p, std=0.02)
            self.template._init_weights(scratch)
        out = {k: p.detach() for k, p in scratch._parameters.items() if p is not None}
        self._cached = (module_name, out)
        return out

    def read(self, names: Sequence[str], shape: Sequence[int], start: int, end: int) -> torch.Tensor | None:
        module_name, _, attr = names[0].rpartition(".")
        tensor = self._generate(module_name).get(attr)
        return None if tensor is None else tensor.reshape(-1)[start:end]


# A writable 1-D view of the part of a parameter this rank holds, as (full shape, flat start,
# flat end, view); engines that shard supply their own (`harness.engine.storage.local_part`).
Part = tuple[Sequence[int], int, int, torch.Tensor]


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' segments (the checkpoint's names have none)."""
    for attr in WRAPPER_ATTRS:
        name = name.replace(attr + ".", "")
    return name


def strip_base_layer(name: str) -> str:
    """`name` with peft's wrapper segments dropped: what the parameter is called in the model
    without adapters (a stacked expert tensor adapted twice sits under two `base_layer`s)."""
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name)


def whole_part(p: torch.Tensor) -> Part:
    return tuple(p.shape), 0, p.numel(), p.data.view(-1)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> nn.Module:
    """Uninitialised storage on `device` (in `dtype`) for the meta parameters, buffers keeping
    their values. Under FSDP2 each rank allocates only its shards."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    if dtype is not None:
        model.to(dtype=dtype)  # meta parameters: free; buffers cast as `.to` always did
    model.to_empty(device=device)
    for shared in (o for o in owners.values() if len(o) > 1):  # `to_empty` gives each owner its own copy
        first = getattr(*shared[0])
        for module, attr in shared[1:]:
            if getattr(module, attr) is not first:
                setattr(module, attr, first)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in saved:
                b.copy_(saved[name])
    return model


@torch.no_grad()
def fill(model: nn.Module, source: WeightSource, *, part_of=whole_part, fallback: WeightSource | None = None) -> list[str]:
    """Write every parameter's local part from `source` (a tensor at a time); persistent buffers
    the checkpoint holds too. Parameters the source lacks come from `fallback` and are returned
    (and logged), as transformers does for a checkpoint without, say, its LM head."""
    names_of: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # a tied weight: all its names
        names_of.setdefault(id(p), []).append(clean_name(name))
        params[id(p)] = p
    missing: list[str] = []
    for key, p in params.items():
        shape, start, end, local = part_of(p)
        if end <= start:
            continue
        piece = source.read(names_of[key], shape, start, end)
        if piece is None and fallback is not None:
            missing.append(names_of[key][0])
            piece = fallback.read(names_of[key], shape, start, end)
        if piece is None:
            raise KeyError(f"no weights for {names_of[key][0]}")
        local.copy_(piece)
    if isinstance(source, CheckpointWeights):
        for name, b in model.named_buffers():
            piece = source.read([clean_name(name)], tuple(b.shape), 0, b.numel())
            if piece is not None:
                b.view(-1).copy_(piece)
    if missing:
        log.warning(
            f"{len(missing)} weights are not in the checkpoint and start from random init: {', '.join(missing[:6])}"
            + (" ..." if len(missing) > 6 else "")
        )
    return missing
