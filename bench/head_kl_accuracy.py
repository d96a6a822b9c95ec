"""Cells' KL three ways on a real model: the log-softmax form (float32, what scans did before head_kl),
head_kl's reference summary (what they do now), and a float64 ground truth (the same final hidden states
through the head in float64). Each case quantizes one group in one format, as a scan's cell does.

    python bench/head_kl_accuracy.py --model qwen2.5-coder-0.5b --cases layers.23:Q8_0,layers.10:Q2_K
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

from cardfit.engine import Engine, Track
from cardfit.formats import get_format
from cardfit.engine.head_kl import slice_kl, summarize
from cardfit.engine.metrics import kl_from_logprobs
from cardfit.sources import open_model, runnable
from cardfit.text import load_text, token_chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--cases", default="layers.23:Q8_0,layers.10:Q8_0,layers.3:Q8_0,layers.10:Q2_K")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--positions", type=int, default=256, help="positions per head slice")
    args = parser.parse_args()
    source = runnable(open_model(args.model))
    chunks = token_chunks(AutoTokenizer.from_pretrained(source.path), load_text(None)[0], args.tokens, args.tokens)
    engine = Engine(source, "cpu")
    stream = engine.stream

    def final(overrides: dict) -> torch.Tensor:
        track = Track(engine.embed([chunks], overrides), 0, overrides)
        engine.walk([track])
        return track.hidden[0]

    reference = final({})
    with engine.head():
        weight = stream.head_matrix()
        for case in args.cases.split(","):
            group, fmt_name = case.split(":")
            fmt = get_format(fmt_name)
            hidden = final({t.name: fmt.roundtrip(t.name, source.read(t.name))
                            for t in source.groups()[group] if len(t.shape) == 2})
            sums, worst, count = {"truth": 0.0, "before": 0.0, "after": 0.0}, {"before": 0.0, "after": 0.0}, 0
            for start in range(0, hidden.shape[1], args.positions):
                ref_h, q_h = reference[:, start:start + args.positions], hidden[:, start:start + args.positions]
                n_ref, n_q = stream.final_norm(ref_h), stream.final_norm(q_h)
                z_ref, z_q = stream.logits(ref_h), stream.logits(q_h)
                lp = torch.log_softmax(n_ref.double() @ weight.double().t(), -1)
                lq = torch.log_softmax(n_q.double() @ weight.double().t(), -1)
                kl = {"truth": (lp.exp() * (lp - lq)).sum(-1)}
                del lp, lq
                kl["before"] = kl_from_logprobs(torch.log_softmax(z_ref, -1), z_q).double()
                kl["after"] = slice_kl(z_q.clone(), n_q, *summarize(z_ref.clone(), n_ref, weight))[0]
                for name, values in kl.items():
                    sums[name] += float(values.sum())
                for name in worst:
                    worst[name] = max(worst[name], float((kl[name] - kl["truth"]).abs().max()))
                count += kl["truth"].numel()
            truth = sums["truth"] / count
            print(f"{case}: truth {truth:.4e}; before {sums['before'] / sums['truth'] - 1:+.2%}, "
                  f"after {sums['after'] / sums['truth'] - 1:+.2%}; worst position before {worst['before']:.1e}, "
                  f"after {worst['after']:.1e}", flush=True)
    engine.close()


if __name__ == "__main__":
    main()
