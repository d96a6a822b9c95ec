"""`compare`: cardfit's recipe against what people use today, at equal bytes, all measured.

The shelf: each llama.cpp preset, quantized by llama.cpp's own `llama_model_quantize` from our
F16 conversion (exactly what `llama-quantize` writes), with or without an importance matrix; the
uniform W4A16 checkpoints people make for vLLM, rounded with RTN, GPTQ and AWQ; and bitsandbytes
NF4 as transformers loads it. For each size on the shelf cardfit plans the least-damage GGUF
recipe whose whole file is no larger, packs it, and every artifact runs in its own runtime
against the full-precision reference over the same held-out tokens. The F16 GGUF is measured
too: it is the floor the runtime itself adds (llama.cpp's arithmetic against the reference's).

A rerun into the same `out` reuses what it already made — the F16 GGUF, the imatrix, the map, the
shelf presets, cardfit's packed files, the W4A16 checkpoints — only when `compare-state.json`
records that file under the key this run would make it with (the model, the calibration text and
every setting that shapes its bytes); another model or setting re-makes it. Measurements are
never reused: every row is measured afresh.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from .errors import CardfitError
from .groups import EMBED, LM_HEAD
from .schemas import content_hash
from .units import format_bytes

DEFAULT_PRESETS = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K")
# Scanned beside the k-quants when an i-quant preset is compared, so cardfit may use what the preset uses.
I_QUANT_MAP_FORMATS = "IQ4_XS,IQ3_S,IQ3_XXS,IQ2_S,IQ2_XS,IQ2_XXS,IQ1_M"
I_QUANT_PRESETS = ("IQ2_XXS", "IQ2_M", "IQ3_XXS", "IQ3_M", "IQ4_XS")  # the low-bit shelf (compare --presets)
# Uniform 4-bit baselines: W4A16 group 128 (llm-compressor's preset) by rounding method, and NF4.
BASELINES = {"rtn": "W4A16-g128 RTN", "gptq": "W4A16-g128 GPTQ", "awq": "W4A16-g128 AWQ",
             "nf4": "bitsandbytes NF4"}
DEFAULT_BASELINES = tuple(BASELINES)
# What each cached artifact in --out was made from; a rerun reuses a file only when its key is equal.
STATE = "compare-state.json"
# what compare writes in its directory (paths.guard_output patterns): an input there would be overwritten
COMPARE_WRITES = (STATE, "imatrix.gguf", "sensitivity*.json", "weight-map*.json", "f16.gguf", "shelf*.gguf",
                  "cardfit*.gguf", "uniform-body*.gguf", "weight-allocator*.gguf", "w4a16-*", "w4a16-*/*", "compare*")
STATE_VERSION = 1


def model_identity(source) -> dict:
    """The model as cached artifacts depend on it: its fingerprint (config and tensor index) and the
    size and modification time of every file it reads, so weights re-saved under the same config —
    another seed, a fine-tune — count as another model without reading them all back."""
    path = Path(source.path)
    files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")) if path.is_dir() else [path]
    stats = [(p.name, p.stat()) for p in files]  # stat() follows a hub snapshot's links to its blobs
    return {"fingerprint": source.fingerprint(), "files": [[name, st.st_size, st.st_mtime_ns] for name, st in stats]}


def artifact_key(artifact: str, **made_from) -> str:
    """The one key of a cached artifact: sha256 of its kind and everything that determines its bytes."""
    blob = json.dumps({"artifact": artifact, **made_from}, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(blob.encode()).hexdigest()


class ArtifactCache:
    """`compare-state.json` in `out`: file name -> the key it was made with. A file is reused only when
    it exists and its recorded key equals the one asked for; anything else (no record, another model
    or setting, an unreadable record) re-makes it. A key is dropped before its file is re-made and
    recorded only once the new file is in place, so an interrupted re-make is never taken as done."""

    def __init__(self, out: Path):
        self.path = out / STATE
        self.keys: dict[str, str] = {}
        try:
            state = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            state = None
        if isinstance(state, dict) and state.get("cardfit_compare_state") == STATE_VERSION:
            artifacts = state.get("artifacts")
            if isinstance(artifacts, dict):
                self.keys = {k: v for k, v in artifacts.items() if isinstance(k, str) and isinstance(v, str)}

    def fresh(self, path: Path, key: str) -> bool:
        return path.exists() and self.keys.get(path.name) == key

    def forget(self, path: Path) -> None:
        if self.keys.pop(path.name, None) is not None:
            self._write()

    def record(self, path: Path, key: str) -> None:
        self.keys[path.name] = key
        self._write()

    def _write(self) -> None:
        from .atomic import write_json

        write_json(self.path, {"cardfit_compare_state": STATE_VERSION, "artifacts": self.keys})

    def ensure(self, path: Path, key: str, make) -> bool:
        """Reuse `path` if it was made with `key`; otherwise `make()` it (atomically, over a stale one)
        and record the key. Returns whether it was made."""
        if self.fresh(path, key):
            return False
        self.forget(path)
        make()
        self.record(path, key)
        return True


def _measure(path: Path, reference, text, max_tokens: int, seq_len: int, runtime: str | None = None,
             reference_logits=None) -> dict:
    from .check import check

    start = time.perf_counter()
    report = check(path, reference, text, max_tokens, seq_len, runtime=runtime, reference_logits=reference_logits)
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
    from .targets.vllm_env import vllm_python

    try:
        vllm_python()
    except CardfitError:
        return {"gen_tokens_per_s": None, "speed_note": "no vLLM environment (scripts/make-vllm-env.sh)"}
    result = bench_vllm(path, reference=reference, gen_tokens=32, batch=32)
    return {"gen_tokens_per_s": result["single_stream_tokens_per_s"],
            "batched_tokens_per_s": result["batched_tokens_per_s"], "speed_runtime": result["runtime"]}


def _nf4_speed(model_dir: Path, text) -> dict:
    from .targets.runtimes import BitsAndBytesRuntime
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


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return getattr(llama_cpp, "__version__", None)


def _quantize_atomically(f16: Path, out: Path, preset: str, imatrix: dict | None) -> None:
    """llama.cpp's quantize into a temporary file renamed over `out`: a stale or half-written preset never stays."""
    from .atomic import atomic_path
    from .targets.shelf import llama_quantize

    with atomic_path(out) as tmp:
        llama_quantize(f16, tmp, preset, imatrix=imatrix)


def _refuse_foreign_map(map_path, source, rounding: str) -> None:
    """A --map compare cannot plan llama.cpp rows from, refused before any work: another runtime's, another
    model's, or another rounding's."""
    from .maps import check_map_model, read_map
    from .targets import for_artifact

    shelf = for_artifact("gguf").name  # whose presets compare meets
    data = read_map(map_path)
    if data.get("runtime", shelf) != shelf:
        raise CardfitError(f"{map_path} was scanned for {data['runtime']}, and compare meets {shelf}'s presets",
                           f"scan a {shelf} map (GGUF formats), or leave --map out")
    check_map_model(data, source)
    if data.get("rounding", "rtn") != rounding:
        raise CardfitError(f"{map_path} was scanned with {data.get('rounding')} rounding, this comparison rounds "
                           f"with {rounding}", "scan the map with the same --rounding, or leave --map out")


def compare(model: str | Path | None = None, out: str | Path = "compare-out", map_path: str | Path | None = None,
            presets: tuple[str, ...] | list[str] = DEFAULT_PRESETS, text: str | Path | None = None,
            max_tokens: int = 2048, seq_len: int = 512, scan_tokens: int = 1024, progress: bool = True,
            log=print, imatrix: bool = False, baselines: tuple[str, ...] | list[str] = DEFAULT_BASELINES,
            speed: bool = True, weight_allocator: bool = True) -> dict:
    """Measure the shelf and cardfit's recipe at each of its sizes; writes compare.json/.md/.png in `out`.

    With `imatrix`, both sides round with the same importance matrix (collected over the calibration
    text): llama.cpp's presets through its quantize API, cardfit's map and pack through its own.
    With `weight_allocator`, each preset size also gets the plan of a weight-signal map over the same
    formats (scan --method weight): the allocator llama.cpp's --target-size stands for, on our menu."""
    from .atomic import write_json, write_text
    from .formats import get_format
    from .pack import pack, reserve_bytes
    from .plan import plan, uniform_recipe
    from .scan import scan
    from .targets.shelf import FTYPES, preset_needs_imatrix
    from .paths import guard_output, input_paths, model_paths, work_directory
    from .sources import open_model, runnable
    from .text import load_text, text_hash

    from .text import refuse_short_budget

    refuse_short_budget(max_tokens, seq_len)  # the held-out check's, and the scan's and packs' calibration
    refuse_short_budget(scan_tokens, seq_len, "--scan-tokens")
    if not presets:
        raise CardfitError("--presets names no llama.cpp preset", "name one or more, e.g. --presets "
                           + ",".join(DEFAULT_PRESETS))
    for preset in presets:
        if preset not in FTYPES:
            raise CardfitError(f"llama.cpp has no preset '{preset}'", "known: " + ", ".join(FTYPES))
        if preset_needs_imatrix(preset) and not imatrix:
            raise CardfitError(f"llama.cpp makes {preset} only with an importance matrix",
                               "add --imatrix (both sides then round with the same one)")
    from .targets import for_artifact

    menu = for_artifact("gguf").whole_menu.split(",")  # every type llama.cpp stores, the source's own grid included
    if any(preset.startswith("IQ") for preset in presets):
        menu += [f for f in I_QUANT_MAP_FORMATS.split(",") if f not in menu]
    map_formats = ",".join(menu)
    for name in baselines:
        if name not in BASELINES:
            raise CardfitError(f"unknown baseline '{name}'", "known: " + ", ".join(BASELINES) + " (or none)")
    source = open_model(model)
    out = guard_output(out, {"the model": model_paths(source), "the map": input_paths(map_path),
                             "the held-out text": input_paths(text)}, kind="workdir", writes=COMPARE_WRITES)
    source = runnable(source)
    if map_path is not None:
        _refuse_foreign_map(map_path, source, "imatrix" if imatrix else "rtn")
    with work_directory(out):
        reference = model or "default"
        from .check import ReferenceLogits

        ref_logits = ReferenceLogits(reference)  # one reference forward per chunk for every row
        tag = "-imatrix" if imatrix else ""
        rounding = "imatrix" if imatrix else "rtn"
        cache = ArtifactCache(out)
        # Everything a cached file's bytes depend on: the model, and the calibration text scan, imatrix and
        # the W4A16 roundings read (the bundled one; the held-out `text` only feeds measurements, never cached).
        made_from = {"model": model_identity(source), "calibration": text_hash(load_text(None)[0])}
        calibrated = {**made_from, "tokens": scan_tokens, "seq_len": seq_len}
        imatrix_file = out / "imatrix.gguf" if imatrix else None
        imatrix_key = artifact_key("imatrix", **calibrated) if imatrix else None
        if imatrix:
            from .imatrix import collect_imatrix

            def collect() -> None:
                if log:
                    log(f"collecting the importance matrix over {scan_tokens} calibration tokens -> {imatrix_file}")
                collect_imatrix(model, None, scan_tokens, seq_len, imatrix_file, progress=progress)

            cache.ensure(imatrix_file, imatrix_key, collect)
        def scanned(path: Path, formats: str, method: str, what: str) -> None:
            """A map of this very job in `path`: resumed when its key matches, else started over (the key goes
            down before the scan, so an interrupted scan of this job resumes on the next run)."""
            key = artifact_key("map" if method == "exact" else f"{method}-map", **calibrated, formats=formats,
                               rounding=rounding, group_by="layer")
            if not cache.fresh(path, key):
                cache.forget(path)
                path.unlink(missing_ok=True)
                cache.record(path, key)
            if log:
                log(f"{what} {formats} ({rounding}) over {scan_tokens} tokens -> {path}")
            scan(model, max_tokens=scan_tokens, formats=formats, group_by="layer", out=path, resume=True,
                 rounding=rounding, seq_len=seq_len, progress=progress, method=method)

        from .maps import read_map

        if map_path is None:
            map_path = out / f"sensitivity{tag}.json"
            scanned(map_path, map_formats, "exact", "scanning")
        weight_map = None
        if weight_allocator:  # the weight signal over the very formats cardfit's map offers
            weight_map = out / f"weight-map{tag}.json"
            scanned(weight_map, ",".join(read_map(map_path)["formats"]), "weight", "pricing by the weight signal")
        f16 = out / "f16.gguf"
        f16_key = artifact_key("f16", **made_from)
        cache.ensure(f16, f16_key, lambda: pack(uniform_recipe(source, "F16"), model, f16, force=True, progress=False,
                                                smoke=False))
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
                   **_measure(path, reference, text, max_tokens, seq_len, reference_logits=ref_logits)}
            if speed:
                row.update(_gguf_speed(path))
            return row

        recipe_kinds = {  # kind -> (row name, file name prefix, how the recipe is made at a byte limit)
            "cardfit": ("cardfit", "cardfit", lambda limit: plan(map_path, limit, reserve_bytes=reserve)),
            "uniform-body": ("uniform body + embed/head", "uniform-body",
                             lambda limit: best_uniform_body(map_path, limit, reserve)),
            "weight-allocator": ("weight-error allocator", "weight-allocator",
                                 lambda limit: plan(weight_map, limit, reserve_bytes=reserve)),
        }

        def recipe_row(against: list[dict], label: str, kind: str) -> dict:
            """A recipe whose whole GGUF is no larger than the smallest of `against`: cardfit's optimum,
            the best uniform body + one embedding/head type, or the weight-signal map's optimum."""
            limit = min(r["bytes"] for r in against)
            best = min(against, key=lambda r: r["kld_mean"])
            title, prefix, make_recipe = recipe_kinds[kind]
            name = f"{title} <= {label}"
            try:
                recipe = make_recipe(limit)
            except CardfitError as exc:
                return {"name": name, "kind": kind, "against": best["name"], "error": str(exc)}
            mine = out / f"{prefix}{tag}-{label}.gguf"
            recipe_hash = content_hash(recipe)
            packed = {}

            def make() -> None:
                start = time.perf_counter()
                pack(recipe, model, mine, force=True, progress=False, smoke=False, imatrix=imatrix_file)  # measured below
                packed["pack_seconds"] = round(time.perf_counter() - start, 1)

            cache.ensure(mine, artifact_key("cardfit", **made_from, recipe=recipe_hash, imatrix=imatrix_key), make)
            row = gguf_row(name, kind, mine, against=best["name"], predicted_damage=recipe["predicted_damage"],
                           formats={g["name"]: g["format"] for g in recipe["groups"]}, **packed)
            row["kld_reduction"] = 1 - row["kld_mean"] / best["kld_mean"] if best["kld_mean"] > 0 else None
            return row

        def cardfit_row(against: list[dict], label: str) -> dict:
            return recipe_row(against, label, "cardfit")

        rows = [gguf_row("llama.cpp F16 (runtime floor)", "floor", f16)]
        say(rows[-1])
        for preset in presets:
            shelf_file = out / f"shelf{tag}-{preset}.gguf"
            cache.ensure(shelf_file, artifact_key("shelf", f16=f16_key, preset=preset, imatrix=imatrix_key,
                                                  llama_cpp=llama_cpp_version()),
                         lambda: _quantize_atomically(f16, shelf_file, preset, shelf_imatrix))
            shelf = gguf_row(f"llama.cpp {preset}" + (" imatrix" if imatrix else ""), "shelf", shelf_file, preset=preset)
            say(shelf)
            simple = recipe_row([shelf], preset, "uniform-body")
            say(simple)
            rows += [shelf, simple]
            allocator = recipe_row([shelf], preset, "weight-allocator") if weight_allocator else None
            if allocator is not None:
                say(allocator)
                rows.append(allocator)
            mine = cardfit_row([shelf], preset)
            for other, key in ((simple, "kld_vs_uniform_body"), (allocator, "kld_vs_weight_allocator")):
                if other is not None and "error" not in mine and "error" not in other and other["kld_mean"] > 0:
                    mine[key] = 1 - mine["kld_mean"] / other["kld_mean"]
            say(mine)
            rows.append(mine)
        four_bit = []
        for method in [m for m in baselines if m != "nf4"]:
            folder = out / f"w4a16-{method}"

            def baseline(folder=folder, method=method) -> None:
                if log:
                    log(f"packing uniform W4A16-g128 with {method} ({scan_tokens} calibration tokens) -> {folder}")
                pack(uniform_recipe(source, "W4A16-g128"), model, folder, method=method, max_tokens=scan_tokens,
                     seq_len=seq_len, force=True, progress=False, smoke=False)

            cache.ensure(folder, artifact_key("w4a16", **calibrated, method=method), baseline)
            row = {"name": BASELINES[method], "kind": "baseline", "baseline": method,
                   "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
                   **_measure(folder, reference, text, max_tokens, seq_len, reference_logits=ref_logits)}
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
                   **_measure(source.path, reference, text, max_tokens, seq_len, runtime="bitsandbytes",
                               reference_logits=ref_logits)}
            if speed:
                row.update(_nf4_speed(source.path, text))
            rows += [row, cardfit_row([row], "NF4")]
            say(row)
            say(rows[-1])
        result = {"model": source.path.name, "source_types": source.source_types(), "map": str(map_path),
                  "weight_map": None if weight_map is None else str(weight_map),
                  "rounding": rounding, "tokens": max_tokens, "seq_len": seq_len, "calibration_tokens": scan_tokens,
                  "rows": rows}
        write_json(out / f"compare{tag}.json", result)
        write_text(out / f"compare{tag}.md", render_compare(result) + "\n")
        from .plots import plot_compare

        plot_compare(rows, out / f"compare{tag}.png")
        return result


def best_uniform_body(map_path, limit: int, reserve: int) -> dict:
    """The smarter shelf row: every decoder layer in one format and the embedding and head in one
    (possibly another), searched exhaustively over the map's formats for the least predicted damage
    whose whole file is no larger than `limit`. What cardfit gains beyond it is what per-group
    allocation adds; what it gains up to it is one decision a user could make by hand."""
    from .maps import read_map
    from .plan import plan

    data = read_map(map_path)
    names = [g["name"] for g in data["groups"]]
    outer = [n for n in (EMBED, LM_HEAD) if n in names]
    best = None
    for body in data["formats"]:
        for edge in data["formats"]:
            pins = {"layers.*": body, **{n: edge for n in outer}}
            try:
                recipe = plan(data, limit, pins=pins, reserve_bytes=reserve)
            except CardfitError:
                continue
            if best is None or recipe["predicted_damage"] < best["predicted_damage"]:
                best = recipe
    if best is None:
        raise CardfitError(f"no uniform body fits {format_bytes(limit)}", "only a per-group recipe does")
    return best


def source_type_table(result: dict) -> str:
    """Per group: what the source stored it as, and the format each recipe row gave it (a recipe that
    lands a group on its own source type is re-quantizing onto the grid the reference sits on)."""
    recipes = [r for r in result["rows"] if r.get("formats")]
    types = result.get("source_types") or {}
    if not recipes:
        return ""
    groups = list(recipes[0]["formats"])
    lines = ["| group | source type | " + " | ".join(r["name"] for r in recipes) + " |",
             "|---|---|" + "---|" * len(recipes)]
    for group in groups:
        cells = []
        for r in recipes:
            fmt = r["formats"].get(group, "")
            cells.append(f"**{fmt}**" if fmt in types.get(group, [])[:1] else fmt)
        lines.append(f"| {group} | {'/'.join(types.get(group, [])) or '—'} | " + " | ".join(cells) + " |")
    lines.append("\nSource type: what the model's file stores each group's matrices as, most bytes first; "
                 "**bold**: the recipe gives the group its own source type (its weights go back onto their grid).")
    return "\n".join(lines)


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
                     f"{r['kld_stderr'] if r['kld_stderr'] is not None else float('nan'):.4f} | {r['kld_p99']:.4f} | {r['top1']:.2%} | {r['perplexity']:.3f} | "
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
    for key, what in (("kld_vs_uniform_body", "the best uniform body + embed/head"),
                      ("kld_vs_weight_allocator", "the weight-error allocator (the weight signal's plan)")):
        margins = [r for r in result["rows"] if r.get(key) is not None]
        if margins:
            lines.append(f"— cardfit vs {what} at the same size: " + ", ".join(
                f"{r['name'].split('<= ')[-1]} {-r[key]:+.1%}" for r in margins) + ".")
    table = source_type_table(result)
    if table:
        lines += ["", table]
    return "\n".join(lines)


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
