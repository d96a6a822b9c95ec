"""Run a causal LM one layer group at a time, weights streamed from a model source.

The model is built as an empty skeleton (parameters on the meta device); a group's tensors
are read from the source's memory maps only while that group computes, then dropped, so
resident weights never exceed one decoder layer plus the embedding/head. Per-layer call
arguments (rotary position embeddings, masks) depend only on positions, so they are built
once per sequence length and replayed; every stage (scan, quantization, check) composes
`embed -> run_layer(i) ... -> logits` from these pieces, on CPU or CUDA alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager

import torch

from .errors import CardfitError
from .groups import EMBED, LM_HEAD, NORM, GroupId
from .sources import HfDirectorySource, ModelSource, runnable


class StreamedModel:
    def __init__(self, source: ModelSource, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        source = runnable(source)  # a GGUF runs as its cached f16 conversion
        if not isinstance(source, HfDirectorySource):
            raise CardfitError(f"{source.path} must be a model directory to run it",
                               "pass a model directory, a .gguf or a cached hub id")
        self.source = source
        from .quant.device import check_device

        self.device = check_device(device)
        self.dtype = dtype
        config = AutoConfig.from_pretrained(str(source.path))
        config._attn_implementation = "sdpa"
        with init_empty_weights():
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.model.eval()
        self.decoder = self.model.model
        self.layers = self.decoder.layers
        self.groups = source.groups()
        self.tied = source.tied_embeddings
        self._loaded: set[str] = set()
        self._kwargs: dict[tuple, list[dict]] = {}

    # -- weights --------------------------------------------------------------------------------------
    def group_tensors(self, group: str) -> list[str]:
        return [t.name for t in self.groups.get(group, [])]

    def load(self, group: str, overrides: Mapping[str, torch.Tensor] | None = None) -> None:
        """Put one group's weights on the device; `overrides` replaces tensors by name (quantized copies)."""
        from accelerate.utils import set_module_tensor_to_device

        for name in self.group_tensors(group):
            value = overrides.get(name) if overrides else None
            if value is None:
                value = self.source.read(name, dtype=self.dtype)
            set_module_tensor_to_device(self.model, name, self.device, value=value.to(self.dtype))
        if group == EMBED and self.tied:
            self.model.lm_head.weight = self.decoder.embed_tokens.weight
        self._loaded.add(group)

    def unload(self, group: str) -> None:
        from accelerate.utils import set_module_tensor_to_device

        for name in self.group_tensors(group):
            set_module_tensor_to_device(self.model, name, "meta")
        if group == EMBED and self.tied:
            self.model.lm_head.weight = self.decoder.embed_tokens.weight
        self._loaded.discard(group)

    @contextmanager
    def resident(self, group: str, overrides: Mapping[str, torch.Tensor] | None = None):
        self.load(group, overrides)
        try:
            yield
        finally:
            self.unload(group)

    # -- computation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        loaded = EMBED in self._loaded
        if not loaded:
            self.load(EMBED)
        try:
            return self.decoder.embed_tokens(input_ids.to(self.device)).to(self.dtype)
        finally:
            if not loaded:
                self.unload(EMBED)

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
        group = GroupId.layer_group(index)
        kwargs = self.layer_kwargs(hidden.shape[0], hidden.shape[1])[index]
        loaded = group in self._loaded
        if not loaded:
            self.load(group, overrides)
        try:
            out = self.layers[index](hidden.to(self.device), **kwargs)
        finally:
            if not loaded:
                self.unload(group)
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Final norm and lm_head (the embedding when tied), in float32."""
        head = EMBED if self.tied else LM_HEAD
        needed = [g for g in (NORM, head) if g not in self._loaded]
        for g in needed:
            self.load(g, overrides)
        try:
            return self._soft_capped(self.model.lm_head(self.decoder.norm(hidden.to(self.device))))
        finally:
            for g in needed:
                self.unload(g)

    @torch.no_grad()
    def logits_with(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Logits through a given head matrix, the final norm resident: lets a caller hold two heads
        (reference and quantized) at once instead of loading one per call."""
        normed = self.decoder.norm(hidden.to(self.device))
        return self._soft_capped(torch.nn.functional.linear(normed, head_weight.to(self.device, self.dtype)))

    def _soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        softcap = getattr(self.model.config, "final_logit_softcapping", None)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        return logits.to(torch.float32)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits of the whole model, one group resident at a time."""
        if overrides and any(n in overrides for n in self.group_tensors(EMBED)):
            with self.resident(EMBED, overrides):
                hidden = self.embed(input_ids)
                for i in range(len(self.layers)):
                    hidden = self.run_layer(i, hidden, overrides)
                return self.logits(hidden, overrides)
        hidden = self.embed(input_ids)
        for i in range(len(self.layers)):
            hidden = self.run_layer(i, hidden, overrides)
        return self.logits(hidden, overrides)
