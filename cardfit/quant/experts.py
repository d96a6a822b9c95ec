"""What each routed expert's matrices read, seen from transformers' fused experts module.

transformers 5 computes a mixture-of-experts layer's routed experts in one module: `gate_up_proj`
(experts x [gate; up] x hidden, or in x out when the module says `is_transposed`, gpt-oss's), `down_proj`,
optional biases (`has_bias`) and `_apply_gate` (act(gate) * up, or gpt-oss's clamped SwiGLU), called with
the layer's tokens and the router's choice. Expert e multiplies only the tokens routed to it, and its
down projection reads the gated value of those tokens, made and dropped inside the module's forward, out
of any hook's reach. So statistics per expert are taken from the module's call: its tokens split by the
router's choice, the down projection's input recomputed from the module's own parameters and its own
`_apply_gate` (exactly what its forward multiplies, as a test checks by rebuilding the module's output).

An expert no calibration token reached has no statistics; the caller rounds it as llama.cpp's
`llama-quantize` does with such an expert (an importance of one on every column: plain weighting).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import CardfitError

READS_TOKENS = "gate_up_proj"  # the fused parameter whose experts multiply the routed hidden states
READS_ACTIVATION = "down_proj"  # the one whose experts multiply act(gate) * up


class ExpertTap:
    """A forward hook on one fused experts module that hands each expert's inputs to `record`.

    `members` are (checkpoint name, Placement) of the module's expert matrices to collect for; `record`
    is called as record(key, x, weight) with key = (module name, expert, READS_TOKENS or READS_ACTIVATION),
    x the rows that expert multiplied (float32) and weight each row's routing weight (what the expert's
    output is scaled by), once per call of the module per expert hit. `tokens` counts every row the
    module was called with (the layer's tokens, routed anywhere)."""

    def __init__(self, module: torch.nn.Module, module_name: str, members, record: Callable):
        fused = {p.param.rsplit(".", 1)[1] for _, p in members}
        if not fused <= {READS_TOKENS, READS_ACTIVATION} or not getattr(module, "has_gate", False) \
                or not hasattr(module, "_apply_gate"):
            raise CardfitError(f"{module_name} ({type(module).__name__}) is not the fused gate/up + down experts "
                               "module cardfit reads statistics from", "use RTN rounding (--rounding rtn / "
                               "--method rtn) for this model")
        self.module_name = module_name
        self.record = record
        self.keys: dict[str, tuple[str, int, str]] = {  # checkpoint name -> what it reads
            name: (module_name, place.expert, place.param.rsplit(".", 1)[1]) for name, place in members}
        width = -2 if module.is_transposed else -1  # an expert's matrix is in x out in gpt-oss's stacks
        self.columns = {name: getattr(module, key[2]).shape[width] for name, key in self.keys.items()}  # row width
        self.experts = sorted({key[1] for key in self.keys.values()})
        self.wants_activation = any(key[2] == READS_ACTIVATION for key in self.keys.values())
        self.tokens = 0
        self.handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def input_groups(self) -> list[list[str]]:
        """Names that read the same rows (an expert's gate and up), whether or not a token came."""
        groups: dict[tuple, list[str]] = {}
        for name, key in self.keys.items():
            groups.setdefault(key, []).append(name)
        return list(groups.values())

    def _hook(self, module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        chosen = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights", kwargs.get("routing_weights"))
        hidden = hidden.reshape(-1, hidden.shape[-1])
        chosen = chosen.reshape(hidden.shape[0], -1)
        weights = weights.reshape(chosen.shape).to(torch.float32)
        self.tokens += hidden.shape[0]
        for expert in self.experts:
            picked = chosen == expert
            rows = picked.any(dim=-1).nonzero().squeeze(-1)
            if rows.numel() == 0:
                continue
            x, weight = hidden[rows], (weights * picked)[rows].sum(-1)
            self.record((self.module_name, expert, READS_TOKENS), x.to(torch.float32), weight)
            if self.wants_activation:
                self.record((self.module_name, expert, READS_ACTIVATION), self._activation(module, expert, x), weight)

    @staticmethod
    def _activation(module, expert: int, x: torch.Tensor) -> torch.Tensor:
        """What expert `expert`'s down projection multiplies for rows `x`, as the module computes it."""
        weight = module.gate_up_proj[expert]
        out = x @ weight if module.is_transposed else x @ weight.T
        if module.has_bias:
            out = out + module.gate_up_proj_bias[expert]
        return module._apply_gate(out).to(torch.float32)

    def close(self) -> None:
        self.handle.remove()


def expert_taps(stream, names, record: Callable) -> list[ExpertTap]:
    """One tap per fused experts module the routed-expert `names` live in (their placements say where)."""
    by_module: dict[str, list] = {}
    for name in names:
        place = stream.place[name]
        by_module.setdefault(place.param.rsplit(".", 1)[0], []).append((name, place))
    return [ExpertTap(stream.model.get_submodule(module_name), module_name, members, record)
            for module_name, members in by_module.items()]
