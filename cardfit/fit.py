"""Stage 6: the whole job in one call — budget, scan, plan, pack, check — into one directory.

Every stage leaves its documented artifact in DIR, and a rerun skips what is finished: the scan
resumes its own checkpoint (or returns at once when complete), the plan is re-solved (seconds),
and the artifact is re-packed only when the recipe changed (`fit.json` records the recipe hash
each artifact was packed from). Ctrl-C at any point leaves a state a rerun continues.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import CardfitError
from .scan.signals import SIGNALS, adaptive_signal, signal_of_map
from .schemas import content_hash
from .units import format_bytes

# The embedded model (SmolLM2-135M, 136 MiB at Q8_0) on a ceiling that squeezes it: 768 MiB minus
# llama.cpp's overhead and an 8k-token KV cache leaves ~97 MiB for weights, between uniform Q4_K
# and Q8_0, so the solver has something to decide. A model of your own takes --vram.
DEFAULT_VRAM = "768MiB"
IMATRIX_FILE = "imatrix.gguf"  # --method imatrix: the scan's importance matrix, shared by every size
FIT_FILES = ("fit.json", "sensitivity.json", "sensitivity.png", "recipe.json", "frontier.json", "frontier.png",
             "check.json", "report.md")


def _read_state(path: Path) -> dict:
    """fit.json, the run's own record; one that is not what fit writes is set aside, not trusted."""
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        state = None
    if not isinstance(state, dict) or not all(isinstance(state.get(k), (dict, str, type(None)))
                                              for k in ("packed_from", "pack", "check", "refined_from")):
        raise CardfitError(f"{path} is not a record cardfit fit wrote",
                           "remove it (the next run re-packs and re-checks) or choose another --out")
    return state


def _say(log, text: str) -> None:
    if log:
        log(text)


def scan_methods() -> tuple[str, ...]:
    """fit's --scan-method words, its default first: adaptive, every registered signal alone, exact."""
    return ("adaptive", *SIGNALS, "exact")


def scan_menu(target, source, tensor_budget: int, method: str = "exact") -> str:
    """fit's scan formats. Exact: the target's default menu plus the quantized types the source itself
    stores (re-quantizing a tensor onto its own grid costs ~0, every other type far more; the embedded
    model's Q4_1 layers are the case). Otherwise the target's whole menu. Either way the low-bit ladder too
    when the tensors cannot fit `tensor_budget` without it (a 32B on a 12 GB card). A cheap signal (adaptive, or
    one alone) prices the whole menu too."""
    from .formats import get_format, parse_formats
    from .sizes import priced_tensors

    if method != "exact":
        names = (target.whole_menu or target.default_scan_formats).split(",")
    else:
        names = target.default_scan_formats.split(",")
        own = {t for types in source.source_types().values() for t in types}
        names += sorted((t for t in own if t in target.formats and t not in names and get_format(t).bits < 16),
                        key=lambda t: -get_format(t).bits)
    default = parse_formats(",".join(names))
    floor = sum(min(f.tensor_bytes(t.name, t.shape) for f in default) for t in priced_tensors(source))
    if floor > tensor_budget and target.low_bit_scan_formats:
        names += [f for f in target.low_bit_scan_formats.split(",") if f not in names]
    return ",".join(names)


def _scanned(path: Path) -> tuple[str | None, str | None, str | None]:
    """The scan method, rounding and adaptive signal of a fit directory's map, so a rerun resumes it as it was
    begun (None: no readable map or value; scan itself then refuses or starts one)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        method, rounding = data["damage"]["method"], data.get("rounding")
        signal = adaptive_signal(data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None, None, None
    word = method.split(" ", 1)[0] if isinstance(method, str) else None  # damage.method's first word names it
    return word if word in scan_methods() else None, rounding if isinstance(rounding, str) else None, signal


def parse_sizes(sizes: str | list[int]) -> list[tuple[str, int]]:
    """[(directory name, bytes)] of `--size SIZE[,SIZE...]`, largest first: each a file size the artifact must
    not exceed; refuses an empty, unreadable or repeated size."""
    import re

    from .units import parse_bytes

    texts = sizes.split(",") if isinstance(sizes, str) else [str(int(s)) for s in sizes]
    if not texts or any(not t.strip() for t in texts):
        raise CardfitError(f"--size '{sizes}' names no size", "pass --size SIZE[,SIZE...], e.g. --size 900MB,1.2GB")
    parsed = [(re.sub(r"[^0-9A-Za-z.+-]+", "", t), parse_bytes(t.strip(), "--size")) for t in texts]
    if any(size < 1 for _, size in parsed):
        raise CardfitError(f"--size '{sizes}' holds a size under one byte", "give each size in bytes or units, "
                           "e.g. --size 900MB")
    if len({b for _, b in parsed}) != len(parsed) or len({n for n, _ in parsed}) != len(parsed):
        raise CardfitError(f"--size '{sizes}' names one size twice", "name each size once")
    return [(f"size-{name}", size) for name, size in sorted(parsed, key=lambda p: -p[1])]


@dataclass
class _Job:
    """What every delivery of one fit run shares: the opened model, its map and how to pack and check."""

    model: str | Path | None
    source: object
    target: object
    sensitivity: dict
    map_path: Path
    reserve: int
    settings: dict  # fit's own arguments: format, method, calibration, max_tokens, seq_len, full_check, ...
    log: object
    imatrix: Path | None = None  # the importance matrix every artifact rounds with (--method imatrix)
    reference: object = None  # check.ReferenceLogits shared by every size's check


def fit(model: str | Path | None = None, vram: str | int | None = None, context: int = 8192, batch: int = 1,
        kv_dtype: str = "f16", format: str = "gguf", out: str | Path = "cardfit-out", formats: str | None = None,
        calibration: str | Path | None = None, max_tokens: int = 1024, seq_len: int = 512, method: str = "rtn",
        full_check: bool = False, check_tokens: int = 2048, device: str = "auto", progress: bool = True,
        log=print, refine: bool = False, refine_tokens: int | None = None, ray: str | None = None,
        workers: int | None = None, scan_method: str | None = None, group_by: str | None = None,
        sizes: str | list[int] | None = None) -> dict:
    """Budget -> scan -> plan -> pack -> check for `model` on a `vram` ceiling; returns the run's summary.
    `scan_method` "adaptive" (the default) prices the target's whole menu by the fast (Fisher) signal and
    measures exactly the cells that decide the plan at this budget; "fast" plans on the Fisher's prices alone
    (no cell measured: minutes on a model where measuring takes hours); "exact" measures every cell of the
    target's default menu and the source's own types (the default with `ray`, and for a directory whose
    map was scanned that way). With `ray`, the scan's group sweeps run on that Ray cluster
    (cluster.py), exactly; the rest stays here. `group_by` None: per tensor for a mixture-of-experts model
    (each expert stack, attention matrix and shared expert its own group: the MoE recipe's whole point) and
    for the fast scan (the Fisher prices a tensor as cheaply as a layer, and its per-tensor plans beat its
    per-layer ones on the 1.5B: docs/benchmarks.md), per layer otherwise. `sizes` ("900MB,1.2GB", instead of `vram`): one scan for all, then the best artifact
    no larger than each size in its own directory (out/size-900MB/...); the summary's "sizes" lists them.
    `method` "imatrix": the scan measures imatrix rounding too (a directory whose map was begun with another
    rounding keeps it) and leaves out/imatrix.gguf, of its own calibration tokens, that every artifact is packed
    with: recorded on the adaptive scan's pricing walk, so one calibration forward serves scan and packs."""
    from .budget import budget as compute_budget
    from .budget import render_budget
    from .pack import refuse_unpackable, reserve_bytes
    from .paths import guard_output, input_paths, model_paths, work_directory
    from .plots import plot_sensitivity
    from .scan import ROUNDINGS, SIGNALS, scan
    from .sources import open_model, runnable
    from .targets import all_targets, for_artifact

    begun_method, begun_rounding, begun_signal = _scanned(Path(out) / "sensitivity.json")
    if scan_method is None:
        scan_method = begun_method or ("exact" if ray is not None else "adaptive")
    if scan_method not in scan_methods():
        raise CardfitError(f"unknown --scan-method '{scan_method}'", "use --scan-method " + ", ".join(scan_methods()))
    if group_by not in (None, "layer", "tensor"):
        raise CardfitError(f"unknown --group-by '{group_by}'", "use --group-by layer or --group-by tensor")
    if ray is not None and scan_method != "exact":
        raise CardfitError("--ray spreads the exact scan's group sweeps", "drop --ray, or use --scan-method exact")
    if ray is None and workers is not None:
        raise CardfitError("--workers spreads the scan over Ray", "add --ray (local, auto or ADDRESS)")
    if sizes is not None and vram is not None:
        raise CardfitError("--size and --vram both set the budget", "give the card's --vram or the file --size, not both")
    labelled = parse_sizes(sizes) if sizes is not None else None
    if ray is not None:  # refused before anything is written, as scan refuses it
        from .scan.cluster import check

        check(ray, None, device)
    target = for_artifact(format)
    runtime = target.name
    if method not in target.pack_methods:  # pack's own rule, before the scan rather than after it
        raise CardfitError(f"--method {method} does not apply to {format}",
                           f"{format} takes --method " + " or ".join(target.pack_methods))
    if vram is None and labelled is None:
        if model is not None:
            raise CardfitError("--vram is required for a model of your own",
                               "pass the card's memory, e.g. --vram 24GiB, or the file's --size")
        vram = DEFAULT_VRAM
    source = open_model(model)
    refuse_unpackable(source, target.artifact)
    files = FIT_FILES + tuple(t.artifact_name for t in all_targets(packs=True))
    writes = files + ((IMATRIX_FILE,) if method == "imatrix" else ()) + tuple(
        f"{label}/{name}" for label, _ in labelled or () for name in files)
    out = guard_output(out, {"the model": model_paths(source), "the calibration text": input_paths(calibration)},
                       kind="workdir", writes=writes)
    for folder in [out] + [out / label for label, _ in labelled or ()]:  # a state fit did not write: refused now
        _read_state(folder / "fit.json")
    source = runnable(source)
    refuse_unpackable(source, target.artifact, layout=True)

    _say(log, "== 1. budget")
    if labelled is None:
        b = compute_budget(model, vram, context, batch, kv_dtype, runtime)
        _say(log, render_budget(b))
        budgets = [b.weight_budget_bytes]
    else:
        b = None
        budgets = [size for _, size in labelled]
        counted = ("each whole file, header and tokenizer included" if target.artifact == "gguf" else
                   "each artifact's tensors, as its budget counts them")
        _say(log, "sizes: " + ", ".join(format_bytes(size) for size in budgets) + f" ({counted}; no KV cache or "
             "runtime overhead is modelled)")

    reserve = reserve_bytes(source, runtime, scratch_dir=out if out.is_dir() else None)
    if formats is None:
        formats = scan_menu(target, source, min(budgets) - reserve, scan_method)
        _say(log, f"scanning {formats}")
    from .formats import parse_formats
    from .scan import refuse_unpriced

    asked = "imatrix" if method == "imatrix" else "rtn"
    rounding = begun_rounding if begun_rounding in ROUNDINGS else asked  # a directory's map resumes as begun
    refuse_unpriced(SIGNALS.get(scan_method), parse_formats(formats), rounding, "--scan-method", ("adaptive", "exact"))
    if group_by is None:
        from .groups import expert_stack

        moe = any(expert_stack(t.name) for t in source.tensors())
        group_by = "tensor" if moe or scan_method in SIGNALS else "layer"  # a signal prices per tensor for nothing
    _refuse_unreachable(source, formats, group_by, min(budgets), reserve,
                        "raise --vram, lower --context" if labelled is None else "raise --size")
    with work_directory(out):
        _say(log, f"\n== 2. scan ({scan_method}, groups per {group_by}, {max_tokens} calibration tokens; resumes "
                  f"{out / 'sensitivity.json'})")
        map_path = out / "sensitivity.json"
        imatrix = out / IMATRIX_FILE if method == "imatrix" else None
        if imatrix is not None:
            _own_imatrix(imatrix, map_path)
        if rounding != asked:
            _say(log, f"{map_path} was begun with {rounding} rounding: resumed as it was begun (a new --out "
                      f"scans {asked} rounding)")
        sensitivity = scan(model, calibration=calibration, max_tokens=max_tokens, formats=formats, group_by=group_by,
                           out=map_path, resume=True, device=device, seq_len=seq_len, progress=progress,
                           log=(lambda line: _say(log, line)) if log else None, ray=ray, workers=workers,
                           method=scan_method, weight_budgets=budgets if scan_method == "adaptive" else None,
                           rounding=rounding, imatrix_out=imatrix,
                           signal=begun_signal if scan_method == "adaptive" and begun_signal in SIGNALS else None)
        for warning in sensitivity["warnings"]:
            _say(log, f"warning: {warning}")
        plot_sensitivity(sensitivity, out / "sensitivity.png")
        settings = dict(format=format, method=method, calibration=calibration, max_tokens=max_tokens, seq_len=seq_len,
                        full_check=full_check, check_tokens=check_tokens, device=device, progress=progress,
                        refine=refine, refine_tokens=refine_tokens)
        job = _Job(model, source, target, sensitivity, map_path, reserve, settings, log, imatrix)
        if full_check and labelled is not None and len(labelled) > 1:
            from .check import ReferenceLogits

            job.reference = ReferenceLogits(model or "default", device)  # every size's check on the same chunks
        if labelled is None:
            info = {"vram_bytes": b.vram_bytes, "context": context, "batch": batch, "kv_dtype": kv_dtype,
                    "kv_bytes": b.kv_bytes, "overhead_bytes": b.overhead_bytes}
            delivered = _deliver(job, out, b.weight_budget_bytes, info, b)
            _refuse_failed([delivered], "raise --vram")
            _say(log, f"\n-> {out}: sensitivity.json, recipe.json, {Path(delivered['artifact']).name}, report.md, "
                      "sensitivity.png, frontier.png" + (f", {IMATRIX_FILE}" if imatrix else ""))
            return {"out": str(out), "budget": b.to_dict(), **delivered}
        delivered = []
        for label, size in labelled:
            _say(log, f"\n==== {label}: the best {target.artifact} of at most {format_bytes(size)}")
            (out / label).mkdir(exist_ok=True)
            delivered.append({"size_bytes": size, "out": str(out / label),
                              **_deliver(job, out / label, size, {"file_size_bytes": size}, None)})
        _refuse_failed(delivered, "raise --size")  # every size checked first: one failure does not stop the others
        others = sorted(p.name for p in out.glob("size-*") if p.is_dir() and p.name not in dict(labelled))
        if others:
            _say(log, f"note: {', '.join(others)} in {out} are from an earlier run's sizes; left as they were")
        _say(log, f"\n-> {out}: sensitivity.json, sensitivity.png, " + (f"{IMATRIX_FILE}, " if imatrix else "")
             + "and " + ", ".join(label for label, _ in labelled))
        return {"out": str(out), "sizes": delivered}


def _refuse_failed(delivered: list[dict], raise_it: str) -> None:
    """Refuse a run any of whose artifacts failed its check (now or in an earlier run of this directory)."""
    failed = [d for d in delivered if d["check"] and d["check"]["verdict"] != "pass"]
    if failed:
        raise CardfitError("; ".join(f"{d['artifact']} failed its check: " + "; ".join(d["check"]["reasons"])
                                     for d in failed), f"do not ship it; {raise_it}, or inspect the recipe")


def _refuse_unreachable(source, formats: str, group_by: str, budget: int, reserve: int, raise_it: str) -> None:
    """Refuse, before any work, a budget that no recipe over `formats` fits (plan's own message; `raise_it`
    names the options that set the budget)."""
    from .budget import no_fit_message
    from .formats import parse_formats
    from .groups import scan_groups

    menu = parse_formats(formats)
    least = reserve + sum(min(sum(f.tensor_bytes(t.name, t.shape) for t in g.tensors) for f in menu)
                          for g in scan_groups(source, group_by))
    if budget < least:
        raise CardfitError(no_fit_message(budget, least), f"{raise_it}, or allow smaller --formats")


def _deliver(job: _Job, out: Path, budget: int, info: dict, b) -> dict:
    """Stages 3-5 into `out` for one budget (a whole artifact's bytes): plan, pack, check and the report,
    each skipped where `out`'s fit.json says it is already done for this recipe."""
    from .atomic import write_json, write_text
    from .pack import pack, render_pack
    from .plan import plan, render_recipe
    from .solver import Problem, frontier
    from .plots import plot_frontier

    settings, log = job.settings, job.log
    state_path = out / "fit.json"
    state = _read_state(state_path)
    _say(log, "\n== 3. plan")
    recipe = plan(job.map_path, budget, budget_info=info, reserve_bytes=job.reserve)
    if settings["refine"]:
        recipe = _refined(recipe, job.sensitivity, state, state_path, out, job.model, settings["calibration"],
                          settings["refine_tokens"] or 4 * settings["max_tokens"], settings["device"], log)
    write_json(out / "recipe.json", recipe)
    _say(log, render_recipe(recipe))
    problem = Problem.from_map(job.sensitivity)
    points = frontier(problem)
    write_json(out / "frontier.json", {"points": points, "uniform_bytes": recipe["uniform_bytes"]})
    plot_frontier(points, problem, out / "frontier.png", chosen=(recipe["bytes"], recipe["predicted_damage"]))

    _say(log, "\n== 4. pack")
    artifact = out / job.target.artifact_name
    recipe_hash = _packing_key(recipe, settings["method"], job.imatrix)
    if artifact.exists() and state.get("packed_from") == recipe_hash and state.get("pack"):
        packed = state["pack"]
        _say(log, f"{artifact} is already packed from this recipe; skipped")
    else:
        packed = pack(recipe, job.model, artifact, settings["format"], settings["method"], settings["calibration"],
                      settings["max_tokens"], settings["seq_len"], force=True, device=settings["device"],
                      progress=settings["progress"], imatrix=job.imatrix)
        state.update({"packed_from": recipe_hash, "pack": packed, "check": None})
        write_json(state_path, state)
        _say(log, render_pack(packed))

    checked = state.get("check")
    if settings["full_check"] and not (checked and checked.get("packed_from") == recipe_hash):
        from .check import check, render_check

        _say(log, "\n== 5. check (full, against the reference)")
        try:
            checked = check(artifact, job.model or "default", None, settings["check_tokens"], settings["seq_len"],
                            predicted_damage=recipe["predicted_damage"], device=settings["device"],
                            reference_logits=job.reference)
        finally:
            if job.reference is not None:
                job.reference.release()  # its logits stay for the next size; its model goes
        checked["packed_from"] = recipe_hash
        state["check"] = checked
        write_json(state_path, state)
        write_json(out / "check.json", checked)
        _say(log, render_check(checked))
    write_text(out / "report.md", render_report(b, job.sensitivity, recipe, packed, checked, artifact, budget))
    return {"recipe": recipe, "pack": packed, "check": checked, "artifact": str(artifact)}


def _own_imatrix(path: Path, map_path: Path) -> None:
    """fit's importance matrix is its own output: anything at DIR/imatrix.gguf that is not an imatrix a scan
    wrote, or that no map of the directory goes with, is replaced (the scan makes it again); a directory there
    is refused. (Beside a map, the scan itself refuses an imatrix of another job.)"""
    from .imatrix import made_for

    if path.is_dir():
        raise CardfitError(f"{path} is a directory, where fit writes its importance matrix",
                           f"remove {path}, or fit into another --out")
    if (path.is_file() or path.is_symlink()) and (made_for(path) is None or not map_path.is_file()):
        path.unlink()


def _packing_key(recipe: dict, method: str, imatrix: Path | None) -> str:
    """What an artifact's bytes follow from, as fit.json records it (`packed_from`): the recipe's hash, with the
    rounding and the importance matrix's job where the rounding is not RTN (a rerun with another --method
    re-packs)."""
    if method == "rtn" and imatrix is None:
        return content_hash(recipe)
    from .imatrix import made_for

    return content_hash({"recipe": content_hash(recipe), "method": method,
                         "imatrix": None if imatrix is None else made_for(imatrix)})


def _refined(recipe, sensitivity, state, state_path, out, model, calibration, tokens, device, log) -> dict:
    """The refined recipe, measured once per plain recipe (a rerun reuses it)."""
    from .atomic import write_json
    from .refine import refine

    plain_hash = content_hash(recipe)
    saved = out / "recipe.json"
    if state.get("refined_from") == plain_hash and saved.exists():
        _say(log, "refinement of this plan already measured; reused")
        return json.loads(saved.read_text())
    _say(log, f"refining: in-context costs of the heaviest downgrades over {tokens} calibration tokens")
    refined = refine(recipe, sensitivity, model, calibration, device=device, log=log, max_tokens=tokens)
    record = refined["refinement"]
    _say(log, f"whole recipe {record['measured_before']:.5f} -> {record['measured_after']:.5f} "
              f"({'re-planned recipe kept' if record['kept'] else 'plan unchanged'})")
    state["refined_from"] = plain_hash
    write_json(state_path, state)
    return refined


def render_report(b, sensitivity: dict, recipe: dict, packed: dict, checked: dict | None, artifact: Path,
                  budget: int | None = None) -> str:
    """report.md: what was fitted, how, and what it measurably cost. `b` None: fitted to a file size, `budget`."""
    from .plan import stored_types

    formats = sensitivity["formats"]
    if b is None:
        ceiling = [f"| file size | {format_bytes(budget)} (the whole artifact, metadata included) |"]
    else:
        ceiling = [f"| VRAM | {format_bytes(b.vram_bytes)} |",
                   f"| KV cache ({b.context} tokens x {b.batch}, {b.kv_dtype}) | {format_bytes(b.kv_bytes)} |",
                   f"| runtime overhead ({b.runtime}) | {format_bytes(b.overhead_bytes)} |",
                   f"| weight budget | {format_bytes(b.weight_budget_bytes)} |"]
    lines = [f"# cardfit report: {sensitivity['model']['name']}", "",
             "## Budget", "", "| | |", "|---|---|", *ceiling, "",
             "## Recipe", "",
             f"Exact optimum (MILP, gap {recipe['solver']['optimality_gap']}): {format_bytes(recipe['bytes'])} of "
             f"tensors + {format_bytes(recipe['reserved_bytes'])} reserved for file metadata, margin "
             f"{format_bytes(recipe['margin_bytes'])} under; predicted damage {recipe['predicted_damage']:.4f} "
             f"(summed KL over {sensitivity['calibration']['tokens']} calibration tokens).", "",
             "`stored as`: the types each group is really written as (the chosen format, then fallbacks for rows "
             "its block does not divide; a group of 1-D tensors, such as the final norm, stays unquantized).", "",
             "| group | stored as | bytes | predicted damage | " + " | ".join(f"damage @ {f}" for f in formats) + " |",
             "|---|---|---|---|" + "---|" * len(formats)]
    cells = {g["name"]: g["cells"] for g in sensitivity["groups"]}
    priced_by = signal_of_map(sensitivity)
    if priced_by is not None:
        lines[-2:-2] = [f"`~`: every damage is the {priced_by.name} signal's estimate (`--scan-method "
                        f"{priced_by.name}`): no cell was measured; the check below measures the artifact itself.", ""]
    elif any(c.get("method") == "estimate" for group in cells.values() for c in group.values()):
        lines[-2:-2] = [f"`~`: estimated from the {adaptive_signal(sensitivity)} signal (adaptive scan), not measured; every cell that "
                        "could decide the plan at this budget was measured.", ""]
    for g in recipe["groups"]:
        row = " | ".join(("~" if priced_by is not None or cells[g["name"]][f].get("method") == "estimate" else "")
                         + f"{cells[g['name']][f]['damage']:.5f}" for f in formats)
        stored = " + ".join(stored_types(g))
        lines.append(f"| {g['name']} | {stored} | {format_bytes(g['bytes'])} | {g['damage']:.5f} | {row} |")
    lines += ["", "## Artifact", "", f"`{artifact.name}` ({packed['format']}, {packed['method']} rounding): "
              f"{format_bytes(packed['counted_bytes'])}, margin {format_bytes(packed['margin_bytes'])} under the weight budget."]
    if packed.get("smoke"):
        lines.append(f"Smoke check: perplexity {packed['smoke']['perplexity']:.4f} over {packed['smoke']['tokens']} "
                     f"tokens (ceiling {packed['smoke']['ceiling']:g}): passed.")
    if checked:
        lines += ["", "## Check (measured in the runtime against the reference)", "",
                  "| | predicted | measured |", "|---|---|---|",
                  f"| mean KLD (nats/token) | {recipe['predicted_damage']:.4f} | {checked['kld_mean']:.4f} ± "
                  f"{checked['kld_stderr'] if checked['kld_stderr'] is not None else float('nan'):.4f} |",
                  f"| p99 KLD | | {checked['kld_p99']:.4f} |",
                  f"| top-1 agreement | | {checked['top1']:.2%} |",
                  f"| perplexity | | {checked['perplexity']:.4f} (reference {checked['reference_perplexity']:.4f}) |",
                  "", f"Verdict: {checked['verdict']}. Predicted damage is measured on calibration text, the "
                  "check on held-out text."]
    else:
        lines += ["", "No full check was run (`cardfit fit --check` runs one)."]
    lines += ["", "![sensitivity](sensitivity.png)", "", "![frontier](frontier.png)", ""]
    return "\n".join(lines)


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
