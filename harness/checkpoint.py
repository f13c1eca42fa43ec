"""Checkpoints: save every N steps and at the end, resume exactly, at any world size.

Each engine keeps its own format, so nothing is reinvented and nothing gathers the full
state on one rank: DeepSpeed writes its sharded checkpoint (`save_checkpoint`, one
optimizer partition per rank), the torch engines (single, DDP, FSDP2) write a
`torch.distributed.checkpoint` (DCP) directory in which every rank writes only its own
shards. Around that we add what the engines do not know: the step (which *is* the data
position, see `harness.data.BatchSampler`), trainer counters, RNG states per rank, pruning
masks, the resolved run config, and the HF config + tokenizer so a checkpoint exports to
a Hugging Face directory on its own.

Layout, under `<output_dir>/checkpoints/`:

    step_00000004/           a complete checkpoint (meta.json is written last)
      meta.json              step, world size, engine, global batch, run config
      trainer_state.pt       scheduler / grad-scaler state and trainer counters (rank 0)
      rng/rank00000.pt       every rank's RNG states
      masks/rank00000.pt     pruning masks, when the pruning stage handed us some
      dcp/ | ds/             the engine's own checkpoint
      hf_config/             HF config.json and tokenizer files (for export)
    latest                   the name of the newest complete checkpoint

Atomicity: a save goes into `.tmp-step_…`, is renamed into place once every rank has
written and synced, and only then does `latest` move (write-to-temp + `os.replace`). A
process killed at any moment therefore leaves `latest` naming a complete checkpoint; the
half-written temp directory is removed by the next run. Old checkpoints are renamed to
`.trash-…` before deletion so that a kill mid-delete never leaves a partial `step_…`.

Resuming at another world size: DCP reshards on load (FSDP2 ⇄ single/DDP, 2 ⇄ 1 ranks);
for ZeRO, DeepSpeed cannot repartition its optimizer state directly, so the checkpoint
is converted once with DeepSpeed's universal-checkpoint tool (`ds_to_universal`) and
loaded with `load_universal`.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from harness.checkpoint_files import (
    DS_TAG, DS_UNIVERSAL, LATEST, META, CheckpointError, CheckpointMeta, fsync_dir, write_json_atomic, write_text_atomic,
    check_compatible, checkpoint_root, complete_checkpoints, engine_family, latest_checkpoint, read_meta, remove_tree,
    resolve_checkpoint_path, resume_path, step_name,
)
from harness.config import RunConfig, config_to_dict
from harness.distributed import DistInfo
from harness.failures import fault_seconds, weights_finite
from harness.strategies import Strategy

# Re-exported: callers (pre-flight, export, tests) use these through harness.checkpoint too.
__all__ = [
    "CheckpointError", "CheckpointManager", "CheckpointMeta", "ResumeState", "check_compatible", "checkpoint_root",
    "complete_checkpoints", "latest_checkpoint", "read_meta", "resolve_checkpoint_path", "resume_path",
]


@dataclass
class ResumeState:
    """What the training loop needs from a restored checkpoint (step 0 when starting fresh)."""

    step: int = 0
    counters: dict[str, Any] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] | None = None
    path: str | None = None


# ------------------------------------------------------------------ RNG


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------ engine states


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process; that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _torch_state(engine: Any) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter FQN: DTensor shards under FSDP2, so DCP reshards."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        optim_sd = get_optimizer_state_dict(engine.model, optimizer)
    else:  # optimizer-in-backward: already FQN-keyed through DCP's helpers
        optim_sd = optimizer.state_dict()
    return {"model": get_model_state_dict(engine.model), "optim": optim_sd}


def _load_torch_state(engine: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = _torch_state(engine)  # the targets: this run's shapes and placements
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=path, no_dist=not (dist.is_available() and dist.is_initialized()))
    set_model_state_dict(engine.model, state["model"])
    optimizer = engine.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        set_optimizer_state_dict(engine.model, optimizer, state["optim"])
    else:
        optimizer.load_state_dict(state["optim"])


def _small_state(engine: Any) -> dict[str, Any]:
    """Scheduler and grad-scaler states (identical on every rank; DeepSpeed saves its own)."""
    out: dict[str, Any] = {}
    if engine.kind != "deepspeed":
        out["scheduler"] = engine.scheduler.state_dict()
        if getattr(engine, "scaler", None) is not None:
            out["scaler"] = engine.scaler.state_dict()
    return out


def _load_small_state(engine: Any, state: dict[str, Any]) -> None:
    if engine.kind != "deepspeed":
        engine.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None and getattr(engine, "scaler", None) is not None:
            engine.scaler.load_state_dict(state["scaler"])


def convert_to_universal(ds_dir: str, out_dir: str) -> None:
    """DeepSpeed's universal-checkpoint conversion (one process): lets ZeRO state load at any world size."""
    from argparse import Namespace

    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = f"{out_dir}.tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    args = Namespace(input_folder=os.path.join(ds_dir, DS_TAG), output_folder=os.path.join(tmp, DS_TAG),
                     num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                     inject_missing_state=False)
    ds_to_universal(args)
    os.replace(tmp, out_dir)


# ------------------------------------------------------------------ the manager


class CheckpointManager:
    """Saves and restores one run's checkpoints; every method is called on every rank.

    `masks` (optional): a dict of tensors the pruning stage sets; saved per rank. Set
    `masks_sharded=True` when each rank holds a different piece (then they only restore
    at the same world size).
    """

    def __init__(self, cfg: RunConfig, strategy: Strategy, info: DistInfo, engine: Any, tokenizer_dir: str | None = None):
        self.cfg, self.strategy, self.info, self.engine = cfg, strategy, info, engine
        self.tokenizer_dir = tokenizer_dir
        self.root = checkpoint_root(cfg.output_dir)
        self.every = cfg.checkpoint.every
        self.keep = max(1, cfg.checkpoint.keep)
        self.masks: dict[str, torch.Tensor] | None = None
        self.masks_sharded = False
        self.last_path: str | None = None  # the newest complete checkpoint of this run
        self.last_step: int | None = None
        self.preempted = False
        if info.is_main:
            self._clean_root()
        self._barrier()

    # --------------------------------------------------------------- public API
    @property
    def final_save(self) -> bool:
        c = self.cfg.checkpoint
        return c.save_final or c.every > 0 or c.export_hf

    def restore(self) -> ResumeState:
        """Load the checkpoint `checkpoint.resume` names (if any) into the engine; return where to continue."""
        path = resume_path(self.cfg)
        if path is None:
            if self.cfg.checkpoint.resume == "auto" and self.info.is_main:
                print(f"[harness] checkpoint.resume=auto: no checkpoint in {self.root}; starting at step 0", flush=True)
            return ResumeState()
        meta = read_meta(path)
        check_compatible(meta, path, self.cfg, self.strategy, self.info.world_size)
        t0 = time.perf_counter()
        if meta.engine == "deepspeed":
            self._load_deepspeed(path, meta)
        else:
            _load_torch_state(self.engine, os.path.join(path, "dcp"))
        trainer = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=False)
        _load_small_state(self.engine, trainer)
        if hasattr(self.engine, "checkpoint_loaded"):
            self.engine.checkpoint_loaded()
        rng_file = os.path.join(path, "rng", f"rank{self.info.rank:05d}.pt")
        if not os.path.isfile(rng_file):  # more ranks than the saving run: continue from rank 0's streams
            rng_file = os.path.join(path, "rng", "rank00000.pt")
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
        masks = self._load_masks(path, meta)
        self.last_path, self.last_step = path, meta.step
        if self.info.is_main:
            self._drop_later_than(meta.step, path)
        self._barrier()
        if self.info.is_main:
            how = "" if meta.world_size == self.info.world_size else f" (saved at world size {meta.world_size}, resharded to {self.info.world_size})"
            print(f"[harness] resumed from {path} at step {meta.step}{how} in {time.perf_counter() - t0:.1f}s", flush=True)
            if meta.config.get("steps") != self.cfg.steps:
                print(f"[harness] note: steps changed from {meta.config.get('steps')} to {self.cfg.steps}; the LR schedule "
                      "follows the new total from the next step", flush=True)
        return ResumeState(step=meta.step, counters=dict(trainer.get("counters", {})), masks=masks, path=path)

    def after_step(self, step: int, counters: dict[str, Any] | None = None, stop: bool = False) -> bool:
        """Save when `step` is due (every N) or a stop was requested; True: the run must stop now (saved)."""
        if stop:
            self.save(step, counters)
            self.preempted = True
            if self.info.is_main:
                print(f"[harness] stop requested (SIGTERM/SIGUSR1): saved {self.last_path}; exiting so the job can requeue", flush=True)
            return True
        if self.every > 0 and step % self.every == 0:
            self.save(step, counters)
        return False

    def finish(self, step: int, counters: dict[str, Any] | None = None) -> None:
        """The end-of-run save (if configured) and the HF export (if `checkpoint.export_hf`)."""
        if not self.final_save:
            return
        if self.last_step != step:
            self.save(step, counters)
        if self.cfg.checkpoint.export_hf and self.last_path:
            out = os.path.join(self.cfg.output_dir, "hf")
            if self.info.is_main:
                from harness.export import export_hf

                export_hf(self.last_path, out)
                print(f"[harness] exported {self.last_path} to {out} (safetensors + config + tokenizer)", flush=True)
            self._barrier()

    def save(self, step: int, counters: dict[str, Any] | None = None) -> str:
        """Write a complete checkpoint of `step` atomically; refuse (CheckpointError) if any weight is non-finite."""
        if not weights_finite(self.engine, self.info):
            raise CheckpointError(
                f"refusing to write a checkpoint at step {step}: the weights are not finite; "
                f"the last good checkpoint is {self.last_path or 'none'}"
            )
        t0 = time.perf_counter()
        final = os.path.join(self.root, step_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_name(step)}")
        if self.info.is_main:
            os.makedirs(self.root, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            for sub in ("rng", "masks") if self.masks is not None else ("rng",):
                os.makedirs(os.path.join(tmp, sub))
        self._barrier()
        self._write_engine_state(tmp)
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{self.info.rank:05d}.pt"))
        if self.masks is not None:
            torch.save({k: v.detach().cpu() for k, v in self.masks.items()}, os.path.join(tmp, "masks", f"rank{self.info.rank:05d}.pt"))
        if self.info.is_main:
            torch.save({**_small_state(self.engine), "counters": dict(counters or {})}, os.path.join(tmp, "trainer_state.pt"))
            self._write_hf_files(os.path.join(tmp, "hf_config"))
        os.sync()  # this rank's writes reach the disk before the checkpoint is declared complete
        self._barrier()
        if self.info.is_main:
            self._commit(tmp, final, step)
        self._barrier()
        self.last_path, self.last_step = final, step
        if self.info.is_main:
            print(f"[harness] saved checkpoint {final} ({time.perf_counter() - t0:.1f}s)", flush=True)
        return final

    # --------------------------------------------------------------- internals
    def _barrier(self) -> None:
        if self.info.distributed and dist.is_initialized():
            dist.barrier()

    def _clean_root(self) -> None:
        """Remove leftovers of killed saves; with checkpoint.overwrite, an earlier run's checkpoints."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            if name.startswith((".tmp-", ".trash-")):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        c = self.cfg.checkpoint
        if c.overwrite and c.resume == "none":
            old = complete_checkpoints(self.root)
            if old:
                print(f"[harness] checkpoint.overwrite=true: deleting {len(old)} checkpoint(s) of an earlier run in {self.root}", flush=True)
            for name in os.listdir(self.root):
                if name.startswith("step_") or name == LATEST:
                    path = os.path.join(self.root, name)
                    remove_tree(path) if os.path.isdir(path) else os.remove(path)

    def _drop_later_than(self, step: int, resumed: str) -> None:
        """Resuming this run from an older checkpoint abandons the later ones: remove them, so that
        `latest` and the keep-k rule never mix two timelines."""
        if not os.path.abspath(resumed).startswith(os.path.abspath(self.root) + os.sep):
            return
        for later_step, path in complete_checkpoints(self.root):
            if later_step > step:
                print(f"[harness] removing {path}: resuming from step {step} abandons it", flush=True)
                remove_tree(path)

    def _write_engine_state(self, tmp: str) -> None:
        if self.engine.kind == "deepspeed":
            # DeepSpeed's own sharded format: each rank writes its optimizer partition. The universal-
            # checkpoint info declares a plain data-parallel model (no tensor/pipeline-parallel patterns),
            # which DeepSpeed's converter needs to repartition the state for another world size.
            from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, UNIVERSAL_CHECKPOINT_VERSION_VALUE

            client = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
            self.engine.ds.save_checkpoint(os.path.join(tmp, "ds"), tag=DS_TAG, client_state=client, save_latest=False)
        else:
            import torch.distributed.checkpoint as dcp

            with _quiet_dcp():
                dcp.save(_torch_state(self.engine), checkpoint_id=os.path.join(tmp, "dcp"), no_dist=not self.info.distributed)

    def _write_hf_files(self, directory: str) -> None:
        """The HF config and tokenizer next to the weights, so export needs nothing else."""
        os.makedirs(directory, exist_ok=True)
        config = getattr(self.engine.module, "config", None)
        if config is not None:
            config.save_pretrained(directory)
        if self.tokenizer_dir and os.path.isdir(self.tokenizer_dir):
            for name in os.listdir(self.tokenizer_dir):
                src = os.path.join(self.tokenizer_dir, name)
                if os.path.isfile(src) and name != "config.json":
                    shutil.copy2(src, os.path.join(directory, name))

    def _meta(self, step: int) -> CheckpointMeta:
        cfg = self.cfg
        return CheckpointMeta(
            step=step, world_size=self.info.world_size, engine=engine_family(self.engine.kind), kind=self.engine.kind,
            strategy=self.strategy.name, zero_stage=self.strategy.zero_stage if self.engine.kind == "deepspeed" else 0,
            global_batch=cfg.micro_batch_size * cfg.grad_accum * self.info.world_size, model=cfg.model.name,
            precision=cfg.precision, config=config_to_dict(cfg),
            masks="none" if self.masks is None else ("sharded" if self.masks_sharded else "replicated"),
        )

    def _commit(self, tmp: str, final: str, step: int) -> None:
        """Rank 0, after every rank wrote: meta.json, rename, then `latest`, then prune to `keep`."""
        write_json_atomic(os.path.join(tmp, META), asdict(self._meta(step)))
        fsync_dir(tmp)
        pause = fault_seconds("save_pause", step)
        if pause:  # fault injection (tests): a window in which the save is written but not yet committed
            print(f"[harness] fault injection: pausing {pause:g}s before committing {final}", flush=True)
            time.sleep(pause)
        if os.path.exists(final):  # the same step saved again (e.g. a rerun of a finished run)
            remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(os.path.join(self.root, LATEST), os.path.basename(final))
        fsync_dir(self.root)
        for _, path in complete_checkpoints(self.root)[: -self.keep]:
            if os.path.abspath(path) != os.path.abspath(final):
                remove_tree(path)

    def _load_deepspeed(self, path: str, meta: CheckpointMeta) -> None:
        ds = self.engine.ds
        if meta.world_size == self.info.world_size:
            loaded, _ = ds.load_checkpoint(os.path.join(path, "ds"), tag=DS_TAG)
        else:
            universal = os.path.join(path, DS_UNIVERSAL)
            if self.info.is_main and not os.path.isdir(universal):
                print(f"[harness] converting {path} to a DeepSpeed universal checkpoint (world size {meta.world_size} -> "
                      f"{self.info.world_size})", flush=True)
                convert_to_universal(os.path.join(path, "ds"), universal)
            self._barrier()
            ds._config.load_universal_checkpoint = True  # read by load_checkpoint only
            try:
                loaded, _ = ds.load_checkpoint(universal, tag=DS_TAG)
            finally:
                ds._config.load_universal_checkpoint = False
        if loaded is None:
            raise CheckpointError(f"DeepSpeed could not load the checkpoint in {path}")

    def _load_masks(self, path: str, meta: CheckpointMeta) -> dict[str, torch.Tensor] | None:
        if meta.masks == "none":
            return None
        rank = self.info.rank
        if meta.world_size != self.info.world_size:
            if meta.masks == "sharded":
                raise CheckpointError(f"the pruning masks in {path} are sharded over {meta.world_size} ranks; resume at that world size")
            rank = 0
        return torch.load(os.path.join(path, "masks", f"rank{rank:05d}.pt"), map_location="cpu", weights_only=True)
