"""A GGUF file as a model source: tensors listed from its header, dequantized one at a time by gguf-py.

Pricing (budget, sizes) reads the header only. Every stage that runs the model (scan, plan's and
pack's GGUF header, imatrix, check's reference, refine, fit, compare) runs `runnable()`: the file
converted once, by transformers' GGUF loader, into an f16 Hugging Face directory in the cardfit
cache, keyed by the file's content hash, so a changed file is converted again and an unchanged one
never is. That directory is the model's identity in maps and recipes (`fingerprint`), so a map
scanned from the .gguf and one scanned from its converted directory are the same map.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import sys
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..architecture import geometry_from_config
from ..atomic import atomic_directory, write_json
from ..cache import cache_root
from ..errors import CardfitError
from ..text import load_tokenizer
from .base import ModelSource, TensorInfo, group_of
from .hf_dir import HfDirectorySource


def read_gguf(path: Path, what: str = "GGUF", fix: str = "re-download the file or convert the model again"):
    """gguf-py's reader of `path`, refusing (one CardfitError) a file gguf-py cannot parse or whose header does
    not describe the whole file (a tensor missing from its table, a cut-short file, bytes appended past the
    data other than padding): every GGUF cardfit reads, a model or an imatrix, is opened here."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise CardfitError(f"{path} is not a readable {what} file ({exc.__class__.__name__}: {exc})", fix) from None
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=reader.data_offset)
    after = Path(path).stat().st_size - end
    if not (0 <= after < max(int(reader.alignment), 1) or _zeros_after(path, end, after)):  # padding, nothing else
        raise CardfitError(f"{path}: its GGUF header does not describe the file: its tensors' data ends "
                           f"{abs(after)} bytes {'before' if after > 0 else 'after'} the file does (a tensor missing "
                           "from its table, or a truncated file)", fix)
    return reader


def _zeros_after(path: Path, end: int, count: int) -> bool:
    """Whether the `count` bytes after `end` are all zero (padding), read only up to 1 MiB of them."""
    if not 0 <= count <= 1 << 20:
        return False
    with open(path, "rb") as fh:
        fh.seek(end)
        return not fh.read(count).strip(b"\0")


def _field(reader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def transformers_config(path: Path, reader=None):
    """The transformers config a GGUF's metadata implies (transformers reads only the header here),
    corrected where transformers' mapping drops what the header states: the head size (Qwen 3's
    `key_length`; transformers keeps its class default) and the absence of a sliding window (a
    Mistral GGUF is llama.cpp's `llama`, full attention, where transformers assumes Mistral's 4096)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise CardfitError(f"cannot derive a model config from {path.name} ({exc.__class__.__name__}: {exc})",
                           "use a GGUF of an architecture transformers reads, or the original model directory") from None
    reader = reader or read_gguf(path)
    arch = _field(reader, "general.architecture")
    key_length, value_length = _field(reader, f"{arch}.attention.key_length"), _field(reader, f"{arch}.attention.value_length")
    if (getattr(config, "head_dim", None) is not None and isinstance(key_length, int) and key_length == value_length
            and "kv_lora_rank" not in config.to_dict()):
        config.head_dim = key_length
    layer_types = getattr(config, "layer_types", None) or []
    if (getattr(config, "sliding_window", None) is not None and _field(reader, f"{arch}.attention.sliding_window") is None
            and not any("sliding" in str(t) for t in layer_types)):
        config.sliding_window = None
    if arch == "llama" and config.model_type == "mistral":
        # transformers names a `llama` GGUF whose name says Mistral "mistral", then finds no gguf-py
        # architecture of that name to load its tensors by; without a window it is exactly a Llama.
        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "sliding_window", "architectures")}
        config = AutoConfig.for_model("llama", **values)
    return config


def _derived_tensor_names() -> frozenset[str]:
    """Tensors llama.cpp's converter computes from the config (rotary frequency factors): not weights
    of the checkpoint, dropped by transformers' loader, so not priced as the model's."""
    import gguf

    kinds = (gguf.MODEL_TENSOR.ROPE_FREQS, gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)
    return frozenset(gguf.TENSOR_NAMES[k] + ".weight" for k in kinds)


def _file_version(path: Path) -> str:
    """The file as it is now: (device, inode) names it across renames and links; size, mtime and
    ctime change with every rewrite. ctime is there because mtime alone can be put back
    (`os.utime`, `touch -d`, `cp -p`, `rsync -t`) after the bytes changed in place; the kernel sets
    ctime to now on every write, utime, chmod, link and rename, and no system call sets it back
    (short of changing the clock). A rename or chmod therefore costs one re-hash. What no key of
    stat() sees is a change below the file system (a failing disk, a raw write to the device):
    only a fresh hash finds that (`cardfit models verify`)."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _hash_index() -> tuple[Path, dict]:
    """The remembered hashes (`$CARDFIT_CACHE/gguf/hashes.json`: file version -> sha256) and where they live;
    an unreadable index is an empty one."""
    index_path = cache_root() / "gguf" / "hashes.json"
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError, RecursionError):
        index = {}
    return index_path, index


def _write_hash_index(index_path: Path, index: dict) -> None:
    try:
        write_json(index_path, index)
    except (CardfitError, OSError):
        pass  # a read-only cache only costs re-hashing next time


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 23), b""):
            digest.update(block)
    return digest.hexdigest()


def remember_content_hash(path: Path, value: str) -> None:
    """Record `value` as the sha256 of the file at `path` as it is now (its `_file_version`), replacing
    what was remembered for the file's older versions. For a caller that has just hashed the bytes
    it wrote (`cardfit models get`), so the first run that uses the file does not read it again."""
    _remember(_file_version(path), value)


def _remember(key: str, value: str) -> None:
    index_path, index = _hash_index()
    index = {k: v for k, v in index.items() if k.split("|")[0] != key.split("|")[0]}  # the file's older versions
    index[key] = value
    _write_hash_index(index_path, index)


def forget_content_hash(path: Path) -> bool:
    """Drop every remembered hash of the file at `path` (all its versions: keyed by device and inode),
    so nothing vouches for its bytes any more. Call it before removing the file (its inode is read
    from it). True if there was an entry to drop."""
    inode = _file_version(path).split("|")[0]
    index_path, index = _hash_index()
    kept = {k: v for k, v in index.items() if k.split("|")[0] != inode}
    if len(kept) == len(index):
        return False
    _write_hash_index(index_path, kept)
    return True


def content_hash(path: Path, fresh: bool = False) -> str:
    """sha256 of the file's bytes, remembered per file version (`_file_version`) in the cache so an
    unchanged multi-GB file is hashed once, and an edited or replaced one is hashed again.

    `fresh=True` ignores what is remembered: the bytes are read and hashed now, and the result is
    remembered for the file's current version (what `cardfit models get` and `models verify` do).
    Without it a file whose bytes were changed in place is still caught as long as its ctime moved,
    which restoring its mtime cannot undo; it is not re-read on every use, since a fresh sha256
    measured 0.8 s/GB from the page cache but 3.0-3.4 s/GB on a first (cold) read on the
    development machine (issue 43: re-hash on first use only if under 1 s/GB)."""
    key = _file_version(path)
    if not fresh:
        _, index = _hash_index()
        if isinstance(index.get(key), str):
            return index[key]
    value = _sha256_of(path)
    if _file_version(path) == key:  # not remembered if the file changed while it was read
        _remember(key, value)
    return value


def converted_dir(path: Path) -> Path:
    """Where the f16 conversion of this GGUF's exact content lives in the cache: found by the content
    hash alone (a copy or a renamed file is the same model), named after the file that made it."""
    digest = content_hash(path)[:16]
    root = cache_root() / "gguf"
    made = sorted(d for d in root.glob(f"*-{digest}-f16") if (d / MANIFEST).exists()) if root.is_dir() else []
    return made[0] if made else root / f"{path.stem}-{digest}-f16"


def converted_source(path: str | Path, source: "GgufSource | None" = None):
    """The GGUF at `path` as the f16 Hugging Face directory it converts to: made once per content
    (one line on stderr says so), atomically, and found again by content hash without reading the
    header. `source` is the file's GgufSource when the caller has one open already."""
    path = Path(path)
    if not path.is_file():
        raise CardfitError(f"no GGUF file at {path}", "check the path")
    target = converted_dir(path)
    converted = _cached_conversion(target)
    if converted is None:
        source = source or GgufSource(path)
        print(f"converting {path.name} to an f16 model directory, once: {target}", file=sys.stderr, flush=True)
        source.materialize(target)
        converted = HfDirectorySource(target)
    converted.origins = (GgufOrigin(path, source),)  # what it was made from: outputs must not overwrite it
    return converted


MANIFEST = "cardfit-manifest.json"  # written last into a conversion: its files' sizes, and small ones' sha256
MANIFEST_HASHED_BELOW = 64 << 20  # files under this are hashed (tokenizer, configs); shards only sized


def _write_manifest(directory: Path) -> None:
    """Record every file of a finished conversion: bytes, and sha256 where small enough to check on every
    read (tokenizer and config files: milliseconds). Its presence is what makes the conversion whole."""
    entries = {}
    for file in sorted(p for p in directory.iterdir() if p.is_file()):
        size = file.stat().st_size
        entries[file.name] = {"bytes": size, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()
                              if size < MANIFEST_HASHED_BELOW else None}
    write_json(directory / MANIFEST, {"files": entries})


def _manifest_problem(directory: Path) -> str | None:
    """What is wrong with a conversion against its manifest (None: every file is as written)."""
    try:
        entries = json.loads((directory / MANIFEST).read_text(encoding="utf-8"))["files"]
        for name, entry in entries.items():
            file = directory / name
            if not file.is_file() or file.stat().st_size != entry["bytes"]:
                return f"{name} is missing or not {entry['bytes']} bytes"
            if entry["sha256"] is not None and hashlib.sha256(file.read_bytes()).hexdigest() != entry["sha256"]:
                return f"{name} changed since it was written"
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"its manifest is unreadable ({exc.__class__.__name__})"
    return None


def _cached_conversion(target: Path):
    """The cached conversion at `target` if it is whole — every file as its manifest recorded it (sizes; the
    sha256 of the small ones: tokenizer and config files), its shards' headers readable — else None, with
    a damaged one removed (and said so on stderr) so that it is made again: a cache entry is checked when
    it is read, never trusted because it exists. A shard's bytes changed in place at the same size are not
    seen here (hashing GBs on every run costs seconds); `check` against the reference would see them."""
    if not target.is_dir():
        return None
    problem = _manifest_problem(target)
    if problem is None:
        try:
            return HfDirectorySource(target)
        except CardfitError as exc:
            problem = str(exc).splitlines()[0][:160]
    print(f"the cached conversion {target} is damaged ({problem}); converting again", file=sys.stderr, flush=True)
    shutil.rmtree(target, ignore_errors=True)
    return None


class GgufOrigin:
    """The GGUF a model directory was converted from: its path, and its tensors, whose header is read only when
    they are asked for (a cached conversion runs without reading it)."""

    def __init__(self, path: str | Path, source: "GgufSource | None" = None):
        self.path, self._source = Path(path), source

    def tensors(self) -> list[TensorInfo]:
        if self._source is None:
            self._source = GgufSource(self.path)
        return self._source.tensors()


def _memo_whole(header) -> bool:
    """Whether a header memo read from the cache has the shape `_header` writes (an edited or damaged one is
    parsed again rather than trusted)."""
    try:
        return (isinstance(header["config"], dict) and isinstance(header["metadata"], dict)
                and isinstance(header["tensors"], list)
                and all(isinstance(name, str) and isinstance(dtype, str) and type(nbytes) is int and nbytes >= 0
                        and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                        for name, shape, dtype, nbytes in header["tensors"]))
    except (KeyError, TypeError, ValueError):
        return False


HEADER_MEMO_VERSION = 2  # 2: memos only of files whose header describes the whole file
MEMO_METADATA = ("general.architecture", "tokenizer.ggml.pre")


def _header_memo_path(path: Path) -> tuple[Path, str]:
    """Where what this file's header says (config, tensor table) is remembered, and the memo's key: the
    file's version and the transformers that derived the config."""
    import transformers

    key = f"{_file_version(path)}|transformers {transformers.__version__}|{HEADER_MEMO_VERSION}"
    return cache_root() / "gguf" / "headers" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json"), key


class GgufSource(ModelSource):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CardfitError(f"no GGUF file at {self.path}", "check the path")
        header = self._header()
        self.config = header["config"]
        self._all = [TensorInfo(name, tuple(shape), dtype, nbytes, group_of(name))
                     for name, shape, dtype, nbytes in header["tensors"]]
        self._metadata = header["metadata"]
        self.geometry = geometry_from_config(self.config, source=str(self.path))
        self.check_against_config()

    def _header(self) -> dict:
        """Config, tensor table and a few metadata keys, read once per version of the file: parsing a
        GGUF's header (its whole vocabulary, twice: gguf-py's and transformers') takes seconds."""
        memo, key = _header_memo_path(self.path)
        try:
            header = json.loads(memo.read_text(encoding="utf-8"))
            if isinstance(header, dict) and header.get("key") == key and _memo_whole(header):
                return header
        except (OSError, ValueError, RecursionError):
            pass
        reader = self._gguf
        tensors = [[t.name, [int(d) for d in reversed(t.shape)], t.tensor_type.name, int(t.n_bytes)]
                   for t in reader.tensors]
        header = {"key": key, "config": self._hf_config.to_dict(), "tensors": tensors,
                  "metadata": {k: _field(reader, k) for k in MEMO_METADATA}}
        try:
            header = json.loads(json.dumps(header))  # the same plain values whether parsed or remembered
        except (TypeError, ValueError):
            return header
        try:
            write_json(memo, header)
        except (CardfitError, OSError):
            pass  # a read-only cache only costs parsing again
        return header

    @cached_property
    def _gguf(self):
        return read_gguf(self.path)

    @cached_property
    def _hf_config(self):
        return transformers_config(self.path, self._gguf)

    @cached_property
    def _by_name(self):
        return {t.name: t for t in self._gguf.tensors}

    def tensors(self) -> list[TensorInfo]:
        derived = _derived_tensor_names()
        return [t for t in self._all if t.name not in derived]

    @property
    def stored_bytes(self) -> int:
        """Every tensor the file holds, the converter's rotary factors included."""
        return sum(t.nbytes for t in self._all)

    def metadata(self, key: str):
        if key in self._metadata:
            return self._metadata[key]
        return _field(self._gguf, key)

    def runnable(self):
        """This model as an f16 Hugging Face directory source, converted once into the cache."""
        if "_runnable" not in self.__dict__:
            self.__dict__["_runnable"] = converted_source(self.path, self)
        return self.__dict__["_runnable"]

    def fingerprint(self) -> str:
        """The converted directory's fingerprint: the model the stages run and maps record."""
        return self.runnable().fingerprint()

    def weights_sample(self) -> str:
        return self.runnable().weights_sample()

    def read(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        import gguf

        tensor = self._by_name[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise CardfitError(f"{self.path.name}: tensor {name} has type {tensor.tensor_type.name}, "
                               "which gguf-py cannot dequantize", "use an F16/BF16/Q8_0/K-quant GGUF") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
        return out if dtype is None else out.to(dtype)

    def materialize(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write an HF directory (config, tokenizer, safetensors) that transformers runs.

        transformers' GGUF loader undoes llama.cpp's converter transforms (Q/K rotary
        permutation, Gemma's norm offset), so the result computes what the GGUF computes.
        The directory appears whole or not at all; both callers keep it as a cache entry named by the
        file's content, so a whole one (its config written) another process finished first is kept.
        """
        from transformers import AutoModelForCausalLM, GgufConfig

        out_dir = Path(out_dir)
        with atomic_directory(out_dir, keep_whole=lambda made: _manifest_problem(made) is None) as tmp:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    str(self.path.parent), gguf_file=self.path.name, dtype=dtype,
                    config=copy.deepcopy(self._hf_config), quantization_config=GgufConfig(dequantize=True))
                if getattr(model, "hf_quantizer", None) is not None:
                    model = model.dequantize(dtype=dtype)
                model.save_pretrained(tmp, safe_serialization=True)
                del model
                load_tokenizer(str(self.path.parent), gguf_file=self.path.name).save_pretrained(tmp)
            except Exception as exc:  # transformers' GGUF support covers some architectures and tokenizers
                raise CardfitError(f"transformers cannot convert {self.path.name} to a model it runs "
                                   f"({exc.__class__.__name__}: {exc})",
                                   "use the original model directory (safetensors) instead of the GGUF") from None
            if self.metadata("tokenizer.ggml.pre") == "smollm":
                restore_pre_tokenizer(tmp)
            _write_manifest(tmp)  # last: a conversion without one is not whole
        return out_dir


# SmolLM's own pre-tokenizer (digits split one by one, then byte-level BPE), which its GGUF names
# `smollm`; transformers' GGUF loader rebuilds a plain byte-level one, which tokenizes digits differently.
SMOLLM_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}


def restore_pre_tokenizer(model_dir: Path) -> None:
    """Put SmolLM's own pre-tokenizer back into a conversion's tokenizer.json."""
    path = model_dir / "tokenizer.json"
    declared = json.loads(path.read_text(encoding="utf-8"))
    if declared.get("pre_tokenizer") != SMOLLM_PRE_TOKENIZER:
        declared["pre_tokenizer"] = SMOLLM_PRE_TOKENIZER
        write_json(path, declared)
