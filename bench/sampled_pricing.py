"""How far the cheap signal's sampled i-quant prices (fisher.sampled_kl) lie from the whole round trip's, and
what each costs: the streamed Fisher of a model once, then every matrix the fast scan prices from a sample
(IQ4_XS's storage, 512 Ki values or more) priced whole and from samples drawn by three guides, over seeds.

    python bench/sampled_pricing.py --model qwen2.5-coder-0.5b

Guides: `expected` (what the scan uses: per block, sum F x the largest |w| of each 32 values squared),
`q4-rounding` (the block's actual Fisher-weighted error under Q4_0 or Q4_K, ggml's rounding of the whole
matrix), `fisher-w2` (sum F w^2). Errors are each estimate over the whole price, per matrix and per layer
(the sum over a layer's matrices, as a cell is).
"""

from __future__ import annotations

import argparse
import collections
import re
import time

import numpy as np
import torch
from transformers import AutoTokenizer

from cardfit.errors import CardfitError
from cardfit.fisher import predicted_kl, sampled, sampled_kl, streamed_fisher, unit_prices
from cardfit.formats import parse_formats
from cardfit.formats.gguf_formats import GGML_BLOCKS, ggml_roundtrip
from cardfit.heap import map_large_blocks
from cardfit.sources import open_model, runnable
from cardfit.text import load_text, token_chunks


def guides(fisher, weight, storage):
    unit = GGML_BLOCKS[storage][0]
    q4 = next(t for t in ("Q4_0", "Q4_K") if GGML_BLOCKS[t][0] == unit)
    return {"expected": None,
            "q4-rounding": unit_prices(fisher, weight, ggml_roundtrip(q4, weight), unit),
            "fisher-w2": (fisher * weight.square()).reshape(-1, unit).sum(-1).double()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded one)")
    parser.add_argument("--format", default="IQ4_XS")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.seeds < 1 or args.tokens < 1 or args.seq_len < 2:
        parser.error("--seeds and --tokens must be at least 1, --seq-len at least 2")
    try:
        fmt = parse_formats(args.format)[0]
        source = runnable(open_model(args.model))
    except CardfitError as error:
        parser.error(str(error))
    if fmt.method_for("rtn") != "rtn":
        parser.error(f"{args.format} rounds only with an importance matrix; the fast signal samples RTN roundings")
    map_large_blocks()
    text, text_path = load_text(None)
    chunks = token_chunks(AutoTokenizer.from_pretrained(str(source.path)), text, args.seq_len, args.tokens,
                          source=str(text_path))
    fisher: dict[str, torch.Tensor] = {}
    start = time.perf_counter()
    streamed_fisher(source, chunks, fisher.update)
    print(f"Fisher pass: {time.perf_counter() - start:.1f} s")
    whole_s = sampled_s = 0.0
    errors: dict[str, list[float]] = collections.defaultdict(list)
    layers: dict[tuple, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    count = 0
    for tensor in source.tensors():
        storage = fmt.storage(tensor.name, tensor.shape)
        if tensor.name not in fisher or not sampled(storage, int(np.prod(tensor.shape))):
            continue
        count += 1
        weight, f = source.read(tensor.name).to(torch.float32), fisher[tensor.name]
        began = time.perf_counter()
        whole = predicted_kl(f, weight, ggml_roundtrip(storage, weight))
        whole_s += time.perf_counter() - began
        began = time.perf_counter()
        sampled_kl(f, weight, storage)
        sampled_s += time.perf_counter() - began
        match = re.search(r"layers\.(\d+)\.", tensor.name)
        layer = match.group(1) if match else tensor.name
        for seed in range(args.seeds):
            layers[(layer, seed)]["whole"] += whole
            for name, guide in guides(f, weight, storage).items():
                estimate = sampled_kl(f, weight, storage, seed=seed, guide=guide)
                errors[name].append(estimate / whole - 1)
                layers[(layer, seed)][name] += estimate
    print(f"{count} matrices of {args.format} priced from a sample; whole round trips {whole_s:.1f} s, "
          f"sampled (expected guide, seed 0) {sampled_s:.1f} s, on this process's cores")
    print("| guide | matrix: max abs error | p90 | mean | layer: max abs error | p90 |")
    print("|---|---|---|---|---|---|")
    for name, errs in errors.items():
        e = np.array(errs)
        per_layer = np.array([v[name] / v["whole"] - 1 for v in layers.values() if v["whole"] > 0])
        print(f"| {name} | {np.abs(e).max():.2%} | {np.quantile(np.abs(e), 0.9):.2%} | {e.mean():+.2%} | "
              f"{np.abs(per_layer).max():.2%} | {np.quantile(np.abs(per_layer), 0.9):.2%} |")


if __name__ == "__main__":
    main()
