"""AWQ (Lin et al. 2023): per-input-channel scales that move salient weights onto a finer grid.

For the weights that read one input (q/k/v read the same normed hidden state, gate/up
another), search s = x_mean^a over a grid of a in [0, 1), normalised so max*min = 1, minimising the output error of Q(W diag(s)) diag(s)^-1 on calibration inputs. The
winning s is then folded into the op that produces the input (an RMSNorm's weight, or the
previous projection's rows) when the architecture allows, or kept as an explicit scale.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

GRID = 20


def awq_search(weights: Sequence[torch.Tensor], inputs: torch.Tensor,
               rounder: Callable[[torch.Tensor], torch.Tensor], grid: int = GRID) -> torch.Tensor:
    """The per-input-channel scale s minimising sum_W ||X W^T - X (Q(W s) / s)^T||^2."""
    x = inputs.to(torch.float32)
    if x.shape[0] == 0:  # no token reached these weights (an unvisited expert): nothing to weigh, plain RTN
        return torch.ones(x.shape[1], device=x.device)
    ws = [w.detach().to(x.device, torch.float32) for w in weights]
    x_mean = x.abs().mean(dim=0)
    refs = [x @ w.T for w in ws]
    best, best_loss = torch.ones_like(x_mean), None
    for step in range(grid):
        ratio = step / grid
        s = x_mean.clamp_min(1e-4).pow(ratio)  # ratio 0 is plain RTN, so AWQ never loses to it here
        s = s / torch.sqrt(s.max() * s.min())
        loss = sum(torch.sum((ref - x @ (rounder(w * s) / s).T) ** 2).item() for w, ref in zip(ws, refs))
        if best_loss is None or loss < best_loss:
            best, best_loss = s, loss
    return best
