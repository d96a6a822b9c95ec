"""Stage 4: write the artifact the recipe says, for the runtime it was planned for.

GGUF (llama.cpp, Ollama) or compressed-tensors (vLLM), streamed one tensor or one layer group
at a time, with RTN or data-aware rounding (imatrix for GGUF, GPTQ for compressed-tensors).
The artifact is written under a temporary name and renamed into place only once it is
complete and its size is within the budget; an existing output is never replaced without
`force`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CardfitError
from ..units import format_bytes



def recipe_target(recipe: dict):
    """The target a recipe was planned for (older recipes name only the map's runtime)."""
    from ..targets import get_target

    return get_target(recipe.get("served_by") or recipe["runtime"])


def pack(recipe: str | Path | dict, model: str | Path | None = None, out: str | Path = "model.gguf",
         format: str | None = None, method: str = "rtn", calibration: str | Path | None = None,
         max_tokens: int = 4096, seq_len: int = 512, force: bool = False, device: str = "auto",
         progress: bool = True, smoke: bool = True, ceiling: float | None = None,
         imatrix: str | Path | None = None, gpu_memory: int | None = None) -> dict:
    """Pack `recipe` for `model`; returns a report (also what the CLI prints).

    `imatrix` is a llama.cpp importance matrix file (GGUF) to round with instead of collecting one."""
    from ..atomic import atomic_directory, atomic_paths
    from ..paths import guard_output, input_paths, model_paths
    from ..recipes import check_model, read_recipe, tensor_formats, validate_recipe
    from ..sources import open_model, runnable

    if isinstance(recipe, dict):
        validate_recipe(recipe)
        data = recipe
    else:
        data = read_recipe(recipe)
    from ..targets import all_targets

    target = recipe_target(data)
    fmt = format or target.artifact
    if fmt not in {t.artifact for t in all_targets(packs=True)}:
        raise CardfitError(f"unknown pack format '{fmt}'", "use --format gguf or --format compressed-tensors")
    if target.artifact != fmt:
        raise CardfitError(f"the recipe was planned for {target.name}, which does not load {fmt}",
                           f"pack it as --format {target.artifact}, or plan from a map of that runtime")
    if imatrix is not None:
        if "imatrix" not in target.pack_methods or method not in ("rtn", "imatrix"):
            raise CardfitError(f"--imatrix rounds {' '.join(sorted({t.artifact for t in all_targets(packs=True) if 'imatrix' in t.pack_methods}))} types only",
                               "pack with --format gguf, without --method")
        method = "imatrix"
    if method not in target.pack_methods:
        raise CardfitError(f"--method {method} does not apply to {fmt}",
                           f"{fmt} takes --method " + " or ".join(target.pack_methods))
    source = open_model(model)
    out = guard_output(out, {"the model": model_paths(source),
                             "the recipe": [] if isinstance(recipe, dict) else input_paths(recipe),
                             "the calibration text": input_paths(calibration), "the imatrix": input_paths(imatrix)},
                       kind="file" if fmt == "gguf" else "dir")
    for name in target.beside(out, data) if target.beside else {}:  # files written next to the artifact
        guard_output(out.parent / name, {"the model": model_paths(source)}, flag=f"the {name} beside --out")
    if out.exists() and not force:
        raise CardfitError(f"{out} exists", "pass --force to replace it, or choose another --out")
    source = runnable(source)
    check_model(data, source)
    refuse_unpackable(source, fmt)
    formats = tensor_formats(data, source)
    target.refuse_expert_formats(formats)
    budget = int(data["budget"]["weight_budget_bytes"])
    if imatrix is not None:
        from ..imatrix import ImatrixFile

        calib = ImatrixFile(imatrix, source)
        calib.require(formats, source)
    else:
        # statistics for the asked rounding, and the imatrix of any type that cannot round without one
        methods = {f.method_for(method) for f in formats.values()} - {"rtn"}
        calib = _calibration(source, methods, calibration, max_tokens, seq_len, device, gpu_memory)
    bar = _bar(progress, len(formats))
    tick = (lambda name: (bar.set_description(name), bar.update(1))) if bar else None
    try:
        if fmt == "gguf":
            from .gguf_pack import write_gguf

            beside = target.beside(out, data) if target.beside else {}
            with atomic_paths(out, *(out.parent / name for name in beside)) as (tmp, *beside_tmps):
                result = write_gguf(tmp, source, formats, budget, method, calib, name=out.stem, progress=tick)
                result["smoke"] = _smoke(tmp, source, fmt, smoke, ceiling, bar)
                for path, text in zip(beside_tmps, beside.values()):
                    path.write_text(text, encoding="utf-8")
        else:
            from .compressed import write_compressed

            with atomic_directory(out) as tmp:
                result = write_compressed(tmp, source, formats, budget, method, calib, progress=tick)
                result["smoke"] = _smoke(tmp, source, fmt, smoke, ceiling, bar)
    finally:
        if bar:
            bar.close()
    from ..engine.calibrate import unvisited_warning

    warnings = result["warnings"] + unvisited_warning(getattr(calib, "unvisited", []))
    # What the budget holds: the whole GGUF file; for compressed-tensors the weights (headers stay on the host).
    counted = result["file_bytes"] if fmt == "gguf" else result["tensor_bytes"]
    return {"artifact": str(out), "target": target.name, "format": fmt, "method": method, "groups": len(data["groups"]),
            "file_bytes": result["file_bytes"], "tensor_bytes": result["tensor_bytes"], "counted_bytes": counted,
            "planned_bytes": data["bytes"], "weight_budget_bytes": budget, "margin_bytes": budget - counted,
            "predicted_damage": data["predicted_damage"], "warnings": warnings, "smoke": result["smoke"]}


def refuse_unpackable(source, artifact: str, layout: bool = False) -> None:
    """What cardfit cannot write yet, refused before any work (fit calls it before its scan); with `layout`,
    (a runnable source) also an architecture or config llama.cpp's GGUF cannot hold or would compute
    differently (gguf_arch.ArchSpec's refusals)."""
    from ..checkpoint_map import fused_only
    from ..groups import expert_stack

    if artifact != "gguf" and any(expert_stack(t.name) for t in source.tensors()):
        reason = fused_only(str(source.config.get("model_type", "")))
        if reason:
            raise CardfitError(reason, "plan for llama.cpp and pack as --format gguf")
    if artifact == "gguf" and layout:
        from .gguf_arch import ArchSpec

        ArchSpec.for_config(source.config)


def _smoke(path, source, fmt, enabled, ceiling, bar):
    """The corpse detector, run on the temporary artifact so a destroyed one never reaches --out."""
    if not enabled:
        return None
    from ..check import DEFAULT_CEILING, smoke_check

    if bar:
        bar.set_description("smoke check")
    report = smoke_check(path, source.path, fmt, ceiling or DEFAULT_CEILING)
    return {"perplexity": report["perplexity"], "tokens": report["tokens"], "ceiling": report["thresholds"]["ceiling"]}


def render_pack(report: dict) -> str:
    what = "file" if report["format"] == "gguf" else "weights"
    size = format_bytes(report["counted_bytes"])
    line = (f"packed {report['groups']} groups -> {report['artifact']} ({size} {what}), "
            f"weight budget {format_bytes(report['weight_budget_bytes'])}, "
            f"margin {format_bytes(report['margin_bytes'])} under")
    lines = [line]
    if report.get("smoke"):
        smoke = report["smoke"]
        lines.append(f"smoke test: perplexity {smoke['perplexity']:.4f} over {smoke['tokens']} tokens, "
                     f"ceiling {smoke['ceiling']:g} — passed")
    return "\n".join(lines + [f"warning: {w}" for w in report["warnings"]])


def _calibration(source, methods: set[str], calibration, max_tokens, seq_len, device, gpu_memory=None):
    if not methods:
        return None
    from ..engine.calibrate import LayerCalibration
    from ..text import load_text, load_tokenizer, token_chunks

    text, path = load_text(calibration)
    tokenizer = load_tokenizer(str(source.path))
    chunks = token_chunks(tokenizer, text, seq_len, max_tokens, source=str(path))
    return LayerCalibration(source, chunks, methods, device=device, gpu_memory=gpu_memory)


def _bar(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", dynamic_ncols=True, disable=None)


def reserve_bytes(source, runtime: str, scratch_dir: str | Path | None = None) -> int:
    """What the artifact holds beside tensor data, whatever the recipe: for GGUF the header (metadata,
    tokenizer, tensor table) plus the most alignment padding the tensors can need; 0 for vLLM, whose
    safetensors headers never reach the GPU."""
    from ..targets import get_target

    if get_target(runtime).artifact != "gguf":
        return 0
    from ..formats import get_format
    from ..sizes import priced_tensors
    from ..sources import runnable
    from .gguf_pack import GgufPlan, header_bytes

    source = runnable(source)  # the header cardfit writes carries the runnable model's tokenizer

    any_format = get_format("Q8_0")  # the tensor table's size does not depend on the types chosen
    plan = GgufPlan(source, {t.name: any_format for t in priced_tensors(source)})
    return plan.reserve_bytes(header_bytes(source, plan, scratch_dir))


from ..stage import callable_stage  # noqa: E402

callable_stage(__name__)
