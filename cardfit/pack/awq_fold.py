"""AWQ for a checkpoint a runtime can serve: each per-input-channel scale is folded into the op
that produces that input, so the stored Linear is simply Q(W diag(s)) with no extra tensor.

    x -> RMSNorm(gamma) -> q/k/v        gamma / s_qkv, and q/k/v store Q(W s_qkv)
    x -> RMSNorm(gamma) -> gate/up      gamma / s_mlp, and gate/up store Q(W s_mlp)
    act(gate) * up      -> down         up's rows / s_down, and down stores Q(W s_down)
                                        (also each shared and each routed expert's own down and up)
    attention(v)        -> o            v's rows / s_o, only where v and o have one head layout (no GQA)

The down scale is searched first and folded into up before the gate/up scale is searched (and
the o scale into v before q/k/v's), so every search sees the weights that will be stored. A set
whose Linears do not all share one integer format (a dense layer, a mixed tensor-level recipe)
is left unscaled. Gemma stores its norm as (1 + w), so its fold is w' = (1 + w) / s - 1. In a
mixture-of-experts layer the norm also feeds the router (kept 16-bit), so routed experts' gate and up
are not scaled; each expert's down is, from the rows routed to it (an expert no token reached is not).
"""

from __future__ import annotations

import torch

from ..formats import IntGroupFormat
from ..quant import awq_search

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.qkv_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj")
# a down projection's name ending -> its up projection's (Mixtral's experts: w2 reads act(w1) * w3)
DOWN_TO_UP = {"down_proj.weight": "up_proj.weight", ".w2.weight": ".w3.weight"}


def _mlp_norm(model_type: str) -> str:
    return "pre_feedforward_layernorm" if model_type.startswith("gemma") else "post_attention_layernorm"


def fold_layer(prefix: str, weights: dict[str, torch.Tensor], calibration: dict, formats: dict, config: dict,
               rounder=None) -> dict[str, torch.Tensor]:
    """The layer's tensors with AWQ scales searched on `calibration` inputs and folded in.

    `rounder(name, fmt, w)` is the quantize-dequantize the search scores with (default: the format's
    RTN); the test of the fold's exactness passes the identity."""
    model_type = str(config.get("model_type", ""))
    offset = 1.0 if model_type.startswith("gemma") else 0.0
    w = {n: t.to(torch.float32) for n, t in weights.items()}
    rounder = rounder or (lambda name, fmt, m: fmt.roundtrip(name, m, None, "rtn"))

    def names(suffixes):
        return [f"{prefix}{s}.weight" for s in suffixes if f"{prefix}{s}.weight" in w]

    def search(linears: list[str]) -> torch.Tensor | None:
        fmts = {formats.get(n).name if formats.get(n) is not None else None for n in linears}
        if not linears or len(fmts) != 1 or not isinstance(formats.get(linears[0]), IntGroupFormat):
            return None
        cal = calibration.get(linears[0])
        if cal is None or cal.inputs is None or not len(cal.inputs):  # an expert no token reached: no scale
            return None
        fmt = formats[linears[0]]
        return awq_search([w[n] for n in linears], cal.inputs, lambda m: rounder(linears[0], fmt, m))

    def scale_columns(linears, s):
        for n in linears:
            w[n] = w[n] * s

    def fold_rows(name: str, s: torch.Tensor, start: int = 0) -> None:
        end = start + s.numel()
        w[name][start:end] = w[name][start:end] / s[:, None]
        bias = name[: -len("weight")] + "bias"
        if bias in w:  # Qwen2's v_proj
            w[bias][start:end] = w[bias][start:end] / s

    def fold_norm(name: str, s: torch.Tensor) -> None:
        w[name] = (w[name] + offset) / s - offset

    # each down <- its own up's rows: the MLP's, a shared expert's, every routed expert's (whose input is
    # act(gate) * up of the tokens routed to it, as its statistics are)
    for down in [n for n in w if n.endswith(tuple(DOWN_TO_UP))]:
        suffix = next(d for d in DOWN_TO_UP if down.endswith(d))
        up, fused_up = down[: -len(suffix)] + DOWN_TO_UP[suffix], down[: -len(suffix)] + "gate_up_proj.weight"
        if up not in w and fused_up not in w:
            continue
        s = search([down])
        if s is not None:
            scale_columns([down], s)
            if up in w:
                fold_rows(up, s)
            else:  # Phi-3: gate rows first, then up rows
                fold_rows(fused_up, s, start=w[fused_up].shape[0] - s.numel())
    # o <- v's rows, where v's outputs are o's inputs one to one
    o, v = names(["self_attn.o_proj"]), names(["self_attn.v_proj"])
    if o and v and w[v[0]].shape[0] == w[o[0]].shape[1]:
        s = search(o)
        if s is not None:
            scale_columns(o, s)
            fold_rows(v[0], s)
    # q/k/v and gate/up <- their norms
    for linears, norm in ((names(ATTN), f"{prefix}input_layernorm.weight"),
                          (names(MLP), f"{prefix}{_mlp_norm(model_type)}.weight")):
        if norm not in w:
            continue
        s = search(linears)
        if s is not None:
            scale_columns(linears, s)
            fold_norm(norm, s)
    return w
