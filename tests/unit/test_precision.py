"""Precision modes: dtypes of parameters, activations and the loss, per engine; bf16 converges.

Runs in one process: single-process engine directly, and FSDP2 / DeepSpeed over a gloo
group of one (the engines' own bf16 modes keep fp32 master weights).
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist
from model_families import save_families

from harness.config import load_config, load_strategy
from harness.distributed import DistInfo
from harness.engine import build_engine, hidden_size_of, load_model, parallelize, plan_engine
from harness.errors import ConfigError
from harness.models import CheckpointWeights, decoder_blocks, model_spec
from harness.training import causal_lm_loss, precision_policy

VOCAB = 256


def _engine(strategy: str, precision: str, distributed: bool, steps: int = 3):
    cfg = load_config(None, [f"strategy={strategy}", f"precision={precision}", "micro_batch_size=2", f"steps={steps}", "optim.lr=0.01"])
    s = load_strategy(cfg.strategy, env={})
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo" if distributed else None)
    spec = model_spec("tiny-llama", vocab_size=VOCAB)
    plan = plan_engine(cfg, s, 1, info.device, hidden_size_of(spec.config))
    engine = build_engine(spec, cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))
    return engine, engine.module


def _activation_dtype(engine, model) -> torch.dtype:
    seen = []
    # a matmul output: the activation dtype autocast and casting decide
    handle = decoder_blocks(model)[0].mlp.up_proj.register_forward_hook(
        lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype)
    )
    x = torch.randint(0, VOCAB, (2, 16))
    loss = engine.forward_loss(x)
    engine.backward(loss, last_micro=True)
    grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    engine.step()
    handle.remove()
    return seen[0], loss.dtype, grad_dtypes


@pytest.mark.parametrize(
    "precision, param_dtype, act_dtype",
    [("fp32", torch.float32, torch.float32), ("bf16", torch.bfloat16, torch.bfloat16), ("fp16", torch.float32, torch.float16)],
)
def test_single_process_dtypes(precision, param_dtype, act_dtype):
    engine, model = _engine("ddp", precision, distributed=False)
    assert {p.dtype for p in model.parameters()} == {param_dtype}
    act, loss, grads = _activation_dtype(engine, model)
    assert act == act_dtype and grads == {param_dtype}
    assert loss == torch.float32  # the loss is always computed in fp32
    assert (engine.scaler is not None) == (precision == "fp16")


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    store = tmp_path_factory.mktemp("pg") / "store"
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}  # DeepSpeed reads LOCAL_RANK
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_fsdp_bf16_keeps_fp32_master_and_computes_in_bf16(group_of_one):
    engine, model = _engine("fsdp", "bf16", distributed=True)
    assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}  # sharded master
    act, loss, grads = _activation_dtype(engine, model)
    assert act == torch.bfloat16 and loss == torch.float32
    assert grads == {torch.float32}  # reduce_dtype fp32, into the fp32 sharded grads


def _lora_fsdp_bf16_run(steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.dtype]]:
    cfg = load_config(None, ["strategy=fsdp", "precision=bf16", "lora.enabled=true", "lora.r=4", "micro_batch_size=2", "optim.lr=0.01"])
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    spec = model_spec("tiny-llama", vocab_size=VOCAB)
    plan = plan_engine(cfg, load_strategy(cfg.strategy, env={}), 1, info.device, hidden_size_of(spec.config))
    engine = build_engine(spec, cfg, plan, info, functools.partial(causal_lm_loss, chunk_size=0))
    losses, batch = [], torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):  # a repeated batch: the loss falls
        loss = engine.forward_loss(batch)
        engine.backward(loss, last_micro=True)
        engine.step()
        losses.append(float(loss.detach()))
    model = engine.module
    adapters = {n: p.detach().full_tensor().clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses, adapters, {n: p.dtype for n, p in model.named_parameters()}


def test_fsdp_bf16_lora_holds_the_frozen_base_in_bf16_and_computes_the_same(group_of_one, monkeypatch):
    """The frozen base takes no step, so FSDP2 keeps no fp32 master of it: it is held in bf16,
    which FSDP2's mixed precision casts every parameter to for compute anyway. Against the same
    run with the base held in fp32 shards (the hold switched off): the same losses and adapters, bit for bit."""
    losses, adapters, dtypes = _lora_fsdp_bf16_run()
    assert {dtypes[n] for n in adapters} == {torch.float32}  # the adapters keep their fp32 master
    assert {d for n, d in dtypes.items() if n not in adapters} == {torch.bfloat16}
    monkeypatch.setattr(parallelize, "hold_frozen_in", lambda model, dtype: None)
    ref_losses, ref_adapters, ref_dtypes = _lora_fsdp_bf16_run()
    assert {d for n, d in ref_dtypes.items() if n not in adapters} == {torch.float32}
    assert losses == ref_losses and losses[-1] < losses[0]
    assert all(torch.equal(adapters[n], ref_adapters[n]) for n in adapters)


def test_deepspeed_bf16_module_bf16_master_fp32(group_of_one):
    engine, model = _engine("zero2", "bf16", distributed=True)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    masters = engine.optimizer.single_partition_of_fp32_groups
    assert masters and all(m.dtype == torch.float32 for m in masters)
    act, loss, _ = _activation_dtype(engine, engine.module)
    assert act == torch.bfloat16 and loss == torch.float32


def test_bf16_training_converges():
    engine, _ = _engine("ddp", "bf16", distributed=False, steps=40)
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB // 8, (4, 2, 32), generator=gen)  # a small, learnable set
    losses = []
    for step in range(40):
        loss = engine.forward_loss(data[step % 4])
        engine.backward(loss, last_micro=True)
        engine.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.5, losses


def test_bf16_without_hardware_support_is_an_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(ConfigError, match="V100 has no bf16 support; use precision=fp16"):
        precision_policy("bf16", torch.device("cuda", 0), "ddp")


def test_deepspeed_bf16_loads_a_bf16_file_without_an_fp32_copy(group_of_one, tmp_path):
    from torch.distributed._tools.mem_tracker import MemTracker

    directory = save_families(tmp_path)["gpt_neox"]  # saved in bf16
    cfg = load_config(None, [f"model.name={directory}", "strategy=zero2", "precision=bf16", "micro_batch_size=2"])
    s = load_strategy(cfg.strategy, env={})
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    tracker = MemTracker()
    with tracker:
        spec = model_spec(directory)
        model = load_model(spec, cfg, plan_engine(cfg, s, 1, info.device, hidden_size_of(spec.config)), info)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    params = {id(p): p for p in model.parameters()}.values()
    assert {p.dtype for p in params} == {torch.bfloat16}  # DeepSpeed's working dtype, built directly
    ckpt = CheckpointWeights(directory, model.base_model_prefix)
    ckpt.follow_conversions(model)  # GPT-NeoX's head is `embed_out` in the file, `lm_head` in transformers 5
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), ckpt.read([name], p.shape, 0, p.numel())), name  # bit for bit
    bf16_bytes = sum(p.numel() * 2 for p in params)
    largest_fp32 = max(p.numel() * 4 for p in params)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert bf16_bytes <= peak <= bf16_bytes + largest_fp32 + 3 * buffers < 2 * bf16_bytes  # never the fp32 model
