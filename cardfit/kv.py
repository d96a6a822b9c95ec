"""Exact KV-cache bytes from the model geometry.

Per attention layer and token the cache holds K (num_kv_heads x head_dim_k) and
V (num_kv_heads x head_dim_v) elements; an MLA layer holds one latent row of
kv_lora_rank + qk_rope_head_dim elements (K and V are projected out of it); a
sliding-window layer keeps min(context, window) tokens; SSM / linear-attention
layers keep no KV but a fixed recurrent state per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from .architecture import NO_KV, SLIDING, ModelGeometry
from .errors import CardfitError

# (numerator, denominator, block): bytes = elements / block * numerator ... exact for whole blocks.
KV_DTYPES = {
    "f32": (4, 1, 1), "f16": (2, 1, 1), "bf16": (2, 1, 1), "fp8": (1, 1, 1),
    "q8_0": (34, 32, 32), "q4_0": (18, 32, 32),
}


def row_bytes(elements: int, kv_dtype: str) -> int:
    """Bytes of one cached row; block formats quantize along the row in blocks of 32."""
    if kv_dtype not in KV_DTYPES:
        raise CardfitError(f"unknown KV dtype '{kv_dtype}'", "use one of " + ", ".join(KV_DTYPES))
    num, den, block = KV_DTYPES[kv_dtype]
    if elements % block:
        raise CardfitError(f"a KV row of {elements} elements is not a multiple of {block}, "
                           f"so {kv_dtype} cannot store it", "use --kv-dtype f16")
    return elements * num // den


@dataclass(frozen=True)
class KvCache:
    attention_layers: int
    sliding_layers: int
    recurrent_layers: int
    kv_bytes_per_token: int  # every attention layer, one token, one sequence
    kv_bytes: int  # at the context and batch, windows applied, recurrent state included
    state_bytes_per_sequence: int  # SSM / linear-attention state, independent of context
    tokens_per_layer: tuple[int, ...]


def layer_token_bytes(geometry: ModelGeometry, kv_dtype: str) -> int:
    if geometry.mla_latent is not None:
        return row_bytes(geometry.mla_latent, kv_dtype)
    return (row_bytes(geometry.num_kv_heads * geometry.head_dim_k, kv_dtype)
            + row_bytes(geometry.num_kv_heads * geometry.head_dim_v, kv_dtype))


def kv_cache(geometry: ModelGeometry, context: int, batch: int = 1, kv_dtype: str = "f16",
             runtime: str = "llama.cpp") -> KvCache:
    if context <= 0:
        raise CardfitError(f"context {context} is not positive", "give --context as a token count such as 8192")
    if batch <= 0:
        raise CardfitError(f"batch {batch} is not positive", "give --batch as a sequence count such as 1")
    from .targets import get_target

    target = get_target(runtime)
    allowed = target.kv_dtypes
    if kv_dtype not in allowed:
        raise CardfitError(f"{runtime} cannot hold its KV cache as {kv_dtype}",
                           "use --kv-dtype " + " or ".join(sorted(allowed)))
    per_layer = layer_token_bytes(geometry, kv_dtype)
    tokens = tuple(0 if k.attention == NO_KV else min(context, k.window) if k.attention == SLIDING else context
                   for k in geometry.layers)
    state = 0
    if geometry.ssm is not None:
        # llama.cpp keeps recurrent state in f32; vLLM in the model dtype (mamba_ssm_cache_dtype=auto).
        element = target.state_element_bytes
        state = geometry.recurrent_layers * (geometry.ssm.state_elements + geometry.ssm.conv_elements) * element
    return KvCache(
        attention_layers=geometry.attention_layers,
        sliding_layers=sum(1 for k in geometry.layers if k.attention == SLIDING),
        recurrent_layers=geometry.recurrent_layers,
        kv_bytes_per_token=per_layer * geometry.attention_layers,
        kv_bytes=batch * (per_layer * sum(tokens) + state),
        state_bytes_per_sequence=state,
        tokens_per_layer=tokens,
    )
