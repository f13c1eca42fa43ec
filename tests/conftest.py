import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/launching.py
# One thread per process, always: the 2-rank tests share 2 cores, and the bit-exact tests
# compare in-process references with subprocess runs, whose matmul reduction order depends
# on the thread count.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)
