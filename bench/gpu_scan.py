"""Scan throughput and peak device memory on CUDA (scripts/gpu-check.sh runs it when a GPU is lent).

    python bench/gpu_scan.py [MODEL] [--tokens 1024] [--formats Q8_0,Q4_K,Q2_K] [--dtype auto]

MODEL is anything `cardfit scan` takes; `shape:qwen2.5-1.5b` builds a random-weight model with the
Qwen2.5-1.5B geometry (hidden 1536, 28 layers, 151,936 vocabulary) for when the real weights cannot
travel to the GPU machine. Prints one JSON line: wall seconds, layer reads, tokens per second through
the scan, the estimate beside the measurement, and torch's peak allocated device memory.
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


def random_model(root: Path) -> Path:
    """A Qwen2 of the 1.5B's shape with random weights and the embedded model's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from cardfit.default_model import default_model_dir

    config = Qwen2Config(**QWEN15_SHAPE, torch_dtype="float16")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float16)
    model.save_pretrained(root, safe_serialization=True)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(root)
    return root


def main() -> None:
    from cardfit.scan import scan

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--formats", default="Q8_0,Q4_K,Q2_K")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "shape:qwen2.5-1.5b":
            model = str(random_model(Path(tmp) / "qwen15-shape"))
        lines: list[str] = []
        out = Path(tmp) / "map.json"
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        scan(model, None, args.tokens, args.formats, out=out, progress=False, device=args.device, dtype=args.dtype,
             log=lines.append)
        wall = time.perf_counter() - began
        data = json.loads(out.read_text())
    estimate = next((line for line in lines if line.startswith("estimate:")), "")
    reads = next((line for line in lines if line.startswith("read decoder layers")), "")
    print(json.dumps({
        "model": args.model or "embedded", "tokens": data["calibration"]["tokens"], "formats": data["formats"],
        "device": lines[0] if lines else "", "wall_seconds": round(wall, 1),
        "cells_per_second": round(sum(len(g["cells"]) for g in data["groups"]) / wall, 3),
        "layer_reads": reads, "estimate": estimate,
        "peak_device_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    }))


if __name__ == "__main__":
    main()
