"""Where a checkpoint tensor lives in transformers' module tree.

Mixture-of-experts checkpoints store one matrix per expert (`mlp.experts.3.up_proj.weight`) while
transformers 5 computes from fused 3-D parameters (`mlp.experts.gate_up_proj`: experts x [gate; up] x
hidden). transformers' own checkpoint conversion mapping (`conversion_mapping.py`) says how one becomes
the other; this module reads that mapping, so a layer streamed one checkpoint tensor at a time lands
where `from_pretrained` would put it, and a quantized copy of one expert's matrix replaces exactly its
slice. Only the operations MoE checkpoints use are understood (renaming, stacking experts, concatenating
gate and up); any other conversion is refused by name rather than guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

from .errors import CardfitError

# transformers' converter operations this reading understands, as (class name, dim) sequences
STACK = (("MergeModulelist", 0),)
STACK_AND_CONCATENATE = (("MergeModulelist", 0), ("Concatenate", 1))


@dataclass(frozen=True)
class Placement:
    """A checkpoint tensor's place: all of `param`, or one expert's `part`-th row block of it."""

    param: str
    expert: int | None = None
    part: int = 0
    parts: int = 1

    @property
    def whole(self) -> bool:
        return self.expert is None

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The slice of the module parameter that holds this checkpoint tensor (a view: writes land)."""
        if self.whole:
            return param
        rows = param.shape[1] // self.parts
        return param[self.expert, self.part * rows:(self.part + 1) * rows]


def _expert_pattern(source: str) -> re.Pattern:
    """A converter's source pattern, its `*` (the expert index) captured."""
    return re.compile(re.escape(source).replace(r"\*", r"(\d+)"))


@lru_cache(maxsize=None)
def _conversions(model_type: str) -> tuple[list[tuple[re.Pattern, str]], list[tuple[list[re.Pattern], str, int]]]:
    """transformers' renamings and expert converters for a model type, as compiled patterns."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    renamings, converters = [], []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = rule.source_patterns, rule.target_patterns
        operations = tuple((type(op).__name__, getattr(op, "dim", None)) for op in getattr(rule, "operations", []))
        if type(rule).__name__ == "WeightRenaming":
            renamings += [(re.compile(s), targets[0]) for s in sources]
        elif operations in (STACK, STACK_AND_CONCATENATE) and len(targets) == 1:
            parts = len(sources) if operations == STACK_AND_CONCATENATE else 1
            converters.append(([_expert_pattern(s) for s in sources], targets[0], parts))
        else:  # an operation this reading does not understand: refused when a tensor needs it
            converters.append(([_expert_pattern(s) for s in sources], None, 0))
    return renamings, converters


def placements(model_type: str, names, parameters: set[str]) -> dict[str, Placement]:
    """Checkpoint name -> its Placement among the model's `parameters` (their dotted names)."""
    renamings, converters = _conversions(model_type)
    out = {}
    for name in names:
        if name in parameters:
            out[name] = Placement(name)
            continue
        renamed = name
        for pattern, target in renamings:
            renamed = pattern.sub(target, renamed)
        if renamed in parameters:
            out[name] = Placement(renamed)
            continue
        out[name] = _expert_placement(model_type, name, renamed, converters, parameters)
    return out


def _expert_placement(model_type, name, renamed, converters, parameters) -> Placement:
    for patterns, target, parts in converters:
        for part, pattern in enumerate(patterns):
            match = pattern.search(renamed)
            if not match:
                continue
            if target is None:
                raise CardfitError(f"{name}: transformers converts this {model_type} tensor in a way cardfit "
                                   "does not stream yet", "use a model whose checkpoint stores its own module "
                                   "tensors, or one of the architectures in docs/formats.md (MoE)")
            param = renamed[:match.start()] + target + renamed[match.end():]
            if param in parameters:
                return Placement(param, int(match.group(1)), part if parts > 1 else 0, max(parts, 1))
    from .groups import expert_stack

    if expert_stack(name):
        raise CardfitError(f"{name}: no tensor of transformers' {model_type} model takes this checkpoint tensor",
                           "check that config.json's model_type matches the weights")
    return Placement(name)  # a dense tensor under its own name: the module tree decides when it is loaded


def refuse_expert_statistics(names, what: str) -> None:
    """Statistics are read per nn.Linear; routed experts live in fused modules that run each expert on
    its own tokens, so data-aware rounding and the Fisher/weight signals cannot see them yet. One line,
    before any work, rather than an AttributeError from the module tree."""
    from .groups import expert_stack

    expert = next((n for n in names if expert_stack(n)), None)
    if expert is not None:
        raise CardfitError(f"{what} cannot reach routed experts yet ({expert}): statistics are not "
                           "collected per expert", "use RTN rounding (--rounding rtn / --method rtn) and the exact "
                           "scan (--method exact) for mixture-of-experts models")
