"""The scan spread over a Ray cluster: one reference pass, then each group sweep as a Ray task.

Once the reference pass has cached every group's input (the hidden states entering its first
layer) and the reference's summary (head_kl.py), the sweeps are independent: a worker needs the model
(read from the same path on every node), those inputs, the final hidden states and the reference,
and runs `measure.measure_group` — the very function the single-process scan runs, so a cell is the
same bits wherever it was measured. The reference pass is a task too (on a GPU node when the
cluster has GPUs); its outputs travel through Ray's object store (one object per boundary, fetched
once per node), or through `--shared-dir`, a directory every node mounts, as safetensors.

One task per sweep (the formats of a group whose quantized copies fit together), longest first (a
group at layer i re-runs L - i layers; the embedding all L), at most `workers` in flight, each with
its resources (one GPU where the cluster has GPUs, else a share of one node's CPUs; `memory` for
what it holds). One coordinator — this process — writes the map after every finished sweep, cells
in canonical order, so the map is byte-identical to a single-process scan and `--resume` works
across both. A worker that dies (SIGKILL, the OOM killer) costs at most its running sweep: Ray
retries the task elsewhere (`RETRIES` times). docs/cluster.md has the commands and the cost model.

Ray is an optional extra (`pip install -e '.[ray]'`); nothing else in cardfit imports it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..atomic import write_json
from ..errors import CardfitError
from ..engine.head_kl import ReferenceSlice, summary_bytes
from ..engine import DIFFERENCES
from .measure import TAIL_ROWS

RETRIES = 3  # attempts after the first when the worker process of a task dies
FORWARDED_ENV = ("CARDFIT_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@dataclass
class ScanJob:
    """Everything a worker needs to measure a group as the coordinator would (plain data, no model)."""

    model: str  # the runnable model directory; every node reads it at this path
    group_by: str
    rounding: str
    chunks: np.ndarray  # calibration token ids, (chunks, seq_len)
    batch: int
    device: str
    dtype: str
    gpu_memory: int | None
    memory_cap: int | None
    limit: int  # bytes of quantized copies one sweep may hold
    shared_dir: str | None = None
    env: dict = field(default_factory=dict)
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # this scan, for workers that serve several

    def activation_cache(self):
        from ..engine.activations import ActivationCache

        budget = None if self.memory_cap is None else self.memory_cap // 2
        return ActivationCache(budget, spill_dir=tempfile.gettempdir())

    def scanner(self):
        """A Scanner on this worker over the job's model, with an empty activation cache."""
        from ..engine import Engine
        from .measure import Scanner
        from ..sources.hf_dir import HfDirectorySource

        source = HfDirectorySource(Path(self.model))
        engine = Engine(source, self.device, self.dtype, self.gpu_memory)
        return Scanner(source, engine, torch.from_numpy(self.chunks.copy()), self.batch, self.activation_cache(),
                       self.rounding)


# -- connecting ---------------------------------------------------------------------------------------
def ray_module():
    try:
        import ray
    except ImportError:
        raise CardfitError("--ray needs Ray, which is not installed", "pip install -e '.[ray]'") from None
    return ray


def check(address: str | None, shared_dir: str | None, device: str = "auto") -> None:
    """What can be refused before any work: Ray missing, a malformed or silent address, no shared dir,
    a device naming one GPU of this host."""
    ray_module()
    if str(device).strip().lower().startswith("cuda:"):
        raise CardfitError(f"--device {device} names one GPU of this host, but on Ray each task gets its own",
                           "use --device auto (or cuda) with --ray")
    if shared_dir is not None and not Path(shared_dir).is_dir():
        raise CardfitError(f"--shared-dir {shared_dir} is not a directory",
                           "create it on a volume every Ray node mounts at the same path")
    spec = (address or "local").strip()
    if spec in ("local", "auto"):
        return
    host, port = _host_port(spec)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        raise CardfitError(f"no Ray cluster answers at {spec} ({exc.strerror or exc})",
                           "start one there with `ray start --head`, or use --ray auto to join this "
                           "host's cluster, or --ray local to start one here") from None


def connect(address: str | None) -> str:
    """Join the cluster at `address` ('auto': the one this host runs; host:port or ray://host:port), or
    start a local one (None or 'local'); returns a line saying which. Ray installs its own SIGTERM
    handler; cardfit's (clean up, exit 143) is put back."""
    ray = ray_module()
    options = dict(logging_level=logging.ERROR, log_to_driver=False, include_dashboard=False)
    spec = (address or "local").strip()
    if ray.is_initialized():
        ray.shutdown()
    if spec != "local":
        check(spec, None)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=spec, **options)  # "local" starts one even where RAY_ADDRESS is set
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CardfitError(f"could not {'start' if spec == 'local' else 'join'} a Ray cluster at '{spec}': {first}",
                           "start one with `ray start --head` and run the scan on one of its nodes (or give "
                           "ray://HEAD:10001), or use --ray local to start one here") from None
    finally:
        if previous is not None:
            try:
                signal.signal(signal.SIGTERM, previous)
            except ValueError:  # not the main thread: Ray set none either
                pass
    if spec == "local":
        return f"started a local Ray cluster ({_resources_line(ray)})"
    return f"joined the Ray cluster at {spec} ({_resources_line(ray)})"


def _host_port(spec: str) -> tuple[str, int]:
    rest = spec.removeprefix("ray://")
    host, _, port = rest.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CardfitError(f"'{spec}' is not a Ray address",
                           "use --ray HOST:PORT (the head's GCS port, 6379 by default), --ray auto or --ray local")
    return host, int(port)


def _resources_line(ray) -> str:
    total = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return (f"{nodes} node{'s' * (nodes != 1)}, {total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs, "
            f"{total.get('memory', 0) / 2**30:.1f} GiB")


# -- what each task asks for -----------------------------------------------------------------------
@dataclass
class Placement:
    workers: int  # sweeps in flight
    sweep: dict  # Ray resources of each sweep task
    reference: dict  # and of the reference pass
    threads: int  # torch threads of a sweep task
    reference_threads: int
    device: str  # what the workers compute on: "cuda" (the GPU Ray gave the task) or "cpu"
    max_calls: int  # tasks per worker process: 1 on GPUs (torch keeps the first GPU it used)


def placement(ray, workers: int | None, device: str, sweep_memory: int, reference_memory: int) -> Placement:
    """One GPU per task where the cluster has GPUs (and --device allows), else an equal share of the
    CPUs, never more than one node has; the reference pass, which every sweep waits for, takes a whole
    node's CPUs. Refused up front when no single node could hold a task with all it asks for: Ray
    would otherwise wait for it forever, silently."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    gpu_nodes = [r for r in nodes if r.get("GPU", 0) >= 1] if not device.startswith("cpu") else []
    if device.startswith("cuda") and not gpu_nodes:
        raise CardfitError(f"--device {device} but the Ray cluster has no GPUs", "use --device auto or cpu")
    cpu_nodes = [r for r in nodes if r.get("CPU", 0) >= 1]
    if not cpu_nodes:
        raise CardfitError("the Ray cluster offers no CPUs", "start its nodes with --num-cpus 1 or more")
    if gpu_nodes:
        slots = sum(int(r["GPU"]) for r in gpu_nodes)
        workers = min(workers or slots, slots)
        sweep = reference = {"num_gpus": 1, "num_cpus": 1}
        threads = reference_threads = 1
    else:
        slots = sum(int(r["CPU"]) for r in cpu_nodes)
        widest = max(int(r["CPU"]) for r in cpu_nodes)
        workers = min(workers or slots, slots)
        threads = max(1, min(slots // workers, widest))
        reference_threads = widest
        sweep, reference = {"num_cpus": threads}, {"num_cpus": widest}
    sweep = {**sweep, "memory": sweep_memory}
    reference = {**reference, "memory": reference_memory}
    for what, wants in (("one sweep", sweep), ("the reference pass", reference)):
        if not any(r.get("CPU", 0) >= wants["num_cpus"] and r.get("GPU", 0) >= wants.get("num_gpus", 0)
                   and r.get("memory", 0) >= wants["memory"] for r in nodes):
            gpu = " and a GPU" if wants.get("num_gpus") else ""
            raise CardfitError(f"{what} needs {wants['num_cpus']} CPU(s){gpu} and {wants['memory'] / 2**30:.1f} GiB "
                               "on one node, and no Ray node offers that",
                               "add a node with more memory, or lower --max-tokens or --batch")
    return Placement(workers, sweep, reference, threads, reference_threads, "cuda" if gpu_nodes else "cpu",
                     1 if gpu_nodes else 0)


# -- the tasks -------------------------------------------------------------------------------------------
def _reference_task(job: ScanJob, threads: int, layers: int):
    """The reference pass: its perplexity, then each boundary's hidden states (points 0..L), then the
    reference's summary (head_kl.py) — one object each, or files under the job's shared directory."""
    torch.set_num_threads(threads)
    scanner = job.scanner()
    try:
        meter = scanner.reference()
        points = [[scanner.cache.get(p, b) for b in range(len(scanner.batches))] for p in range(layers + 1)]
        reference = {"slices": [(key, *ref.tensors()) for key, ref in scanner.summary.items()],
                     "tails": [scanner.cache.get(TAIL_ROWS, b) for b in range(len(scanner.batches))
                               if scanner.stream.linear_head]}
        if job.shared_dir:  # safetensors, not the object store: any dtype, read by path on every node
            from safetensors.torch import save_file

            for p, arrays in enumerate(points):
                save_file({str(b): a for b, a in enumerate(arrays)}, str(Path(job.shared_dir) / f"point-{p}.safetensors"))
            flat = {f"slice/{i}/{b}/{r}/{s}": tensor for (b, r, s), *tensors in reference["slices"]
                    for i, tensor in enumerate(tensors)}
            flat.update({f"tail/{b}": tail for b, tail in enumerate(reference["tails"])})
            save_file(flat, str(Path(job.shared_dir) / "reference.safetensors"))
            points, reference = [None] * (layers + 1), None
        return (meter.perplexity, *points, reference)
    finally:
        scanner.cache.close()
        scanner.engine.close()


_WORKER: dict = {}  # this worker process's scanner for the job it serves, reused by its next tasks


def _worker_scanner(ray, job: ScanJob, reference_box: list):
    """The scanner this process measures with: built at its first task of the job (the engine, with any
    layers it keeps resident on a GPU, and the reference fetched once), reused by the ones after."""
    key = (job.key, tuple(ray.get_gpu_ids()))
    if _WORKER.get("key") != key:
        old = _WORKER.pop("scanner", None)
        if old is not None:
            old.cache.close()
            old.engine.close()
        scanner = job.scanner()
        reference = _reference(ray, job, reference_box[0])
        for ref_key, *tensors in reference["slices"]:
            scanner.summary[ref_key] = ReferenceSlice(*tensors)
        _WORKER.update(key=key, scanner=scanner, tails=reference["tails"])
    return _WORKER["scanner"]


def _sweep_task(job: ScanJob, threads: int, index: int, formats: list[str], point_refs: list, reference_box: list):
    """Every pending cell of group `index`, measured by measure.measure_group on this worker."""
    ray = ray_module()
    from ..formats import parse_formats
    from ..groups import scan_groups
    from .measure import measure_group

    torch.set_num_threads(threads)
    scanner = _worker_scanner(ray, job, reference_box)
    scanner.cache = job.activation_cache()
    for b, tail in enumerate(_WORKER["tails"]):
        scanner.cache.put(TAIL_ROWS, b, tail)
    reads_before = scanner.engine.layer_loads()
    try:
        group = scan_groups(scanner.source, job.group_by)[index]
        layers = scanner.layers
        point = None if group.start < 0 else min(group.start, layers)
        wanted = sorted({layers} | ({point} if point is not None else set()))
        if scanner.engine.compute == DIFFERENCES:  # the reference's input to every layer the sweep walks
            wanted = list(range(point or 0, layers + 1))
        for p in wanted:
            for b, array in enumerate(_point(ray, job, p, point_refs)):
                scanner.cache.put(p, b, array)
        cells = measure_group(scanner, group, parse_formats(formats), job.limit)
        return {"group": group.name, "cells": dict(cells), "sweeps": cells.sweeps,
                "layer_reads": scanner.engine.layer_loads() - reads_before, "host": socket.gethostname(),
                "pid": os.getpid()}
    finally:
        scanner.cache.close()


def _point(ray, job: ScanJob, p: int, refs: list) -> list[torch.Tensor]:
    if job.shared_dir:
        from safetensors.torch import load_file

        arrays = load_file(str(Path(job.shared_dir) / f"point-{p}.safetensors"))
        return [arrays[str(b)] for b in range(len(arrays))]
    return ray.get(refs[p])


def _reference(ray, job: ScanJob, ref) -> list:
    """The reference's summary, {"slices": [((batch, row, start), its tensors...)], "tails": [a batch's tail
    rows]}, from the object store or the shared directory."""
    if not job.shared_dir:
        return ray.get(ref)
    from safetensors.torch import load_file

    flat = load_file(str(Path(job.shared_dir) / "reference.safetensors"))
    parts: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
    tails: dict[int, torch.Tensor] = {}
    for name, tensor in flat.items():
        kind, *index = name.split("/")
        if kind == "tail":
            tails[int(index[0])] = tensor
        else:
            i, b, r, s = (int(x) for x in index)
            parts.setdefault((b, r, s), {})[i] = tensor
    return {"slices": [(key, *(tensors[i] for i in sorted(tensors))) for key, tensors in parts.items()],
            "tails": [tails[b] for b in sorted(tails)]}


# -- the coordinator ---------------------------------------------------------------------------------
def task_memory(source, chunks: torch.Tensor, limit: int, differences: bool = False) -> int:
    """Bytes one sweep task holds at its peak: its group's input and the final hidden states (in difference
    form the reference's input to every layer the sweep walks, at most L + 1 of them), the reference's
    summary, the quantized copies of one sweep, two float32 layers and the head."""
    from ..groups import GroupId

    g = source.geometry
    hidden = chunks.numel() * g.hidden_size * 4
    points = g.num_layers + 1 if differences else 2
    reference = chunks.numel() * summary_bytes(g.hidden_size, differences)
    layer = sum(t.numel for t in source.groups()[GroupId.layer_group(0)]) * 4
    head = g.vocab_size * g.hidden_size * 4
    return int(points * hidden + reference + limit + 2 * layer + 2 * head + 512 * 2**20)


def reference_task_memory(source, chunks: torch.Tensor, differences: bool = False) -> int:
    """Bytes the reference pass holds at its peak: every boundary (L + 1 of them) and the reference's
    summary, each twice while Ray serializes them, two float32 layers and the head."""
    from ..groups import GroupId

    g = source.geometry
    boundaries = (g.num_layers + 1) * chunks.numel() * g.hidden_size * 4
    reference = chunks.numel() * summary_bytes(g.hidden_size, differences)
    layer = sum(t.numel for t in source.groups()[GroupId.layer_group(0)]) * 4
    head = g.vocab_size * g.hidden_size * 4
    return int(2 * (boundaries + reference) + 2 * layer + 2 * head + 512 * 2**20)


def scan_on_ray(address: str | None, workers: int | None, shared_dir: str | None, *, source, groups, todo,
                result: dict, out: Path, fmts, chunks: torch.Tensor, batch: int, rounding: str, group_by: str,
                device: str, dtype: str, gpu_memory: int | None, memory_cap: int | None, limit: int,
                bar=None, log=None, estimate=None) -> dict:
    """Measure `todo` on a Ray cluster and write the map as the single-process scan would."""
    from ..groups import pending_by_group
    from .measure import finish, format_batches, in_map_order

    ray = ray_module()
    check(address, shared_dir)
    said = connect(address)
    job_dir = None
    refs: list = []
    running: dict = {}
    try:
        differences = dtype == DIFFERENCES  # the engine's resolved compute: its summary carries two tail rows
        where = placement(ray, workers, device, task_memory(source, chunks, limit, differences),
                          reference_task_memory(source, chunks, differences))
        if log:
            log(f"{said}; {where.workers} sweep{'s' * (where.workers != 1)} at a time, each "
                + ("on one GPU" if where.device == "cuda" else f"on {where.threads} CPU thread(s)"))
            if estimate is not None and where.device == "cpu":
                log(estimate.render_workers(where.workers))
        if shared_dir:
            job_dir = Path(shared_dir).resolve() / f"cardfit-scan-{uuid.uuid4().hex[:12]}"
            job_dir.mkdir()
        env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
        job = ScanJob(str(Path(source.path).resolve()), group_by, rounding, chunks.numpy().copy(), batch,
                      where.device, dtype, gpu_memory, memory_cap, limit, str(job_dir) if job_dir else None, env)
        common = {"max_retries": RETRIES, "retry_exceptions": False, "runtime_env": {"env_vars": env}}
        layers = source.geometry.num_layers
        remote_reference = ray.remote(max_calls=where.max_calls)(_reference_task).options(
            num_returns=layers + 3, **where.reference, **common)
        refs = remote_reference.remote(job, where.reference_threads, layers)
        perplexity = _get(ray, refs[0], "the reference pass")
        result["reference"] = {"perplexity": round(perplexity, 6)}
        point_refs, reference_ref = refs[1:layers + 2], refs[layers + 2]
        # one task per sweep (the formats of a group whose copies fit `limit` together), so a worker that
        # dies takes at most one sweep's cells with it, as a killed single-process scan does; longest
        # first: a group at layer i re-runs L - i layers, the embedding (start -1) all of them
        tasks = [(i, batch_formats) for i, pending in pending_by_group(todo).items()
                 for batch_formats in format_batches(groups[i], pending, limit)]
        tasks.sort(key=lambda task: max(groups[task[0]].start, 0))
        sweep = ray.remote(max_calls=where.max_calls)(_sweep_task).options(**where.sweep, **common)
        sweeps = reads = 0
        hosts = set()
        while tasks or running:
            while tasks and len(running) < where.workers:
                i, batch_formats = tasks.pop(0)
                ref = sweep.remote(job, where.threads, i, [f.name for f in batch_formats], point_refs,
                                   [reference_ref])
                running[ref] = i
            done, _ = _interruptible(lambda: ray.wait(list(running), num_returns=1))
            i = running.pop(done[0])
            answer = _get(ray, done[0], f"group {groups[i].name}")
            entry = result["groups"][i]
            entry["cells"].update(answer["cells"])
            entry["cells"] = in_map_order(entry["cells"], fmts)
            write_json(out, result)
            sweeps, reads = sweeps + answer["sweeps"], reads + answer["layer_reads"]
            hosts.add((answer["host"], answer["pid"]))
            if bar:
                bar.update(len(answer["cells"]))
        if log:
            log(f"read decoder layers {reads} times in {sweeps} group sweeps on {len(hosts)} worker process(es), "
                f"plus {layers} for the reference pass")
        return finish(result, out)
    finally:
        for ref in [*running, *refs[:1]]:
            try:
                ray.cancel(ref, force=True)
            except Exception:  # already finished or gone: nothing to stop
                pass
        try:
            ray.shutdown()
        finally:
            if job_dir is not None:
                shutil.rmtree(job_dir, ignore_errors=True)


def _interruptible(call):
    """A blocking Ray call; a SIGTERM or Ctrl-C that lands inside Ray's C code arrives as a SystemError
    caused by cardfit's Terminated or KeyboardInterrupt: re-raised as itself, so the clean-up runs."""
    try:
        return call()
    except SystemError as exc:
        inner = exc.__cause__ or exc.__context__
        if isinstance(inner, BaseException) and not isinstance(inner, Exception):
            raise inner from None
        raise


def _get(ray, ref, what: str):
    """A task's result. A user error raised on a worker comes back as that error, a file problem there
    as its one line; a worker that died more often than Ray retries, or any other failure of Ray, as one
    line saying that finished cells are kept."""
    try:
        return _interruptible(lambda: ray.get(ref))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, CardfitError):
            raise cause from None
        if isinstance(cause, OSError):
            where = f" ({cause.filename})" if cause.filename else ""
            raise CardfitError(f"a Ray worker measuring {what} could not read or write a file{where}: "
                               f"{cause.strerror or type(cause).__name__}",
                               "every node must see the model, CARDFIT_CACHE and --shared-dir at the same "
                               "paths; then rerun with --resume (finished cells are kept)") from None
        raise
    except (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError, ray.exceptions.NodeDiedError) as exc:
        raise CardfitError(f"the Ray worker measuring {what} died {RETRIES + 1} times ({type(exc).__name__})",
                           "give the nodes more memory or lower --max-tokens, then rerun with --resume "
                           "(finished cells are kept)") from None
    except ray.exceptions.RayError as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CardfitError(f"Ray failed while measuring {what}: {type(exc).__name__}: {first}",
                           "rerun with --resume (finished cells are kept)") from None
