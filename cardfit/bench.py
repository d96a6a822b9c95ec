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


def _refuse_oversized_context(path: Path, tokens: int) -> None:
    """Before llama.cpp allocates a context of `tokens`: refuse one whose KV cache alone would not fit the
    memory this machine has free (`bench --gen-tokens 100000000000` grew to 22.9 GB and was killed)."""
    import psutil

    from .kv import kv_cache
    from .sources import GgufSource
    from .units import format_bytes

    need = kv_cache(GgufSource(path).geometry, tokens).kv_bytes
    free = psutil.virtual_memory().available
    if need > free:
        raise CardfitError(f"--prompt-tokens + --gen-tokens = {tokens} tokens need a {format_bytes(need)} KV cache, "
                           f"more than the {format_bytes(free)} of memory free here",
                           "lower --gen-tokens (and --prompt-tokens)")


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
    vram_bytes = None if vram is None else parse_bytes(vram, "--vram")  # refused before the minutes of measuring
    _refuse_oversized_context(path, prompt_tokens + gen_tokens)
    from .targets.runtimes import load_llama

    process = psutil.Process()
    before = process.memory_info().rss
    start = time.perf_counter()
    try:
        llm = load_llama(path, n_ctx=prompt_tokens + gen_tokens + 8, n_batch=prompt_tokens,
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
    if vram_bytes is not None:
        geometry = GgufSource(path).geometry
        result["vram_bytes"] = vram_bytes
        result["max_context_tokens"] = max_context_tokens(geometry, vram_bytes, path.stat().st_size,
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


def bench_vllm(artifact: str | Path, vram: str | int | None = None, reference: str | Path | None = None,
               gen_tokens: int = 64, batch: int = 32, python: str | Path | None = None) -> dict:
    """The seed's vLLM table for a compressed-tensors checkpoint: weights, ratio to the 16-bit reference,
    KV budget in tokens beside the weights on `vram`, single-stream and batched generation tokens/s.

    Also the KV cache vLLM itself allocates for 1 GiB (VLLM_CPU_KVCACHE_SPACE=1) next to what
    cardfit's KV model predicts for that space, so the KV column is checked against the runtime."""
    from .architecture import geometry_from_config, load_config
    from .kv import kv_cache
    from .sources import open_model
    from .units import parse_bytes
    from .targets.vllm_env import run_driver

    path = Path(artifact)
    if not (path.is_dir() and (path / "config.json").exists()):
        raise CardfitError(f"{path} is not a compressed-tensors checkpoint directory",
                           "cardfit bench --runtime vllm measures what `cardfit pack --format compressed-tensors` writes")
    vram_bytes = None if vram is None else parse_bytes(vram, "--vram")  # refused before vLLM starts
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    ref = open_model(reference, run=True)  # its 16-bit form, also for a .gguf
    ref_bytes = sum(t.nbytes for t in ref.tensors())
    answer, _ = run_driver({"task": "bench", "model": str(path), "max_model_len": 1024, "gen_tokens": gen_tokens,
                            "batch": batch, "kv_cache_gib": 1}, python=python)
    geometry = geometry_from_config(load_config(path), source=str(path / "config.json"))
    per_token = kv_cache(geometry, 1, 1, "f16", "vllm").kv_bytes_per_token
    result = {"artifact": str(path), "runtime": f"vllm {answer['vllm']} (CPU)", "threads": os.cpu_count(),
              "weights_bytes": weights, "reference_bytes": ref_bytes, "ratio": ref_bytes / weights,
              "load_seconds": answer["load_s"], "single_stream_tokens_per_s": answer["single_stream_tok_s"],
              "batched_tokens_per_s": answer["batched_tok_s"], "batch": batch, "gen_tokens": gen_tokens,
              "vllm_kv_tokens_per_gib": answer["kv_cache_tokens"], "predicted_kv_tokens_per_gib": 2**30 // per_token}
    if vram_bytes is not None:
        result["vram_bytes"] = vram_bytes
        result["max_context_tokens"] = max_context_tokens(geometry, vram_bytes, weights, "vllm")
    return result


def render_bench_vllm(result: dict) -> str:
    from .units import format_bytes

    lines = [f"{result['artifact']} in {result['runtime']} ({result['threads']} threads)",
             f"  weights              {format_bytes(result['weights_bytes'])} "
             f"(ratio {result['ratio']:.2f}x to the 16-bit reference)",
             f"  load                 {result['load_seconds']:.1f} s",
             f"  single stream        {result['single_stream_tokens_per_s']:.1f} tokens/s ({result['gen_tokens']} tokens)",
             f"  batched x{result['batch']:<11} {result['batched_tokens_per_s']:.1f} tokens/s",
             f"  KV cache per GiB     {result['vllm_kv_tokens_per_gib']:,} tokens in vLLM "
             f"(cardfit predicts {result['predicted_kv_tokens_per_gib']:,})"]
    if "max_context_tokens" in result:
        lines.append(f"  KV budget            {result['max_context_tokens']:,} tokens beside the weights on "
                     f"{format_bytes(result['vram_bytes'])} (vLLM overhead model)")
    return "\n".join(lines)
