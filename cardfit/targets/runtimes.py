"""Run a packed artifact in the runtime that will serve it and read back its logits.

GGUF runs in llama.cpp (llama-cpp-python, every position's logits); a compressed-tensors
checkpoint runs in transformers, which decompresses it with compressed-tensors' own code, or in
vLLM (its own environment, full-vocabulary log-probabilities of every position). All answer the
same question: the next-token logits (or log-probabilities, equivalent for every metric) for a
batch of token ids.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..errors import CardfitError


_PARAMS_LOCK = threading.Lock()


def load_llama(path: str | Path, **kwargs):
    """llama_cpp.Llama(path, **kwargs), without llama.cpp's AMX weight buffers on a CPU that has AMX:
    there its AMX matmul segfaults in the first decode (llama.cpp issue 20824, open; every GGUF cardfit
    wrote crashed so on a Sapphire Rapids machine), so the weights stay in ggml's plain CPU buffers
    (llama.cpp's `use_extra_bufts` off, which also skips its repacking; the same logits, slower on AMX).
    llama-cpp-python does not take that parameter, so its default parameters are amended while it loads."""
    import llama_cpp

    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        return llama_cpp.Llama(str(path), **kwargs)
    with _without_extra_buffers():
        return llama_cpp.Llama(str(path), **kwargs)


@contextmanager
def _without_extra_buffers():
    import llama_cpp.llama_cpp as native

    original = native.llama_model_default_params

    def plain_buffers():
        params = original()
        params.use_extra_bufts = False
        return params

    with _PARAMS_LOCK:
        native.llama_model_default_params = plain_buffers
        try:
            yield
        finally:
            native.llama_model_default_params = original


class Runtime:
    """What check and bench ask of a runtime: `logits(ids)` for a batch of token chunks, `close()`, and
    `prepare(chunks)`, a chance to score every chunk at once (vLLM starts its engine once)."""

    name = "runtime"

    def prepare(self, chunks: torch.Tensor) -> None:
        return None

    def close(self) -> None:
        return None


class GgufRuntime(Runtime):
    name = "llama.cpp"

    def __init__(self, path: str | Path, n_ctx: int = 512, threads: int | None = None):
        import os

        self.path = Path(path)
        try:
            self.llm = load_llama(self.path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False,
                                       n_threads=threads or os.cpu_count())
        except (ValueError, RuntimeError) as exc:
            raise CardfitError(f"llama.cpp cannot load {self.path} ({exc})",
                               "re-pack the artifact; a file llama.cpp refuses is not usable") from None
        self.n_ctx = n_ctx

    def tokenize(self, text: str) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = []
        for row in ids.tolist():
            if len(row) > self.n_ctx:
                raise ValueError(f"chunk of {len(row)} tokens exceeds n_ctx {self.n_ctx}")
            self.llm.reset()
            self.llm.eval(row)
            out.append(torch.from_numpy(np.array(self.llm.scores[: len(row)], dtype=np.float32)))
        return torch.stack(out)

    def close(self) -> None:
        self.llm.close()


def _refuse_zero_points(path: Path) -> None:
    """transformers (5.24, compressed-tensors 0.20) builds every packed layer's zero point unpacked and refuses
    the packed one a pack-quantized checkpoint stores (llm-compressor#1618): say so, not "cannot load"."""
    import json

    try:
        groups = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]
        asymmetric = sorted(name for name, g in groups.items() if (g.get("weights") or {}).get("symmetric") is False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # not a compressed-tensors checkpoint, or not one this can read: from_pretrained says what it is
    if asymmetric:
        raise CardfitError(f"{path} has asymmetric (zero-point) layers ({', '.join(asymmetric)}), which transformers "
                           "cannot load from a pack-quantized checkpoint (llm-compressor#1618)",
                           "check it in vLLM (--runtime vllm), or plan without the -asym formats")


class TransformersRuntime(Runtime):
    name = "transformers"

    def __init__(self, path: str | Path, device: str = "cpu"):
        from transformers import AutoModelForCausalLM

        from ..text import load_tokenizer

        self.path = Path(path)
        _refuse_zero_points(self.path)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32,
                                                              use_safetensors=True).to(device)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CardfitError(f"transformers cannot load {self.path} ({exc.__class__.__name__}: {exc})",
                               "re-pack the artifact") from None
        self.model.eval()
        self.tokenizer = load_tokenizer(str(self.path))
        self.device = device

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids.to(self.device)).logits.to(torch.float32).cpu()

    def close(self) -> None:
        del self.model


class BitsAndBytesRuntime(Runtime):
    """bitsandbytes NF4 as people use it: no file, transformers quantizes the full-precision model
    at load (4-bit NF4 codes, one fp32 absmax per 64 weights, decoder linears only; the
    embedding and the output matrix stay 16-bit). `path` is the reference model itself."""

    def __init__(self, path: str | Path, device: str = "cpu"):
        import importlib
        from importlib.metadata import version

        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        from ..text import load_tokenizer

        self.path = Path(path)
        try:
            importlib.import_module("bitsandbytes")
        except Exception as exc:  # a broken install raises all sorts of errors at import
            raise CardfitError(f"bitsandbytes does not import here ({exc.__class__.__name__}: {exc})",
                               "pip install bitsandbytes (0.49 or newer runs on CPU)") from None
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                    bnb_4bit_compute_dtype=torch.float32, bnb_4bit_use_double_quant=False)
        try:
            self.model = AutoModelForCausalLM.from_pretrained(str(self.path), quantization_config=config,
                                                              device_map=device, use_safetensors=True)
        except (OSError, ValueError, RuntimeError) as exc:
            raise CardfitError(f"bitsandbytes cannot load {self.path} ({exc.__class__.__name__}: {exc})",
                               "give a full-precision model directory") from None
        self.model.eval()
        self.tokenizer = load_tokenizer(str(self.path))
        self.device = device
        self.name = f"transformers + bitsandbytes {version('bitsandbytes')} NF4"

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids.to(self.device)).logits.to(torch.float32).cpu()

    @torch.no_grad()
    def generation_tokens_per_s(self, prompt: list[int], tokens: int = 32) -> float:
        """Greedy decoding speed: the time for `tokens` new tokens less the time for the first (the prompt)."""
        import time

        ids = torch.tensor([prompt], device=self.device)

        def timed(n: int) -> float:
            start = time.perf_counter()
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=self.tokenizer.eos_token_id)
            return time.perf_counter() - start

        timed(1)  # warm-up
        return (tokens - 1) / max(timed(tokens) - timed(1), 1e-9)

    def close(self) -> None:
        del self.model


class VllmRuntime(Runtime):
    """vLLM serving a compressed-tensors checkpoint. Starting vLLM costs ~20 s, so `prepare` scores
    every chunk in one engine start and `logits` reads the answers back."""

    name = "vllm"

    def __init__(self, path: str | Path, n_ctx: int = 512, python: str | Path | None = None):
        from ..architecture import geometry_from_config, load_config
        from .vllm_env import vllm_python

        self.path = Path(path)
        self.n_ctx = n_ctx
        self.python = vllm_python(python)
        self._tensors: Path | None = None
        self._index: dict[tuple, int] = {}
        self._folder = None
        self.vocab_size = geometry_from_config(load_config(self.path), source=str(self.path)).vocab_size

    def tokenize(self, text: str) -> list[int]:
        from ..text import load_tokenizer

        return load_tokenizer(str(self.path))(text, add_special_tokens=False).input_ids

    def prepare(self, chunks: torch.Tensor) -> None:
        import tempfile

        from .vllm_env import run_driver

        sequences = [row.tolist() for row in chunks]
        self._folder = tempfile.TemporaryDirectory(prefix="cardfit-vllm-")
        job = {"task": "logprobs", "model": str(self.path), "max_model_len": max(self.n_ctx, chunks.shape[1]) + 8,
               "sequences": sequences, "top_k": -1}
        answer, folder = run_driver(job, self._folder.name, self.python)
        self.name = f"vllm {answer['vllm']}"  # the report names the version that served it
        self._tensors = folder / answer["tensors"]
        self._index = {tuple(seq): n for n, seq in enumerate(sequences)}

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        if self._tensors is None:
            self.prepare(ids)
        out = []
        with safe_open(str(self._tensors), framework="pt") as arrays:
            for row in ids.tolist():
                n = self._index[tuple(row)]
                token_ids, values = arrays.get_tensor(f"ids.{n}"), arrays.get_tensor(f"logprobs.{n}")
                dense = torch.full((len(row), self.vocab_size), float("-inf"))
                out.append(dense.scatter_(1, token_ids, values))
        return torch.stack(out)

    def close(self) -> None:
        if self._folder is not None:
            self._folder.cleanup()


def _refuse_pickles(path: Path) -> None:
    """A checkpoint directory is loaded from safetensors only: transformers (and vLLM) would unpickle a .bin."""
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt") for p in path.glob(pattern)]
        if pickles:
            raise CardfitError(f"{path} holds only pickle checkpoints ({', '.join(sorted(pickles)[:3])}), "
                               "which cardfit never loads", "convert them to safetensors first, on a trusted machine")


def open_runtime(path: str | Path, n_ctx: int = 512, device: str = "cpu", kind: str | None = None,
                 runtime: str | None = None):
    """The runtime an artifact is measured in: the target named by `runtime`, else the default reader of
    its kind of file (llama.cpp for GGUF, transformers for a checkpoint directory; cardfit.targets).

    `kind` ("gguf" or "compressed-tensors") names it when the file name cannot (a temporary name).
    """
    from . import default_reader, get_target, names

    path = Path(path)
    if path.is_dir():
        _refuse_pickles(path)
    if runtime is None:
        if path.is_file() and (kind == "gguf" or path.suffix == ".gguf"):
            runtime = default_reader("gguf").name
        elif path.is_dir() and (path / "config.json").exists():
            runtime = default_reader("compressed-tensors").name
        else:
            raise CardfitError(f"no artifact at {path}", "give a .gguf file or a compressed-tensors checkpoint directory")
    target = get_target(runtime)
    if target.load is None:
        raise CardfitError(f"cardfit cannot run an artifact in {runtime}", "use --runtime " + ", ".join(names(loads=True)))
    return target.load(path, n_ctx, device)
