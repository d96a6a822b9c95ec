"""Held-out quality of rounding methods on the embedded model (issue 3's table).

    python bench/quant_methods.py [--calib-tokens 16384] [--eval-tokens 8192]

Decoder linears are quantized; embeddings, norms and the (tied) head stay f16, as in
rtn-gptq-awq-from-scratch.txt. Prints a markdown table; sizes are the formats' exact bytes.
"""

import argparse
import time

from transformers import AutoTokenizer

from cardfit.engine.evaluate import measure, reference_logits
from cardfit.formats import get_format, is_decoder_linear
from cardfit.quant.model import quantize_model
from cardfit.engine import Engine
from cardfit.sizes import priced_tensors
from cardfit.sources import open_model
from cardfit.text import load_text, token_chunks
from cardfit.units import format_bytes

ROWS = [("fp16 (reference)", None, None), ("Q8_0 (GGUF)", "Q8_0", "rtn"), ("INT8 W8A16 RTN", "W8A16", "rtn"),
        ("INT4 W4A16-g128 RTN", "W4A16-g128", "rtn"), ("INT4 W4A16-g128 GPTQ", "W4A16-g128", "gptq"),
        ("INT4 W4A16-g128 AWQ", "W4A16-g128", "awq"), ("Q4_K (GGUF) RTN", "Q4_K", "rtn"),
        ("Q4_K (GGUF) imatrix", "Q4_K", "imatrix")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calib-tokens", type=int, default=16384)
    parser.add_argument("--eval-tokens", type=int, default=8192)
    args = parser.parse_args()
    source = open_model(None)
    stream = Engine(source, "cpu")
    tok = AutoTokenizer.from_pretrained(source.path)
    calib = token_chunks(tok, load_text(None)[0], 512, args.calib_tokens)
    held = token_chunks(tok, load_text(None, "heldout")[0], 512, args.eval_tokens)
    ref = reference_logits(stream, held)
    tensors = priced_tensors(source)
    print(f"calibration {calib.numel()} tokens (Python tutorial+HOWTOs), held-out {held.numel()} tokens (Python FAQ)\n")
    print("| recipe | weights | held-out ppl | mean KLD | top-1 | quantize time |")
    print("|---|---|---|---|---|---|")
    for label, name, method in ROWS:
        if name is None:
            size = sum(t.numel * 2 for t in tensors)
            meter = measure(stream, held, None, ref)
            print(f"| {label} | {format_bytes(size)} | {meter.ref_perplexity:.3f} | 0 | 1.000 | - |")
            continue
        fmt = get_format(name)
        chosen = lambda n, fmt=fmt: fmt if is_decoder_linear(n, (2, 2)) else None
        size = sum(fmt.tensor_bytes(t.name, t.shape) if chosen(t.name) else t.numel * 2 for t in tensors)
        start = time.time()
        overrides = quantize_model(stream, calib, chosen, method)
        spent = time.time() - start
        meter = measure(stream, held, overrides, ref)
        print(f"| {label} | {format_bytes(size)} | {meter.perplexity:.3f} | {meter.kl:.4f} ± {meter.kl_stderr:.4f} "
              f"| {meter.top1:.3f} | {spent:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
