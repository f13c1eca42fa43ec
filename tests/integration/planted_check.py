"""`harness/train.py` with one bug planted (`HARNESS_TEST_PLANT`), for the check's tests: each bug
is one that leaves a run training without an error, and the check must name it.

- `unreduced`: DDP never all-reduces the gradients (every rank steps on its own half of the batch, or, under
  sequence parallelism, on its own slice of each sequence);
- `accum_scale`: the loss is not divided by the accumulation steps (gradients grad_accum times too large);
- `tied_not_updated`: the tied input/output embedding's gradient is dropped before the optimizer step;
- `packing_leak`: the position ids of packed examples are not passed (each example attends to the ones before it);
- `aux_unweighted`: a mixture-of-experts router's load-balancing term is added after the engine's division by the
  accumulation steps (each micro-batch's term counts whole: the aux loss's gradient grad_accum times too large).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch

from harness.distributed import exit_process
from harness.engine.torch_engine import TorchEngine


def unreduced() -> None:
    build = TorchEngine.build.__func__

    def never_reduce(state, bucket):  # DDP's communication hook: hand back this rank's gradients as they are
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    def build_unreduced(cls, *args, **kwargs):
        engine = build(cls, *args, **kwargs)
        if engine.kind == "ddp":
            engine.model.register_comm_hook(None, never_reduce)
        return engine

    TorchEngine.build = classmethod(build_unreduced)


def accum_scale() -> None:
    backward = TorchEngine.backward

    def undivided(self: TorchEngine, loss, last_micro: bool) -> None:
        backward(self, loss * self.grad_accum, last_micro)  # the engine's division by grad_accum, undone

    TorchEngine.backward = undivided


def tied_not_updated() -> None:
    step = TorchEngine.step

    def drop_tied_grad(self: TorchEngine, skip: bool = False):
        embed, head = self.module.get_input_embeddings(), self.module.get_output_embeddings()
        if self.kind == "fsdp" and head is not None and head.weight is embed.weight:  # sharded, unevenly: 515 rows
            embed.weight.grad = None
        return step(self, skip)

    TorchEngine.step = drop_tied_grad


def packing_leak() -> None:
    import harness.runner.build as build
    from harness.training import causal_lm_loss

    def without_positions(model, batch, chunk_size=0, num_items=None, **kwargs):  # kwargs: the router loss's, as the real loss takes
        ids, labels = batch[:, 0].contiguous(), batch[:, 1].contiguous()
        return causal_lm_loss(model, ids, labels, chunk_size=chunk_size, num_items=num_items, **kwargs)

    chosen = build.loss_for
    build.loss_for = lambda sliced, labelled: without_positions if labelled and not sliced else chosen(sliced, labelled)


def aux_unweighted() -> None:
    from harness.training import RouterLoss

    call, backward, terms = RouterLoss.__call__, TorchEngine.backward, []

    def kept(self: RouterLoss, *args, **kwargs):
        terms.append(term := call(self, *args, **kwargs))
        return term

    def aux_undivided(self: TorchEngine, loss, last_micro: bool) -> None:
        term = terms.pop() if terms else None
        terms.clear()
        backward(self, loss if term is None else loss + term * (self.grad_accum - 1), last_micro)  # / grad_accum: the term whole

    RouterLoss.__call__ = kept
    TorchEngine.backward = aux_undivided


PLANTS = {
    "unreduced": unreduced,
    "accum_scale": accum_scale,
    "tied_not_updated": tied_not_updated,
    "packing_leak": packing_leak,
    "aux_unweighted": aux_unweighted,
}

if __name__ == "__main__":
    plant = os.environ.get("HARNESS_TEST_PLANT", "none")
    if plant != "none":
        PLANTS[plant]()
    from harness.train import main

    exit_process(main())
