"""What a default scan of a big model would take on N GPUs: the engine's own counts, priced by stated
assumptions about the GPU, plus ggml's quantizer speed measured here.

No weights are needed: the model's tensors come from its config.json (an empty, meta-device model), the
counts from `estimate.estimate_scan` (the walk scan.py runs, group by group), and the N-worker time from
`ScanEstimate.on_workers` (reference pass, then the longest-first schedule cluster.py submits).

    python bench/project_cluster.py bench/configs/qwen2.5-7b-instruct.json bench/configs/llama-3.1-70b-instruct.json --workers 8

Assumptions (printed with the result; change them with the options):
- layer and head matmuls at --flops (default: half an H100 SXM's 67 TFLOP/s float32 peak: the scan's
  layers compute in float32 unless --dtype bfloat16, and torch leaves TF32 off for float32 matmuls);
  the head's log-softmax and KL cost 1.5x its logits, as estimate.py measures them;
- every layer read the engine counts crosses host to device at --read-bandwidth (default 25 GB/s,
  PCIe 5 in practice) from the bf16 weights; an upper bound, since on CUDA the engine keeps what fits
  in the card resident (all of a 7B in float32 on an 80 GB card; under a third of a 70B);
- ggml's quantizers run on one CPU core of the GPU's host at the speed measured on this machine
  (they are CPU code in any deployment), per format and parameter;
- transfers of activations between nodes, task start-up and the coordinator are not counted.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch

from cardfit.architecture import geometry_from_config
from cardfit.scan.estimate import estimate_scan, layer_flops
from cardfit.formats import parse_formats
from cardfit.groups import GroupId
from cardfit.groups import scan_groups
from cardfit.scan.measure import LOGIT_POSITIONS, copy_bytes
from cardfit.scan import scan
from cardfit.sources.base import ModelSource, TensorInfo, group_of


class ConfigSource(ModelSource):
    """A model known only by its config.json: tensor names and shapes of an empty (meta) model."""

    def __init__(self, path: Path):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = path
        self.config = json.loads(path.read_text())
        self.geometry = geometry_from_config(self.config, source=str(path))
        config = AutoConfig.for_model(**self.config)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        self._tensors = [TensorInfo(name, tuple(p.shape), "BF16", p.numel() * 2, group_of(name))
                         for name, p in model.state_dict().items()]

    def tensors(self) -> list[TensorInfo]:
        return self._tensors


def measured_quantizers(formats: str) -> dict:
    """ggml's quantizer seconds per parameter for each format, measured on this machine (one real
    layer of the embedded model), as the scan's own estimate measures them."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        answer = scan(None, max_tokens=512, seq_len=512, formats=formats, out=Path(tmp) / "map.json",
                      progress=False, estimate=True)
    return answer["estimate"]["unit_seconds"]["quantize_per_param"]


def project(config: Path, formats: str, tokens: int, seq_len: int, batch: int, flops: float, bandwidth: float,
            quantize: dict, workers: list[int]) -> dict:
    source = ConfigSource(config)
    geometry = source.geometry
    fmts = parse_formats(formats)
    groups = scan_groups(source, "layer")
    chunks = torch.zeros(tokens // seq_len, seq_len, dtype=torch.long)
    batches = [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
    layers = geometry.num_layers
    # layers streamed (none kept resident), as the projection in docs/benchmarks.md was priced; a linear head
    engine = SimpleNamespace(layers=layers, dtype=torch.float32, device=torch.device("cuda"),
                             stream=SimpleNamespace(keep_bytes=0, linear_head=True))
    scanner = SimpleNamespace(engine=engine, source=source, batches=batches, chunks=chunks, rounding="rtn",
                              heads_per_cell=lambda group: 1, positions=LOGIT_POSITIONS)
    layer_params = sum(t.numel for t in source.groups()[GroupId.layer_group(0)] if len(t.shape) >= 2)
    batch_tokens = batch * seq_len
    layer_bytes = sum(t.nbytes for t in source.groups()[GroupId.layer_group(0)])
    units = {"layer_forward": layer_flops(geometry, seq_len, layer_params) * batch_tokens / flops,
             "head_forward": 2 * geometry.vocab_size * geometry.hidden_size * batch_tokens / flops * 1.5,
             "layer_read": layer_bytes / bandwidth,
             "quantize_per_param": quantize}
    todo = [(i, g, f) for i, g in enumerate(groups) for f in fmts]
    limit = max(copy_bytes(g) for g in groups)
    guess = estimate_scan(scanner, groups, todo, limit, fmts, units)
    return {"model": config.stem, "layers": layers, "parameters": sum(t.numel for t in source.tensors()),
            "groups": len(groups), "cells": len(todo), "tflop": guess.flops / 1e12,
            "layer_reads": guess.layer_reads, "hours_one_gpu": guess.seconds / 3600,
            "reference_minutes": guess.reference_seconds / 60,
            "longest_sweep_minutes": max(guess.group_seconds) / 60,
            "hours_on": {n: guess.on_workers(n) / 3600 for n in workers}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", nargs="+", type=Path)
    parser.add_argument("--formats", default="Q8_0,Q6_K,Q4_K,Q3_K,Q2_K")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--flops", type=float, default=67e12 * 0.5)
    parser.add_argument("--read-bandwidth", type=float, default=25e9)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    quantize = measured_quantizers(args.formats)
    print(f"assumed: {args.flops / 1e12:.1f} TFLOP/s per GPU, {args.read_bandwidth / 1e9:.0f} GB/s per layer read; "
          f"measured here, ggml s/param: " + ", ".join(f"{k} {v:.2e}" for k, v in quantize.items()))
    print(f"scan: {args.tokens} tokens (chunks of {args.seq_len}, {args.batch} per batch), formats {args.formats}")
    for config in args.configs:
        row = project(config, args.formats, args.tokens, args.seq_len, args.batch, args.flops,
                      args.read_bandwidth, quantize, args.workers)
        on = ", ".join(f"{n} GPU{'s' * (n != 1)} {h:.2f} h" for n, h in row["hours_on"].items())
        print(f"{row['model']}: {row['parameters'] / 1e9:.1f}B parameters, {row['groups']} groups, {row['cells']} cells, "
              f"{row['tflop']:.0f} TFLOP, {row['layer_reads']} layer reads; reference pass "
              f"{row['reference_minutes']:.1f} min, longest sweep {row['longest_sweep_minutes']:.1f} min; {on}")


if __name__ == "__main__":
    main()
