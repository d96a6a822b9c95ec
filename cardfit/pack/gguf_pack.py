"""Stream a recipe into a GGUF file that llama.cpp (and Ollama) load.

One pass, one tensor resident: every tensor's GGUF type and exact byte size is known from the
recipe before any weight is read, so the header (metadata, tokenizer, tensor table) is written
first, the file's final size is checked against the budget, and then each tensor is read from
the model's memory maps, transformed as llama.cpp's converter would, quantized by ggml itself
and appended. No f16 intermediate file is ever written.
"""

from __future__ import annotations

import numpy as np

from ..errors import CardfitError
from ..formats import GgmlFormat
from ..formats.ggml_types import ggml_type
from ..formats.gguf_formats import ggml_tensor_bytes, llama_file_type
from ..groups import LM_HEAD, GroupId, expert_stack, group_of
from ..sources import ModelSource
from .gguf_arch import ArchSpec
from .gguf_vocab import add_vocab, loadable_name

ALIGNMENT = 32  # GGUF's default data alignment


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def ordered_tensors(source: ModelSource, formats: dict) -> list:
    """Write order: embedding, decoder layers in order, final norm, output (llama.cpp's converter order)."""
    return sorted((t for t in source.tensors() if t.name in formats), key=lambda t: GroupId(t.group).sort_key)


class GgufPlan:
    """Every tensor's GGUF name, type and bytes, decided before any weight is read. An entry's
    checkpoint names are one tensor's, or every expert's of one stack (in expert order)."""

    def __init__(self, source: ModelSource, formats: dict):
        self.spec = ArchSpec.for_config(source.config)
        self.entries = []  # (checkpoint names, gguf name, storage type, shape, nbytes)
        stacks: dict[str, list] = {}
        for t in ordered_tensors(source, formats):
            fmt = formats[t.name]
            if not isinstance(fmt, GgmlFormat):
                raise CardfitError(f"format {fmt.name} of {t.name} is not a GGUF type",
                                   "plan from a llama.cpp map, or pack with --format compressed-tensors")
            storage = fmt.storage(t.name, t.shape)
            stack = expert_stack(t.name)
            if stack is None:
                self.entries.append(((t.name,), self.spec.tensor_name(t.name), storage, t.shape,
                                     ggml_tensor_bytes(storage, t.shape)))
                continue
            if stack[0] not in stacks:
                stacks[stack[0]] = []
                self.entries.append(stack[0])  # its place in the write order, filled in below
            stacks[stack[0]].append((stack[1], t, storage))
        self.entries = [e if isinstance(e, tuple) else self._stacked(e, stacks[e]) for e in self.entries]
        self.extra = self.spec.extra_tensors()

    def _stacked(self, stack: str, experts: list) -> tuple:
        experts = sorted(experts, key=lambda e: e[0])
        if [e[0] for e in experts] != list(range(len(experts))):
            raise CardfitError(f"{stack}: the checkpoint's experts are not numbered 0..{len(experts) - 1}",
                               "restore the model's original weights")
        storages = {e[2] for e in experts}
        shapes = {tuple(e[1].shape) for e in experts}
        if len(storages) > 1 or len(shapes) > 1:
            raise CardfitError(f"{stack}: one GGUF tensor holds every expert, so they need one type "
                               f"(the recipe gives {', '.join(sorted(storages))})",
                               "plan with --group-by layer, which keeps an expert stack in one group")
        shape = (len(experts), *shapes.pop())
        storage = storages.pop()
        return (tuple(e[1].name for e in experts), self.spec.tensor_name(stack), storage, shape,
                ggml_tensor_bytes(storage, shape))

    @property
    def tensor_bytes(self) -> int:
        return sum(e[4] for e in self.entries) + sum(a.nbytes for a in self.extra.values())

    def file_bytes(self, header: int) -> int:
        """The whole file: the header padded to the alignment, then every tensor padded."""
        return _pad(header) + sum(_pad(e[4]) for e in self.entries) + sum(_pad(a.nbytes) for a in self.extra.values())

    def reserve_bytes(self, header: int) -> int:
        """The file beside the recipe's tensor data, whatever their types: header, extra tensors, and the
        most alignment padding any tensor can need."""
        return _pad(header) + sum(_pad(a.nbytes) for a in self.extra.values()) + (ALIGNMENT - 1) * len(self.entries)

    def file_type(self) -> int:
        """general.file_type: llama.cpp's file type of the type holding the most bytes (F32 aside)."""
        counts: dict[str, int] = {}
        for _, _, storage, _, nbytes in self.entries:
            if storage != "F32":
                counts[storage] = counts.get(storage, 0) + nbytes
        top = max(counts, key=counts.get) if counts else "F16"
        return llama_file_type(top)


def _writer(path, source: ModelSource, plan: GgufPlan, name: str):
    import gguf

    writer = gguf.GGUFWriter(str(path), plan.spec.arch)
    writer.add_type("model")
    writer.add_file_type(plan.file_type())
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_string("general.quantized_by", "cardfit")
    plan.spec.metadata(writer)
    tokens, warnings = add_vocab(writer, source.path, int(plan.spec.config["vocab_size"]))
    writer.add_name(loadable_name(name, tokens, warnings))
    for _, gguf_name, storage, shape, nbytes in plan.entries:
        writer.add_tensor_info(gguf_name, list(shape), np.dtype(np.float32), nbytes,
                               raw_dtype=ggml_type(storage))
    for gguf_name, array in plan.extra.items():
        writer.add_tensor_info(gguf_name, list(array.shape), array.dtype, array.nbytes)
    return writer, warnings + plan.spec.warnings()


def header_bytes(source: ModelSource, plan: GgufPlan, scratch_dir) -> int:
    """Bytes of the header (metadata, tokenizer, tensor table), measured by writing it."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(dir=scratch_dir) as tmp:
        path = Path(tmp) / "header.gguf"
        writer, _ = _writer(path, source, plan, source.path.name)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        size = writer.fout[0].tell()
        writer.close()
    return size


def write_gguf(path, source: ModelSource, formats: dict, budget: int | None, method: str = "rtn",
               calibration=None, name: str | None = None, progress=None) -> dict:
    """Write the artifact at `path` (a temporary name: the caller renames it into place)."""
    plan = GgufPlan(source, formats)
    writer, warnings = _writer(path, source, plan, name or source.path.name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    predicted = plan.file_bytes(fout.tell())
    if budget is not None and predicted > budget:
        writer.close()
        from ..units import format_bytes

        raise CardfitError(f"the GGUF would be {format_bytes(predicted)}, over the "
                           f"{format_bytes(budget)} weight budget by {format_bytes(predicted - budget)}",
                           "re-plan with the metadata reserved (cardfit plan --model), or raise the budget")
    _check_free_space(path, predicted - fout.tell())
    current_layer, stats = None, {}
    for hf_names, gguf_name, storage, shape, nbytes in plan.entries:
        hf_name = hf_names[0]
        layer = _layer_index(hf_name)
        if calibration is not None:
            if layer != current_layer:
                if current_layer is not None:
                    calibration.advance(current_layer)  # llama.cpp's imatrix sees the unquantized model
                stats = calibration.statistics(layer) if layer is not None else {}
                current_layer = layer
            if group_of(hf_name) == LM_HEAD:
                stats = {hf_name: calibration.head_statistics()}  # the final norm's output, what it multiplies
        fmt = formats[hf_name]
        rounding = fmt.method_for(method)
        parts = []
        for part in hf_names:  # one tensor, or a stack's experts in order (ggml's rows run on across them)
            weight = plan.spec.transform(part, source.read(part))
            actual, raw = fmt.quantize(part, weight, stats.get(part), rounding)
            if actual != storage:
                raise RuntimeError(f"{part}: planned {storage}, quantized {actual}")
            parts.append(raw)
            del weight
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if raw.nbytes != nbytes:
            raise RuntimeError(f"{gguf_name}: planned {nbytes} B, quantized {raw.nbytes} B")
        _write(writer, raw)
        del raw, parts
        if progress:
            progress(gguf_name)
    for array in plan.extra.values():
        _write(writer, array)
    writer.close()
    size = path.stat().st_size
    if size != predicted:
        raise RuntimeError(f"wrote {size} bytes, predicted {predicted}")
    return {"file_bytes": size, "tensor_bytes": plan.tensor_bytes, "tensors": len(plan.entries) + len(plan.extra),
            "arch": plan.spec.arch, "warnings": warnings}


def _write(writer, array: np.ndarray) -> None:
    try:
        writer.write_tensor_data(array)
    except OSError as exc:
        import errno

        if exc.errno == errno.ENOSPC:
            raise CardfitError("the disk filled up while writing the artifact (nothing was left behind)",
                               "free disk space or choose another --out") from None
        raise


def _check_free_space(path, needed: int) -> None:
    import shutil

    free = shutil.disk_usage(path.parent).free
    if free < needed:
        from ..units import format_bytes

        raise CardfitError(f"the artifact needs {format_bytes(needed)} more, the disk has {format_bytes(free)} free",
                           "free disk space or choose another --out")


def _layer_index(name: str) -> int | None:
    return group_of(name).layer

