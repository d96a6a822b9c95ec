"""An importance matrix in llama.cpp's own file format, so users can make one here and use it with
`llama-quantize --imatrix`, or bring one made by `llama-imatrix` to `cardfit pack --imatrix`.

The GGUF layout is the one llama.cpp's imatrix tool writes: `general.type = imatrix`, the keys
`imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`, and per weight matrix (by its
GGUF tensor name) `NAME.in_sum2` = the sum over tokens of each input column squared, shape
(1, n_per_row), and `NAME.counts` = the tokens summed, shape (1, 1). Statistics are collected on
the unquantized model, as llama.cpp does. The token embedding is a lookup, not a matmul, so it
has no entry; a tied output matrix is the embedding and has none either.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .errors import CardfitError
from .formats import Calibration
from .groups import LM_HEAD, GroupId
from .sources import ModelSource


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


def collect_imatrix(model: str | Path | None = None, calibration: str | Path | None = None, max_tokens: int = 8192,
                    seq_len: int = 512, out: str | Path = "imatrix.gguf", device: str = "auto",
                    progress: bool = True) -> dict:
    """Run the calibration text through the model one layer at a time and write llama.cpp's imatrix."""
    import gguf
    from transformers import AutoTokenizer

    from .atomic import atomic_path
    from .calibrate import LayerCalibration
    from .paths import guard_output, input_paths, model_paths
    from .sources import open_model, runnable
    from .text import load_text, token_chunks

    out = Path(out)
    if out.suffix != ".gguf":
        raise CardfitError(f"{out} does not end in .gguf", "cardfit writes llama.cpp's GGUF imatrix: --out imatrix.gguf")
    source = open_model(model)
    guard_output(out, {"the model": model_paths(source), "the calibration text": input_paths(calibration)})
    source = runnable(source)
    names = gguf_tensor_names(source)
    text, text_path = load_text(calibration)
    chunks = token_chunks(AutoTokenizer.from_pretrained(str(source.path)), text, seq_len, max_tokens,
                          source=str(text_path))
    tokens = int(chunks.numel())
    calib = LayerCalibration(source, chunks, "imatrix", device=device)
    sums: dict[str, np.ndarray] = {}
    layers = source.geometry.num_layers
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=layers, unit="layer", dynamic_ncols=True, disable=None)
    for index in range(layers):
        for hf_name, cal in calib.statistics(index).items():
            if hf_name in names and cal.imatrix is not None:
                sums[names[hf_name]] = (cal.imatrix.to(torch.float64) * tokens).numpy().astype(np.float32)
        calib.advance(index)
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    head = [t.name for t in source.tensors() if t.group == LM_HEAD and t.name in names]
    if head:
        cal = calib.head_statistics()
        sums[names[head[0]]] = (cal.imatrix.to(torch.float64) * tokens).numpy().astype(np.float32)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch="imatrix")
        writer.kv_data[0].pop("general.architecture", None)  # llama.cpp's imatrix files have none
        writer.add_type(gguf.GGUFType.IMATRIX)
        writer.add_array(gguf.Keys.IMatrix.DATASETS, [text_path.name])
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunks.shape[0]))
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunks.shape[1]))
        for name in sorted(sums):
            writer.add_tensor(f"{name}.in_sum2", sums[name].reshape(1, -1))
            writer.add_tensor(f"{name}.counts", np.array([[tokens]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return {"imatrix": str(out), "entries": len(sums), "tokens": tokens, "chunks": int(chunks.shape[0]),
            "chunk_size": int(chunks.shape[1]), "dataset": text_path.name}


class ImatrixFile:
    """A llama.cpp imatrix (GGUF) as pack's calibration: the same per-layer interface as LayerCalibration."""

    def __init__(self, path: str | Path, source: ModelSource):
        import gguf

        path = self.path = Path(path)
        try:
            reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError) as exc:
            raise CardfitError(f"{path} is not a readable GGUF imatrix ({exc})",
                               "make one with cardfit imatrix or llama-imatrix --output-format gguf") from None
        kind = reader.get_field("general.type")
        if kind is None or kind.contents() != "imatrix":
            raise CardfitError(f"{path} is a GGUF file but not an imatrix (general.type is not 'imatrix')",
                               "make one with cardfit imatrix or llama-imatrix --output-format gguf")
        tensors = {t.name: np.asarray(t.data, dtype=np.float64) for t in reader.tensors}
        self.means: dict[str, torch.Tensor] = {}
        shapes = {t.name: t.shape for t in source.tensors()}
        for hf_name, gguf_name in gguf_tensor_names(source).items():
            sums, counts = tensors.get(f"{gguf_name}.in_sum2"), tensors.get(f"{gguf_name}.counts")
            if sums is None or counts is None:
                continue  # llama.cpp quantizes such a tensor without one too
            sums = sums.reshape(-1)
            if sums.size != shapes[hf_name][-1]:
                raise CardfitError(f"{path}: {gguf_name} has {sums.size} columns, the model's has "
                                   f"{shapes[hf_name][-1]}", "use an imatrix made for this model")
            self.means[hf_name] = torch.from_numpy(sums / max(float(counts.reshape(-1)[0]), 1.0)).to(torch.float32)
        if not self.means:
            raise CardfitError(f"{path} has no entry for any tensor of this model", "use an imatrix made for this model")
        self._layer_of = {t.name: t.group for t in source.tensors()}

    def require(self, formats: dict, source: ModelSource) -> None:
        """Refuse, before anything is written, a file that lacks a tensor whose type cannot round without
        one (the embedding needs none: it is a lookup, weighed equally)."""
        from .formats.gguf_formats import IMATRIX_TYPES

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
