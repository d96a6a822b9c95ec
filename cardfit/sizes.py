"""Model bytes as stored and at each uniform format, from tensor shapes alone."""

from __future__ import annotations

from dataclasses import dataclass

from .formats import Format, get_format, runtime_formats
from .sources import LM_HEAD, ModelSource

UNIFORM_FORMATS = ("F16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ2_XXS", "IQ1_S", "W8A16", "W4A16-g128")


def priced_tensors(source: ModelSource):
    """Every tensor a packed artifact stores (a tied lm_head is the embedding, stored once)."""
    return [t for t in source.tensors() if not (t.group == LM_HEAD and source.tied_embeddings)]


def uniform_bytes(source: ModelSource, fmt: Format) -> int:
    return sum(fmt.tensor_bytes(t.name, t.shape) for t in priced_tensors(source))


def minimum_bytes(source: ModelSource, runtime: str) -> int:
    """The smallest any recipe for this runtime can be: each tensor at its cheapest format."""
    formats = runtime_formats(runtime)
    return sum(min(f.tensor_bytes(t.name, t.shape) for f in formats) for t in priced_tensors(source))


@dataclass
class SizeReport:
    stored_bytes: int
    uniform: dict[str, int]
    minimum: dict[str, int]
    parameters: int

    def to_dict(self) -> dict:
        return {"stored_bytes": self.stored_bytes, "parameters": self.parameters, "uniform_bytes": self.uniform,
                "minimum_bytes": self.minimum}


def size_report(source: ModelSource, formats: tuple[str, ...] = UNIFORM_FORMATS) -> SizeReport:
    from .targets import all_targets

    return SizeReport(
        stored_bytes=source.stored_bytes,
        uniform={name: uniform_bytes(source, get_format(name)) for name in formats},
        minimum={t.name: minimum_bytes(source, t.name) for t in all_targets(budget=True)},
        parameters=sum(t.numel for t in priced_tensors(source)),
    )
