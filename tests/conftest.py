import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/launching.py
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
