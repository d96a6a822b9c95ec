"""The quantized-source effect, in weight space: re-quantize a GGUF's tensors (already on a ggml grid)
to their own type and to other types of similar size, and compare the relative error.

A model shipped as Q4_K_M is dequantized to f16 to become cardfit's reference. Re-quantizing a
tensor to the type it came from can put it back exactly on its grid (error ~0), while a type with
*more* bits lands off that grid: a recipe or preset that happens to reproduce the source's types
looks almost free, and comparisons at or above the source's size say nothing about real models.

    python bench/quantized_source.py qwen2.5-coder-1.5b [--layers 0,14,27] [--json out.json]
    python bench/quantized_source.py qwen2.5-coder-1.5b --map sensitivity.json   # the same, in measured KL

Prints, per source type, the mean relative error ||W - q(W)||^2 / ||W||^2 of RTN re-quantization
(ggml's own quantizers) to each candidate type, and how many tensors its own type returns exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

CANDIDATES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_XS", "Q3_K")


def main() -> int:
    from cardfit.formats import ggml_lib
    from cardfit.formats.ggml_types import GGML_BLOCKS
    from cardfit.sources import open_model
    from cardfit.sources.gguf_file import GgufSource

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="A GGUF model (catalog name or path).")
    parser.add_argument("--layers", default=None, help="Layers sampled (default: first, middle, last).")
    parser.add_argument("--json", default=None, help="Also write the per-tensor numbers here.")
    parser.add_argument("--map", default=None, help="Instead: the effect in a sensitivity map of this model "
                        "(measured KL per group and format).")
    args = parser.parse_args()
    if args.map:
        return map_inversions(args.model, args.map)

    source = open_model(args.model)
    if not isinstance(source, GgufSource):
        print("error: the quantized-source effect needs a GGUF model — name one", file=sys.stderr)
        return 2
    blocks = source.geometry.num_layers
    layers = ([int(x) for x in args.layers.split(",")] if args.layers
              else sorted({0, blocks // 2, blocks - 1}))
    picked = [t for t in source.tensors() if len(t.shape) == 2 and t.dtype not in ("F32", "F16", "BF16")
              and (t.group in ("embed", "lm_head") or t.group in {f"layers.{i}" for i in layers})]
    rows = []
    start = time.perf_counter()
    for t in picked:
        # as the f16 reference holds it: the dequantized values rounded to f16
        weight = source.read(t.name).numpy().reshape(-1, t.shape[-1]).astype(np.float16).astype(np.float32)
        norm = float(np.square(weight, dtype=np.float64).sum())
        errors = {}
        for cand in CANDIDATES:
            if t.shape[-1] % GGML_BLOCKS[cand][0]:
                continue  # llama.cpp would fall back; the candidate does not apply to this row width
            raw = ggml_lib.quantize(cand, weight, None)
            back = ggml_lib.dequantize(cand, raw, weight.shape)
            errors[cand] = float(np.square(weight - back, dtype=np.float64).sum()) / norm
        rows.append({"tensor": t.name, "group": t.group, "source": t.dtype, "shape": list(t.shape), "errors": errors})
        print(f"{t.name:<32} {t.dtype:<6} " + " ".join(f"{k}={v:.2e}" for k, v in errors.items()), flush=True)
    print(f"\n{len(rows)} tensors in {time.perf_counter() - start:.0f} s; layers {layers} + embedding/head\n")
    print("| source type | tensors | own type back on its grid (err < 1e-6) | " + " | ".join(CANDIDATES) + " |")
    print("|---|---|---|" + "---|" * len(CANDIDATES))
    for src in sorted({r["source"] for r in rows}):
        mine = [r for r in rows if r["source"] == src]
        exact = sum(1 for r in mine if r["errors"].get(src, 1.0) < 1e-6)
        cells = []
        for cand in CANDIDATES:
            values = [r["errors"][cand] for r in mine if cand in r["errors"]]
            cell = f"{np.mean(values):.2e}" if values else "—"
            cells.append(f"**{cell}**" if cand == src else cell)
        print(f"| {src} | {len(mine)} | {exact} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"model": str(source.path), "layers": layers, "rows": rows}, out, indent=1)
    return 0


def map_inversions(model: str, map_path: str) -> int:
    """Groups where a format with more bits measured more damage than one with fewer, beyond two
    standard errors: in a quantized source, the smaller format is usually the source's own grid."""
    from cardfit.formats import get_format
    from cardfit.maps import read_map
    from cardfit.sources import open_model, runnable

    data = read_map(map_path)
    types = runnable(open_model(model)).source_types()
    formats = sorted(data["formats"], key=lambda f: -get_format(f).bits)
    inverted = 0
    print("| group | source type | " + " | ".join(formats) + " | inversions (more bits, more damage) |")
    print("|---|---|" + "---|" * len(formats) + "---|")
    for g in data["groups"]:
        cells = g["cells"]
        pairs = []
        for i, big in enumerate(formats):
            for small in formats[i + 1:]:
                if g["bytes"][big] <= g["bytes"][small]:
                    continue
                a, b = cells[big], cells[small]
                noise = 2 * ((a.get("stderr") or 0) ** 2 + (b.get("stderr") or 0) ** 2) ** 0.5
                if a["damage"] > b["damage"] + noise:
                    pairs.append(f"{big}>{small}")
        inverted += bool(pairs)
        print(f"| {g['name']} | {'/'.join(types.get(g['name'], [])) or '—'} | "
              + " | ".join(f"{cells[f]['damage']:.2e}" for f in formats) + f" | {', '.join(pairs)} |")
    print(f"\n{inverted} of {len(data['groups'])} groups have a format that loses more than a smaller one "
          f"({data['rounding']} rounding, {data['calibration']['tokens']} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
