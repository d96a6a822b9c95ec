"""The fast damage estimator: KL(P_ref || P_q) ≈ ½ δwᵀ F δw with the diagonal Fisher F.

Around the reference weights the KL of a small perturbation δw is, to second order, ½ δwᵀ F δw,
where F is the Fisher information of the model's own next-token distribution. Its diagonal is
estimated from gradients of the log-likelihood of tokens *sampled from the model itself* (so
the score has zero mean and squared chunk gradients estimate the per-token Fisher without the
cross terms that true labels leave). One forward+backward per chunk and sample gives F for
every weight at once; each cell then costs only its quantization round trip, with no model run.

Unlike the exact scan this holds the whole model (weights, gradients and the Fisher
accumulators: about three times its float32 size); it is the pilot, not the measurement.
"""

from __future__ import annotations

import torch


def fisher_diagonal(model_dir, chunks: torch.Tensor, device: str = "cpu", samples: int = 2, batch: int = 4,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Mean per-token diagonal Fisher of every parameter, by name (tied weights share one entry)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True).to(device)
    model.eval()
    params = {n: p for n, p in model.named_parameters()}
    fisher = {n: torch.zeros_like(p, device="cpu") for n, p in params.items()}
    generator = torch.Generator(device="cpu").manual_seed(seed)
    tokens = 0
    for i in range(0, len(chunks), batch):
        ids = chunks[i:i + batch].to(device)
        for _ in range(samples):
            model.zero_grad(set_to_none=True)
            logits = model(ids).logits.to(torch.float32)
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1).reshape(-1, logits.shape[-1]).cpu()
                labels = torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1]).to(device)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     reduction="sum")
            loss.backward()
            for n, p in params.items():
                if p.grad is not None:
                    fisher[n] += p.grad.detach().to("cpu") ** 2
        tokens += ids.numel()
    del model
    return {n: f / (tokens * samples) for n, f in fisher.items()}


def predicted_kl(fisher: torch.Tensor, original: torch.Tensor, quantized: torch.Tensor) -> float:
    """½ Σ F δw² in nats per token."""
    delta = (quantized.to(torch.float32) - original.to(torch.float32)).cpu()
    return 0.5 * float((fisher * delta * delta).sum())
