"""Where a checkpoint tensor lives in transformers' module tree.

Mixture-of-experts checkpoints store one matrix per expert (`mlp.experts.3.up_proj.weight`) while
transformers 5 computes from fused 3-D parameters (`mlp.experts.gate_up_proj`: experts x [gate; up] x
hidden). transformers' own checkpoint conversion mapping (`conversion_mapping.py`) says how one becomes
the other; this module reads that mapping, so a layer streamed one checkpoint tensor at a time lands
where `from_pretrained` would put it, and a quantized copy of one expert's matrix replaces exactly its
slice. Only the operations MoE checkpoints use are understood (renaming, stacking experts, concatenating
gate and up); any other conversion is refused by name rather than guessed.

gpt-oss goes the other way: its checkpoint already holds the fused stacks, in its own orientation
(experts x in x out, gate and up interleaved column by column, biases beside them). cardfit prices,
rounds and packs matrices the way runtimes multiply them, so such a checkpoint is presented as the
per-expert matrices llama.cpp's converter cuts from it (`mlp.experts.3.gate_proj.weight`, out x in):
the source reads only that expert's block (`fused_views`), and each lands back in its strided slice
of the module's stack.
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
    """A checkpoint tensor's place: all of `param`, or one expert's `part`-th row block of it (rows taken
    every `parts`-th from `part` when `interleaved`; the expert's matrix read transposed when `transposed`,
    gpt-oss storing in x out)."""

    param: str
    expert: int | None = None
    part: int = 0
    parts: int = 1
    interleaved: bool = False
    transposed: bool = False

    @property
    def whole(self) -> bool:
        return self.expert is None

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The slice of the module parameter that holds this checkpoint tensor (a view: writes land)."""
        return param if self.whole else self.within(param[self.expert])

    def within(self, block: torch.Tensor) -> torch.Tensor:
        """This tensor's part of its expert's block (`param[expert]`), as a view."""
        if self.transposed:
            block = block.transpose(-1, -2)
        if self.interleaved:
            return block[self.part::self.parts]
        rows = block.shape[0] // self.parts
        return block[self.part * rows:(self.part + 1) * rows]


# Checkpoints that store the fused stacks themselves, per model type: fused tensor suffix ->
# (per-expert projections it holds, in interleave order; whether each expert's matrix is in x out).
FUSED_CHECKPOINT = {
    "gpt_oss": {"mlp.experts.gate_up_proj": (("gate_proj", "up_proj"), True),
                "mlp.experts.gate_up_proj_bias": (("gate_proj", "up_proj"), False),
                "mlp.experts.down_proj": (("down_proj",), True),
                "mlp.experts.down_proj_bias": (("down_proj",), False)},
}


def fused_views(model_type: str | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, Placement, tuple]]:
    """Per-expert name -> (fused checkpoint tensor, its Placement in it, its shape), for a model type whose
    checkpoint stores fused stacks (FUSED_CHECKPOINT); empty for every other model."""
    views = {}
    for name, shape in shapes.items():
        if model_type in FUSED_CHECKPOINT and ".experts." in name and name.endswith(("_blocks", "_scales")):
            raise CardfitError(f"{name}: this checkpoint stores its experts in MXFP4 (gpt-oss's release "
                               "format), and cardfit measures and re-rounds from 16-bit weights",
                               "use the model's BF16 weights (a BF16 release, or transformers' "
                               "Mxfp4Config(dequantize=True) then save_pretrained)")
        for suffix, (projections, transposed) in FUSED_CHECKPOINT.get(model_type, {}).items():
            if not name.endswith("." + suffix):
                continue
            if len(shape) != (3 if transposed else 2) or shape[-1] % len(projections):
                raise CardfitError(f"{name} has shape {list(shape)}, not a stack of experts", "restore the model's "
                                   "original weights")
            prefix, kind = name[:-len(suffix)] + "mlp.experts", "bias" if suffix.endswith("_bias") else "weight"
            own = (shape[-1] // len(projections),) + ((shape[1],) if transposed else ())
            for expert in range(shape[0]):
                for projection in projections:
                    view = f"{prefix}.{expert}.{projection}.{kind}"
                    views[view] = (name, _fused_placement(model_type, view), own)
    return views


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


def fused_only(model_type: str) -> str | None:
    """Why transformers cannot load this model type's experts written one per expert, as a compressed-tensors
    checkpoint stores them: it builds its fused experts from per-expert tensors only where its conversion
    mapping merges them (gpt-oss loads its fused stacks as they are). None where it can; callers ask only
    for a model that has experts."""
    if any(target is not None for _, target, _ in _conversions(model_type)[1]):
        return None
    return (f"transformers loads {model_type}'s experts only as its fused stacks, and a compressed-tensors "
            "checkpoint stores them one per expert")


_PER_EXPERT = re.compile(r"^(.*)mlp\.experts\.(\d+)\.(\w+)\.(weight|bias)$")


def _fused_placement(model_type: str, name: str) -> Placement | None:
    """Where a per-expert name fused_views made lives in its fused stack; None for any other name."""
    match = _PER_EXPERT.match(name) if model_type in FUSED_CHECKPOINT else None
    if match is None:
        return None
    prefix, expert, projection, kind = match.groups()
    for suffix, (projections, transposed) in FUSED_CHECKPOINT[model_type].items():
        if projection in projections and suffix.endswith("_bias") == (kind == "bias"):
            return Placement(prefix + suffix, int(expert), projections.index(projection), len(projections),
                             interleaved=len(projections) > 1, transposed=transposed)
    return None


def placements(model_type: str, names, parameters: set[str]) -> dict[str, Placement]:
    """Checkpoint name -> its Placement among the model's `parameters` (their dotted names)."""
    renamings, converters = _conversions(model_type)
    out = {}
    for name in names:
        place = _fused_placement(model_type, name)
        if place is not None and place.param in parameters:
            out[name] = place
            continue
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
