"""Stage 1: what is left for weights once the KV cache and the runtime have taken theirs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .architecture import ModelGeometry, load_geometry
from .errors import CardfitError
from .kv import KvCache, kv_cache
from .overhead import OverheadSettings, runtime_overhead
from .units import format_bytes, parse_bytes


@dataclass
class Budget:
    vram_bytes: int
    context: int
    batch: int
    kv_dtype: str
    runtime: str
    attention_layers: int
    sliding_layers: int
    recurrent_layers: int
    kv_bytes_per_token: int
    kv_bytes: int
    state_bytes_per_sequence: int
    overhead_bytes: int
    overhead_terms: dict[str, int]
    weight_budget_bytes: int
    sizes: dict | None = field(default=None)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def fits_any(self) -> bool | None:
        if not self.sizes:
            return None
        return self.sizes["minimum_bytes"][self.runtime] <= self.weight_budget_bytes


def no_fit_message(weight_budget: int, minimum: int) -> str:
    return (f"no recipe fits the {format_bytes(weight_budget)} weight budget — minimum achievable is "
            f"{format_bytes(minimum)} ({format_bytes(minimum - weight_budget)} over)")


def compute_budget(geometry: ModelGeometry, vram: int | str, context: int, batch: int = 1, kv_dtype: str = "f16",
                   runtime: str = "llama.cpp", settings: OverheadSettings | None = None) -> Budget:
    vram_bytes = parse_bytes(vram, "--vram")
    cache: KvCache = kv_cache(geometry, context, batch, kv_dtype, runtime)
    overhead = runtime_overhead(geometry, vram_bytes, context, runtime, settings)
    weight_budget = vram_bytes - cache.kv_bytes - overhead.total
    if weight_budget <= 0:
        raise CardfitError(
            f"{format_bytes(vram_bytes)} leaves no room for weights: KV cache {format_bytes(cache.kv_bytes)} + "
            f"runtime overhead {format_bytes(overhead.total)} = {format_bytes(cache.kv_bytes + overhead.total)}",
            "lower --context or --batch, use a smaller --kv-dtype, or a larger --vram")
    return Budget(
        vram_bytes=vram_bytes, context=context, batch=batch, kv_dtype=kv_dtype, runtime=runtime,
        attention_layers=cache.attention_layers, sliding_layers=cache.sliding_layers,
        recurrent_layers=cache.recurrent_layers, kv_bytes_per_token=cache.kv_bytes_per_token,
        kv_bytes=cache.kv_bytes, state_bytes_per_sequence=cache.state_bytes_per_sequence,
        overhead_bytes=overhead.total, overhead_terms=overhead.terms, weight_budget_bytes=weight_budget)


def budget(model: str | Path | None = None, vram: int | str = "24GiB", context: int = 8192, batch: int = 1,
           kv_dtype: str = "f16", runtime: str = "llama.cpp", settings: OverheadSettings | None = None) -> Budget:
    """The weight budget for a model (a config.json, a model directory, a GGUF, or the default model).

    When weights are present their sizes at every uniform format are attached, so the
    caller learns at once whether any recipe can fit.
    """
    from .sizes import size_report
    from .sources import open_model

    path = Path(model) if model is not None else None
    if path is not None and path.suffix == ".json" and not (
            path.name == "config.json" and any(path.parent.glob("*.safetensors"))):
        geometry, source = load_geometry(path), None
    elif path is not None and path.is_dir() and not any(path.glob("*.safetensors")):
        geometry, source = load_geometry(path), None
    else:
        source = open_model(model)
        geometry = source.geometry
    result = compute_budget(geometry, vram, context, batch, kv_dtype, runtime, settings)
    if source is not None:
        result.sizes = size_report(source).to_dict()
    return result


def render_budget(b: Budget) -> str:
    lines = [f"attention layers {b.attention_layers} (KV {b.kv_bytes_per_token} bytes/token, {b.kv_dtype})"]
    if b.sliding_layers:
        lines.append(f"  of which sliding-window {b.sliding_layers} (each keeps at most its window)")
    if b.recurrent_layers:
        lines.append(f"recurrent layers {b.recurrent_layers} (state {format_bytes(b.state_bytes_per_sequence)}"
                     " per sequence)")
    lines += [
        f"VRAM total {format_bytes(b.vram_bytes)}",
        f"- KV cache {format_bytes(b.kv_bytes)} ({b.context} tokens x {b.batch} seq)",
        f"- runtime overhead {format_bytes(b.overhead_bytes)} ({b.runtime}: "
        + ", ".join(f"{k} {format_bytes(v)}" for k, v in b.overhead_terms.items()) + ")",
        f"= weight budget {format_bytes(b.weight_budget_bytes)}",
    ]
    if b.sizes:
        lines.append("")
        lines.append(f"model as stored {format_bytes(b.sizes['stored_bytes'])}; uniform formats:")
        for name, size in b.sizes["uniform_bytes"].items():
            verdict = "fits" if size <= b.weight_budget_bytes else "over"
            lines.append(f"  {name:<11} {format_bytes(size):>11}  {verdict}")
        lines.append(f"  minimum achievable for {b.runtime}: {format_bytes(b.sizes['minimum_bytes'][b.runtime])}")
    return "\n".join(lines)


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
