"""Export any checkpoint to a Hugging Face directory (safetensors + config + tokenizer).

One process, any checkpoint, no need for the world size that wrote it:

    python -m harness.export runs/x/checkpoints/step_00000100 --out runs/x/hf

Only model weights are read. From a DCP checkpoint we ask DCP for the `model.*` keys
alone (it reassembles each tensor from however many shards were written and never
touches the optimizer entries); from a DeepSpeed checkpoint we use DeepSpeed's own
`zero_to_fp32` consolidation (fp32 master weights, lazily loaded), or the module state of a
stage-0 checkpoint. The result is what `AutoModelForCausalLM.from_pretrained` loads. A LoRA
checkpoint gives the PEFT adapter directory (`PeftModel.from_pretrained(base, dir)`), or with
`--merged` the base with the adapters merged in (`from_pretrained` loads it).
"""

from __future__ import annotations

import argparse
import sys

from harness import imports_done  # the package first: as the program, the imports below run with the collector held
from harness.checkpoint import check_export_target, export_hf, resolve_checkpoint_path, unreadable_as_checkpoint_error, verified_meta
from harness.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT, CheckpointError, ConfigError, command_errors


@command_errors("harness.export", (CheckpointError,), EXIT_CHECKPOINT)
@command_errors("harness.export", (ConfigError,), EXIT_BAD_INPUT)
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harness.export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step_* directory, a checkpoints/ directory or a run directory (its latest)")
    parser.add_argument("--out", required=True, help="the Hugging Face directory to write: new, empty, or an earlier export (--overwrite)")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="LoRA checkpoints: write the base with the adapters merged in (default: the PEFT adapter directory)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier harness export in --out (never a directory holding anything else)",
    )
    args = parser.parse_args(argv)
    path = resolve_checkpoint_path(args.checkpoint)
    check_export_target(args.out, path, args.overwrite)  # before the checkpoint is read: seconds, not minutes
    verified_meta(path)
    with unreadable_as_checkpoint_error(path):
        out = export_hf(path, args.out, merged=args.merged, overwrite=args.overwrite)
    print(f"exported {path} to {out}")
    return 0


if __name__ == "__main__":
    imports_done()
    sys.exit(main())
