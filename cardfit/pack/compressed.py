"""Stream a recipe into a compressed-tensors checkpoint (what vLLM serves and transformers loads).

Layout, as llmcompressor writes it: every quantized Linear stores `weight_packed` (int32 words of
packed integers), `weight_scale` (16-bit, one per row and group), `weight_shape` and, when
asymmetric, `weight_zero_point`; everything else stays 16-bit. config.json carries a
`quantization_config` with one config group per integer format, targeting exactly the modules
the recipe put in that format (or `Linear` with `ignore: [lm_head]` when one format covers every
decoder Linear, the declaration of llmcompressor's W4A16 recipe). One safetensors shard is
written per layer group, so only one group is resident while packing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
from pathlib import Path

import torch

from ..errors import CardfitError
from ..formats import DenseFormat, IntGroupFormat, is_packed_matrix
from ..groups import GroupId, expert_stack
from ..sources import ModelSource, group_of, group_sort_key

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt")


def _scheme(fmt: IntGroupFormat, targets: list[str]):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=fmt.num_bits, type="int", symmetric=fmt.symmetric,
                            strategy="channel" if fmt.group_size == -1 else "group",
                            group_size=None if fmt.group_size == -1 else fmt.group_size)
    return QuantizationScheme(targets=targets, weights=args)


def quantization_config(source: ModelSource, formats: dict) -> dict:
    """config.json's quantization_config for this per-tensor assignment.

    Routed experts are one `re:` target (EXPERTS_TARGET) in their format's group: transformers finds the
    experts' scheme as the group whose regex names experts (and decompresses every expert with it), vLLM
    matches each layer's `experts.0.<proj>` against it; listing 128 experts x 3 projections x 48 layers by
    name would serve the same and log a warning per name. Every other matrix of a decoder layer that is
    not packed (routers, a shared expert's gate, MLA's low-rank projections) is named in `ignore`, so a
    runtime matching `Linear` never expects packed weights it does not find."""
    from compressed_tensors.quantization import QuantizationConfig

    by_format: dict[str, tuple[IntGroupFormat, list[str]]] = {}
    ignore, experts = [], set()
    for t in source.tensors():
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            continue
        module = t.name[: -len(".weight")]
        fmt = formats.get(t.name)
        if is_packed_matrix(t.name, t.shape) and isinstance(fmt, IntGroupFormat):
            resolved = fmt.resolve(t.shape)
            if expert_stack(t.name):
                experts.add(resolved.name)
                by_format.setdefault(resolved.name, (resolved, []))
            else:
                by_format.setdefault(resolved.name, (resolved, []))[1].append(module)
        elif group_of(t.name).in_layer:
            ignore.append(module)
    if len(experts) > 1:  # the plan ties them (Target.one_expert_format); a hand-made recipe may not
        raise CardfitError(f"the routed experts are in {len(experts)} formats ({', '.join(sorted(experts))}); "
                           "transformers decompresses every expert with one scheme",
                           "give every experts stack one format (cardfit plan does)")
    ignore.append("lm_head")  # every causal LM has the module, tied or not; it stays 16-bit
    if len(by_format) == 1 and not [m for m in ignore if m != "lm_head"]:
        (fmt, _), = by_format.values()
        groups = {"group_0": _scheme(fmt, ["Linear"])}
        ignore = ["lm_head"]
    else:
        groups = {f"group_{i}": _scheme(fmt, sorted(mods, key=_module_key) + ([EXPERTS_TARGET] if name in experts else []))
                  for i, (name, (fmt, mods)) in enumerate(by_format.items())}
    config = QuantizationConfig(config_groups=groups, format="pack-quantized", quantization_status="compressed",
                                ignore=sorted(set(ignore), key=_module_key))
    return config.model_dump(exclude_none=False)


# Every routed expert's matrix (`model.layers.3.mlp.experts.17.down_proj`, Mixtral's `...experts.5.w2`)
EXPERTS_TARGET = r"re:.*\.experts\.\d+\.[^.]+$"


def _module_key(name: str):
    return (group_sort_key(group_of(name + ".weight")), name)


def storage_dtype(stored_dtype: str) -> torch.dtype:
    """Unquantized tensors keep a 16-bit model dtype; a float32 checkpoint is stored as bfloat16."""
    return torch.float16 if stored_dtype == "F16" else torch.bfloat16


def compress_tensor(name: str, weight: torch.Tensor, fmt, calibration, method: str, dense_dtype: torch.dtype
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(tensors to store, the weight the runtime computes with)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from ..quant import quantize_int

    shape = tuple(weight.shape)
    if not (isinstance(fmt, IntGroupFormat) and is_packed_matrix(name, shape)):
        stored = weight.to(dense_dtype)
        return {name: stored}, stored.to(torch.float32)
    resolved = fmt.resolve(shape)
    q, scale, zero, _ = quantize_int(resolved, weight, calibration, method)
    base = name[: -len("weight")]
    out = {f"{base}weight_packed": pack_to_int32(q, resolved.num_bits),
           f"{base}weight_scale": scale.to(resolved.scale_dtype),
           f"{base}weight_shape": torch.tensor(shape, dtype=torch.int64)}
    if not resolved.symmetric:
        out[f"{base}weight_zero_point"] = pack_to_int32(zero.to(torch.int8), resolved.num_bits, packed_dim=0)
    effective = resolved.dequantize(q, scale.to(resolved.scale_dtype).to(torch.float32), zero)
    return out, effective


def write_compressed(out_dir: Path, source: ModelSource, formats: dict, budget: int | None, method: str = "rtn",
                     calibration=None, progress=None) -> dict:
    """Write the checkpoint into `out_dir` (a temporary directory: the caller renames it into place)."""
    for name, fmt in formats.items():
        if not isinstance(fmt, (IntGroupFormat, DenseFormat)):
            raise CardfitError(f"format {fmt.name} of {name} is not a compressed-tensors format",
                               "plan from a vLLM map, or pack with --format gguf")
    shapes = {t.name: t.shape for t in source.tensors()}
    predicted = sum(fmt.tensor_bytes(name, shapes[name]) for name, fmt in formats.items())
    if budget is not None and predicted > budget:
        from ..units import format_bytes

        raise CardfitError(f"the checkpoint would hold {format_bytes(predicted)} of weights, over the "
                           f"{format_bytes(budget)} weight budget", "re-plan for this budget")
    config = dict(source.config)
    config["quantization_config"] = quantization_config(source, formats)  # its refusals before any work
    groups = [g for g in source.groups().items() if any(t.name in formats for t in g[1])]
    engine = getattr(calibration, "engine", None)
    quantizers = engine.quantizers if engine is not None else contextlib.nullcontext
    weight_map, total = {}, 0
    for k, (group, tensors) in enumerate(groups):
        layer = GroupId(group).layer
        stats = calibration.statistics(layer) if calibration is not None and layer is not None else {}
        shard: dict[str, torch.Tensor] = {}
        effective: dict[str, torch.Tensor] = {}
        folded = {}
        if method == "awq" and layer is not None:  # scales folded into norms and rows, then plain rounding
            from .awq_fold import fold_layer

            names = [t.name for t in tensors if t.name in formats]
            marker = f"{GroupId.layer_group(layer)}."  # HF names hold the group's name: model.layers.N.
            prefix = names[0].split(marker)[0] + marker
            folded = fold_layer(prefix, {n: source.read(n) for n in names}, stats, formats, source.config)
        for t in tensors:
            if t.name not in formats:
                continue
            fmt = formats[t.name]
            # AWQ's scales are already folded in (plain rounding); a tensor without statistics rounds plainly
            rounding = fmt.method_for("rtn" if method == "awq" or t.name not in stats else method)
            weight = folded[t.name] if t.name in folded else source.read(t.name)
            with quantizers():  # GPTQ works on the calibration's device, under its --gpu-memory
                stored, effective[t.name] = compress_tensor(t.name, weight, fmt, stats.get(t.name),
                                                            rounding, storage_dtype(t.dtype))
            shard.update(stored)
            if progress:
                progress(t.name)
        if calibration is not None and layer is not None:
            calibration.advance(layer, effective)  # GPTQ/AWQ: the next layer calibrates on this layer's output
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        _save_shard(shard, out_dir / file)
        for n, v in shard.items():
            weight_map[n] = file
            total += v.numel() * v.element_size()
    if total != predicted:
        raise RuntimeError(f"stored {total} bytes of tensors, formats predicted {predicted}")
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (source.path / name).exists():
            shutil.copy(source.path / name, out_dir / name)
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return {"file_bytes": size, "tensor_bytes": total, "tensors": len(weight_map), "warnings": []}


def _save_shard(shard: dict, path: Path) -> None:
    """safetensors' writer reports a full disk as its own error type; it is the OS's ENOSPC all the same."""
    from safetensors.torch import save_file

    try:
        save_file({n: v.contiguous() for n, v in shard.items()}, str(path), metadata={"format": "pt"})
    except Exception as exc:
        if "os error 28" in str(exc) or "No space left" in str(exc):
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from None
        raise
