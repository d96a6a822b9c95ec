"""How far the cheap signals' sampled prices lie from the whole round trip's, and what each costs.

`--signal fast` (the default): the streamed Fisher of a model once, then every matrix the fast scan prices
from a sample of its blocks (fisher.sampled_kl; 512 Ki values or more) priced whole and from samples drawn by
three guides, over seeds. `--signal weight`: the imatrix walk (weight_signal's statistics), then every matrix
of every `--layer-step`-th layer and the embedding priced whole and from a sample of its rows
(weight_signal.tensor_error) at each of `--formats` with `--rounding`, over seeds, per matrix and per cell
(a layer's sum, as a map holds it), with the seconds each took.

    python bench/sampled_pricing.py --model qwen2.5-coder-0.5b
    python bench/sampled_pricing.py --model qwen2.5-coder-0.5b --signal weight --rounding imatrix

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
from cardfit.scan.signals.fisher import predicted_kl, sampled, sampled_kl, streamed_fisher, unit_prices
from cardfit.formats import parse_formats
from cardfit.formats.ggml_types import GGML_BLOCKS
from cardfit.formats.gguf_formats import ggml_roundtrip
from cardfit.engine.heap import map_large_blocks
from cardfit.sources import open_model, runnable
from cardfit.text import load_text, token_chunks


def guides(fisher, weight, storage):
    unit = GGML_BLOCKS[storage][0]
    q4 = next(t for t in ("Q4_0", "Q4_K") if GGML_BLOCKS[t][0] == unit)
    return {"expected": None,
            "q4-rounding": unit_prices(fisher, weight, ggml_roundtrip(q4, weight), unit),
            "fisher-w2": (fisher * weight.square()).reshape(-1, unit).sum(-1).double()}


WEIGHT_MENU = "Q8_0,Q6_K,Q5_K,Q4_K,Q4_0,IQ4_XS,Q3_K,IQ3_S,IQ3_XXS,Q2_K,IQ2_S,IQ2_XXS"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded one)")
    parser.add_argument("--signal", default="fast", choices=("fast", "weight"))
    parser.add_argument("--format", default="IQ4_XS", help="--signal fast: the format priced")
    parser.add_argument("--formats", default=WEIGHT_MENU, help="--signal weight: the formats priced")
    parser.add_argument("--rounding", default="imatrix", choices=("rtn", "imatrix"), help="--signal weight")
    parser.add_argument("--layer-step", type=int, default=1, help="--signal weight: every N-th layer")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if args.seeds < 1 or args.tokens < 1 or args.seq_len < 2 or args.layer_step < 1:
        parser.error("--seeds, --tokens and --layer-step must be at least 1, --seq-len at least 2")
    try:
        fmt = parse_formats(args.format)[0]
        fmts = parse_formats(args.formats)
        source = runnable(open_model(args.model))
    except CardfitError as error:
        parser.error(str(error))
    if args.signal == "fast" and fmt.method_for("rtn") != "rtn":
        parser.error(f"{args.format} rounds only with an importance matrix; the fast signal samples RTN roundings")
    map_large_blocks()
    text, text_path = load_text(None)
    chunks = token_chunks(AutoTokenizer.from_pretrained(str(source.path)), text, args.seq_len, args.tokens,
                          source=str(text_path))
    if args.signal == "weight":
        return weight_signal_errors(source, chunks, fmts, args)
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


def weight_signal_errors(source, chunks, fmts, args) -> None:
    """Whole against sampled weight-signal prices, per matrix and per cell, with the seconds of each."""
    from cardfit.engine.calibrate import LayerCalibration
    from cardfit.groups import EMBED
    from cardfit.scan.signals.weight import _EdgeStatistics, _LayerStatistics, tensor_error, token_frequencies

    from cardfit.scan.signals import sampling

    drawn: list[tuple[float, float]] = []
    draw = sampling.sampled_total
    sampling.sampled_total = lambda *a, **k: drawn.append(draw(*a, **k)) or drawn[-1]
    walk = LayerCalibration(source, chunks, {"imatrix"}, "cpu", 4)
    layers = source.geometry.num_layers
    rows: list[tuple[str, str, float, list[float]]] = []  # (cell, format, whole, [sampled by seed])
    seconds = {"walk": 0.0, "whole": 0.0, "sampled": 0.0}

    def price(cell: str, tensors, statistics) -> None:
        for f in fmts:
            whole, drawn = 0.0, [0.0] * args.seeds
            for tensor in tensors:
                if f.storage(tensor.name, tensor.shape) == "F32":
                    continue
                weight = source.read(tensor.name)
                began = time.perf_counter()
                exact = tensor_error(tensor, weight, f, args.rounding, statistics, sample=False)
                seconds["whole"] += time.perf_counter() - began
                whole += exact
                own = f.storage(tensor.name, tensor.shape) == source.origin_types().get(tensor.name)
                own_grid[f.name] += own and sampling.worth_sampling(weight.numel())
                for seed in range(args.seeds):
                    began = time.perf_counter()
                    estimate = tensor_error(tensor, weight, f, args.rounding, statistics, sample=not own, seed=seed)
                    if seed == 0:
                        seconds["sampled"] += time.perf_counter() - began
                    drawn[seed] += estimate
                    if sampling.worth_sampling(weight.numel()) and not own:
                        matrix_errors[f.name].append(estimate / exact - 1 if exact > 0 else 0.0)
            rows.append((cell, f.name, whole, drawn))

    matrix_errors: dict[str, list[float]] = collections.defaultdict(list)
    own_grid: dict[str, int] = collections.Counter()  # large matrices priced whole: rounded onto their own grid
    by_layer = {index: [t for t in source.tensors() if f".layers.{index}." in t.name and len(t.shape) == 2]
                for index in range(0, layers, args.layer_step)}
    last = max(by_layer)
    for index in range(last + 1):
        began = time.perf_counter()
        stats = walk.statistics(index) if index in by_layer else None
        seconds["walk"] += time.perf_counter() - began
        if stats is not None:
            price(f"layers.{index}", by_layer[index], _LayerStatistics(stats))
        began = time.perf_counter()
        if index < last or source.tied_embeddings:
            walk.advance(index)
        seconds["walk"] += time.perf_counter() - began
    embedding = next(t for t in source.tensors() if t.group == EMBED and len(t.shape) == 2)
    if source.tied_embeddings:
        for index in range(last + 1, layers):
            walk.advance(index)
    head = walk.head_statistics() if source.tied_embeddings else None
    price("embed", [embedding], _EdgeStatistics(token_frequencies(chunks, embedding.shape[0]), head,
                                                source.tied_embeddings))
    walk.engine.close()
    print(f"{len(rows)} cells ({len(by_layer)} layers + the embedding) x {len(fmts)} formats, {args.rounding} "
          f"rounding; imatrix walk {seconds['walk']:.1f} s, whole pricing {seconds['whole']:.1f} s, sampled "
          f"(seed 0) {seconds['sampled']:.1f} s ({seconds['whole'] / max(seconds['sampled'], 1e-9):.1f}x), on this "
          "process's cores")
    whole = sum(e > sampling.MAX_RELATIVE_ERROR * abs(t) for t, e in drawn)
    print(f"{len(drawn)} draws, {whole} priced whole instead (stated error over {sampling.MAX_RELATIVE_ERROR:.0%}); "
          f"stated error: median {np.median([e / t for t, e in drawn if t > 0]):.2%}")
    print("| format | matrices drawn | own grid (whole) | matrix: max abs error | p90 | cell: max abs error | p90 | mean |")
    print("|---|---|---|---|---|---|---|---|")
    for f in fmts:
        cells = np.array([d / w - 1 for _, name, w, ds in rows if name == f.name and w > 0 for d in ds])
        m = np.abs(np.array(matrix_errors[f.name] or [0.0]))
        print(f"| {f.name} | {len(matrix_errors[f.name]) // args.seeds} | {own_grid[f.name]} | {m.max():.2%} | "
              f"{np.quantile(m, 0.9):.2%} "
              f"| {np.abs(cells).max():.2%} | {np.quantile(np.abs(cells), 0.9):.2%} | {cells.mean():+.2%} |")


if __name__ == "__main__":
    main()
