"""Runs inside vLLM's own Python environment (stdlib + vllm only; cardfit is not importable there).

vLLM pins torch, transformers and compressed-tensors versions that clash with cardfit's, so it
lives in a separate virtual environment and cardfit talks to it through this script: a JSON job in,
a JSON answer out (written to a temporary name and renamed). Jobs:

- logprobs: for each token sequence, the log-probability vLLM gives to chosen token ids at every
  position (the reference's most likely tokens, so cardfit can compute KL on them exactly).
- generate: greedy text for prompts (the coherence check).
- bench: single-stream and batched generation speed, load time, and the KV cache vLLM allocated.

    python vllm_driver.py JOB.json ANSWER.json
"""

from __future__ import annotations

import json
import os
import sys
import time

# Run as a script, this file's folder (cardfit/targets/) heads sys.path, and its vllm.py would stand in for vLLM.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _engine(job: dict):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 1)))
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=job["model"], max_model_len=job.get("max_model_len", 1024), enforce_eager=True,
              dtype=job.get("dtype", "auto"), seed=0, max_logprobs=-1,
              max_num_seqs=job.get("max_num_seqs", 32))
    return llm, time.perf_counter() - start


def _kv_tokens(llm) -> int | None:
    try:
        config = llm.llm_engine.vllm_config.cache_config
        return int(config.num_gpu_blocks) * int(config.block_size)
    except (AttributeError, TypeError):
        return None


def logprobs(llm, job: dict, answer_path: str) -> dict:
    """vLLM's log-probabilities of its top_k tokens (-1: the whole vocabulary) at every position of
    every sequence, most likely first, as arrays in a safetensors file beside the answer: `ids.N` and
    `logprobs.N` of shape (tokens, k), row t predicting token t + 1 as the logits at position t do."""
    import numpy as np
    from safetensors.numpy import save_file
    from vllm import SamplingParams, TokensPrompt

    k = job.get("top_k", -1)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, logprobs=k, flat_logprobs=True,
                            detokenize=False)
    arrays = {}
    for n, ids in enumerate(job["sequences"]):
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        # prompt row t (t >= 1) predicts token t from the tokens before it; the one generated step
        # predicts the token after the last: together, the logits of positions 0 .. len - 1.
        positions = [(out.prompt_logprobs, t) for t in range(1, len(ids))] + [(out.outputs[0].logprobs, 0)]
        rows = []
        for flat, t in positions:
            start, end = flat.start_indices[t], flat.end_indices[t]
            row_ids = np.asarray(flat.token_ids[start:end], dtype=np.int64)
            row_values = np.asarray(flat.logprobs[start:end], dtype=np.float32)
            _, first = np.unique(row_ids, return_index=True)  # the prompt token may repeat a top-k entry
            order = first[np.argsort(-row_values[first], kind="stable")]
            rows.append((row_ids[order], row_values[order]))
        width = min(len(r[0]) for r in rows)
        token_ids = np.stack([r[0][:width] for r in rows])
        values = np.stack([r[1][:width] for r in rows])
        arrays[f"ids.{n}"], arrays[f"logprobs.{n}"] = token_ids, values
    tensors_path = answer_path + ".safetensors"
    save_file(arrays, tensors_path + ".tmp")
    os.replace(tensors_path + ".tmp", tensors_path)
    return {"tensors": os.path.basename(tensors_path)}


def generate(llm, job: dict) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0.0)
    return {"texts": [o.outputs[0].text for o in llm.generate(job["prompts"], params, use_tqdm=False)]}


def bench(llm, job: dict) -> dict:
    from vllm import SamplingParams

    n = job.get("gen_tokens", 64)
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    prompt = job.get("prompt", "The history of the city begins")
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    single = n / (time.perf_counter() - start)
    batch = job.get("batch", 32)
    start = time.perf_counter()
    outs = llm.generate([f"{prompt} ({i})" for i in range(batch)], params, use_tqdm=False)
    batched = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    return {"single_stream_tok_s": single, "batched_tok_s": batched, "batch": batch, "gen_tokens": n}


def main() -> None:
    job_path, answer_path = sys.argv[1], sys.argv[2]
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    import vllm

    llm, load_s = _engine(job)
    answer = {"vllm": vllm.__version__, "load_s": load_s, "kv_cache_tokens": _kv_tokens(llm)}
    if job["task"] == "logprobs":
        answer.update(logprobs(llm, job, answer_path))
    else:
        answer.update({"generate": generate, "bench": bench}[job["task"]](llm, job))
    tmp = answer_path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(answer, f)
    os.replace(tmp, answer_path)
    # Stop the engine's processes before the interpreter tears down; vLLM can still abort at exit
    # ("terminate called without an active exception"), which is harmless once the answer is in place.
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if shutdown is not None:
        shutdown()


if __name__ == "__main__":
    main()
