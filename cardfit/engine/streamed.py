"""Run a causal LM one layer group at a time, weights streamed from a model source.

The model is built as an empty skeleton (parameters on the meta device); a group's tensors
are read from the source's memory maps only while that group computes, then dropped, unless
the residency budget lets them stay on the device (`keep_bytes`: on a GPU with room for the
whole model, each layer is read once per process). Replaced tensors (a quantized copy of a
group) are swapped into a resident group and back, so many variants of a layer compute from
one read of it. Decoder layers compute in `dtype`; the embedding, final norm and head always
in float32, so logits, log-softmax and KL sums never see half precision. Per-layer call
arguments (rotary position embeddings, masks) depend only on positions, so they are built
once per sequence length and replayed. Walks over these pieces live in `engine.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from ..errors import CardfitError
from ..groups import EMBED, LM_HEAD, NORM, GroupId
from ..sources import HfDirectorySource, ModelSource, runnable

HEAD_GROUPS = (EMBED, NORM, LM_HEAD)  # computed in float32 whatever the layers' dtype


class StreamedModel:
    def __init__(self, source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 keep_bytes: int = 0, prefetch: bool = False):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        source = runnable(source)  # a GGUF runs as its cached f16 conversion
        if not isinstance(source, HfDirectorySource):
            raise CardfitError(f"{source.path} must be a model directory to run it",
                               "pass a model directory, a .gguf or a cached hub id")
        self.source = source
        from ..quant.device import check_device

        self.device = check_device(device)
        self.dtype = dtype
        config = AutoConfig.from_pretrained(str(source.path))
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        # sdpa where transformers has it; eager for models whose attention it cannot express (gpt-oss's sinks)
        config._attn_implementation = "sdpa" if MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa else "eager"
        with init_empty_weights():
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        self.model.eval()
        for module in self.model.modules():  # rotary tables and other buffers live where the layers compute
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type != "meta":
                    module._buffers[key] = buffer.to(self.device)
        self.decoder = self.model.model
        self.layers = self.decoder.layers
        self.groups = source.groups()
        from ..checkpoint_map import placements

        # checkpoint name -> its place in the module tree (an expert's slice of a fused parameter)
        self.place = placements(config.model_type, [t.name for ts in self.groups.values() for t in ts],
                                {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
                                | {n for n, _ in self.model.named_buffers()})
        self._refuse_unplaced(type(self.model).__name__)
        self._refuse_uncovered_stacks()
        self.tied = source.tied_embeddings
        self.keep_bytes = keep_bytes
        self.prefetching = prefetch
        self.loads: Counter[str] = Counter()  # group -> times its weights were read from the source
        self._loaded: set[str] = set()
        self._kept: dict[str, int] = {}  # groups left resident after use -> their bytes on the device
        self._prefetched: dict[str, Future] = {}
        self._reader = ThreadPoolExecutor(max_workers=1) if prefetch else None
        self._kwargs: dict[tuple, list[dict]] = {}

    def _refuse_unplaced(self, model_class: str) -> None:
        """Every checkpoint tensor has a place in the module tree the config builds, and every parameter of
        that tree outside the embedding's tie gets a tensor: a checkpoint with a tensor the architecture has no
        place for (or one short of a tensor) is weights of another model, refused before any compute."""
        known = {n for n, _ in self.model.named_parameters(remove_duplicate=False)} | {
            n for n, _ in self.model.named_buffers()}
        extra = sorted(name for name, place in self.place.items() if place.param not in known)
        fix = "use the config.json that came with these weights (or re-download the model)"
        if extra:
            raise CardfitError(f"the checkpoint holds {extra[0]}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}"
                               f", for which {model_class} (the config's architecture) has no place", fix)
        shapes = {t.name: tuple(t.shape) for ts in self.groups.values() for t in ts}
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        for name, place in self.place.items():
            expected = tuple(parameters[place.param].shape) if place.whole and place.param in parameters else None
            if expected is not None and name in shapes and shapes[name] != expected:
                raise CardfitError(f"the checkpoint's {name} is {'x'.join(map(str, shapes[name]))}, but the config "
                                   f"builds {place.param} as {'x'.join(map(str, expected))}", fix)
        filled = {place.param for place in self.place.values()}
        names_of: dict[int, list[str]] = {}  # a parameter (tied ones are one object) -> its dotted names
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(param), []).append(name)
        head = self.model.get_output_embeddings()
        spared = {id(head.weight)} if head is not None and self.source.tied_embeddings else set()  # the embedding
        unfilled = sorted(names[0] for key, names in names_of.items() if key not in spared and not filled & set(names))
        if unfilled:
            raise CardfitError(f"the checkpoint has no tensor for {unfilled[0]}"
                               f"{f' and {len(unfilled) - 1} more' if len(unfilled) > 1 else ''} of {model_class}", fix)

    def _refuse_uncovered_stacks(self) -> None:
        """Every slice of a fused expert stack has a checkpoint tensor (an unfilled one would compute with
        whatever the allocation held)."""
        slices: dict[str, set] = {}
        parts: dict[str, int] = {}
        for place in self.place.values():
            if not place.whole:
                slices.setdefault(place.param, set()).add((place.expert, place.part))
                parts[place.param] = place.parts
        for param, have in slices.items():
            experts = self.model.get_parameter(param).shape[0]
            missing = sorted({(e, p) for e in range(experts) for p in range(parts[param])} - have)
            if missing:
                raise CardfitError(f"the checkpoint has no tensor for expert {missing[0][0]} of {param} ({len(missing)} "
                                   f"of {experts * parts[param]} expert matrices missing)",
                                   "restore the model's original weights")

    # -- weights --------------------------------------------------------------------------------------
    def group_tensors(self, group: str) -> list[str]:
        return [t.name for t in self.groups.get(group, [])]

    def group_params(self, group: str) -> list[str]:
        """The module parameters the group's checkpoint tensors fill (a fused expert stack once)."""
        return list(dict.fromkeys(self.place[n].param for n in self.group_tensors(group)))

    def _materialized(self, param: str, dtype: torch.dtype) -> torch.Tensor:
        """A fused parameter allocated on the device, for its slices to be written into."""
        from accelerate.utils import set_module_tensor_to_device

        tensor = self.model.get_parameter(param)
        if tensor.device.type == "meta":
            set_module_tensor_to_device(self.model, param, self.device,
                                        value=torch.empty(tensor.shape, dtype=dtype, device=self.device))
            tensor = self.model.get_parameter(param)
        return tensor

    def group_dtype(self, group: str) -> torch.dtype:
        return torch.float32 if group in HEAD_GROUPS else self.dtype

    def _read_group(self, group: str) -> dict[str, torch.Tensor]:
        dtype = self.group_dtype(group)
        out = {}
        for name in self.group_tensors(group):
            value = self.source.read(name, dtype=dtype)
            out[name] = value.pin_memory() if self.device.type == "cuda" else value
        return out

    def prefetch(self, group: str) -> None:
        """Start reading `group` from the source on a background thread (overlaps the current compute)."""
        if self._reader is None or group in self._loaded or group in self._prefetched or group not in self.groups:
            return
        self._prefetched[group] = self._reader.submit(self._read_group, group)

    def load(self, group: str) -> None:
        """Put one group's source weights on the device (nothing read when it is already there);
        replacements go in through `swapped`, which also puts the originals back."""
        from accelerate.utils import set_module_tensor_to_device

        if group in self._loaded:
            return
        future = self._prefetched.pop(group, None)
        values = future.result() if future is not None else self._read_group(group)
        dtype = self.group_dtype(group)
        for name, value in values.items():
            place = self.place[name]
            if place.whole:
                set_module_tensor_to_device(self.model, place.param, self.device, value=value, dtype=dtype)
            else:
                place.view(self._materialized(place.param, dtype).data).copy_(value)
        if group == EMBED and self.tied:
            self.model.lm_head.weight = self.decoder.embed_tokens.weight
        layer = GroupId(group).layer if GroupId(group).in_layer else None
        missing = [] if layer is None else [n for n, p in self.layers[layer].named_parameters() if p.device.type == "meta"]
        if missing:  # a tensor the layer computes with that the checkpoint does not hold
            raise CardfitError(f"the checkpoint has no tensor for {group}'s {missing[0]}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                               "restore the model's original weights")
        self._loaded.add(group)
        self.loads[group] += 1

    def swap_in(self, group: str, overrides: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Replace the resident group's tensors named in `overrides`; returns the originals for `swap_out`."""
        saved = {}
        dtype = self.group_dtype(group)
        for name in self.group_tensors(group):
            if name not in overrides:
                continue
            place = self.place[name]
            param = self.model.get_parameter(place.param)
            if place.whole:
                saved[place.param] = param.data
                param.data = overrides[name].to(self.device, dtype)
                continue
            if place.param not in saved:  # a fused stack: the original stays intact for swap_out
                saved[place.param] = param.data
                param.data = param.data.clone()
            place.view(param.data).copy_(overrides[name])
        return saved

    def swap_out(self, saved: Mapping[str, torch.Tensor]) -> None:
        for name, value in saved.items():
            self.model.get_parameter(name).data = value

    def unload(self, group: str) -> None:
        """Drop the group from the device, unless the residency budget lets it stay (then it is never
        read again). Overridden tensors never stay: a kept group holds the source's weights."""
        from accelerate.utils import set_module_tensor_to_device

        if group in self._kept:
            return
        size = sum(self.model.get_parameter(n).nbytes for n in self.group_params(group))
        if GroupId(group).in_layer and sum(self._kept.values()) + size <= self.keep_bytes:
            self._kept[group] = size
            return
        for name in self.group_params(group):
            set_module_tensor_to_device(self.model, name, "meta")
        if group == EMBED and self.tied:
            self.model.lm_head.weight = self.decoder.embed_tokens.weight
        self._loaded.discard(group)

    @contextmanager
    def resident(self, group: str, overrides: Mapping[str, torch.Tensor] | None = None):
        """The group on the device (with `overrides` swapped in) for the duration; dropped afterwards
        unless it was already resident."""
        was_loaded = group in self._loaded
        self.load(group)
        try:
            with self.swapped(group, overrides):
                yield
        finally:
            if not was_loaded:
                self.unload(group)

    @contextmanager
    def swapped(self, group: str, overrides: Mapping[str, torch.Tensor] | None):
        """The resident group with `overrides` swapped in for the duration (nothing read)."""
        saved = self.swap_in(group, overrides) if overrides else {}
        try:
            yield
        finally:
            self.swap_out(saved)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._prefetched.clear()

    # -- computation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        with self.resident(EMBED, overrides):
            return self.decoder.embed_tokens(input_ids.to(self.device)).to(self.dtype)

    @torch.no_grad()
    def layer_kwargs(self, batch: int, length: int) -> list[dict]:
        """Each decoder layer's call arguments for a batch of sequences of `length` tokens."""
        key = (batch, length)
        if key in self._kwargs:
            return self._kwargs[key]
        captured: list[dict] = []
        originals = [layer.forward for layer in self.layers]
        norm_forward = self.decoder.norm.forward

        def recorder(hidden_states, *args, **kwargs):
            captured.append({k: v for k, v in kwargs.items() if k not in ("cache", "past_key_values")})
            return hidden_states

        try:
            for layer in self.layers:
                layer.forward = recorder
            self.decoder.norm.forward = lambda h: h
            embeds = torch.zeros(batch, length, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
            self.decoder(inputs_embeds=embeds, use_cache=False)
        finally:
            for layer, fwd in zip(self.layers, originals):
                layer.forward = fwd
            self.decoder.norm.forward = norm_forward
        for kwargs in captured:
            kwargs["use_cache"] = False
        self._kwargs[key] = captured
        return captured

    @torch.no_grad()
    def run_layer(self, index: int, hidden: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None = None
                  ) -> torch.Tensor:
        kwargs = self.layer_kwargs(hidden.shape[0], hidden.shape[1])[index]
        with self.resident(GroupId.layer_group(index), overrides):
            out = self.layers[index](hidden.to(self.device, self.dtype), **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and lm_head (the embedding when tied), in float32; written into `out` (float32,
        hidden's positions x vocab) when given, the same bits without a fresh (positions x vocab) tensor."""
        with self.resident(EMBED if self.tied else LM_HEAD, overrides):
            return self.head_logits(self.final_norm(hidden), out)

    @torch.no_grad()
    def head_logits(self, normed: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The resident head (engine.head()) on the final norm's output, for a caller that needs that output
        too (head_kl's summary and cells) and so computes it once; `out` as in logits."""
        if out is None or self.model.lm_head.bias is not None:
            return self._soft_capped(self.model.lm_head(normed))
        return self._into(normed, self.model.lm_head.weight, out)

    @torch.no_grad()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's input: the final norm of `hidden`, in float32 on the device."""
        with self.resident(NORM):
            return self.decoder.norm(hidden.to(self.device, torch.float32))

    @property
    def linear_head(self) -> bool:
        """Whether the logits are W n + b in the final norm's output n (no soft-capping), the form
        head_kl's reference summary needs."""
        return not getattr(self.model.config, "final_logit_softcapping", None)

    def head_matrix(self) -> torch.Tensor:
        """The resident output matrix (the embedding when tied), float32 on the device."""
        return self.model.lm_head.weight

    @torch.no_grad()
    def logits_with(self, hidden: torch.Tensor, head_weight: torch.Tensor, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """Logits through a given head matrix, the final norm resident: lets a caller hold two heads
        (reference and quantized) at once instead of loading one per call. `out` as in logits."""
        normed = self.final_norm(hidden)
        weight = head_weight.to(self.device, torch.float32)
        bias = self.model.lm_head.bias  # a head's bias is not quantized: the quantized head keeps it
        if out is None or bias is not None:
            return self._soft_capped(torch.nn.functional.linear(normed, weight, bias))
        return self._into(normed, weight, out)

    def _into(self, normed: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """normed @ weightᵀ (a float32 head), soft-capped, in `out`: the kernel linear calls on a 2-D view,
        so the same bits (test_runner)."""
        torch.mm(normed.reshape(-1, normed.shape[-1]), weight.t(), out=out.view(-1, out.shape[-1]))
        return self._soft_capped(out, in_place=True)

    def _soft_capped(self, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """Gemma 2's final logit soft-capping where the config asks for it; `in_place` for a buffer outside
        any autograd graph (tanh keeps its output for the backward the Fisher pass runs)."""
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if softcap and in_place:
            logits.div_(softcap).tanh_().mul_(softcap)
        elif softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.to(torch.float32)
