"""`cardfit bench`: what an artifact costs to serve, measured in its runtime.

Load time and the resident memory loading adds, prompt-processing and generation speed, and —
for a given card — how many tokens of context fit beside the weights (the seed's "KV budget in
tokens" column): the largest context whose KV cache and runtime overhead (the same model as
`cardfit budget`) still leave room for the artifact's weights.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from .errors import CardfitError


def max_context_tokens(geometry, vram: int, weight_bytes: int, runtime: str, batch: int = 1,
                       kv_dtype: str = "f16", limit: int = 1 << 24) -> int:
    """The largest context (tokens per sequence) for which the budget still holds the weights; 0 if none."""
    from .budget import compute_budget

    def fits(context: int) -> bool:
        try:
            return compute_budget(geometry, vram, context, batch, kv_dtype, runtime).weight_budget_bytes >= weight_bytes
        except CardfitError:  # no room at all
            return False

    if not fits(1):
        return 0
    low, high = 1, limit
    if fits(high):
        return high
    while high - low > 1:  # KV grows with context, so `fits` is monotone
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def bench(artifact: str | Path, vram: str | int | None = None, prompt_tokens: int = 256, gen_tokens: int = 32,
          text: str | Path | None = None, threads: int | None = None) -> dict:
    """Measure a GGUF in llama.cpp: load, memory, prompt and generation tokens/s, context that fits `vram`."""
    import psutil

    from .sources import GgufSource
    from .text import load_text
    from .units import parse_bytes

    path = Path(artifact)
    if not (path.is_file() and path.suffix == ".gguf"):
        raise CardfitError(f"{path} is not a .gguf file", "cardfit bench measures GGUF artifacts in llama.cpp")
    import llama_cpp

    process = psutil.Process()
    before = process.memory_info().rss
    start = time.perf_counter()
    try:
        llm = llama_cpp.Llama(str(path), n_ctx=prompt_tokens + gen_tokens + 8, n_batch=prompt_tokens,
                              n_threads=threads or os.cpu_count(), verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise CardfitError(f"llama.cpp cannot load {path} ({exc})", "re-pack the artifact") from None
    load_s = time.perf_counter() - start
    loaded_rss = process.memory_info().rss - before
    body, _ = load_text(text, default="heldout")
    prompt = llm.tokenize(body.encode("utf-8"), add_bos=False)[:prompt_tokens]
    if len(prompt) < prompt_tokens:
        raise CardfitError(f"the text has only {len(prompt)} tokens", "give a longer --text or fewer --prompt-tokens")
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(gen_tokens):
        token = llm.sample(top_k=1, temp=0.0)
        llm.eval([token])
    gen_s = time.perf_counter() - start
    llm.close()
    result = {"artifact": str(path), "runtime": "llama.cpp", "threads": threads or os.cpu_count(),
              "file_bytes": path.stat().st_size, "load_seconds": load_s, "load_rss_bytes": loaded_rss,
              "prompt_tokens": prompt_tokens, "prompt_tokens_per_s": prompt_tokens / prompt_s,
              "gen_tokens": gen_tokens, "gen_tokens_per_s": gen_tokens / gen_s}
    if vram is not None:
        geometry = GgufSource(path).geometry
        result["vram_bytes"] = parse_bytes(vram, "--vram")
        result["max_context_tokens"] = max_context_tokens(geometry, result["vram_bytes"], path.stat().st_size,
                                                          "llama.cpp")
    return result


def render_bench(result: dict) -> str:
    from .units import format_bytes

    lines = [f"{result['artifact']} in {result['runtime']} ({result['threads']} threads)",
             f"  file                 {format_bytes(result['file_bytes'])}",
             f"  load                 {result['load_seconds']:.2f} s, +{format_bytes(result['load_rss_bytes'])} resident",
             f"  prompt               {result['prompt_tokens_per_s']:.1f} tokens/s ({result['prompt_tokens']} tokens)",
             f"  generation           {result['gen_tokens_per_s']:.1f} tokens/s ({result['gen_tokens']} tokens, greedy)"]
    if "max_context_tokens" in result:
        lines.append(f"  context that fits    {result['max_context_tokens']:,} tokens beside the weights on "
                     f"{format_bytes(result['vram_bytes'])} (llama.cpp overhead model)")
    return "\n".join(lines)
