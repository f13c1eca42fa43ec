"""The optimizer rungs on the harness's own engine: every optimizer x {one process, FSDP2 at world
2} x {accumulation, optimizer-in-backward} trains, resumes bit-exactly from its DCP checkpoint, and
holds exactly the optimizer-state and parameter bytes the planner's account gives
(`harness.training.optimizer_state_bytes`, per local numel). Two launches, side by side: each rank
runs its engine's cases in sequence (`optimizer_worker.py`).

torchao's step runs eager here (TORCHDYNAMO_DISABLE=1): compiled, its first step costs 10-40 s of
inductor per tensor shape on 2 cores. The compiled path is what `notes/optimizers.md`'s runs took.
Refusals (DeepSpeed, bitsandbytes under FSDP2, bf16_pure with a round-to-nearest optimizer,
cpu_offload on CPU) are cases of test_preflight's battery.
"""

from __future__ import annotations

import json

import pytest
from launching import TESTS, finish, start

from harness.config import OPTIMIZER_NAMES

pytestmark = pytest.mark.integration

WORKER = str(TESTS / "integration" / "optimizer_worker.py")
ALL = list(OPTIMIZER_NAMES)  # every name the config accepts
# (optimizer, precision, grad_accum, optimizer_in_backward)
# sgd with optimizer-in-backward is left out: its stateless per-parameter optimizers do not load back
# through DCP ("different number of parameter groups"), a limitation older than these optimizers.
SINGLE = [[n, "fp32", 2, False] for n in ALL] + [[n, "fp32", 1, True] for n in ALL if n != "sgd"]
SINGLE += [[n, "bf16_pure", 2, False] for n in ("adamw_bf16", "adamw_8bit", "adamw_4bit")]
# FSDP2: the rungs and adamw as their reference (adam/sgd under FSDP2 are torch's own, as before)
TORCHAO = ["adamw_bf16", "adamw_8bit", "adamw_4bit"]
FSDP = [[n, "fp32", 2, False] for n in ["adamw", *TORCHAO]] + [[n, "fp32", 1, True] for n in TORCHAO]
FSDP += [["adamw_bf16", "bf16_pure", 2, False]]


def _results(output: str) -> list[dict]:
    return [json.loads(line.removeprefix("RESULT ")) for line in output.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def results(tmp_path_factory, monkeypatch_module) -> list[dict]:
    work = tmp_path_factory.mktemp("optimizers")
    single = start(WORKER, ["ddp", json.dumps(SINGLE), str(work / "single")], 1)[0]
    fsdp = start(WORKER, ["fsdp", json.dumps(FSDP), str(work / "fsdp")], 2)[0]
    out = finish(single, "single optimizers", 400)[0] + finish(fsdp, "fsdp optimizers", 400)[0]
    got = _results(out)
    assert len(got) == len(SINGLE) + 2 * len(FSDP), out[-3000:]
    return got


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHDYNAMO_DISABLE", "1")  # start() copies os.environ into each rank
        yield mp


def test_every_case_trains_and_resumes_bit_exactly(results):
    bad = [r["case"] for r in results if not (r["exact"] and r["trained"])]
    assert not bad, bad


def test_state_and_parameter_bytes_equal_the_planners_account(results):
    off = [
        (r["case"], r["rank"], r["optim_state"], r["planned_optim_state"]) for r in results if r["optim_state"] != r["planned_optim_state"]
    ]
    assert not off, off
    off = [(r["case"], r["rank"], r["params"], r["planned_params"]) for r in results if r["params"] != r["planned_params"]]
    assert not off, off
    # the account is not trivially met: the rungs hold less, in the order the ladder promises
    by = {r["case"]: r["optim_state"] for r in results if r["rank"] == 0}
    full, bf16, q8, q4 = (by[f"ddp/{n}/fp32/accum2/oib0"] for n in ("adamw", "adamw_bf16", "adamw_8bit", "adamw_4bit"))
    assert full > bf16 > q8 > q4 > 0, (full, bf16, q8, q4)
