"""Stage 2: the sensitivity map — the damage of every group at every format, measured (measure.py: the
KL of the output distribution with only that group quantized), priced by a cheap signal (signals/), or
adaptive (a signal, measured where the plan is decided: adaptive.py). Written atomically as it goes; a
resumed map is the same bytes as an uninterrupted one. estimate.py prices an exact scan; cluster.py runs
its sweeps on Ray.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..engine.activations import ActivationCache
from ..atomic import write_json
from ..engine import resolve_compute, resolve_device, resolve_dtype
from ..errors import CardfitError
from ..formats import Format, parse_formats
from ..groups import Group, pending_by_group, scan_groups
from ..engine.heap import map_large_blocks, return_freed_memory
from .measure import (ROUND_TRACK_BYTES, RoundedAhead, Scanner, copy_bytes, finish, format_batches, in_map_order,
                      measure_group, measure_round, measured_formats, walk_windows)
from ..schemas import KL_METRIC, MAP_VERSION, model_header, same_model
from ..sources import ModelSource, open_model, runnable
from ..text import calibration_header, load_text, load_tokenizer, token_chunks
from .signals import SIGNALS, PricingJob, Signal, adaptive_signal, default_signal

ROUNDINGS = ("rtn", "imatrix", "gptq", "awq")
ADAPTIVE = ("adaptive (a cheap signal scaled to KL per group; measured where the plan at the budgets "
            "is decided)")


def methods() -> dict[str, str]:
    """--method word -> the map's damage.method: exact, every registered signal, adaptive."""
    return {"exact": "exact", **{name: signal.description for name, signal in SIGNALS.items()}, "adaptive": ADAPTIVE}


def refuse_unpriced(signal: Signal | None, fmts: list[Format], rounding: str, flag: str, also: tuple = ()) -> None:
    """One line when `signal` cannot price `fmts` under `rounding`, naming the `flag` values that can."""
    if signal is not None and not signal.prices(fmts, rounding):
        others = [name for name, s in SIGNALS.items() if s.prices(fmts, rounding)] + list(also)
        raise CardfitError(signal.refusal(fmts, rounding), f"use {flag} " + " or ".join(others))


def map_header(source: ModelSource, text: str, text_path: Path, chunks: torch.Tensor, formats: list[Format],
               group_by: str, rounding: str, method: str = "exact", compute: str = "float32") -> dict:
    runtimes = {f.runtime for f in formats}
    if len(runtimes) > 1:
        raise CardfitError("formats mix runtimes (" + ", ".join(sorted(runtimes)) + ")",
                           "scan GGUF types and vLLM formats into separate maps")
    return {
        "cardfit_map": MAP_VERSION,
        "model": model_header(source),
        "calibration": calibration_header(text, text_path, chunks),
        "damage": {"metric": SIGNALS[method].metric if method in SIGNALS else KL_METRIC, "method": methods()[method]},
        "rounding": rounding,
        "compute": compute,
        "group_by": group_by,
        "runtime": runtimes.pop(),
        "formats": [f.name for f in formats],
    }


def _same_job(a: dict, b: dict) -> bool:
    keys = ("cardfit_map", "calibration", "damage", "rounding", "group_by", "runtime", "formats")
    return (all(a.get(k) == b.get(k) for k in keys) and same_model(a.get("model", {}), b.get("model", {}))
            and a.get("compute", "float32") == b.get("compute", "float32"))


def scan(model: str | Path | None = None, calibration: str | Path | None = None, max_tokens: int = 8192,
         formats: str | list[str] = "Q8_0,Q6_K,Q4_K,Q3_K,Q2_K", group_by: str = "layer",
         out: str | Path = "sensitivity.json", resume: bool = False, device: str = "auto",
         memory_cap: int | None = None, rounding: str = "rtn", seq_len: int = 512, batch: int = 4,
         progress: bool = True, method: str = "exact", dtype: str = "auto", gpu_memory: int | None = None,
         log=None, estimate: bool = False, ray: str | None = None, workers: int | None = None,
         shared_dir: str | Path | None = None, weight_budgets: list[int] | None = None,
         signal: str | None = None, imatrix_out: str | Path | None = None) -> dict:
    """Measure the damage of every group at every format; returns the map (also written to `out`).

    With `imatrix_out`, llama.cpp's importance matrix of the map's model and calibration tokens is there when
    the scan returns: recorded by the weight signal's walk where the scan prices by it (one forward for both),
    else by a walk of its own (exact, fast and Ray scans, a resumed map already priced), and kept where an
    earlier run left one of that very job (imatrix.made_from)."""
    result = _scan(model, calibration, max_tokens, formats, group_by, out, resume, device, memory_cap, rounding,
                   seq_len, batch, progress, method, dtype, gpu_memory, log, estimate, ray, workers, shared_dir,
                   weight_budgets, signal, imatrix_out)
    if imatrix_out is not None and not estimate:
        from ..imatrix import collect_imatrix, job_key, made_from

        if not made_from(Path(imatrix_out), job_key(result["model"], result["calibration"])):
            if log:
                log(f"importance matrix of the map's {result['calibration']['tokens']} tokens -> {imatrix_out}")
            collect_imatrix(model, calibration, max_tokens, seq_len, imatrix_out, device, progress=progress, log=log,
                            batch=batch, dtype=dtype, gpu_memory=gpu_memory)
    return result


def _scan(model, calibration, max_tokens, formats, group_by, out, resume, device, memory_cap, rounding, seq_len,
          batch, progress, method, dtype, gpu_memory, log, estimate, ray, workers, shared_dir, weight_budgets,
          signal, imatrix_out) -> dict:
    """scan() without the imatrix's last resort (see scan).

    With `estimate`, measures nothing and writes nothing: returns {"estimate": ...}, the counts and the
    time the scan would take (estimate.py). With `log`, that estimate is also shown before a scan.
    With `ray` ('local', 'auto' or a cluster's address) the group sweeps run as Ray tasks (cluster.py),
    at most `workers` at a time; the map is the same bytes. `method='adaptive'` measures exactly only the
    cells that decide the plans at `weight_budgets` (plan's --weight-budget) and estimates the rest by
    `signal` (a name in signals.SIGNALS; by default the first registered that prices the rounding)."""
    from ..paths import guard_output, input_paths, model_paths
    from ..engine import Engine

    if method not in methods():
        raise CardfitError(f"unknown --method '{method}'", "use --method " + ", ".join(methods()))
    if rounding not in ROUNDINGS:
        raise CardfitError(f"unknown rounding '{rounding}'", "use " + ", ".join(ROUNDINGS))
    if ray is None and (workers is not None or shared_dir is not None):
        raise CardfitError("--workers and --shared-dir spread a scan over Ray", "add --ray (local, auto or ADDRESS)")
    if (method == "adaptive") != bool(weight_budgets):
        raise CardfitError("--method adaptive measures the cells that decide the plan at given budgets",
                           "use --method adaptive with --weight-budget SIZE[,SIZE...], or neither")
    if signal is not None and method != "adaptive":
        raise CardfitError("--signal chooses what prices an adaptive scan's unmeasured cells",
                           "add --method adaptive, or drop --signal")
    if method == "adaptive" and signal is not None and signal not in SIGNALS:
        raise CardfitError(f"unknown --signal '{signal}'", "use --signal " + " or ".join(SIGNALS))
    if estimate and method != "exact":
        raise CardfitError("--estimate prices the exact scan", "drop --estimate, or use --method exact")
    if ray is not None and method != "exact":
        raise CardfitError("--ray spreads the exact scan's group sweeps", "drop --ray, or use --method exact")
    if workers is not None and workers < 1:
        raise CardfitError(f"--workers {workers} is not a positive count", "e.g. --workers 8")
    if ray is not None:
        from .cluster import check

        check(ray, None if shared_dir is None else str(shared_dir), device)
    if max_tokens <= 0 or seq_len <= 1 or batch <= 0:
        raise CardfitError("--max-tokens, --seq-len and --batch must be positive",
                           "e.g. --max-tokens 8192 --seq-len 512 --batch 4")
    if group_by not in ("layer", "tensor"):
        raise CardfitError(f"unknown --group-by '{group_by}'", "use --group-by layer or --group-by tensor")
    resolve_dtype(dtype)
    compute = resolve_compute(dtype, resolve_device(device)[0]) if method in ("exact", "adaptive") else "float32"
    fmts = parse_formats(formats)
    if method == "adaptive" and signal is None:
        signal = default_signal(fmts, rounding).name
    refuse_unpriced(SIGNALS.get(signal if method == "adaptive" else method), fmts, rounding,
                    "--signal" if method == "adaptive" else "--method", ("exact",) if method != "adaptive" else ())
    source = open_model(model)
    guard_output(out, {"the model": model_paths(source), "the calibration text": input_paths(calibration)})
    if imatrix_out is not None:
        from ..imatrix import refuse_output

        if estimate:
            raise CardfitError("--estimate writes nothing, --imatrix-out an imatrix", "drop one of them")
        from ..paths import distinct_outputs

        distinct_outputs({"--out": out, "--imatrix-out": imatrix_out})
        refuse_output(Path(imatrix_out), "--imatrix-out", replaces=False)
        guard_output(imatrix_out, {"the model": model_paths(source), "the calibration text": input_paths(calibration),
                                   "the map (--out)": [Path(out)]}, flag="--imatrix-out")
    source = runnable(source)
    text, text_path = load_text(calibration)
    tokenizer = load_tokenizer(str(source.path))
    chunks = token_chunks(tokenizer, text, seq_len, max_tokens, source=str(text_path), rows=source.embedding_rows())
    header = map_header(source, text, text_path, chunks, fmts, group_by, rounding, method, compute)
    out = Path(out)
    result = None
    if out.exists() and (resume or not estimate):
        if not resume:
            raise CardfitError(f"{out} exists", "pass --resume to continue it, or choose another --out")
        from ..maps import read_map

        previous = read_map(out)
        if not _same_job(previous, header):
            raise CardfitError(f"{out} was scanned for another model, text or settings",
                               "use a new --out, or the original model, calibration and formats")
        result = previous
        result.setdefault("compute", header["compute"])  # a map begun before the key was float32
    record = None
    if imatrix_out is not None:
        from ..imatrix import ImatrixRecord, job_key, made_for, made_from

        job = job_key(header["model"], header["calibration"])
        if made_for(Path(imatrix_out)) not in (None, job):  # another map's imatrix: its packs would round with ours
            raise CardfitError(f"--imatrix-out {imatrix_out} holds the importance matrix of another scan (another "
                               "model or calibration text)", "choose another --imatrix-out, or remove that file")
        if not made_from(Path(imatrix_out), job):
            record = ImatrixRecord(source, chunks, text_path.name, job)
    groups = scan_groups(source, group_by)
    if result is None:
        result = dict(header)
        result["reference"] = {}
        result["groups"] = [{"name": g.name, "tensors": [t.name for t in g.tensors],
                             "bytes": {f.name: sum(f.tensor_bytes(t.name, t.shape) for t in g.tensors)
                                       for f in fmts},
                             "storage": {f.name: sorted({f.storage(t.name, t.shape) for t in g.tensors})
                                         for f in fmts},
                             "cells": {}} for g in groups]
        result["complete"] = False
        result["warnings"] = []
    todo = [(i, g, f) for i, g in enumerate(groups) for f in fmts
            if f.name not in result["groups"][i]["cells"]]
    job = PricingJob(source, chunks, groups, rounding, device, batch, dtype, gpu_memory, log, record, imatrix_out)
    if method == "adaptive":
        return _adaptive_cells(job, SIGNALS[signal], fmts, result, out, memory_cap, weight_budgets)
    if not todo and result.get("complete"):
        return {"estimate": None} if estimate else result  # a finished map of this very job: nothing to measure
    if method in SIGNALS:
        return _signal_cells(job, SIGNALS[method], todo, fmts, result, out, progress)
    map_large_blocks()
    engine = Engine(source, device, dtype, gpu_memory, log=log)
    budget = None if memory_cap is None else memory_cap // 2
    cache = ActivationCache(budget, spill_dir=out.parent)
    scanner = Scanner(source, engine, chunks, batch, cache, rounding)
    # quantized copies held at once: never more than the largest group's single copy (the old one-cell peak)
    limit = max(copy_bytes(g) for g in groups)
    guess = None
    if estimate or log:
        from .estimate import estimate_scan

        try:
            guess = estimate_scan(scanner, groups, todo, limit, fmts,
                                  rounds_ahead=ray is None and RoundedAhead.applies(scanner, fmts, memory_cap),
                                  windows=ray is None and not RoundedAhead.applies(scanner, fmts, memory_cap))
        finally:
            if estimate:
                cache.close()
                engine.close()
        engine.loads.clear()
        if log:
            log(guess.render())
        if estimate:
            answer = {"estimate": guess.as_dict()}
            if ray is not None and workers:
                answer["estimate"]["workers"] = workers
                answer["estimate"]["seconds_on_workers"] = guess.on_workers(workers)
                if log:
                    log(guess.render_workers(workers))
            return answer
    if ray is not None:
        from .cluster import scan_on_ray

        cache.close()
        engine.close()
        if torch.cuda.is_available():  # what the estimate held on this GPU goes back to the workers
            torch.cuda.empty_cache()
        bar = _progress(progress, len(groups) * len(fmts), len(groups) * len(fmts) - len(todo))
        try:
            return scan_on_ray(ray, workers, None if shared_dir is None else str(shared_dir), source=source,
                               groups=groups, todo=todo, result=result, out=out, fmts=fmts, chunks=chunks,
                               batch=batch, rounding=rounding, group_by=group_by, device=device, dtype=compute,
                               gpu_memory=gpu_memory, memory_cap=memory_cap, limit=limit,
                               bar=bar, log=log, estimate=guess)
        finally:
            if bar:
                bar.close()
    bar = _progress(progress, len(groups) * len(fmts), len(groups) * len(fmts) - len(todo))
    sweeps = 0
    ahead = None
    try:
        if RoundedAhead.applies(scanner, fmts, memory_cap):
            ahead = RoundedAhead(scanner, [(groups[i], sweep) for i, pending in pending_by_group(todo).items()
                                           for sweep in format_batches(groups[i], measured_formats(groups[i], pending),
                                                                       limit)])
        ref = scanner.reference()
        return_freed_memory()
        result["reference"] = {"perplexity": round(ref.perplexity, 6)}
        track_bytes = ROUND_TRACK_BYTES if memory_cap is None else memory_cap // 4
        for together, window in walk_windows(scanner, groups, pending_by_group(todo), ahead is None):
            measured = [None] * len(window)
            if together:
                if bar:
                    bar.set_description(f"{groups[window[0][0]].name}..{groups[window[-1][0]].name}")
                measured = measure_round(scanner, [(groups[i], pending) for i, pending in window], track_bytes)
            for (i, pending), cells in zip(window, measured):
                entry = result["groups"][i]

                def sweep_done(cells, entry=entry):
                    entry["cells"].update(cells)
                    write_json(out, result)
                    if bar:
                        bar.update(len(cells))

                if cells is None:
                    cells = measure_group(scanner, groups[i], pending, limit, sweep_done, bar, ahead)
                else:
                    sweep_done(cells)
                sweeps += cells.sweeps
                entry["cells"] = in_map_order(entry["cells"], fmts)
    finally:
        if ahead:
            ahead.close()
        cache.close()
        engine.close()
        if bar:
            bar.close()
    if log:
        log(f"read decoder layers {engine.layer_loads()} times ({engine.layers} layers, {sweeps} group sweeps)")
    return finish(result, out)


def _progress(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="cell", dynamic_ncols=True, disable=None)


def _signal_cells(job: PricingJob, signal: Signal, todo: list, fmts: list[Format], result: dict, out: Path,
                  progress: bool) -> dict:
    """Every to-do cell priced by `signal`, no model run per cell; the map is written after each group as the
    exact scan's is, so an interrupted run resumes."""
    clock = PricingClock(job.groups, todo, job.log)
    bar = _progress(progress, len(job.groups) * len(fmts), len(job.groups) * len(fmts) - len(todo))
    mark = {} if signal.mark is None else {"method": signal.mark}

    def done(index: int, priced: dict) -> None:
        clock.priced(index)
        cells = result["groups"][index]["cells"]
        cells.update({name: {"damage": damage, "stderr": None, "top1": None, **mark} for name, damage in priced.items()})
        result["groups"][index]["cells"] = in_map_order(cells, fmts)
        write_json(out, result)
        if bar:
            bar.update(len(priced))

    try:
        signal.price(job, todo, done)
    finally:
        if bar:
            bar.close()
    result["separable_fraction"] = None
    result["complete"] = True
    write_json(out, result)
    return result


class PricingClock:
    """Says, when the first group is priced and then at each further quarter of the work, how long a cheap
    signal's pricing has taken and about how long the rest will: work counted as a group's values times its
    formats to price, its pace taken from the groups after the first (what comes before the first, a walk or
    the Fisher's forward pass, is paid once)."""

    def __init__(self, groups: list[Group], todo: list, log, clock=time.perf_counter):
        self.time, self.log = clock, log
        formats: dict[int, int] = {}
        for index, _, _ in todo:
            formats[index] = formats.get(index, 0) + 1
        self.work = {i: n * sum(math.prod(t.shape) for t in groups[i].quantizable) for i, n in formats.items()}
        self.total, self.done, self.said = max(sum(self.work.values()), 1), 0, 0.0
        self.began = self.time()
        self.first: tuple[float, int] | None = None  # (when, work done) at the first group priced

    def priced(self, index: int) -> None:
        self.done += self.work.pop(index, 0)
        share = self.done / self.total
        if not self.log or not self.done or share >= 1:
            return
        now = self.time()
        if self.first is None:
            self.first, self.said = (now, self.done), share
            self.log(f"priced {share:.0%} of the cells' work in {now - self.began:.0f} s")
        elif share >= self.said + 0.25:
            pace = (now - self.first[0]) / (self.done - self.first[1])
            self.log(f"priced {share:.0%} of the cells' work in {now - self.began:.0f} s: about "
                     f"{pace * (self.total - self.done) / 60:.1f} minutes left")
            self.said = share


def _say_round_time(scanner, groups, todo: dict[int, list[str]], by_name: dict, fmts, units, with_reference: bool,
                    log) -> dict:
    """Say about how long an adaptive round's exact cells will take (estimate.estimate_scan of those cells, the
    reference pass only before the first round); returns the unit times, measured for every format on the
    first call and reused."""
    from .estimate import estimate_scan
    from .measure import copy_bytes

    cells = [(i, groups[i], by_name[name]) for i, names in todo.items() for name in names]
    guess = estimate_scan(scanner, groups, cells, max(copy_bytes(g) for g in groups), fmts, units=units,
                          windows=True)
    seconds = guess.seconds - (0.0 if with_reference else guess.reference_seconds)
    when = f"about {seconds / 60:.0f} minutes" if seconds >= 120 else f"about {seconds:.0f} seconds"
    log(f"  {when} on this device" + (", the reference pass included" if with_reference else ""))
    return guess.unit_seconds


def _adaptive_cells(job: PricingJob, signal: Signal, fmts: list[Format], result: dict, out: Path,
                    memory_cap: int | None, weight_budgets: list[int]) -> dict:
    """The adaptive scan (adaptive.py): every cell's cheap `signal`, then exact cells where the plans at the
    budgets are decided, the map written after every group; a resumed run keeps both."""
    from .adaptive import adaptive_rounds, check_budgets
    from ..engine import Engine
    from ..pack import reserve_bytes

    source, groups, log = job.source, job.groups, job.log
    budgets = sorted(set(weight_budgets), reverse=True)
    before = result.get("adaptive", {})
    priced_by = adaptive_signal(result) or signal.name
    if priced_by != signal.name:
        raise CardfitError(f"{out} was priced by the {priced_by} signal",
                           f"resume with --signal {priced_by}, or choose another --out")
    if result.get("complete") and before.get("weight_budgets") == budgets:
        return result
    reserve = reserve_bytes(source, result["runtime"])
    check_budgets(result, budgets, reserve)
    result["adaptive"] = {"signal": signal.name, "weight_budgets": budgets}
    result["complete"] = False
    unsigned = [(i, g, f) for i, g in enumerate(groups) for f in fmts
                if "signal" not in result["groups"][i]["cells"].get(f.name, {})]
    if unsigned:
        clock = PricingClock(groups, unsigned, log)

        def signed(index: int, priced: dict) -> None:
            clock.priced(index)
            cells = result["groups"][index]["cells"]
            for name, value in priced.items():
                cells[name] = ({**cells[name], "signal": value} if name in cells else
                               {"damage": value, "stderr": None, "top1": None, "method": "estimate", "signal": value})
            result["groups"][index]["cells"] = in_map_order(cells, fmts)
            write_json(out, result)

        if log:
            log(f"pricing {len(unsigned)} cells by the {signal.name} signal")
        signal.price(job, unsigned, signed)
    map_large_blocks()
    engine = Engine(source, job.device, job.dtype, job.gpu_memory, log=log)
    cache = ActivationCache(None if memory_cap is None else memory_cap // 2, spill_dir=out.parent)
    scanner = Scanner(source, engine, job.chunks, job.batch, cache, job.rounding)
    by_name = {f.name: f for f in fmts}
    track_bytes = ROUND_TRACK_BYTES if memory_cap is None else memory_cap // 4
    reference = None
    units = None  # this device's unit times (estimate.py), measured before the first round

    def measure(todo: dict[int, list[str]]) -> None:
        nonlocal reference, units
        if log:
            units = _say_round_time(scanner, groups, todo, by_name, fmts, units, reference is None, log)
        if reference is None:
            reference = scanner.reference()
            result["reference"] = {"perplexity": round(reference.perplexity, 6)}
            return_freed_memory()
        measured = measure_round(scanner, [(groups[i], [by_name[n] for n in names]) for i, names in todo.items()],
                                 track_bytes)
        for index, cells in zip(todo, measured):
            entry = result["groups"][index]
            for name, cell in cells.items():
                entry["cells"][name] = {**cell, "signal": entry["cells"][name]["signal"]}
        write_json(out, result)

    try:
        rounds = adaptive_rounds(result, [b - reserve for b in budgets], measure, log)
    finally:
        cache.close()
        engine.close()
    exact = sum(c.get("method") is None for g in result["groups"] for c in g["cells"].values())
    result["adaptive"].update({"rounds": rounds, "exact_cells": exact})
    if log:
        log(f"adaptive: {exact} of {len(groups) * len(fmts)} cells measured exactly in {rounds} rounds")
    result["separable_fraction"] = None
    result["complete"] = True
    write_json(out, result)
    return result


from ..stage import callable_stage  # noqa: E402

callable_stage(__name__)
