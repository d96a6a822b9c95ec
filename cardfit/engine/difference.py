"""A decoder layer computed as the reference's float32 pass plus a track's difference from it, the products
of that difference in bfloat16.

A scan pushes many tracks (quantized variants) through every layer after their own, each only a little
away from the reference, whose input at every layer it has cached. Whole bfloat16 layers are not faithful
(engine.resolve_dtype): rounding a track's hidden state to 8 bits of mantissa loses a change smaller than
its last bit, so near-lossless cells read a noise floor. Here a layer f(h') is f(h) + (f(h') − f(h)): the
reference's intermediates f(h) are computed once per layer in float32 and shared by every track; a track
computes its norms, rotary embedding, attention and activation in float32 as before, and only the
matmuls of the *changes* (W·Δx, where Δx is the track's input to a projection less the reference's) in
bfloat16, whose rounding is then relative to the change, not to the value. The projections are all but a
few percent of a layer's arithmetic, and bfloat16 runs them 5-6x faster where the hardware has it (AMX,
AVX512-BF16, tensor cores), so each track's layer costs a fraction of its float32 forward.

Only decoder layers whose forward this file writes out are taken (the Llama form: RMSNorm, rotary,
grouped-query causal attention without sliding windows, SwiGLU); every reference pass is checked against
the layer's own float32 output, and any other layer, or a reference that does not reproduce it, runs
whole in float32 as before.

The head takes the same form (head_change): a slice's reference logits, one float32 matmul shared by every
track of a walk, plus the head's product with the change of the final norm's output. There the product's
output must stay float32 (a bfloat16 logit change rounded on the way out read a cell 0.6 % high on one
thread count and low on the other), so it runs as a float32 matmul with inputs rounded to bfloat16.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LAYERS = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")  # the forward written out below
CHECK_TOLERANCE = 1e-4  # the reference pass against the layer's own output, relative to its largest value


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run well ahead of float32 here: a CUDA device with bfloat16 support, a CPU
    with AMX or AVX512-BF16. Elsewhere a bfloat16 matmul is emulated and slower than float32's."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return False


@contextmanager
def bfloat16_matmul_inputs():
    """CPU float32 matmuls whose inputs oneDNN rounds to bfloat16 (to nearest even, as `.to(torch.bfloat16)`),
    accumulated and returned in float32, for the duration: what `torch.mm(..., out_dtype=torch.float32)` does
    for bfloat16 inputs on CUDA and has no CPU kernel for in torch 2.13 (a bfloat16 output rounds what it
    returns to 8 bits). The setting is the process's, not the thread's: taken only on the scan's own thread,
    while no other thread of the scan multiplies float32 matrices (ggml's quantizers and the layer prefetch
    do not)."""
    before = torch._C._get_fp32_precision_getter("mkldnn", "matmul")
    torch._C._set_fp32_precision_setter("mkldnn", "matmul", "bf16")
    try:
        yield
    finally:
        torch._C._set_fp32_precision_setter("mkldnn", "matmul", before)


_ROUNDS_INPUTS: dict[tuple, bool] = {}  # (rows, hidden, vocab, threads) -> whether oneDNN honoured the flag


def head_change(reference_logits: torch.Tensor, change: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                low_weight: torch.Tensor | None = None) -> torch.Tensor:
    """A track's logits as the reference's float32 logits plus the head's product with the change of its input
    (the track's final norm output less the reference's, already rounded to bfloat16), that product from
    bfloat16 inputs into float32: its rounding is then relative to the change of each logit, not to the
    logit, and nothing is rounded on the way out. The head is rounded to nearest, as head_kl's rounded tail
    rows round it; the KL needs the two to agree. `out` is a buffer of the logits' shape other than
    `reference_logits`; `low_weight` the head in bfloat16 where the caller keeps one (CUDA)."""
    rows, flat = out.view(-1, out.shape[-1]), change.reshape(-1, change.shape[-1])
    if out.device.type == "cuda":  # bfloat16 tensor cores, float32 out
        low = low_weight if low_weight is not None else weight.to(torch.bfloat16)
        rows.copy_(torch.mm(flat.to(torch.bfloat16), low.t(), out_dtype=torch.float32))
        return out.add_(reference_logits)
    key = (*flat.shape, weight.shape[0], torch.get_num_threads())
    if _ROUNDS_INPUTS.get(key, True):
        with bfloat16_matmul_inputs():
            torch.mm(flat, weight.t(), out=rows)
        if key not in _ROUNDS_INPUTS:
            _ROUNDS_INPUTS[key] = _rounded_inputs(flat, weight, rows)
    if not _ROUNDS_INPUTS[key]:  # a float32 kernel ran (no AMX, or a shape oneDNN keeps in float32)
        from .head_kl import rounded_head_blocks

        for start, block in rounded_head_blocks(weight):
            torch.mm(flat, block.t(), out=rows[:, start:start + block.shape[0]])
    return out.add_(reference_logits)


def _rounded_inputs(flat: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, columns: int = 16) -> bool:
    """Whether a product under bfloat16_matmul_inputs rounded its inputs: the flag is a hint oneDNN takes only
    where a bfloat16 kernel exists for the shape (AMX, not AVX512-BF16 alone; not one row of a 256-wide
    input), else the product is plain float32. Checked on a few columns against both float64 forms; where
    the head is bfloat16 already the two agree and either kernel is right."""
    head = weight[:columns].double()
    rounded = flat.double() @ weight[:columns].to(torch.bfloat16).double().t()
    plain = flat.double() @ head.t()
    got = rows[:, :columns].double()
    return bool((got - rounded).abs().sum() <= (got - plain).abs().sum())


ROW_BLOCK, COLUMN_BLOCK = 256, 8192  # a product's fixed pieces: its bits never depend on the thread count
_POOL: dict = {}


def product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b into `out`, the same bits whatever threads torch has. On the CPU a bfloat16 matmul splits its
    reduction by thread count for some shapes (a 1024 x 8960 by 8960 x 1536 product differs on 1 and 2
    threads), which would make a Ray task's cells other bits than a single process's; so the product is cut
    into fixed blocks (rows where there are many, else columns), each computed on one thread, the blocks
    spread over a pool of torch's thread count."""
    if a.device.type != "cpu":
        return torch.mm(a, b, out=out)
    rows, columns = a.shape[0], b.shape[1]
    threads = torch.get_num_threads()
    if _POOL.get("threads") != threads:
        from concurrent.futures import ThreadPoolExecutor

        if "pool" in _POOL:
            _POOL["pool"].shutdown()
        _POOL.clear()
        _POOL.update(threads=threads, pool=ThreadPoolExecutor(threads, thread_name_prefix="product"))

    def by_rows(start):
        with torch.no_grad():  # grad mode is per thread
            torch.mm(a[start:start + ROW_BLOCK], b, out=out[start:start + ROW_BLOCK])

    def by_columns(start):  # into a contiguous block of its own, then copied: no temporary per call
        shape = (rows, min(COLUMN_BLOCK, columns - start))
        key = ("block", start, shape, out.dtype)
        if key not in _POOL:
            _POOL[key] = torch.empty(shape, dtype=out.dtype)
        block = _POOL[key]
        with torch.no_grad():
            out[:, start:start + block.shape[1]].copy_(torch.mm(a, b[:, start:start + block.shape[1]], out=block))

    if rows >= 2 * ROW_BLOCK or columns < 2 * COLUMN_BLOCK:
        work, starts = by_rows, range(0, rows, ROW_BLOCK)
    else:
        work, starts = by_columns, range(0, columns, COLUMN_BLOCK)
    torch.set_num_threads(1)
    try:
        list(_POOL["pool"].map(work, starts))
    finally:
        torch.set_num_threads(threads)
    return out


def unsupported(layer: torch.nn.Module) -> str | None:
    """Why this decoder layer cannot run in difference form, or None when it can."""
    name = type(layer).__name__
    if name not in LAYERS:
        return f"{name} is not a Llama-form layer"
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(attn, "sliding_window", None):
        return f"{name} attends through a sliding window"
    if type(mlp.act_fn).__name__ != "SiLUActivation" and type(mlp.act_fn) is not torch.nn.SiLU:
        return f"{name}'s MLP activation is {type(mlp.act_fn).__name__}, not SiLU"
    if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
        return f"{name} normalizes its queries and keys"
    return None


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class Reference:
    """One layer's float32 intermediates at one batch of the reference's hidden states."""

    x: torch.Tensor  # the input norm's output
    qkv: torch.Tensor  # the three projections (biases included), concatenated
    attn: torch.Tensor  # attention's output, before o_proj
    o: torch.Tensor  # o_proj's output
    x2: torch.Tensor  # the post-attention norm's output
    gate: torch.Tensor
    up: torch.Tensor
    neg_a: torch.Tensor  # −silu(gate) * up: one fused pass gives a track's change of it
    d: torch.Tensor  # down_proj's output
    out: torch.Tensor  # the layer's output


class DifferenceLayer:
    """One resident decoder layer, ready to run tracks against its reference: the bfloat16 copies of its
    projections (q, k and v as one matrix, gate and up as one), made once per layer per walk."""

    def __init__(self, layer: torch.nn.Module, low: torch.dtype = torch.bfloat16):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer, self.low = layer, low
        self.heads = attn.config.num_attention_heads
        self.kv_heads = attn.config.num_key_value_heads
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.split = [p.out_features for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_low = torch.cat([p.weight.to(low) for p in (attn.q_proj, attn.k_proj, attn.v_proj)])
        self.o_low = attn.o_proj.weight.to(low)
        self.gu_low = torch.cat([mlp.gate_proj.weight.to(low), mlp.up_proj.weight.to(low)])
        self.down_low = mlp.down_proj.weight.to(low)

    def _attention(self, qkv: torch.Tensor, kwargs: dict) -> torch.Tensor:
        batch, length, _ = qkv.shape
        cos, sin = (t.unsqueeze(1) for t in kwargs["position_embeddings"])
        q, k, v = qkv.split(self.split, dim=-1)
        q = _rotated(q.view(batch, length, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotated(k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                             enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)

    @torch.no_grad()
    def reference(self, h: torch.Tensor, kwargs: dict) -> Reference:
        """The reference's intermediates at this layer, all float32, through the layer's own modules."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        x = _rms_norm(self.layer.input_layernorm, h)
        qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        out = self._attention(qkv, kwargs)
        o = attn.o_proj(out)
        mid = h + o
        x2 = _rms_norm(self.layer.post_attention_layernorm, mid)
        gate, up = mlp.gate_proj(x2), mlp.up_proj(x2)
        a = F.silu(gate) * up
        d = mlp.down_proj(a)
        return Reference(x, qkv, out, o, x2, gate, up, a.neg_(), d, mid + d)

    @torch.no_grad()
    def forward(self, ref: Reference, h: torch.Tensor, kwargs: dict, work: "Workspace | None" = None) -> torch.Tensor:
        """The layer at a track's hidden states `h`: the reference's intermediates plus the bfloat16 products
        of the track's changes (the biases cancel in a difference). Everything but the output is written into
        `work`'s buffers: fresh tensors are mapped and zeroed page by page (heap.map_large_blocks), which
        measured as much system time as the arithmetic of a 1.5B's layer."""
        work = work or Workspace()
        low, width, shape = self.low, ref.gate.shape[-1], h.shape
        rows = shape[0] * shape[1]
        buffer = lambda name, columns, dtype=torch.float32: work.get(name, (rows, columns), dtype, h)  # noqa: E731
        flat = h.reshape(rows, -1)
        x = _rms_norm_into(self.layer.input_layernorm, flat, buffer("x", flat.shape[1]), buffer("square", flat.shape[1]))
        dx = torch.sub(x, ref.x.view(rows, -1), out=buffer("dx", x.shape[1], low))
        dqkv = product(dx, self.qkv_low.t(), buffer("dqkv", self.qkv_low.shape[0], low))
        qkv = buffer("qkv", dqkv.shape[1]).copy_(dqkv).add_(ref.qkv.view(rows, -1))
        attn = self._attention(qkv.view(*shape[:2], -1), kwargs).reshape(rows, -1)
        dattn = torch.sub(attn, ref.attn.view(rows, -1), out=buffer("dattn", attn.shape[1], low))
        do = product(dattn, self.o_low.t(), buffer("dh", self.o_low.shape[0], low))
        mid = torch.add(flat, ref.o.view(rows, -1)).add_(do)  # the output: a tensor of its own
        x2 = _rms_norm_into(self.layer.post_attention_layernorm, mid, x, buffer("square", mid.shape[1]))
        dx2 = torch.sub(x2, ref.x2.view(rows, -1), out=dx)
        change = product(dx2, self.gu_low.t(), buffer("change", 2 * width, low))
        gate = buffer("gate", width).copy_(change[:, :width]).add_(ref.gate.view(rows, -1))
        up = buffer("up", width).copy_(change[:, width:]).add_(ref.up.view(rows, -1))
        F.silu(gate, inplace=True).mul_(up).add_(ref.neg_a.view(rows, -1))
        da = buffer("da", width, low).copy_(gate)
        dd = product(da, self.down_low.t(), do)
        return mid.add_(ref.d.view(rows, -1)).add_(dd).view(shape)


def _rms_norm_into(norm: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
    """_rms_norm's bits, written into `out` (`square` a scratch of x's shape)."""
    variance = torch.mul(x, x, out=square).mean(-1, keepdim=True)
    return torch.mul(x, torch.rsqrt(variance + norm.variance_epsilon), out=out).mul_(norm.weight)


class Workspace:
    """Buffers a difference forward writes its intermediate-wide tensors into, kept across tracks and layers
    (one walk's shapes repeat)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        buffer = self.buffers.get(name)
        if buffer is None or tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype or buffer.device != like.device:
            buffer = self.buffers[name] = torch.empty(shape, dtype=dtype, device=like.device)
        return buffer
