"""The schemas of the JSON artifacts stages exchange: the sensitivity map and the recipe.

One declaration per artifact (docs/formats.md describes the same fields), checked by pydantic
when a stage reads the artifact, so a missing, mistyped or absurd field is one line naming it
instead of a KeyError minutes later. Unknown extra fields are kept (older and newer writers
add records such as `refinement`); the fields a stage reads are required and typed strictly.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, \
    field_validator, model_validator

from .errors import CardfitError

MAP_VERSION = 1
RECIPE_VERSION = 1
# JSON numbers past 2**53 are no longer exact integers; no real tensor comes near it (8 PiB).
MAX_BYTES = 2 ** 53
# Mean KL in nats per token: a destroyed model measures tens; beyond this it is not a measurement.
MAX_DAMAGE = 1e4
KL_METRIC = "mean KL(P_ref || P_q), nats per token"
# Any damage in any map's metric (the weight signal's squared activations run to 1e5 and more): finite
# and non-negative is all a cell or recipe can be held to before its map's metric is known.
MAX_SIGNAL = 1e30

ByteCount = Annotated[StrictInt, Field(ge=0, le=MAX_BYTES)]
Positive = Annotated[StrictInt, Field(ge=1, le=MAX_BYTES)]
Name = Annotated[StrictStr, Field(min_length=1, max_length=4096)]


def _finite(value, low: float, high: float, what: str):
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number")
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{what} {value!r} is outside [{low:g}, {high:g}]")
    return float(value) if isinstance(value, float) else value


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ModelHeader(_Record):
    """Which model a map was measured on: plan and pack refuse any other."""

    fingerprint: Annotated[StrictStr, Field(pattern=r"^sha256:[0-9a-f]{64}$")]
    weights: Annotated[StrictStr, Field(pattern=r"^sha256:[0-9a-f]{64}$")] | None = None  # absent before 2026-12
    model_type: Name
    name: StrictStr
    tied_embeddings: StrictBool
    num_layers: Positive


class CalibrationHeader(_Record):
    sha256: StrictStr
    source: StrictStr
    tokens: Positive
    seq_len: Positive
    chunks: Positive


class DamageHeader(_Record):
    metric: StrictStr
    method: StrictStr


class Cell(_Record):
    damage: float
    stderr: Optional[float] = None
    top1: Optional[float] = None

    @field_validator("damage", mode="before")
    @classmethod
    def _damage(cls, v):
        if v is None:
            raise ValueError("damage is missing")
        return _finite(v, 0.0, MAX_SIGNAL, "damage")

    @field_validator("stderr", mode="before")
    @classmethod
    def _stderr(cls, v):
        return _finite(v, 0.0, MAX_SIGNAL, "stderr")

    @field_validator("top1", mode="before")
    @classmethod
    def _top1(cls, v):
        return _finite(v, 0.0, 1.0, "top1")


class MapGroup(_Record):
    name: Name
    tensors: list[StrictStr]
    bytes: dict[StrictStr, ByteCount]
    storage: Optional[dict[StrictStr, list[StrictStr]]] = None
    cells: dict[StrictStr, Cell]


class SensitivityMap(_Record):
    """`cardfit scan`'s output (`cardfit_map: 1`)."""

    cardfit_map: Literal[1]
    model: ModelHeader
    calibration: CalibrationHeader
    damage: DamageHeader
    rounding: Literal["rtn", "imatrix", "gptq", "awq"]
    compute: Literal["float32", "bfloat16-differences", "bfloat16", "float16"] = "float32"  # engine.DTYPES less auto
    group_by: Literal["layer", "tensor"]
    runtime: StrictStr
    formats: Annotated[list[Name], Field(min_length=1, max_length=256)]
    reference: dict = {}
    groups: Annotated[list[MapGroup], Field(min_length=1)]
    complete: StrictBool = False
    separable_fraction: Optional[float] = None
    warnings: list[StrictStr] = []

    @model_validator(mode="after")
    def _consistent(self):
        from .formats import get_format

        _family(self.runtime)
        if len(set(self.formats)) != len(self.formats):
            raise ValueError("formats lists a format twice")
        for name in self.formats:
            get_format(name)  # an unknown format is its own one-line error with the known list
        seen = set()
        for g in self.groups:
            if g.name in seen:
                raise ValueError(f"group {g.name} appears twice")
            seen.add(g.name)
            for f in self.formats:
                if f not in g.bytes:
                    raise ValueError(f"group {g.name} has no bytes for {f}")
            for f, cell in g.cells.items():
                if f not in self.formats:
                    raise ValueError(f"group {g.name} has a cell for unknown format {f!r}")
                if self.damage.metric == KL_METRIC and cell.damage > MAX_DAMAGE:
                    raise ValueError(f"group {g.name}'s {f} damage {cell.damage!r} is outside [0, {MAX_DAMAGE:g}] "
                                     "nats: not a KL measurement")
        return self


class RecipeGroup(_Record):
    name: Name
    format: Name
    bytes: ByteCount
    damage: Optional[float] = None
    largest_bytes: Optional[ByteCount] = None
    stored_as: Optional[list[StrictStr]] = None  # the storage types its tensors really get (F32 for norms)

    @field_validator("damage", mode="before")
    @classmethod
    def _damage(cls, v):
        return _finite(v, 0.0, MAX_SIGNAL, "damage")


class MapReference(_Record):
    sha256: Optional[StrictStr] = None
    model: ModelHeader
    calibration: Optional[CalibrationHeader] = None
    rounding: Literal["rtn", "imatrix", "gptq", "awq"]


class RecipeBudget(_Record):
    weight_budget_bytes: Annotated[StrictInt, Field(ge=1, le=MAX_BYTES)]


class Recipe(_Record):
    """`cardfit plan`'s output (`cardfit_recipe: 1`); `source: uniform` marks a shelf preset (no damages)."""

    cardfit_recipe: Literal[1]
    source: Optional[Literal["uniform"]] = None
    map: MapReference
    runtime: StrictStr
    served_by: Optional[StrictStr] = None
    budget: RecipeBudget
    constraints: Optional[dict] = None  # the formats, pins and floors it was planned under
    solver: Optional[dict] = None  # how the optimum was found and proven (null for a shelf preset)
    refinement: Optional[dict] = None  # cardfit refine's record, when the recipe was refined
    predicted_damage: Optional[float] = None
    bytes: ByteCount
    reserved_bytes: ByteCount = 0
    margin_bytes: Optional[Annotated[StrictInt, Field(ge=-MAX_BYTES, le=MAX_BYTES)]] = None
    uniform_bytes: dict[StrictStr, ByteCount] = {}
    groups: Annotated[list[RecipeGroup], Field(min_length=1)]

    @field_validator("predicted_damage", mode="before")
    @classmethod
    def _predicted(cls, v):
        return _finite(v, 0.0, MAX_SIGNAL, "predicted_damage")

    @model_validator(mode="after")
    def _consistent(self):
        from .formats import get_format
        from .targets import get_target

        _family(self.runtime)
        if self.served_by is not None:
            if self.served_by not in _target_names():
                raise ValueError(f"served_by {self.served_by!r} is not a runtime cardfit knows ({', '.join(_target_names())})")
            if get_target(self.served_by).family != self.runtime:
                raise ValueError(f"served_by {self.served_by} does not load {self.runtime} files")
        seen = set()
        for g in self.groups:
            if g.name in seen:
                raise ValueError(f"group {g.name} appears twice")
            seen.add(g.name)
            fmt = get_format(g.format)
            if fmt.runtime != self.runtime:
                raise ValueError(f"group {g.name} has format {g.format}, which {self.runtime} does not load")
        if self.source != "uniform":
            if self.predicted_damage is None:
                raise ValueError("predicted_damage is missing")
            for g in self.groups:
                if g.damage is None:
                    raise ValueError(f"group {g.name} has no damage")
        total = sum(g.bytes for g in self.groups)
        if total != self.bytes:
            raise ValueError(f"bytes {self.bytes} is not the sum of its groups' bytes ({total})")
        return self


def content_hash(artifact: dict) -> str:
    """The one hash of a map or recipe: sha256 of its canonical JSON (sorted keys). A recipe records its
    map's; fit and compare record the recipe an artifact was packed from."""
    import hashlib
    import json

    return "sha256:" + hashlib.sha256(json.dumps(artifact, sort_keys=True).encode()).hexdigest()


def model_header(source) -> dict:
    """What maps and recipes say about the model they belong to (the one place this header is made)."""
    return {"fingerprint": source.fingerprint(), "weights": source.weights_sample(),
            "model_type": source.geometry.model_type,
            "name": source.path.name, "tied_embeddings": source.tied_embeddings,
            "num_layers": source.geometry.num_layers}


def same_model(recorded: dict, header: dict) -> bool:
    """Whether a model header an artifact recorded names the model `header` describes: every key equal, the
    weights sample compared only where both have one (maps and recipes made before it was recorded)."""
    unsampled = None in (recorded.get("weights"), header.get("weights"))
    return all(recorded.get(k) == header.get(k) for k in set(recorded) | set(header)
               if not (unsampled and k == "weights"))


def _target_names() -> list[str]:
    from .targets import names

    return names()


def _family(runtime: str) -> None:
    """A map or recipe's runtime is the family of files some packing target writes (cardfit.targets)."""
    from .targets import all_targets

    families = sorted({t.family for t in all_targets(packs=True)})
    if runtime not in families:
        raise ValueError(f"runtime {runtime!r} is not one cardfit packs for ({', '.join(families)})")


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in ("function-after", "function-before") and not str(part).startswith(("function-", "json-")):
            out += f".{part}" if out else str(part)
    return out


def validate(model: type[BaseModel], data, where: str, fix: str) -> None:
    """Check `data` against `model`; the first problem becomes one CardfitError line naming the field."""
    if not isinstance(data, dict):
        raise CardfitError(f"{where}: holds {type(data).__name__}, not a JSON object", fix)
    try:
        model.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = _where(error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "missing":
            problem = f"{field} is missing"
        elif error["type"] == "literal_error" and field in ("cardfit_map", "cardfit_recipe"):
            problem = f"not a cardfit {'sensitivity map' if field == 'cardfit_map' else 'recipe'} (version 1)"
        else:
            shown = repr(error.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            problem = f"{field + ': ' if field else ''}{message}" + (f" (got {shown})" if "input" in error and
                                                                     error["type"] != "value_error" else "")
        raise CardfitError(f"{where}: {problem}", fix) from None
