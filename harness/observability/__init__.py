"""Observability: metrics file, W&B, console progress, MFU, end-of-run plots and summary.

The trainer uses `Observer` alone; the submodules are importable for tools that read a
run afterwards (`plots.write_plots`, `metrics.read_records`, `mfu.flops_per_token`).
"""

from .metrics import PEAK_RANK, format_bytes
from .observer import Observer

__all__ = ["PEAK_RANK", "Observer", "format_bytes"]
