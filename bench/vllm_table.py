"""The seed's vLLM table for the embedded model, measured in real vLLM (CPU build, its own environment):
uniform W4A16 (the llmcompressor preset) against cardfit's recipe for vLLM's CPU build at 1.25x its
bytes, each with weights, ratio, KV budget in tokens on a 6 GiB card, single-stream and batched x32
generation tokens/s, and what was lost (KLD, top-1, perplexity) measured in vLLM on held-out text.

    scripts/make-vllm-env.sh            # once
    python bench/vllm_table.py --out bench-vllm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cardfit.bench import bench_vllm
from cardfit.check import check
from cardfit.default_model import default_model_dir
from cardfit.pack import pack
from cardfit.plan import plan, uniform_recipe
from cardfit.scan import scan
from cardfit.sources import open_model
from cardfit.units import format_bytes

CARD = "6GiB"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench-vllm")
    parser.add_argument("--scan-tokens", type=int, default=512)
    parser.add_argument("--check-tokens", type=int, default=1024)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = default_model_dir()
    source = open_model(model)
    baseline = uniform_recipe(source, "W4A16-g128")
    sensitivity = scan(model, None, args.scan_tokens, "BF16-dense,W4A16-g32,W4A16-g128", seq_len=256,
                       out=out / "map-vllm.json", resume=True, progress=False)
    low = sum(g["bytes"]["W4A16-g128"] for g in sensitivity["groups"])
    recipe = plan(out / "map-vllm.json", int(low * 1.25), runtime="vllm-cpu")
    rows = []
    for name, rec in (("uniform W4A16-g128 (llmcompressor preset, RTN)", baseline),
                      ("cardfit, vllm-cpu recipe at 1.25x", recipe)):
        artifact = out / name.split()[0].replace(",", "")
        if not artifact.exists():
            pack(rec, model, artifact, progress=False)
        speed = bench_vllm(artifact, CARD)
        quality = check(artifact, model, max_tokens=args.check_tokens, seq_len=256, runtime="vllm")
        formats = sorted({g["format"] for g in rec["groups"]})
        rows.append({"name": name, "formats": formats, "bench": speed, "check": quality})
        print(json.dumps(rows[-1], default=str)[:400], flush=True)
    (out / "vllm_table.json").write_text(json.dumps(rows, indent=2, default=str))
    print(f"\n{rows[0]['bench']['runtime']}, {rows[0]['bench']['threads']} threads; KV budget on {CARD}; "
          f"{args.check_tokens} held-out tokens\n")
    print("| artifact | weights | ratio | KV budget (tokens) | single-stream tok/s | batched x32 tok/s | "
          "KLD (vLLM) | top-1 | perplexity |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        b, c = row["bench"], row["check"]
        print(f"| {row['name']} | {format_bytes(b['weights_bytes'])} | {b['ratio']:.2f}x | "
              f"{b['max_context_tokens']:,} | {b['single_stream_tokens_per_s']:.1f} | {b['batched_tokens_per_s']:.1f} | "
              f"{c['kld_mean']:.4f} ± {c['kld_stderr']:.4f} | {c['top1']:.1%} | {c['perplexity']:.2f} |")
    b = rows[0]["bench"]
    print(f"\nKV cache vLLM allocates per GiB: {b['vllm_kv_tokens_per_gib']:,} tokens; cardfit's KV model predicts "
          f"{b['predicted_kv_tokens_per_gib']:,}. Reference perplexity {rows[0]['check']['reference_perplexity']:.2f}.")


if __name__ == "__main__":
    main()
