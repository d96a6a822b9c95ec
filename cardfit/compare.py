"""`compare`: cardfit's recipe against what people use today, at equal bytes, all measured.

The shelf: each llama.cpp preset, quantized by llama.cpp's own `llama_model_quantize` from our
F16 conversion (exactly what `llama-quantize` writes), with or without an importance matrix; the
uniform W4A16 checkpoints people make for vLLM, rounded with RTN, GPTQ and AWQ; and bitsandbytes
NF4 as transformers loads it. For each size on the shelf cardfit plans the least-damage GGUF
recipe whose whole file is no larger, packs it, and every artifact runs in its own runtime
against the full-precision reference over the same held-out tokens. The F16 GGUF is measured
too: it is the floor the runtime itself adds (llama.cpp's arithmetic against the reference's).
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import CardfitError
from .units import format_bytes

DEFAULT_PRESETS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
DEFAULT_MAP_FORMATS = "Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K"
# Uniform 4-bit baselines: W4A16 group 128 (llm-compressor's preset) by rounding method, and NF4.
BASELINES = {"rtn": "W4A16-g128 RTN", "gptq": "W4A16-g128 GPTQ", "awq": "W4A16-g128 AWQ",
             "nf4": "bitsandbytes NF4"}
DEFAULT_BASELINES = tuple(BASELINES)


def _measure(path: Path, reference, text, max_tokens: int, seq_len: int, runtime: str | None = None) -> dict:
    from .check import check

    start = time.perf_counter()
    report = check(path, reference, text, max_tokens, seq_len, runtime=runtime)
    return {"runtime": report["runtime"], "kld_mean": report["kld_mean"], "kld_stderr": report["kld_stderr"],
            "kld_p99": report["kld_p99"], "top1": report["top1"], "perplexity": report["perplexity"],
            "reference_perplexity": report["reference_perplexity"],
            "check_seconds": round(time.perf_counter() - start, 1), "verdict": report["verdict"]}


def _gguf_speed(path: Path) -> dict:
    from .bench import bench

    result = bench(path, prompt_tokens=256, gen_tokens=32)
    return {"gen_tokens_per_s": result["gen_tokens_per_s"], "prompt_tokens_per_s": result["prompt_tokens_per_s"],
            "speed_runtime": "llama.cpp"}


def _vllm_speed(path: Path, reference) -> dict:
    """Single-stream generation in vLLM when its environment exists; otherwise the row says why not."""
    from .bench import bench_vllm
    from .vllm_env import vllm_python

    try:
        vllm_python()
    except CardfitError:
        return {"gen_tokens_per_s": None, "speed_note": "no vLLM environment (scripts/make-vllm-env.sh)"}
    result = bench_vllm(path, reference=reference, gen_tokens=32, batch=32)
    return {"gen_tokens_per_s": result["single_stream_tokens_per_s"],
            "batched_tokens_per_s": result["batched_tokens_per_s"], "speed_runtime": result["runtime"]}


def _nf4_speed(model_dir: Path, text) -> dict:
    from .runtimes import BitsAndBytesRuntime
    from .text import load_text

    runtime = BitsAndBytesRuntime(model_dir)
    try:
        body, _ = load_text(text, default="heldout")
        prompt = runtime.tokenize(body)[:256]
        return {"gen_tokens_per_s": runtime.generation_tokens_per_s(prompt, 32), "speed_runtime": runtime.name}
    finally:
        runtime.close()


def llama_imatrix_values(path: Path, source) -> dict:
    """An imatrix file as llama.cpp's quantize API takes it: mean squared input per column, by GGUF name."""
    from .imatrix import ImatrixFile, gguf_tensor_names

    names = gguf_tensor_names(source)
    return {names[hf]: means.numpy() for hf, means in ImatrixFile(path, source).means.items()}


def compare(model: str | Path | None = None, out: str | Path = "compare-out", map_path: str | Path | None = None,
            presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, text: str | Path | None = None,
            max_tokens: int = 2048, seq_len: int = 512, scan_tokens: int = 1024, progress: bool = True,
            log=print, imatrix: bool = False, baselines: tuple[str, ...] | list[str] = DEFAULT_BASELINES,
            speed: bool = True) -> dict:
    """Measure the shelf and cardfit's recipe at each of its sizes; writes compare.json/.md/.png in `out`.

    With `imatrix`, both sides round with the same importance matrix (collected over the calibration
    text): llama.cpp's presets through its quantize API, cardfit's map and pack through its own."""
    from .atomic import write_json, write_text
    from .formats import get_format
    from .pack import pack, reserve_bytes
    from .plan import plan, uniform_recipe
    from .scan import scan
    from .shelf import FTYPES, llama_quantize
    from .paths import guard_output, input_paths, model_paths
    from .sources import open_model, runnable

    for preset in presets:
        if preset not in FTYPES:
            raise CardfitError(f"llama.cpp has no preset '{preset}'", "known: " + ", ".join(FTYPES))
    for name in baselines:
        if name not in BASELINES:
            raise CardfitError(f"unknown baseline '{name}'", "known: " + ", ".join(BASELINES) + " (or none)")
    source = open_model(model)
    out = guard_output(out, {"the model": model_paths(source), "the map": input_paths(map_path),
                             "the held-out text": input_paths(text)}, kind="workdir")
    source = runnable(source)
    out.mkdir(parents=True, exist_ok=True)
    reference = model or "default"
    tag = "-imatrix" if imatrix else ""
    rounding = "imatrix" if imatrix else "rtn"
    imatrix_file = out / "imatrix.gguf" if imatrix else None
    if imatrix and not imatrix_file.exists():
        from .imatrix import collect_imatrix

        if log:
            log(f"collecting the importance matrix over {scan_tokens} calibration tokens -> {imatrix_file}")
        collect_imatrix(model, None, scan_tokens, seq_len, imatrix_file, progress=progress)
    if map_path is None:
        map_path = out / f"sensitivity{tag}.json"
        if log:
            log(f"scanning {DEFAULT_MAP_FORMATS} ({rounding}) over {scan_tokens} tokens -> {map_path}")
        scan(model, None, scan_tokens, DEFAULT_MAP_FORMATS, "layer", map_path, resume=True, rounding=rounding,
             seq_len=seq_len, progress=progress)
    else:
        from .maps import read_map

        if read_map(map_path).get("rounding", "rtn") != rounding:
            raise CardfitError(f"{map_path} was scanned with {read_map(map_path).get('rounding')} rounding, "
                               f"this comparison rounds with {rounding}",
                               "scan the map with the same --rounding, or leave --map out")
    f16 = out / "f16.gguf"
    if not f16.exists():
        pack(uniform_recipe(source, "F16"), model, f16, progress=False, smoke=False)
    reserve = reserve_bytes(source, "llama.cpp", scratch_dir=out)
    shelf_imatrix = llama_imatrix_values(imatrix_file, source) if imatrix else None

    def say(row: dict) -> None:
        if not log:
            return
        if "error" in row:
            log(f"{row['name']:<32} {row['error']}")
            return
        versus = f"  (KLD {-row['kld_reduction']:+.1%} vs {row['against']})" if row.get("kld_reduction") is not None else ""
        log(f"{row['name']:<32} {format_bytes(row['bytes']):>11}  KLD {row['kld_mean']:.4f}  top-1 {row['top1']:.2%}"
            + versus)

    def gguf_row(name: str, kind: str, path: Path, **extra) -> dict:
        row = {"name": name, "kind": kind, **extra, "bytes": path.stat().st_size,
               **_measure(path, reference, text, max_tokens, seq_len)}
        if speed:
            row.update(_gguf_speed(path))
        return row

    def cardfit_row(against: list[dict], label: str) -> dict:
        """cardfit's optimum whose whole GGUF is no larger than the smallest of `against`."""
        limit = min(r["bytes"] for r in against)
        best = min(against, key=lambda r: r["kld_mean"])
        name = f"cardfit <= {label}"
        try:
            recipe = plan(map_path, limit, reserve_bytes=reserve)
        except CardfitError as exc:
            return {"name": name, "kind": "cardfit", "against": best["name"], "error": str(exc)}
        mine = out / f"cardfit{tag}-{label}.gguf"
        pack(recipe, model, mine, force=True, progress=False, smoke=False, imatrix=imatrix_file)  # measured below
        row = gguf_row(name, "cardfit", mine, against=best["name"], predicted_damage=recipe["predicted_damage"])
        row["kld_reduction"] = 1 - row["kld_mean"] / best["kld_mean"] if best["kld_mean"] > 0 else None
        return row

    rows = [gguf_row("llama.cpp F16 (runtime floor)", "floor", f16)]
    say(rows[-1])
    for preset in presets:
        shelf_file = out / f"shelf{tag}-{preset}.gguf"
        if not shelf_file.exists():
            llama_quantize(f16, shelf_file, preset, imatrix=shelf_imatrix)
        shelf = gguf_row(f"llama.cpp {preset}" + (" imatrix" if imatrix else ""), "shelf", shelf_file, preset=preset)
        rows += [shelf, cardfit_row([shelf], preset)]
        say(shelf)
        say(rows[-1])
    four_bit = []
    for method in [m for m in baselines if m != "nf4"]:
        folder = out / f"w4a16-{method}"
        if not folder.exists():
            if log:
                log(f"packing uniform W4A16-g128 with {method} ({scan_tokens} calibration tokens) -> {folder}")
            pack(uniform_recipe(source, "W4A16-g128"), model, folder, method=method, max_tokens=scan_tokens,
                 seq_len=seq_len, progress=False, smoke=False)
        row = {"name": BASELINES[method], "kind": "baseline", "baseline": method,
               "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
               **_measure(folder, reference, text, max_tokens, seq_len)}
        if speed:
            row.update(_vllm_speed(folder, reference))
        four_bit.append(row)
        rows.append(row)
        say(row)
    if four_bit:
        rows.append(cardfit_row(four_bit, "W4A16-g128"))
        say(rows[-1])
    if "nf4" in baselines:
        nf4 = get_format("NF4")
        row = {"name": BASELINES["nf4"], "kind": "baseline", "baseline": "nf4",
               "bytes": sum(nf4.tensor_bytes(t.name, t.shape) for t in source.tensors()),
               **_measure(source.path, reference, text, max_tokens, seq_len, runtime="bitsandbytes")}
        if speed:
            row.update(_nf4_speed(source.path, text))
        rows += [row, cardfit_row([row], "NF4")]
        say(row)
        say(rows[-1])
    result = {"model": source.path.name, "map": str(map_path), "rounding": rounding, "tokens": max_tokens,
              "seq_len": seq_len, "calibration_tokens": scan_tokens, "rows": rows}
    write_json(out / f"compare{tag}.json", result)
    write_text(out / f"compare{tag}.md", render_compare(result) + "\n")
    from .plots import plot_compare

    plot_compare(rows, out / f"compare{tag}.png")
    return result


def render_compare(result: dict) -> str:
    lines = ["| artifact | runtime | size | mean KLD | p99 KLD | top-1 | perplexity | gen tok/s | KLD vs the shelf |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | | — | {r['error']} | | | | | |")
            continue
        reduction = (f"{-r['kld_reduction']:+.1%} vs {r['against']}" if r.get("kld_reduction") is not None else "")
        speed = f"{r['gen_tokens_per_s']:.1f}" if r.get("gen_tokens_per_s") is not None else "—"
        lines.append(f"| {r['name']} | {r['runtime']} | {format_bytes(r['bytes'])} | {r['kld_mean']:.4f} ± "
                     f"{r['kld_stderr']:.4f} | {r['kld_p99']:.4f} | {r['top1']:.2%} | {r['perplexity']:.3f} | "
                     f"{speed} | {reduction} |")
    ref = next((r["reference_perplexity"] for r in result["rows"] if "reference_perplexity" in r), None)
    if ref is not None:
        lines.append(f"\nReference perplexity {ref:.3f} over {result['tokens']} held-out tokens (chunks of "
                     f"{result['seq_len']}); rounding of the GGUF rows: "
                     f"{'importance matrix on both sides' if result.get('rounding') == 'imatrix' else 'RTN on both sides'}. "
                     "Size: the whole GGUF file; the checkpoint's safetensors; NF4's bytes in memory "
                     "(bitsandbytes quantizes at load). gen tok/s: single-stream greedy decoding in the row's runtime.")
    elsewhere = [r for r in result["rows"] if r.get("speed_runtime") and r["speed_runtime"] != r.get("runtime")]
    for runtime in sorted({r["speed_runtime"] for r in elsewhere}):
        names = ", ".join(r["name"] for r in elsewhere if r["speed_runtime"] == runtime)
        lines.append(f"— tok/s of {names}: measured in {runtime} (KLD in the runtime column).")
    notes = sorted({r["speed_note"] for r in result["rows"] if r.get("speed_note")})
    lines += [f"— tok/s: {note}." for note in notes]
    return "\n".join(lines)
