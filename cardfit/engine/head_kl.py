"""KL against the reference through a linear head, without the reference's log-probabilities.

A cell's damage is KL(p ‖ q) per position, p the reference's output distribution and q the quantized
model's. Where the head is linear in the final norm's output n (logits z = W n + b, no soft-capping) and
the head itself is the reference's, log q_v = z'_v − lse(z') and Σ_v p_v z'_v = n'·(Σ_v p_v W_v) + p·b, so

    KL = Σ_v p_v · (lse(z') − lse(z)) − (Σ_v p_v z'_v − Σ_v p_v z_v)

needs from the reference only a few numbers per position, not a vocabulary-wide row: the scan keeps
`ReferenceSlice`s (about hidden x 4 bytes a position where the log-probabilities took vocab x 4: 6 KB
against 600 KB for a 1536-wide, 152k-vocabulary model), and a cell's head costs its logits' matmul, one
max, one exp and one sum, with no reference row read.

Two details keep it as exact as the log-softmax form. Σ_v p_v is the float32 probabilities' own sum
(`mass`, 1 only within ~1e-6): taken as 1, a shift common to every logit, which no distribution sees,
would read as damage. And Σ p z' is split: the reference's `TOP_TOKENS` most probable tokens take their
logits from the cell's own float32 logits, the rest from the linear form (the "tail row"
Σ_{v ∉ top} p_v W_v); from the linear form alone, an exact dot product would be set against lse's
float32-rounded logits, ~1e-5 nats a position of the matmul's rounding that no longer cancels. Summed in
float64, the cells of the real 0.5B land closer to a float64 ground truth than the log-softmax form's
(docs/benchmarks.md; test_head_kl pins both details).

A scan whose tracks run in difference form (difference.py) takes a cell's logits as the reference's plus
the bfloat16-rounded head's product with the rounded change of its input; its tail is then taken through
the same rounded head and change (`difference_slice_kl`, the summary carrying the rounded head's tail rows
too), so the rounding enters the KL only through q − p, not to first order.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

TOP_TOKENS = 32  # the reference's most probable tokens whose logits a cell reads back from its own


@dataclass(frozen=True)
class ReferenceSlice:
    """What one slice of positions' KL needs from the reference (shapes (rows, positions, ...)), less its
    tail rows (hidden-wide: a scan caches those with its activations, under --memory-cap)."""

    offset: torch.Tensor  # float64: mass · lse(z) − Σ_v p_v z_v, the bias term left out of both sides
    mass: torch.Tensor  # float64: Σ_v p_v of the float32 probabilities (1 within ~1e-6, not exactly)
    top_ids: torch.Tensor  # int64 (…, TOP_TOKENS)
    top_probs: torch.Tensor  # float64 (…, TOP_TOKENS)
    argmax: torch.Tensor  # int64: the reference's top-1 token (first index of the maximum, as argmax)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.offset, self.mass, self.top_ids, self.top_probs, self.argmax

    def to(self, device, non_blocking: bool = False) -> "ReferenceSlice":
        return ReferenceSlice(*(t.to(device, non_blocking=non_blocking) for t in self.tensors()))

    def map(self, function) -> "ReferenceSlice":
        return ReferenceSlice(*(function(t) for t in self.tensors()))


SLICE_BYTES = 8 + 8 + TOP_TOKENS * (8 + 8) + 8  # a ReferenceSlice's bytes per position


def summary_bytes(hidden_size: int, rounded: bool = False) -> int:
    """Bytes of the reference's summary per position: a ReferenceSlice's and the float32 tail row (two with
    the rounded head's, summarize's `rounded`)."""
    return SLICE_BYTES + 4 * hidden_size * (2 if rounded else 1)


@contextmanager
def one_thread(device: torch.device):
    """Torch on one CPU thread for the duration (nothing changes on a GPU): for the reductions whose bits
    depend on how many threads split them (a matmul over the vocabulary; one row's vocabulary-wide sum),
    so a cell is the same bits whatever threads its process has (a Ray task's and a single process's)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def log_partition(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lse over the last dim in float64, argmax), computed in place: `logits` holds exp(z − max) after."""
    peak, top = logits.max(-1)
    logits.sub_(peak.unsqueeze(-1)).exp_()
    return peak.double() + logits.sum(-1).double().log(), top


def _expected_logit(logits: torch.Tensor, linear: torch.Tensor, top_ids, top_probs) -> torch.Tensor:
    """Σ_v p_v z_v less the bias term, in float64: the top tokens from `logits`, the tail as `linear` (float64,
    the tail's part by the linear form)."""
    return linear + (top_probs * logits.gather(-1, top_ids).double()).sum(-1)


def _linear_tail(normed: torch.Tensor, tail_row: torch.Tensor) -> torch.Tensor:
    return (normed.double() * tail_row.double()).sum(-1)


ROUNDED_BLOCK = 8192  # vocabulary rows of the head rounded to bfloat16 at a time (rounded_head_blocks)


def rounded_head_blocks(head_weight: torch.Tensor):
    """(first row, float32 block) of the head rounded to bfloat16 (to nearest even), a block of the vocabulary
    at a time, so no float32 copy of the rounded head is held whole: the one rounding difference.head_change
    multiplies by and rounded_tail_rows sums."""
    for start in range(0, head_weight.shape[0], ROUNDED_BLOCK):
        yield start, head_weight[start:start + ROUNDED_BLOCK].to(torch.bfloat16).float()


def rounded_tail_rows(tail_probs: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """Σ_{v ∉ top} p_v W̃_v, W̃ the head rounded to bfloat16 (what difference.head_change multiplies by), in
    float32 from 2-D probabilities with the top tokens zeroed."""
    out = torch.zeros(tail_probs.shape[0], head_weight.shape[1], device=tail_probs.device)
    for start, block in rounded_head_blocks(head_weight):
        out.addmm_(tail_probs[:, start:start + block.shape[0]], block)
    return out


def summarize(logits: torch.Tensor, normed: torch.Tensor, head_weight: torch.Tensor, rounded: bool = False
              ) -> tuple[ReferenceSlice, torch.Tensor]:
    """The reference's slice and its tail rows (float32, (…, hidden): Σ_{v ∉ top} p_v W_v) from its float32
    logits (overwritten) and the head's input and matrix. The tail rows reduce over the vocabulary, which a
    threaded CPU matmul splits by thread count (unlike the logits' reduction over the hidden size), so they
    are made on one thread: once per slice of the reference pass. `rounded` (a scan whose cells take the head
    in difference form) appends the rounded head's tail rows (rounded_tail_rows): (…, 2 · hidden)."""
    probs = torch.softmax(logits, dim=-1)
    mass = probs.sum(-1, dtype=torch.float64)
    top_probs, top_ids = probs.topk(min(TOP_TOKENS, probs.shape[-1]), dim=-1)
    probs.scatter_(-1, top_ids, 0.0)
    flat = probs.reshape(-1, probs.shape[-1])
    with one_thread(probs.device):
        tail_row = (flat @ head_weight).reshape(*probs.shape[:-1], -1)
        rounded_row = rounded_tail_rows(flat, head_weight).reshape(tail_row.shape) if rounded else None
    top_probs = top_probs.double()
    expected = _expected_logit(logits, _linear_tail(normed, tail_row), top_ids, top_probs)
    lse, argmax = log_partition(logits)
    tail_rows = tail_row if rounded_row is None else torch.cat([tail_row, rounded_row], -1)
    return ReferenceSlice(mass * lse - expected, mass, top_ids, top_probs, argmax), tail_rows


def slice_kl(logits: torch.Tensor, normed: torch.Tensor, ref: ReferenceSlice, tail_row: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL(p ‖ q) per position in float64, clamped at 0; q's argmax) from a cell's float32 logits
    (overwritten) through the reference's own head, the head's input `normed`, and the reference's slice
    and tail rows there."""
    expected = _expected_logit(logits, _linear_tail(normed, tail_row), ref.top_ids, ref.top_probs)
    return _kl(logits, expected, ref)


def difference_slice_kl(logits: torch.Tensor, reference_normed: torch.Tensor, change: torch.Tensor,
                        ref: ReferenceSlice, tail_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """slice_kl for a cell's logits made in difference form (difference.head_change: the reference's logits
    plus the rounded head's product with `change`, the head input's change already rounded to bfloat16),
    `tail_rows` the summary's with the rounded head's appended. The tail's expected logit is taken through the
    same rounded head and change as the logits: taken exactly, the product's rounding would enter the KL
    to first order (Σ_v q_v ε_v against a second-order KL; on a random head, 0.1-0.9 % off float64 where
    this form is within 0.2 %)."""
    hidden = change.shape[-1]
    linear = _linear_tail(reference_normed, tail_rows[..., :hidden]) + _linear_tail(change, tail_rows[..., hidden:])
    return _kl(logits, _expected_logit(logits, linear, ref.top_ids, ref.top_probs), ref)


def _kl(logits: torch.Tensor, expected: torch.Tensor, ref: ReferenceSlice) -> tuple[torch.Tensor, torch.Tensor]:
    lse, top = log_partition(logits)
    return (ref.mass * lse - expected - ref.offset).clamp_min(0), top
