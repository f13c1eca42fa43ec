"""The CUDA allocator default (set unless the user chose, under either name) and that an fp32
AdamW run does not import the optimizer libraries."""

from __future__ import annotations

import subprocess
import sys

from harness.distributed import configure_cuda_allocator
from harness.distributed.allocator import DEFAULT_ALLOC_CONF


def test_allocator_default_is_set_when_the_user_chose_nothing():
    env: dict[str, str] = {}
    line = configure_cuda_allocator(env)
    assert env == {"PYTORCH_ALLOC_CONF": DEFAULT_ALLOC_CONF} and "harness's default" in line


def test_allocator_setting_of_the_user_is_respected_under_either_name():
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env = {name: "max_split_size_mb:128"}
        line = configure_cuda_allocator(env)
        assert env == {name: "max_split_size_mb:128"} and "(yours)" in line


def test_default_optimizer_imports_no_optimizer_library():
    code = (
        "import sys, torch; import harness.train; from harness.training import build_optimizer; from harness.config import OptimConfig; "
        "build_optimizer(torch.nn.Linear(4, 4).parameters(), OptimConfig(lr=1e-3)); "
        "print(sorted(m for m in ('torchao', 'bitsandbytes') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
