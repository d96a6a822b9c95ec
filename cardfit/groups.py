"""The identity of a layer group: one type, parsed and formatted here and nowhere else.

A group is what cardfit prices and chooses a format for: the token embedding (`embed`), a
decoder layer (`layers.N`), the final norm (`norm`), an untied output matrix (`lm_head`), and,
with `--group-by tensor`, one matrix (named by the tensor itself), one projection's routed-expert
stack of an MoE layer (named `...experts.<proj>.weight`: one GGUF `ffn_<proj>_exps` tensor holds every
expert, so they take one type) or the 1-D tensors of a layer (`layers.N.fixed`). `GroupId` is a `str` — maps, recipes and dictionaries keep the names they
always had, byte for byte — that also knows what it names: `kind`, `layer`, `tensor`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import CardfitError

EMBED_KIND, LAYER_KIND, FIXED_KIND, TENSOR_KIND, NORM_KIND, HEAD_KIND, OTHER_KIND = (
    "embed", "layer", "fixed", "tensor", "norm", "lm_head", "other")

_LAYER_GROUP = re.compile(r"^layers\.(\d+)(\.fixed)?$")
# A tensor's layer, in Hugging Face (model.layers.N., transformer.h.N., blocks.N.) and GGUF (blk.N.) names.
_TENSOR_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|blk)\.(\d+)\.")


class GroupId(str):
    """A group's name that knows its kind and layer. Construct from a name (`GroupId("layers.3")`) or
    with `GroupId.layer_group(3)`, `GroupId.fixed_group(3)`, `GroupId.tensor_group(name)`."""

    kind: str
    layer: int | None
    tensor: str | None

    def __new__(cls, name: str) -> "GroupId":
        if isinstance(name, GroupId):
            return name
        self = super().__new__(cls, name)
        self.tensor = None
        match = _LAYER_GROUP.match(name)
        if match:
            self.kind, self.layer = (FIXED_KIND if match.group(2) else LAYER_KIND), int(match.group(1))
        elif name in (EMBED_KIND, NORM_KIND, HEAD_KIND, OTHER_KIND):
            self.kind, self.layer = name, None
        else:  # a tensor priced on its own (--group-by tensor)
            found = _TENSOR_LAYER.search(name)
            self.kind, self.layer, self.tensor = TENSOR_KIND, (int(found.group(1)) if found else None), name
        return self

    @classmethod
    def layer_group(cls, index: int) -> "GroupId":
        return cls(f"layers.{int(index)}")

    @classmethod
    def fixed_group(cls, index: int) -> "GroupId":
        """The 1-D tensors (norms, biases) of layer `index`, priced together when grouping by tensor."""
        return cls(f"layers.{int(index)}.fixed")

    @classmethod
    def tensor_group(cls, tensor_name: str) -> "GroupId":
        return cls(tensor_name)

    @property
    def in_layer(self) -> bool:
        """Part of a decoder layer (the whole layer, its 1-D tensors, or one of its matrices)."""
        return self.layer is not None

    @property
    def sort_key(self) -> tuple:
        """Forward order: embedding, layers in order, the final norm, the output matrix, the rest."""
        if self.kind == EMBED_KIND:
            return (0, 0)
        if self.layer is not None:
            return (1, self.layer)
        return {NORM_KIND: (2, 0), HEAD_KIND: (3, 0)}.get(self.kind, (4, 0))

    def __reduce__(self):
        return (GroupId, (str(self),))


EMBED = GroupId(EMBED_KIND)
NORM = GroupId(NORM_KIND)
LM_HEAD = GroupId(HEAD_KIND)
OTHER = GroupId(OTHER_KIND)


_EXPERT = re.compile(r"\.experts\.(\d+)\.")


def expert_stack(tensor_name: str) -> tuple[str, int] | None:
    """(its stack's name, the expert's index) for one routed expert's matrix (`...experts.<e>.<proj>.weight`:
    every expert of a layer's projection is stacked into one tensor by llama.cpp's converter and by
    transformers' fused modules); None for any other tensor."""
    match = _EXPERT.search(tensor_name)
    if match is None:
        return None
    return tensor_name[:match.start()] + ".experts." + tensor_name[match.end():], int(match.group(1))


def group_of(tensor_name: str) -> GroupId:
    """The layer group of an HF or GGUF tensor name: embed, layers.N, norm, lm_head or other."""
    match = _TENSOR_LAYER.search(tensor_name)
    if match:
        return GroupId.layer_group(int(match.group(1)))
    name = tensor_name
    if "vision" in name or "visual" in name or "multi_modal" in name or "audio" in name:
        return OTHER
    if name.endswith(("embed_tokens.weight", "wte.weight", "token_embd.weight", "tok_embeddings.weight")):
        return EMBED
    if name.startswith("lm_head") or name in ("output.weight",) or name.endswith(".lm_head.weight"):
        return LM_HEAD
    if name.endswith(("model.norm.weight", "norm_f.weight", "ln_f.weight", "output_norm.weight",
                      "final_layernorm.weight")) or name == "norm.weight":
        return NORM
    return OTHER


def group_sort_key(group: str) -> tuple:
    return GroupId(group).sort_key


@dataclass
class Group:
    """What a scan measures and a plan chooses one format for: the named group's tensors (TensorInfo), and the
    first decoder layer a change to them reaches."""

    name: str
    tensors: list  # TensorInfo
    start: int  # first decoder layer to re-run; -1 embedding, L = head only

    @property
    def quantizable(self) -> list:
        return [t for t in self.tensors if len(t.shape) >= 2]


def scan_groups(source, group_by: str) -> list[Group]:
    """The groups of `source` in forward order, per decoder layer or (`group_by` "tensor") per matrix and per
    routed-expert stack; a tied lm_head is the embedding and is priced once, with it."""
    if group_by not in ("layer", "tensor"):
        raise CardfitError(f"unknown --group-by '{group_by}'", "use --group-by layer or --group-by tensor")
    layers = source.geometry.num_layers
    out = []
    for name, tensors in source.groups().items():
        if name == LM_HEAD and source.tied_embeddings:
            continue
        group = GroupId(name)
        start = -1 if group == EMBED else layers if group in (NORM, LM_HEAD) else group.layer
        if group.kind == "layer" and group_by == "tensor":
            stacks: dict[str, list] = {}  # an MoE projection's experts: one group, as one GGUF tensor
            for t in tensors:
                if len(t.shape) >= 2:
                    stack = expert_stack(t.name)
                    stacks.setdefault(t.name if stack is None else stack[0], []).append(t)
            out += [Group(name, members, start) for name, members in stacks.items()]
            fixed = [t for t in tensors if len(t.shape) < 2]
            if fixed:
                out.append(Group(GroupId.fixed_group(group.layer), fixed, start))
        else:
            out.append(Group(name, tensors, start))
    return out


def pending_by_group(todo: list) -> dict[int, list]:
    """The scan's to-do cells (group index, group, format) as group index -> formats, in order."""
    out: dict[int, list] = {}
    for i, _, fmt in todo:
        out.setdefault(i, []).append(fmt)
    return out
