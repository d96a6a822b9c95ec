"""GPTQ time and device peak vs column block size, on a Qwen2.5-7B down_proj-wide layer.

    python bench/gptq_blocks.py [--width 18944] [--rows 256] [--cap 512MiB]

The factorisation of H (host) is timed apart from the sweep (device), since block size
changes only the sweep.
"""

import argparse
import time

import torch

from cardfit.formats import get_format
from cardfit.quant import DeviceArena
from cardfit.quant.gptq import gptq_quantize, inverse_hessian_factor
from cardfit.units import format_bytes, parse_bytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=18944)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--cap", default="512MiB")
    parser.add_argument("--blocks", default="32,64,128,256,512")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, args.width, generator=g)
    hessian = x.T @ x / x.shape[0]
    w = torch.randn(args.rows, args.width, generator=g) * 0.02
    fmt = get_format("W4A16-g128")
    start = time.time()
    inverse_hessian_factor(hessian)
    factor = time.time() - start
    print(f"width {args.width}, rows {args.rows}, Hessian {format_bytes(hessian.numel() * 4)} (host), "
          f"cap {args.cap}, threads {torch.get_num_threads()}; factorisation {factor:.1f} s\n")
    print("| block | total s | sweep s (total - factorisation) | device peak |")
    print("|---|---|---|---|")
    for block in [int(b) for b in args.blocks.split(",")]:
        arena = DeviceArena("cpu", parse_bytes(args.cap))
        start = time.time()
        gptq_quantize(fmt, w, hessian, block_size=block, arena=arena)
        total = time.time() - start
        print(f"| {block} | {total:.1f} | {total - factor:.1f} | {format_bytes(arena.peak)} |", flush=True)


if __name__ == "__main__":
    main()
