"""A model as a list of tensors grouped the way cardfit prices them.

A source answers names, shapes and dtypes from file headers alone; `read(name)` pulls
one tensor through a memory map, so nothing larger than the tensor asked for is ever
resident.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..architecture import ModelGeometry
from ..errors import CardfitError

from ..groups import EMBED, LM_HEAD, NORM, OTHER, GroupId, group_of, group_sort_key  # noqa: F401  (re-exported)

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, or a GGUF type name for GGUF sources
    nbytes: int
    group: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# Tensors that are not the language model's decoder: vision/audio towers, multi-token-prediction heads.
_NOT_DECODER = ("vision", "visual", "multi_modal", "audio")
_MTP = re.compile(r"(?:^|\.)mtp\.")
# Integer dtypes of packed (pre-quantized) tensors, whose stored shape is not the logical one.
_PACKED_DTYPES = {"I8", "U8", "I16", "I32", "I64", "BOOL"}
# Families whose projections are plain (out, in) matrices of the config's widths. MoE experts and
# gated / latent attention (Qwen3-Next, DeepSeek) have other shapes and are not checked here.
_ATTENTION_CHECKED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gemma3_text",
                      "smollm3", "granite", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe"}
_MLP_CHECKED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3", "gemma3_text",
                "smollm3", "granite", "olmo2"}
# (HF suffix, GGUF suffix) -> role
_PROJECTIONS = {
    "self_attn.q_proj.weight": "q", "attn_q.weight": "q",
    "self_attn.k_proj.weight": "k", "attn_k.weight": "k",
    "self_attn.v_proj.weight": "v", "attn_v.weight": "v",
    "self_attn.o_proj.weight": "o", "attn_output.weight": "o",
    "self_attn.qkv_proj.weight": "qkv", "attn_qkv.weight": "qkv",
    "mlp.gate_proj.weight": "gate", "ffn_gate.weight": "gate",
    "mlp.up_proj.weight": "up", "ffn_up.weight": "ffn_up",
    "mlp.down_proj.weight": "down", "ffn_down.weight": "down",
    "mlp.gate_up_proj.weight": "gate_up",
}


def _decoder_tensor(name: str) -> bool:
    return not any(marker in name for marker in _NOT_DECODER) and not _MTP.search(name)


def _span(indices: list[int]) -> str:
    if not indices:
        return "none"
    first, last = GroupId.layer_group(indices[0]), GroupId.layer_group(indices[-1])
    return first if len(indices) == 1 else f"{first}..{last}"


class ModelSource:
    """Common surface of every model source."""

    path: Path
    geometry: ModelGeometry
    config: dict

    def tensors(self) -> list[TensorInfo]:
        raise NotImplementedError

    def read(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def check_against_config(self) -> None:
        """The weights are the model config.json describes: embedding rows, layer count, projection shapes.

        Headers only (names and shapes), so a model whose config and weights disagree is refused when
        it is opened, not minutes into a scan as a shape traceback. Every source calls this at open.

        Embedding and output rows must equal vocab_size exactly: transformers builds the embedding
        with vocab_size rows and refuses a checkpoint of any other shape, and llama.cpp takes its
        vocabulary size from those rows. Vocabularies padded past the tokenizer (Qwen, Phi-3) state
        the padded size in vocab_size itself, so they pass; the tokenizer may be shorter.
        Layers stored past num_hidden_layers are allowed only for num_nextn_predict_layers (DeepSeek's
        multi-token-prediction layer); vision/audio towers and `mtp.` heads are not the decoder's.
        """
        g = self.geometry
        where, keys = g.source, g.keys
        fix = "use the config.json that came with these weights (or re-download the model)"
        decoder = [t for t in self.tensors() if _decoder_tensor(t.name)]

        indices = sorted({GroupId(t.group).layer for t in decoder if GroupId(t.group).in_layer})
        nextn = g.raw.get("num_nextn_predict_layers") or 0
        missing = [i for i in range(g.num_layers) if i not in set(indices)]
        beyond = [i for i in indices if i >= g.num_layers + nextn]
        if missing or beyond:
            got = f"{len(indices)} decoder layers ({_span(indices)})"
            detail = f"; missing {_span(missing[:1])}" if missing and indices else ""
            raise CardfitError(f"{where} has {keys.get('num_layers', 'num_hidden_layers')}={g.num_layers} "
                               f"but the weights hold {got}{detail}", fix)

        for t in decoder:
            if len(t.shape) != 2 or t.dtype in _PACKED_DTYPES or t.group not in (EMBED, LM_HEAD):
                continue
            role = "embedding" if t.group == EMBED else "output head"
            if t.shape[0] != g.vocab_size:
                raise CardfitError(f"{where} has {keys.get('vocab', 'vocab_size')}={g.vocab_size} but the "
                                   f"{role} {t.name} has {t.shape[0]} rows", fix)
            if t.shape[1] != g.hidden_size:
                raise CardfitError(f"{where} has {keys.get('hidden', 'hidden_size')}={g.hidden_size} but the "
                                   f"{role} {t.name} is {t.shape[1]} wide", fix)

        if self.config.get("quantization_config") is not None:
            return  # pre-quantized checkpoints store packed projections of other shapes
        for t in decoder:
            if len(t.shape) != 2 or t.dtype in _PACKED_DTYPES or not GroupId(t.group).in_layer:
                continue
            role = next((r for suffix, r in _PROJECTIONS.items() if t.name.endswith("." + suffix)), None)
            if role is None:
                continue
            expected = self._projection_shape(role)
            if expected is not None and tuple(t.shape) != expected[0]:
                raise CardfitError(f"{where}: {t.name} is {t.shape[0]}x{t.shape[1]}, but {expected[1]} "
                                   f"make it {expected[0][0]}x{expected[0][1]}", fix)

    def _projection_shape(self, role: str) -> tuple[tuple[int, int], str] | None:
        """(expected (out, in) shape, the config keys that set it) of one projection, or None if unchecked."""
        g = self.geometry
        k = g.keys
        hidden, hk = g.hidden_size, f"{k.get('hidden', 'hidden_size')}={g.hidden_size}"
        if role in ("q", "k", "v", "o", "qkv"):
            if g.model_type not in _ATTENTION_CHECKED or g.mla_latent is not None:
                return None
            hd = f"{k.get('head_dim', 'head_dim')}={g.head_dim_k}"
            q = g.num_heads * g.head_dim_k
            kv = g.num_kv_heads * g.head_dim_k
            qk = f"{k.get('heads', 'num_attention_heads')}={g.num_heads}"
            kvk = f"{k.get('kv_heads', 'num_key_value_heads')}={g.num_kv_heads}"
            return {"q": ((q, hidden), f"{qk}, {hd}, {hk}"),
                    "k": ((kv, hidden), f"{kvk}, {hd}, {hk}"),
                    "v": ((kv, hidden), f"{kvk}, {hd}, {hk}"),
                    "o": ((hidden, q), f"{qk}, {hd}, {hk}"),
                    "qkv": ((q + 2 * kv, hidden), f"{qk}, {kvk}, {hd}, {hk}")}[role]
        if g.model_type not in _MLP_CHECKED or g.intermediate_size is None:
            return None
        inter = g.intermediate_size
        ik = f"{k.get('intermediate', 'intermediate_size')}={inter}"
        if role == "gate_up" or (role == "ffn_up" and g.model_type == "phi3"):  # Phi-3 keeps gate and up fused,
            return (2 * inter, hidden), f"{ik}, {hk}"  # in llama.cpp's ffn_up too
        role = "up" if role == "ffn_up" else role
        return {"gate": ((inter, hidden), f"{ik}, {hk}"), "up": ((inter, hidden), f"{ik}, {hk}"),
                "down": ((hidden, inter), f"{ik}, {hk}")}[role]

    @property
    def tied_embeddings(self) -> bool:
        names = {t.name for t in self.tensors()}
        has_head = any(group_of(n) == LM_HEAD for n in names)
        return self.geometry.tie_word_embeddings or not has_head

    def groups(self) -> dict[str, list[TensorInfo]]:
        """Tensors by layer group, in forward order; a tied lm_head is priced once, with embed."""
        out: dict[str, list[TensorInfo]] = {}
        for info in self.tensors():
            out.setdefault(info.group, []).append(info)
        return dict(sorted(out.items(), key=lambda kv: group_sort_key(kv[0])))

    @property
    def stored_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    origins: tuple = ()  # the GGUFs this model was converted from (gguf_file.GgufOrigin): read, never written

    def embedding_rows(self) -> int | None:
        """How many token ids the model has an embedding row for (None: no token embedding found)."""
        return next((t.shape[0] for t in self.tensors() if t.group == EMBED and len(t.shape) == 2), None)

    def origin_types(self) -> dict[str, str]:
        """Matrix name -> the ggml type it was stored as in the GGUF this model was converted from (empty for a
        model that came unquantized): rounding a tensor back onto that grid costs ~0 but in a few blocks."""
        if not self.origins:
            return {}
        if getattr(self, "_origin_types", None) is None:
            from ..pack.gguf_arch import ArchSpec

            stored = {t.name: t.dtype for t in self.origins[0].tensors()}
            try:
                spec = ArchSpec.for_config(self.config)
            except CardfitError:  # an architecture cardfit does not name for llama.cpp: its grid unknown
                self._origin_types = {}
                return self._origin_types
            named = {}
            for t in self.tensors():
                if len(t.shape) >= 2:
                    try:
                        named[t.name] = stored.get(spec.tensor_name(t.name))
                    except CardfitError:  # a tensor llama.cpp has no name for: nothing known of its grid
                        continue
            self._origin_types = {name: dtype for name, dtype in named.items() if dtype is not None}
        return self._origin_types

    def source_types(self) -> dict[str, list[str]]:
        """What each group's matrices are stored as where this model came from, most bytes first: the
        ggml types of the GGUF it was converted from (the grid its "f16" reference really sits on), or
        its own dtypes. compare prints them beside every recipe (docs/benchmarks.md, the quantized source)."""
        tensors = self.tensors()
        if self.origins:
            tensors = self.origins[0].tensors()
        weight: dict[str, dict[str, int]] = {}
        for t in tensors:
            if len(t.shape) >= 2:
                by_type = weight.setdefault(t.group, {})
                by_type[t.dtype] = by_type.get(t.dtype, 0) + t.nbytes
        return {group: sorted(by_type, key=by_type.get, reverse=True) for group, by_type in weight.items()}

    def weights_sample(self) -> str:
        """A hash of some of the weights' values (what `fingerprint` leaves out), so a map is never taken for the
        map of another checkpoint of the same architecture (a fine-tune); the sources say which values."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Content hash of config and tensor index (names, shapes, dtypes): names the model in artifacts."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self.config, sort_keys=True).encode())
        for t in sorted(self.tensors(), key=lambda t: t.name):
            digest.update(f"{t.name}|{t.shape}|{t.dtype}\n".encode())
        return "sha256:" + digest.hexdigest()
