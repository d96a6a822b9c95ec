"""Scan throughput and peak device memory on CUDA (scripts/gpu-check.sh runs it when a GPU is lent).

    python bench/gpu_scan.py [MODEL] [--tokens 1024] [--formats Q8_0,Q4_K,Q2_K] [--dtype auto]

MODEL is anything `cardfit scan` takes; `shape:qwen2.5-1.5b` builds a random-weight model with the
Qwen2.5-1.5B geometry (hidden 1536, 28 layers, 151,936 vocabulary) and `shape:embedded` one with the
embedded model's geometry, for when the real weights cannot travel to the GPU machine (the device tool
carries at most 64 MiB; the embedded GGUF is 98 MB). A shape is built once per machine under
/tmp/cardfit-shapes. Random weights time the scan faithfully; their damage values mean nothing.
Prints one JSON line: wall seconds, layer reads, cells per second, the estimate beside the measurement,
and torch's peak allocated device memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

QWEN15_SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True)


def shape_config(name: str):
    from transformers import AutoConfig, Qwen2Config

    from cardfit.default_model import default_model_dir

    if name == "qwen2.5-1.5b":
        return Qwen2Config(**QWEN15_SHAPE)
    if name == "embedded":
        return AutoConfig.from_pretrained(default_model_dir())
    raise SystemExit(f"unknown shape {name!r}: use shape:qwen2.5-1.5b or shape:embedded")


def random_model(name: str, root: Path = Path("/tmp/cardfit-shapes")) -> Path:
    """A float16 model of a named geometry with random weights and the embedded model's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cardfit.default_model import default_model_dir

    target = root / name
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(shape_config(name), dtype=torch.float16)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(target)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return target


def main() -> None:
    from cardfit.scan import scan

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--formats", default="Q8_0,Q4_K,Q2_K")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gpu-memory", type=float, help="GiB of device memory the layers may keep resident")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model and model.startswith("shape:"):
            model = str(random_model(model.removeprefix("shape:")))
        lines: list[str] = []
        out = Path(tmp) / "map.json"
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        scan(model, None, args.tokens, args.formats, out=out, progress=False, device=args.device, dtype=args.dtype,
             gpu_memory=None if args.gpu_memory is None else int(args.gpu_memory * 2**30), log=lines.append)
        wall = time.perf_counter() - began
        data = json.loads(out.read_text())
    estimate = next((line for line in lines if line.startswith("estimate:")), "")
    reads = next((line for line in lines if line.startswith("read decoder layers")), "")
    print(json.dumps({
        "model": args.model or "embedded", "dtype": args.dtype, "gpu_memory_gib": args.gpu_memory,
        "tokens": data["calibration"]["tokens"], "formats": data["formats"],
        "device": lines[0] if lines else "", "wall_seconds": round(wall, 1),
        "cells_per_second": round(sum(len(g["cells"]) for g in data["groups"]) / wall, 3),
        "layer_reads": reads, "estimate": estimate,
        "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    }))


if __name__ == "__main__":
    main()
