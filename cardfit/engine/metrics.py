"""Distances between output distributions, accumulated chunk by chunk.

KL(P_ref || P_q) per token in nats, top-1 agreement, and negative log-likelihood, from
logits; everything is computed in float32 via log_softmax (tested against float64).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def token_kl(ref_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_q) for every position (nats), shape = logits.shape[:-1]."""
    return kl_from_logprobs(torch.log_softmax(ref_logits.to(torch.float32), dim=-1), q_logits)


def kl_from_logprobs(ref_logprobs: torch.Tensor, q_logits: torch.Tensor,
                     scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """token_kl with the reference's log-probabilities given (a scan computes them once, not per cell):
    Σ exp(ref) (ref − log_softmax(q)), clamped at 0. `scratch`: two float32 tensors of the logits' shape
    that the (positions x vocab) temporaries are written into, so a scan that keeps them allocates (and,
    with large blocks mapped, faults in) none of ~39 MB per 64 positions of a 152k vocabulary; the same
    kernels as the out-of-place expression, so the same bits (test_runner)."""
    q = q_logits.to(torch.float32)
    probs, work = scratch if scratch is not None else (torch.empty_like(q), torch.empty_like(q))
    torch._log_softmax(q, -1, False, out=work)
    torch.sub(ref_logprobs, work, out=work)
    torch.exp(ref_logprobs, out=probs)
    torch.mul(probs, work, out=work)
    return torch.sum(work, dim=-1).clamp_min(0)


def target_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of targets[..., t] under logits[..., t, :]."""
    logp = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return -logp.gather(-1, targets.to(logp.device).unsqueeze(-1)).squeeze(-1)


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token negative log-likelihood for positions 0..T-2."""
    return target_nll(logits[..., :-1, :], input_ids[..., 1:])


@dataclass
class DistanceMeter:
    """Running KL / top-1 / NLL over chunks; per-chunk means give the standard error."""

    kl_sum: float = 0.0
    top1_sum: float = 0.0
    nll_sum: float = 0.0
    ref_nll_sum: float = 0.0
    tokens: int = 0
    nll_tokens: int = 0
    chunk_kl: list[float] = field(default_factory=list)
    kl_values: list[torch.Tensor] = field(default_factory=list)

    def add(self, ref_logits: torch.Tensor, q_logits: torch.Tensor, input_ids: torch.Tensor | None = None,
            keep_values: bool = False, rows_per_slice: int = 256) -> None:
        # KL in slices of positions: the log-softmax temporaries then cost a few vocab-wide rows,
        # not four copies of the whole (batch x tokens x vocab) logits.
        flat_ref = ref_logits.reshape(-1, ref_logits.shape[-1])
        flat_q = q_logits.reshape(-1, q_logits.shape[-1])
        kl = torch.cat([token_kl(flat_ref[i:i + rows_per_slice], flat_q[i:i + rows_per_slice])
                        for i in range(0, flat_ref.shape[0], rows_per_slice)]).reshape(ref_logits.shape[:-1])
        agree = ref_logits.argmax(-1) == q_logits.argmax(-1)
        self.record(kl, agree, keep_values)
        if input_ids is not None:
            self.nll_sum += float(token_nll(q_logits, input_ids).sum())
            self.ref_nll_sum += float(token_nll(ref_logits, input_ids).sum())
            self.nll_tokens += input_ids[..., 1:].numel()

    def record(self, kl: torch.Tensor, agree: torch.Tensor, keep_values: bool = False) -> None:
        """Per-token KL and top-1 agreement of whole sequences (last dim = positions): each sequence is
        one chunk of the standard error."""
        self.kl_sum += float(kl.sum())
        self.top1_sum += float(agree.to(torch.float32).sum())
        self.tokens += kl.numel()
        for row in kl.reshape(-1, kl.shape[-1]):
            self.chunk_kl.append(float(row.mean()))
        if keep_values:
            self.kl_values.append(kl.reshape(-1).cpu())

    @property
    def kl(self) -> float:
        return self.kl_sum / max(self.tokens, 1)

    @property
    def kl_stderr(self) -> float:
        n = len(self.chunk_kl)
        if n < 2:
            return float("nan")
        values = torch.tensor(self.chunk_kl, dtype=torch.float64)
        return float(values.std(unbiased=True) / n ** 0.5)

    @property
    def top1(self) -> float:
        return self.top1_sum / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return float(torch.exp(torch.tensor(self.nll_sum / max(self.nll_tokens, 1))))

    @property
    def ref_perplexity(self) -> float:
        return float(torch.exp(torch.tensor(self.ref_nll_sum / max(self.nll_tokens, 1))))

    def kl_quantile(self, q: float) -> float:
        if not self.kl_values:
            return float("nan")
        return float(torch.quantile(torch.cat(self.kl_values).to(torch.float64), q))
