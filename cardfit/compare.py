"""`compare`: cardfit's recipe against llama.cpp's own presets at equal bytes, both measured.

For each llama.cpp preset (quantized by llama.cpp's `llama_model_quantize` from our F16
conversion of the model, so the shelf file is exactly what `llama-quantize` makes), cardfit
plans the least-damage recipe whose whole file is no larger than the preset's file, packs it,
and both run in llama.cpp against the full-precision reference over the same held-out tokens.
The table says, row by row, whether cardfit lost less at no more bytes.
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import CardfitError
from .units import format_bytes

DEFAULT_PRESETS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
DEFAULT_MAP_FORMATS = "Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K"


def _measure(path: Path, reference, text, max_tokens: int, seq_len: int) -> dict:
    from .check import check

    start = time.perf_counter()
    report = check(path, reference, text, max_tokens, seq_len)
    seconds = time.perf_counter() - start
    return {"bytes": path.stat().st_size, "kld_mean": report["kld_mean"], "kld_stderr": report["kld_stderr"],
            "kld_p99": report["kld_p99"], "top1": report["top1"], "perplexity": report["perplexity"],
            "reference_perplexity": report["reference_perplexity"], "check_seconds": round(seconds, 1),
            "verdict": report["verdict"]}


def compare(model: str | Path | None = None, out: str | Path = "compare-out", map_path: str | Path | None = None,
            presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, text: str | Path | None = None,
            max_tokens: int = 2048, seq_len: int = 512, scan_tokens: int = 1024, progress: bool = True,
            log=print) -> dict:
    """Measure each preset and cardfit's recipe at the preset's size; writes compare.json/.md/.png in `out`."""
    from .atomic import write_json
    from .pack import pack, reserve_bytes
    from .plan import plan, uniform_recipe
    from .scan import scan
    from .shelf import FTYPES, llama_quantize
    from .sources import open_model

    for preset in presets:
        if preset not in FTYPES:
            raise CardfitError(f"llama.cpp has no preset '{preset}'", "known: " + ", ".join(FTYPES))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    source = open_model(model)
    reference = model or "default"
    if map_path is None:
        map_path = out / "sensitivity.json"
        if log:
            log(f"scanning {DEFAULT_MAP_FORMATS} over {scan_tokens} tokens -> {map_path}")
        scan(model, None, scan_tokens, DEFAULT_MAP_FORMATS, "layer", map_path, resume=True, progress=progress)
    f16 = out / "f16.gguf"
    if not f16.exists():
        pack(uniform_recipe(source, "F16"), model, f16, progress=False, smoke=False)
    reserve = reserve_bytes(source, "llama.cpp", scratch_dir=out)
    rows = []
    for preset in presets:
        shelf_file = out / f"shelf-{preset}.gguf"
        if not shelf_file.exists():
            llama_quantize(f16, shelf_file, preset)
        shelf = {"name": f"llama.cpp {preset}", "kind": "shelf", "preset": preset,
                 **_measure(shelf_file, reference, text, max_tokens, seq_len)}
        rows.append(shelf)
        if log:
            log(f"{shelf['name']:<22} {format_bytes(shelf['bytes']):>11}  KLD {shelf['kld_mean']:.4f}  "
                f"top-1 {shelf['top1']:.2%}")
        try:
            recipe = plan(map_path, shelf["bytes"], reserve_bytes=reserve)
        except CardfitError as exc:
            rows.append({"name": f"cardfit <= {preset}", "kind": "cardfit", "preset": preset, "error": str(exc)})
            continue
        mine = out / f"cardfit-{preset}.gguf"
        pack(recipe, model, mine, force=True, progress=False, smoke=False)  # measured in full below
        row = {"name": f"cardfit <= {preset}", "kind": "cardfit", "preset": preset,
               "predicted_damage": recipe["predicted_damage"],
               **_measure(mine, reference, text, max_tokens, seq_len)}
        row["kld_reduction"] = 1 - row["kld_mean"] / shelf["kld_mean"] if shelf["kld_mean"] > 0 else None
        rows.append(row)
        if log:
            log(f"{row['name']:<22} {format_bytes(row['bytes']):>11}  KLD {row['kld_mean']:.4f}  "
                f"top-1 {row['top1']:.2%}  (KLD {-row['kld_reduction']:+.1%} vs the preset)")
    result = {"model": source.path.name, "map": str(map_path), "tokens": max_tokens, "seq_len": seq_len,
              "rows": rows}
    write_json(out / "compare.json", result)
    (out / "compare.md").write_text(render_compare(result) + "\n", encoding="utf-8")
    from .plots import plot_compare

    plot_compare(rows, out / "compare.png")
    return result


def render_compare(result: dict) -> str:
    lines = ["| artifact | file size | mean KLD | p99 KLD | top-1 | perplexity | KLD vs preset |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | — | {r['error']} | | | | |")
            continue
        reduction = f"{-r['kld_reduction']:+.1%}" if r.get("kld_reduction") is not None else ""
        lines.append(f"| {r['name']} | {format_bytes(r['bytes'])} | {r['kld_mean']:.4f} ± {r['kld_stderr']:.4f} | "
                     f"{r['kld_p99']:.4f} | {r['top1']:.2%} | {r['perplexity']:.3f} | {reduction} |")
    ref = next((r["reference_perplexity"] for r in result["rows"] if "reference_perplexity" in r), None)
    if ref is not None:
        lines.append(f"\nReference perplexity {ref:.3f} over {result['tokens']} held-out tokens "
                     f"(chunks of {result['seq_len']}); every artifact ran in llama.cpp.")
    return "\n".join(lines)
