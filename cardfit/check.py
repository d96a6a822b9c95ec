"""Stage 5: load the artifact in its real runtime and measure what was lost; refuse a corpse.

Full check: the artifact (llama.cpp for GGUF, transformers for compressed-tensors) and the
full-precision reference run over the same held-out token chunks; we report perplexity of both,
mean and 99th-percentile KL(P_ref || P_artifact) per token, top-1 agreement, and the plan's
predicted damage beside the measured one. Smoke check: the artifact alone over a few chunks,
with a perplexity ceiling. It cannot say how much was lost, only whether the artifact still
produces language; it is the corpse detector `pack` and `fit` run before an artifact is
renamed into place (the seed's destroyed file had perplexity ~1e6 and top-1 agreement 0.3 %).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .errors import CardfitError
from .engine.metrics import DistanceMeter, token_nll

DEFAULT_CEILING = 1000.0
DEFAULT_MIN_TOP1 = 0.05


class ReferenceLogits:
    """The reference model's logits per token chunk, computed once and shared by every check that
    measures against the same reference (compare measures a dozen artifacts over the same chunks;
    the reference's forward would otherwise be repeated for each). Kept on the host, keyed by the
    chunk's token ids, so a check over other chunks computes its own. Only the first `max_bytes` of
    logits are kept (tokens x vocab x 4 bytes: 1.2 GB for 2,048 tokens of a 152k vocabulary); chunks
    beyond it are computed again for each check rather than held whole."""

    def __init__(self, reference: str | Path, device: str = "auto", max_bytes: int = 4 << 30, dtype: str = "auto"):
        self.reference = reference
        self.device = device
        self.dtype = dtype
        self.max_bytes = max_bytes
        self._engine = None
        self._logits: dict[bytes, torch.Tensor] = {}
        self._held = 0

    def release(self) -> None:
        """Let the reference model go (its memory, on the device too); the logits kept stay, and a chunk not
        kept opens the model again."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        key = ids.to(torch.int64).cpu().numpy().tobytes() + bytes(str(tuple(ids.shape)), "ascii")
        if key not in self._logits:
            if self._engine is None:
                from .engine import Engine
                from .sources import open_model

                self._engine = Engine(open_model(self.reference, run=True), device=self.device, dtype=self.dtype)
            logits = self._engine.forward(ids).to("cpu")
            if self._held + logits.nbytes > self.max_bytes:
                return logits
            self._logits[key] = logits
            self._held += logits.nbytes
        return self._logits[key]


def check(artifact: str | Path, reference: str | Path | None = None, text: str | Path | None = None,
          max_tokens: int = 4096, seq_len: int = 512, ceiling: float = DEFAULT_CEILING,
          min_top1: float = DEFAULT_MIN_TOP1, max_kld: float | None = None, predicted_damage: float | None = None,
          smoke: bool = False, device: str = "auto", batch: int = 4, tokenizer_dir: str | Path | None = None,
          kind: str | None = None, runtime: str | None = None, reference_logits: ReferenceLogits | None = None) -> dict:
    """Measure `artifact` against `reference` (or, with `smoke`, alone); returns the report with a verdict.
    `reference_logits` shares the reference's forward passes between checks of one reference."""
    from .engine import resolve_device
    from .targets.runtimes import open_runtime
    from .text import load_text, refuse_short_budget

    device = str(resolve_device(device)[0])
    if not smoke and reference is None:
        raise CardfitError("a full check needs the reference model", "pass --reference MODEL, or --smoke")
    refuse_short_budget(max_tokens, seq_len)  # before the runtime allocates a context of seq_len
    body, text_path = load_text(text, default="heldout")
    runtime = open_runtime(artifact, n_ctx=seq_len, device=device, kind=kind, runtime=runtime)
    try:
        chunks = _chunks(runtime, body, text_path, seq_len, max_tokens, reference, tokenizer_dir)
        runtime.prepare(chunks)  # vLLM scores every chunk in one engine start
        meter = DistanceMeter()
        finite = True
        if smoke:
            for i in range(0, len(chunks), batch):
                ids = chunks[i:i + batch]
                logits = runtime.logits(ids)
                finite &= bool(torch.isfinite(logits).all())
                meter.nll_sum += float(token_nll(logits, ids).sum())
                meter.nll_tokens += ids[:, 1:].numel()
        else:
            reference_logits = reference_logits or ReferenceLogits(reference, device)
            for i in range(0, len(chunks), batch):
                ids = chunks[i:i + batch]
                logits = runtime.logits(ids)
                finite &= bool(torch.isfinite(logits).all())
                meter.add(reference_logits(ids), torch.nan_to_num(logits, nan=0.0, posinf=1e4, neginf=-1e4), ids,
                          keep_values=True)
    finally:
        runtime.close()
    report = {"artifact": str(artifact), "runtime": runtime.name, "mode": "smoke" if smoke else "full",
              "text": text_path.name, "tokens": int(chunks.numel()), "seq_len": int(chunks.shape[1]),
              "perplexity": _finite(meter.perplexity), "finite_logits": finite}
    if not smoke:
        report.update({"reference": str(reference), "reference_perplexity": _finite(meter.ref_perplexity),
                       "kld_mean": meter.kl, "kld_stderr": _finite(meter.kl_stderr), "kld_p99": meter.kl_quantile(0.99),
                       "top1": meter.top1, "predicted_damage": predicted_damage})
    report["verdict"], report["reasons"] = _verdict(report, ceiling, min_top1, max_kld)
    report["thresholds"] = {"ceiling": ceiling, "min_top1": None if smoke else min_top1, "max_kld": max_kld}
    return report


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _chunks(runtime, body: str, text_path: Path, seq_len: int, max_tokens: int, reference, tokenizer_dir):
    """Token chunks from the reference's tokenizer (so both sides see the same ids), else the runtime's own."""
    from .text import load_tokenizer, token_chunks

    tok_dir = tokenizer_dir or reference
    if tok_dir is not None:
        from .sources import open_model

        model = open_model(tok_dir, run=True)
        tokenizer = load_tokenizer(str(model.path))
        return token_chunks(tokenizer, body, seq_len, max_tokens, source=str(text_path), rows=model.embedding_rows())

    class _Wrap:  # token_chunks' tokenizer interface over the runtime's own tokenizer
        def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
            from types import SimpleNamespace

            return SimpleNamespace(input_ids=torch.tensor([runtime.tokenize(text)]))

    return token_chunks(_Wrap(), body, seq_len, max_tokens, source=str(text_path))


def _verdict(report: dict, ceiling: float, min_top1: float, max_kld: float | None) -> tuple[str, list[str]]:
    reasons = []
    ppl = report["perplexity"]
    if not report["finite_logits"]:
        reasons.append("the runtime produced non-finite logits")
    if ppl is None or ppl > ceiling:
        reasons.append(f"perplexity {ppl if ppl is None else round(ppl, 2)} is above the ceiling {ceiling:g}")
    if report["mode"] == "full":
        if report["top1"] < min_top1:
            reasons.append(f"top-1 agreement {report['top1']:.1%} is below {min_top1:.0%}")
        if max_kld is not None and report["kld_mean"] > max_kld:
            reasons.append(f"mean KLD {report['kld_mean']:.4f} is above --max-kld {max_kld:g}")
    return ("fail" if reasons else "pass"), reasons


def render_check(report: dict) -> str:
    def num(x, fmt=".4f"):
        return "n/a" if x is None else format(x, fmt)

    lines = [f"{report['mode']} check of {report['artifact']} in {report['runtime']} over {report['tokens']} tokens "
             f"of {report['text']}"]
    if report["mode"] == "full":
        lines += [f"  perplexity            {num(report['perplexity'])} (reference {num(report['reference_perplexity'])})",
                  f"  mean KLD              {num(report['kld_mean'])} ± {num(report['kld_stderr'])}",
                  f"  p99 KLD               {num(report['kld_p99'])}",
                  f"  top-1 agreement       {num(report['top1'], '.2%')}",
                  f"  predicted damage      {num(report['predicted_damage'])} (sum of scanned cells)"]
    else:
        lines.append(f"  perplexity            {num(report['perplexity'])} (ceiling {report['thresholds']['ceiling']:g})")
    verdict = "PASS" if report["verdict"] == "pass" else "FAIL: " + "; ".join(report["reasons"])
    lines.append(f"  verdict               {verdict}")
    return "\n".join(lines)


def smoke_check(artifact: Path, tokenizer_dir: Path, kind: str, ceiling: float = DEFAULT_CEILING, tokens: int = 512,
                seq_len: int = 256) -> dict:
    """The corpse detector pack runs before renaming an artifact into place; raises on failure."""
    report = check(artifact, text=None, max_tokens=tokens, seq_len=seq_len, ceiling=ceiling, smoke=True,
                   tokenizer_dir=tokenizer_dir, kind=kind)
    if report["verdict"] != "pass":
        raise CardfitError("the packed artifact failed its smoke check (" + "; ".join(report["reasons"]) +
                           "); nothing was written", "check the recipe's formats and the model; "
                           "--no-smoke skips this check")
    return report


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
