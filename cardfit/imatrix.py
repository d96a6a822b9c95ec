"""An importance matrix in llama.cpp's own file format, so users can make one here and use it with
`llama-quantize --imatrix`, or bring one made by `llama-imatrix` to `cardfit pack --imatrix`.

The GGUF layout is the one llama.cpp's imatrix tool writes: `general.type = imatrix`, the keys
`imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`, and per weight matrix (by its
GGUF tensor name) `NAME.in_sum2` = the sum over tokens of each input column squared, shape
(1, n_per_row), and `NAME.counts` = the tokens summed, shape (1, 1). A routed experts' stack
(`ffn_up_exps`) has one row per expert, (n_expert, n_per_row) and (n_expert, 1): each expert's sums
over the tokens routed to it, 0 and 0 for an expert no token reached (llama-quantize then weighs its
columns equally; so does cardfit). Statistics are collected on the unquantized model, as llama.cpp
does. The token embedding is a lookup, not a matmul, so it has no entry; a tied output matrix is the
embedding and has none either.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from .errors import CardfitError
from .formats import Calibration
from .groups import LM_HEAD, GroupId, expert_stack
from .sources import ModelSource


JOB_KEY = "cardfit.made_for"  # job_key of the model and calibration tokens it was made from; llama.cpp ignores it


def job_key(model: dict, calibration: dict) -> str:
    """What an imatrix cardfit writes records of its making: a hash of the model and calibration headers a map
    records (schemas.model_header, text.calibration_header), so it belongs to exactly the maps of that job."""
    from .schemas import content_hash

    return content_hash({"model": model, "calibration": calibration})


def gguf_tensor_names(source: ModelSource) -> dict[str, str]:
    """HF tensor name -> llama.cpp's name, for the matrices llama.cpp multiplies by."""
    from .pack.gguf_arch import ArchSpec

    spec = ArchSpec.for_config(source.config)
    names = {}
    for t in source.tensors():
        if len(t.shape) == 2 and not t.name.endswith("embed_tokens.weight"):
            if t.group == LM_HEAD and source.tied_embeddings:
                continue
            names[t.name] = spec.tensor_name(t.name)
    return names


class ImatrixRecord:
    """llama.cpp's imatrix entries gathered from any walk of the unquantized model that collects "imatrix"
    statistics (`cardfit imatrix`'s own walk, or the weight signal's, so a scan's pricing pass leaves the file
    pack then rounds with: one forward, not two). `job`: job_key of what the walk ran."""

    def __init__(self, source: ModelSource, chunks: torch.Tensor, dataset: str, job: str):
        self.names = gguf_tensor_names(source)
        self.head = next((t.name for t in source.tensors() if t.group == LM_HEAD and t.name in self.names), None)
        self.chunks, self.dataset, self.job = chunks, dataset, job
        self.rows: dict[str, dict[int, tuple[np.ndarray, int]]] = {}  # GGUF name -> row (expert, or 0) -> sums, count

    def layer(self, statistics: dict[str, Calibration]) -> None:
        """Take one decoder layer's statistics (LayerCalibration.statistics)."""
        for hf_name, cal in statistics.items():
            if hf_name in self.names and cal.imatrix is not None:
                stack = expert_stack(hf_name)
                sums = (cal.imatrix.to(torch.float64) * cal.tokens).numpy().astype(np.float32)
                self.rows.setdefault(self.names[hf_name], {})[stack[1] if stack else 0] = (sums, cal.tokens)

    def output(self, cal: Calibration) -> None:
        """Take the untied output matrix's statistics (LayerCalibration.head_statistics)."""
        if self.head is not None:
            tokens = int(self.chunks.numel())
            self.rows[self.names[self.head]] = {0: ((cal.imatrix.to(torch.float64) * tokens).numpy().astype(np.float32),
                                                    tokens)}

    def whole(self) -> bool:
        """Every matrix llama.cpp multiplies by has its entry (a walk that stopped early has not)."""
        return set(self.names.values()) <= set(self.rows)

    def write(self, out: Path) -> int:
        """Write the entries taken so far to `out` atomically as llama.cpp's GGUF imatrix (whole() says whether
        they cover the model); returns how many. An expert stack with a row missing is a bug of ours."""
        import gguf

        from .atomic import atomic_path

        with atomic_path(out) as tmp:
            writer = gguf.GGUFWriter(str(tmp), arch="imatrix")
            writer.kv_data[0].pop("general.architecture", None)  # llama.cpp's imatrix files have none
            writer.add_type(gguf.GGUFType.IMATRIX)
            writer.add_array(gguf.Keys.IMatrix.DATASETS, [self.dataset])
            writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(self.chunks.shape[0]))
            writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(self.chunks.shape[1]))
            writer.add_string(JOB_KEY, self.job)
            for name in sorted(self.rows):
                order = sorted(self.rows[name])
                if order != list(range(len(order))):
                    raise RuntimeError(f"{name}: statistics for rows {order}, not every expert")
                writer.add_tensor(f"{name}.in_sum2", np.stack([self.rows[name][r][0] for r in order]))
                writer.add_tensor(f"{name}.counts",
                                  np.array([[self.rows[name][r][1]] for r in order], dtype=np.float32))
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
        return len(self.rows)


def collect_imatrix(model: str | Path | None = None, calibration: str | Path | None = None, max_tokens: int = 8192,
                    seq_len: int = 512, out: str | Path = "imatrix.gguf", device: str = "auto",
                    progress: bool = True, log=None, batch: int = 4, dtype: str = "auto",
                    gpu_memory: int | None = None) -> dict:
    """Run the calibration text through the model one layer at a time and write llama.cpp's imatrix; `log`
    hears what it will do and, once the first layer is done, how long the rest should take."""
    from .engine.calibrate import LayerCalibration
    from .paths import guard_output, input_paths, model_paths
    from .schemas import model_header
    from .sources import open_model, runnable
    from .text import calibration_header, load_text, load_tokenizer, token_chunks

    out = Path(out)
    refuse_output(out, "--out")
    source = open_model(model)
    guard_output(out, {"the model": model_paths(source), "the calibration text": input_paths(calibration)})
    source = runnable(source)
    text, text_path = load_text(calibration)
    chunks = token_chunks(load_tokenizer(str(source.path)), text, seq_len, max_tokens,
                          source=str(text_path), rows=source.embedding_rows())
    tokens = int(chunks.numel())
    calib = LayerCalibration(source, chunks, "imatrix", device=device, batch=batch, dtype=dtype, gpu_memory=gpu_memory)
    job = job_key(model_header(source), calibration_header(text, text_path, chunks))
    record = ImatrixRecord(source, chunks, text_path.name, job)
    layers = source.geometry.num_layers
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=layers, unit="layer", dynamic_ncols=True, disable=None)
    if log:
        log(f"imatrix: {tokens} tokens ({chunks.shape[0]} chunks of {chunks.shape[1]}) through {layers} layers")
    began = time.perf_counter()
    for index in range(layers):
        record.layer(calib.statistics(index))
        calib.advance(index)
        if log and index == 0 and layers > 1:
            first = time.perf_counter() - began
            log(f"the first layer took {first:.1f} s: at most about {_duration(first * (layers - 1))} for the "
                f"other {layers - 1} layers (the first also paid for the embedding and warm-up)")
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    if record.head is not None:
        record.output(calib.head_statistics())
    entries = record.write(out)
    return {"imatrix": str(out), "entries": entries, "tokens": tokens, "unvisited": calib.unvisited,
            "chunks": int(chunks.shape[0]), "chunk_size": int(chunks.shape[1]), "dataset": text_path.name}


def made_from(path: Path, job: str) -> bool:
    """Whether `path` holds an imatrix cardfit wrote for `job` (job_key) with sound values (unsound_entry);
    False for anything else, unreadable or missing included (so a damaged one is made again). Whether its
    entries fit the model, ImatrixFile checks where it is read."""
    reader = _cardfit_imatrix(path)
    if reader is None or str(reader.get_field(JOB_KEY).contents()) != job:
        return False
    return unsound_entry({t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}) is None


def unsound_entry(tensors: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """(name, "negative" or "non-finite") of the first entry no imatrix can hold (sums of squares and counts are
    finite and never negative), or None."""
    for name, values in tensors.items():
        if not np.isfinite(values).all():
            return name, "non-finite"
        if (values < 0).any():
            return name, "negative"
    return None


def refuse_output(path: Path, flag: str, replaces: bool = True) -> None:
    """Refuse, before work, an imatrix output that is not a .gguf name, or (`replaces` False: an output a scan
    may leave alone or replace as it sees fit) one that holds anything but an imatrix a cardfit scan wrote, so a
    user's own llama-imatrix file is never replaced unasked."""
    if Path(path).suffix != ".gguf":
        raise CardfitError(f"{path} does not end in .gguf", f"cardfit writes llama.cpp's GGUF imatrix: {flag} imatrix.gguf")
    if not replaces and Path(path).is_file() and made_for(Path(path)) is None:
        raise CardfitError(f"{flag} {path} holds a file that is not the imatrix of a cardfit scan",
                           f"choose another {flag}, or remove the file (the scan makes it again)")


def made_for(path: Path) -> str | None:
    """The job_key an imatrix cardfit wrote at `path` records, else None (no file, unreadable, not cardfit's)."""
    reader = _cardfit_imatrix(path)
    return None if reader is None else str(reader.get_field(JOB_KEY).contents())


def _cardfit_imatrix(path: Path):
    """gguf-py's reader of a readable GGUF at `path` that records JOB_KEY, else None."""
    from .sources.gguf_file import read_gguf

    if not Path(path).is_file():
        return None
    try:
        reader = read_gguf(path, "GGUF imatrix", "")
        return reader if reader.get_field(JOB_KEY) is not None else None
    except (CardfitError, OSError, ValueError):
        return None


def _refuse_other_depth(path: Path, tensors: dict, names: dict[str, str], layers: int) -> None:
    """Refuse an imatrix made for a model of another depth: entries for decoder layers this model does not
    have, or none for a layer it has while others have theirs (it would round that layer without one,
    silently). Entries outside the decoder layers (a tied output's token_embd) are llama.cpp's own affair."""
    import re

    def layer(name: str) -> int | None:
        found = re.match(r"blk\.(\d+)\.", name)
        return int(found.group(1)) if found else None

    have = {layer(n) for n in tensors if n.endswith(".in_sum2")} - {None}
    beyond = sorted(n for n in have if n >= layers)
    wanted = {layer(n) for n in names.values()} - {None}
    missing = sorted(wanted - have) if have else []
    if beyond or missing:
        what = (f"entries for layer {beyond[0]}, and this model has {layers} layers" if beyond else
                f"no entry for layer {missing[0]} of this model's {layers}, while other layers have theirs")
        raise CardfitError(f"{path} has {what}: it was made for another model",
                           "use an imatrix made for this model (cardfit imatrix MODEL)")


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


class ImatrixFile:
    """A llama.cpp imatrix (GGUF) as pack's calibration: the same per-layer interface as LayerCalibration."""

    def __init__(self, path: str | Path, source: ModelSource):
        from .sources.gguf_file import read_gguf

        path = self.path = Path(path)
        if not path.is_file():
            raise CardfitError(f"no imatrix file at {path}", "check the path, or make one with cardfit imatrix")
        reader = read_gguf(path, "GGUF imatrix", "make one with cardfit imatrix or llama-imatrix --output-format gguf")
        kind = reader.get_field("general.type")
        if kind is None or kind.contents() != "imatrix":
            raise CardfitError(f"{path} is a GGUF file but not an imatrix (general.type is not 'imatrix')",
                               "make one with cardfit imatrix or llama-imatrix --output-format gguf")
        tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
        unsound = unsound_entry(tensors)
        if unsound is not None:
            raise CardfitError(f"{path}: {unsound[0]} holds {unsound[1]} values (sums of squares and counts are finite "
                               "and never negative)", "make the imatrix again with cardfit imatrix")
        _refuse_other_depth(path, tensors, gguf_tensor_names(source), source.geometry.num_layers)
        self.means: dict[str, torch.Tensor] = {}
        self.unvisited: list[str] = []  # routed experts' matrices the file has no token for
        shapes = {t.name: t.shape for t in source.tensors()}
        for hf_name, gguf_name in gguf_tensor_names(source).items():
            sums, counts = tensors.get(f"{gguf_name}.in_sum2"), tensors.get(f"{gguf_name}.counts")
            if sums is None or counts is None:
                continue  # llama.cpp quantizes such a tensor without one too
            columns, stack = shapes[hf_name][-1], expert_stack(hf_name)
            counts = counts.reshape(-1)
            if sums.size % columns or (sums.size // columns != counts.size and counts.size != 1):
                raise CardfitError(f"{path}: {gguf_name} has {sums.size} values and {counts.size} counts, the model's "
                                   f"rows are {columns} wide", "use an imatrix made for this model")
            sums = sums.reshape(-1, columns)
            row = stack[1] if stack else 0
            if row >= sums.shape[0] or (stack is None and sums.shape[0] != 1):
                raise CardfitError(f"{path}: {gguf_name} has {sums.shape[0]} rows of statistics, the model's "
                                   f"{hf_name} needs {'expert ' + str(row) if stack else 'one'}",
                                   "use an imatrix made for this model")
            count = float(counts[row if counts.size > 1 else 0])
            if count > 0:
                self.means[hf_name] = torch.from_numpy(sums[row] / count).to(torch.float32)
            else:  # no token reached it (an expert the router never chose): llama-quantize weighs columns equally
                self.means[hf_name] = torch.ones(columns)
                self.unvisited += [hf_name] if stack else []
        if not self.means:
            raise CardfitError(f"{path} has no entry for any tensor of this model", "use an imatrix made for this model")
        self._layer_of = {t.name: t.group for t in source.tensors()}

    def require(self, formats: dict, source: ModelSource) -> None:
        """Refuse, before anything is written, a file that lacks a tensor whose type cannot round without
        one (the embedding needs none: it is a lookup, weighed equally)."""
        from .formats.ggml_types import IMATRIX_TYPES

        shapes = {t.name: t.shape for t in source.tensors()}
        matrices = gguf_tensor_names(source)
        for name, fmt in formats.items():
            storage = fmt.storage(name, shapes[name])
            if storage in IMATRIX_TYPES and name not in self.means and name in matrices:
                raise CardfitError(f"{self.path} has no entry for {matrices[name]}, which the "
                                   f"recipe stores as {storage} (a type that quantizes only with one)",
                                   "use an imatrix made over this whole model, or leave --imatrix out and pack collects one")

    def statistics(self, index: int) -> dict[str, Calibration]:
        group = GroupId.layer_group(index)
        return {n: Calibration(imatrix=m) for n, m in self.means.items() if self._layer_of[n] == group}

    def advance(self, index: int, overrides=None) -> None:
        """Nothing to run: the statistics are already in the file."""

    def head_statistics(self) -> Calibration:
        head = [m for n, m in self.means.items() if self._layer_of[n] == LM_HEAD]
        return Calibration(imatrix=head[0] if head else None)
