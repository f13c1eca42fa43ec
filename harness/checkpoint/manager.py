"""Checkpoints: save every N steps and at the end, resume exactly, at any world size.

Each engine keeps its own format (`Engine.save_state`/`load_state`), so nothing is
reinvented and nothing gathers the full state on one rank, and this module never asks
which engine it has. Around the engine's state we add what the engines do not know: the step (which *is* the data
position, see `harness.data.BatchSampler`), trainer counters, RNG states per rank, pruning
masks, the resolved run config, and the HF config + tokenizer so a checkpoint exports to
a Hugging Face directory on its own.

Layout, under `<output_dir>/checkpoints/`:

    step_00000004/           a complete checkpoint (meta.json is written last)
      meta.json              step, world size, engine, global batch, run config
      trainer_state.pt       scheduler / grad-scaler state and trainer counters (rank 0)
      rng/rank00000.pt       every rank's RNG states
      data/rank00000.pt      every rank's position in a streamed dataset (data.streaming only)
      masks/rank00000.pt     pruning masks, when the pruning stage handed us some
      dcp/ | ds/             the engine's own checkpoint
      hf_config/             HF config.json and tokenizer files (for export)
    latest                   the name of the newest complete checkpoint

Atomicity: a save goes into `.tmp-step_…`, is renamed into place once every rank has
written and synced, and only then does `latest` move (write-to-temp + `os.replace`). A
process killed at any moment therefore leaves `latest` naming a complete checkpoint; the
half-written temp directory is removed by the next run. Old checkpoints are renamed to
`.trash-…` before deletion so that a kill mid-delete never leaves a partial `step_…`.

Resuming at another world size is the engine's business: DCP reshards on load; DeepSpeed
converts once to its universal checkpoint (see `harness.engine`).
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.api import CheckpointException

from harness.checkpoint.export import export_hf
from harness.checkpoint.layout import (
    LATEST,
    META,
    CheckpointMeta,
    adapter_dir,
    check_compatible,
    checkpoint_root,
    complete_checkpoints,
    file_sizes,
    fsync_dir,
    later_checkpoints,
    read_file,
    remove_tree,
    resume_path,
    step_name,
    unreadable_as_checkpoint_error,
    verified_meta,
    write_json_atomic,
    write_text_atomic,
)
from harness.checkpoint.outdir import is_harness_export
from harness.config import RunConfig, Strategy, config_to_dict
from harness.distributed import Collectives, DistInfo
from harness.engine import Engine, weights_finite
from harness.errors import CheckpointError
from harness.faults import fault_seconds, fault_step, hold
from harness.log import get_logger

log = get_logger(__name__)


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


class CheckpointManager:
    """Saves and restores one run's checkpoints; every method is called on every rank.

    Pruning masks, once a stage registers them (`register_masks`), are saved per rank with
    every later checkpoint.
    """

    def __init__(
        self,
        cfg: RunConfig,
        strategy: Strategy,
        info: DistInfo,
        engine: Engine,
        tokenizer_dir: str | None = None,
        per_rank: dict[str, Any] | None = None,
    ):
        self.cfg, self.strategy, self.info, self.engine = cfg, strategy, info, engine
        self.comm = Collectives()  # agreeing on a failed save
        # Other stateful objects whose state differs per rank (a streamed data position): saved as
        # <name>/rank<r>.pt when they have a state_dict, restored into them on resume.
        self.per_rank = {name: obj for name, obj in (per_rank or {}).items() if hasattr(obj, "state_dict")}
        self.tokenizer_dir = tokenizer_dir
        self.root = checkpoint_root(cfg.output_dir)
        self.every = cfg.checkpoint.every
        self.keep = max(1, cfg.checkpoint.keep)
        self._masks: Any = None  # `register_masks`: a Stateful whose state_dict() is name -> this rank's mask
        self._masks_sharded = False
        self._kept_experts: dict[str, list[int]] = {}
        self.last_path: str | None = None  # the newest complete checkpoint of this run
        self.last_step: int | None = None
        self.preempted = False
        self._rebased: bool | None = None  # optim.lr changed on resume: rebased (True) or kept by the file's scheduler (False)
        if info.is_main:
            self._clean_root()
        self._barrier()

    # --------------------------------------------------------------- public API
    def register_masks(self, masks: Any, sharded: bool) -> None:
        """Later checkpoints carry `masks` (a Stateful: `state_dict()` -> name -> this rank's mask
        tensor), as the sampler's position is carried; `sharded`: each rank holds a different
        piece, restorable at the same world size only. The newest checkpoint, if any, predates
        them (the weights changed in place): the end-of-run save is written again."""
        self._masks, self._masks_sharded = masks, sharded
        self.last_step = None

    def register_kept_experts(self, kept: dict[str, list[int]]) -> None:
        """Later checkpoints name the experts expert pruning kept (MoE block -> indices); their
        export writes the smaller model. The end-of-run save is written again."""
        self._kept_experts = kept
        self.last_step = None

    @property
    def final_save(self) -> bool:
        c = self.cfg.checkpoint
        # A LoRA run always ends with its checkpoint (adapters and their optimizer state: small): its adapter directory is written from it.
        return c.save_final or c.every > 0 or c.export_hf or self.cfg.lora.enabled

    def restore(self) -> ResumeState:
        """Load the checkpoint `checkpoint.resume` names (if any) into the engine; return where to continue."""
        path = resume_path(self.cfg.checkpoint, self.cfg.output_dir)
        if path is None:
            if self.cfg.checkpoint.resume == "auto" and self.info.is_main:
                log.info(f"checkpoint.resume=auto: no checkpoint in {self.root}; starting at step 0")
            return ResumeState()
        meta = verified_meta(path)
        if meta.kept_experts:
            raise CheckpointError(
                f"{path} holds a model whose experts were pruned (its export drops them); export it "
                f"(python -m harness.export {path} --out <dir>) and train the exported model: model.name=<dir>, checkpoint.resume=none"
            )
        check_compatible(meta, path, self.cfg, self.strategy, self.engine.plan.layout)
        t0 = time.perf_counter()
        with unreadable_as_checkpoint_error(path):
            trainer = self._load_states(path, meta)
            masks = self._load_masks(path, meta)
        self.last_path, self.last_step = path, meta.step
        self._rebased = self._rebase_lr(meta)
        if self.info.is_main:
            self._drop_later_than(meta.step, path)
        self._barrier()
        if self.info.is_main:
            how = (
                ""
                if meta.world_size == self.info.world_size
                else f" (saved at world size {meta.world_size}, resharded to {self.info.world_size})"
            )
            log.info(f"resumed from {path} at step {meta.step}{how} in {time.perf_counter() - t0:.1f}s")
            self._announce_lr(meta)
            if meta.config.get("steps") != self.cfg.steps:
                log.info(
                    f"note: steps changed from {meta.config.get('steps')} to {self.cfg.steps}; the LR schedule "
                    "follows the new total from the next step"
                )
        return ResumeState(step=meta.step, counters=dict(trainer.get("counters", {})), masks=masks, path=path)

    def _rebase_lr(self, meta: CheckpointMeta) -> bool | None:
        """optim.lr changed since the checkpoint (what the non-finite stop advises): the schedule's
        restored state holds the old rate; honour the new one. None: unchanged."""
        saved = meta.config.get("optim", {}).get("lr")
        if saved is None or float(saved) == float(self.cfg.optim.lr):
            return None
        return self.engine.rebase_lr(self.cfg.optim.lr)

    def _announce_lr(self, meta: CheckpointMeta) -> None:
        saved = meta.config.get("optim", {}).get("lr")
        if self._rebased:
            log.warning(
                f"optim.lr changed from {saved} to {self.cfg.optim.lr}: the schedule continues from step {meta.step} at the new "
                f"rate (lr now {self.engine.lr:.3g})"
            )
        elif self._rebased is False:
            log.warning(
                f"optim.lr changed from {saved} to {self.cfg.optim.lr}, but the strategy file's own scheduler keeps its rate "
                "(set its warmup_max_lr to change it)"
            )

    def _load_states(self, path: str, meta: CheckpointMeta) -> dict[str, Any]:
        """The engine's state, the trainer state, this rank's RNG and per-rank objects from `path`."""
        self.engine.load_state(path, meta.world_size, self.info.is_main)
        trainer = read_file(os.path.join(path, "trainer_state.pt"))
        self.engine.load_trainer_state(trainer)
        rng_file = os.path.join(path, "rng", f"rank{self.info.rank:05d}.pt")
        if not os.path.isfile(rng_file):  # more ranks than the saving run: continue from rank 0's streams
            rng_file = os.path.join(path, "rng", "rank00000.pt")
        set_rng_state(read_file(rng_file))
        for name, obj in self.per_rank.items():
            state_file = os.path.join(path, name, f"rank{self.info.rank:05d}.pt")
            if not os.path.isfile(state_file):
                raise CheckpointError(
                    f"{path} has no {name} state for rank {self.info.rank} (saved at world size {meta.world_size}); "
                    f"resume at that world size"
                )
            obj.load_state_dict(read_file(state_file))
        return trainer

    def after_step(self, step: int, counters: dict[str, Any] | None = None, stop: bool = False) -> bool:
        """Save when `step` is due (every N) or a stop was requested; True: the run must stop now (saved)."""
        if stop:
            self.save(step, counters)
            self.preempted = True
            log.info(f"stop requested (SIGTERM/SIGUSR1/Ctrl-C): saved {self.last_path}; exiting so the job can requeue")
            return True
        if self.every > 0 and step % self.every == 0:
            self.save(step, counters)
        return False

    def ensure_saved(self, step: int, counters: dict[str, Any] | None = None) -> None:
        """Save `step` unless it is already the newest checkpoint, where the run saves at all: before
        a long stage that changes the weights in place (pruning), so a stop or crash in it loses
        no training."""
        if self.final_save and self.last_step != step:
            self.save(step, counters)

    def finish(self, step: int, counters: dict[str, Any] | None = None) -> None:
        """The end-of-run save (if configured) and the HF export (if `checkpoint.export_hf`)."""
        if not self.final_save:
            return
        if self.last_step != step:
            self.save(step, counters)
        exports = []  # (directory, merged): where HF Trainer / axolotl users look for the result
        if self.cfg.lora.enabled:
            exports.append((adapter_dir(self.cfg.output_dir), False))
        if self.cfg.checkpoint.export_hf:
            exports.append((os.path.join(self.cfg.output_dir, "hf"), self.cfg.lora.enabled))
        if self.last_path and self.info.is_main:
            for out, merged in exports:
                earlier = is_harness_export(out)
                export_hf(self.last_path, out, merged=merged, overwrite=True)  # pre-flight refused a directory that is not harness's export
                what = "PEFT adapter" if self.cfg.lora.enabled and not merged else "safetensors + config + tokenizer"
                log.info(f"exported {self.last_path} to {out} ({what}{'; replaced the earlier export there' if earlier else ''})")
        if exports:
            self._barrier()

    def result_line(self) -> str:
        """Where the trained model is, in the form a user loads it (the run's last line)."""
        out = os.path.abspath(self.cfg.output_dir)
        if self.cfg.lora.enabled and self.last_path:
            return f"adapter in {adapter_dir(out)} (PeftModel.from_pretrained(base, it))"
        if self.cfg.checkpoint.export_hf and self.last_path:
            return f"HF model in {os.path.join(out, 'hf')}"
        if self.last_path:
            return f"HF model: python -m harness.export {self.last_path} --out {os.path.join(out, 'hf')}"
        return "no checkpoint saved: set checkpoint.export_hf=true (or checkpoint.save_final=true) to keep the model"

    def save(self, step: int, counters: dict[str, Any] | None = None) -> str:
        """Write a complete checkpoint of `step` atomically; refuse (CheckpointError) if any weight is non-finite."""
        if not weights_finite(self.engine, self.comm):
            raise CheckpointError(
                f"refusing to write a checkpoint at step {step}: the weights are not finite; "
                f"the last good checkpoint is {self.last_path or 'none'}"
            )
        t0 = time.perf_counter()
        final = os.path.join(self.root, step_name(step))
        tmp = os.path.join(self.root, f".tmp-{step_name(step)}")
        self._collectively(step, tmp, lambda: self._prepare(tmp) if self.info.is_main else None)
        self._collectively(step, tmp, lambda: self._write(tmp, step, counters))
        self._collectively(step, tmp, lambda: self._commit(tmp, final, step) if self.info.is_main else None)
        self.last_path, self.last_step = final, step
        log.info(f"saved checkpoint {final} ({time.perf_counter() - t0:.1f}s)")
        return final

    def _prepare(self, tmp: str) -> None:
        os.makedirs(self.root, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        for sub in ("rng", *self.per_rank, *(("masks",) if self._masks is not None else ())):
            os.makedirs(os.path.join(tmp, sub))

    def _write(self, tmp: str, step: int, counters: dict[str, Any] | None) -> None:
        """This rank's part of the checkpoint (the engine's state is written collectively)."""
        self.engine.save_state(tmp)
        if fault_step("save_error", self.info.rank) == step:  # fault injection (tests): a full disk
            raise OSError(errno.ENOSPC, f"No space left on device (injected by HARNESS_FAULT=save_error@{step})")
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank{self.info.rank:05d}.pt"))
        for name, obj in self.per_rank.items():
            torch.save(obj.state_dict(), os.path.join(tmp, name, f"rank{self.info.rank:05d}.pt"))
        if self._masks is not None:
            state = {k: v.detach().cpu() for k, v in self._masks.state_dict().items()}
            torch.save(state, os.path.join(tmp, "masks", f"rank{self.info.rank:05d}.pt"))
        if self.info.is_main:
            torch.save({**self.engine.trainer_state(), "counters": dict(counters or {})}, os.path.join(tmp, "trainer_state.pt"))
            self._write_hf_files(os.path.join(tmp, "hf_config"))
        os.sync()  # this rank's writes reach the disk before the checkpoint is declared complete

    def _collectively(self, step: int, tmp: str, work: Callable[[], None]) -> None:
        """Run this rank's part of a save, then agree with every rank (in place of a barrier): if
        any rank could not write (a full disk, a permission, a quota), all raise CheckpointError,
        the partial save is removed and `latest` still names the last complete checkpoint."""
        why = ""
        try:
            work()
        except (OSError, RuntimeError, CheckpointException) as exc:  # torch.save and DCP report write failures so
            why = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
        if not self.comm.any([bool(why)])[0]:
            return
        reasons = self.comm.gather_object(why)
        rank, reason = next((r, w) for r, w in enumerate(reasons) if w)
        if self.info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        where = f"rank {rank}: " if len(reasons) > 1 else ""
        raise CheckpointError(
            f"could not write the checkpoint of step {step} ({where}{reason}); the partial save was removed and the last complete "
            f"checkpoint is {self.last_path or 'none'} (`latest` unchanged); free space or fix permissions, then resume with "
            "checkpoint.resume=auto"
        )

    # --------------------------------------------------------------- internals
    def _barrier(self) -> None:
        self.comm.barrier()

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
                log.info(f"checkpoint.overwrite=true: deleting {len(old)} checkpoint(s) of an earlier run in {self.root}")
            for name in os.listdir(self.root):
                if name.startswith("step_") or name == LATEST:
                    path = os.path.join(self.root, name)
                    remove_tree(path) if os.path.isdir(path) else os.remove(path)

    def _drop_later_than(self, step: int, resumed: str) -> None:
        """Resuming this run from an older checkpoint abandons the later ones. Pre-flight refuses
        that unless checkpoint.overwrite=true (`later_checkpoints`); then they are removed, each
        named, so that `latest` and the keep-k rule never mix two timelines."""
        for path in later_checkpoints(self.root, step, resumed):
            log.warning(f"checkpoint.overwrite=true: removing {path} (resuming from step {step} abandons it)")
            remove_tree(path)

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
            step=step,
            world_size=self.info.world_size,
            engine=self.engine.checkpoint_format,
            kind=self.engine.kind,
            strategy=self.strategy.name,
            zero_stage=self.engine.zero_stage,
            global_batch=self.engine.plan.layout.global_batch(cfg.micro_batch_size, cfg.grad_accum),
            model=cfg.model.name,
            precision=cfg.precision,
            config=config_to_dict(cfg),
            masks="none" if self._masks is None else ("sharded" if self._masks_sharded else "replicated"),
            kept_experts=self._kept_experts,
        )

    def _commit(self, tmp: str, final: str, step: int) -> None:
        """Rank 0, after every rank wrote: meta.json, rename, then `latest`, then prune to `keep`."""
        meta = self._meta(step)
        meta.files = file_sizes(tmp)  # the manifest: a resume or export names a file lost or truncated since
        write_json_atomic(os.path.join(tmp, META), asdict(meta))
        fsync_dir(tmp)
        pause = fault_seconds("save_pause", step)
        if pause:  # fault injection (tests): a window in which the save is written but not yet committed
            log.info(f"fault injection: pausing {pause:g}s before committing {final}")
            hold(pause)
        if os.path.exists(final):  # the same step saved again (e.g. a rerun of a finished run)
            remove_tree(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        write_text_atomic(os.path.join(self.root, LATEST), os.path.basename(final))
        fsync_dir(self.root)
        for _, path in complete_checkpoints(self.root)[: -self.keep]:
            if os.path.abspath(path) != os.path.abspath(final):
                remove_tree(path)

    def _load_masks(self, path: str, meta: CheckpointMeta) -> dict[str, torch.Tensor] | None:
        if meta.masks == "none":
            return None
        rank = self.info.rank
        if meta.world_size != self.info.world_size:
            if meta.masks == "sharded":
                raise CheckpointError(f"the pruning masks in {path} are sharded over {meta.world_size} ranks; resume at that world size")
            rank = 0
        return read_file(os.path.join(path, "masks", f"rank{rank:05d}.pt"), weights_only=True)
