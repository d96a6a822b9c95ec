"""What the cheap signal's pricing costs per ggml type, whole: every matrix of a model round-tripped once per
distinct rounding (`Format.rounding_key`, as a sweep rounds), RTN, on the cores this process may use, the seconds
summed per storage type (over threads where small matrices run their formats side by side). fisher_cells prices
the i-quants of large matrices from a sample of blocks instead (bench/sampled_pricing.py).

    python bench/roundtrip_costs.py --model qwen2.5-coder-0.5b --formats Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_1,Q4_0,IQ4_XS,Q3_K,Q2_K
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

from cardfit.formats import parse_formats
from cardfit.formats.ggml_lib import over_items
from cardfit.engine.heap import map_large_blocks
from cardfit.sources import open_model, runnable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded one)")
    parser.add_argument("--formats", default="Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_1,Q4_0,IQ4_XS,Q3_K,Q2_K")
    args = parser.parse_args()
    map_large_blocks()  # as the scan runs
    source = runnable(open_model(args.model))
    formats = parse_formats(args.formats)
    seconds: collections.Counter = collections.Counter()
    lock = threading.Lock()
    start = time.perf_counter()
    for tensor in source.tensors():
        if len(tensor.shape) != 2:
            continue
        weight = source.read(tensor.name)
        alike: dict[tuple, list] = {}
        for fmt in formats:
            if fmt.storage(tensor.name, tensor.shape) != "F32":
                alike.setdefault(fmt.rounding_key(tensor.name, tensor.shape, "rtn"), []).append(fmt)

        def roundtrip(same, name=tensor.name, weight=weight, shape=tensor.shape):
            began = time.perf_counter()
            same[0].roundtrip(name, weight, None, "rtn")
            with lock:
                seconds[same[0].storage(name, shape)] += time.perf_counter() - began

        over_items(roundtrip, list(alike.values()), weight.numel())
    print(f"{time.perf_counter() - start:.1f} s wall; seconds per storage type, summed over threads:")
    for storage, spent in seconds.most_common():
        print(f"  {storage}: {spent:.1f}")


if __name__ == "__main__":
    main()
