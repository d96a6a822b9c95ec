"""What a sensitivity signal is: a cheap price for every (group, format) cell of a map, without running the
model once per cell. Each signal is one module with one `Signal` subclass, registered in signals/__init__."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

# done(group index, {format name: price}) as each group's cells are final
Done = Callable[[int, dict[str, float]], None]


@dataclass
class PricingJob:
    """Everything a signal may read: the opened model, its calibration tokens and groups, how the cells round,
    where to run, and the importance-matrix record to fill on the way (`record`, written to `imatrix_out`)."""

    source: object
    chunks: torch.Tensor
    groups: list
    rounding: str
    device: str
    batch: int
    dtype: str
    gpu_memory: int | None
    log: Callable[[str], None] | None = None
    record: object | None = None
    imatrix_out: str | Path | None = None

    def keep_imatrix(self) -> None:
        """Write the importance matrix a pricing walk recorded, if it walked the whole model."""
        if self.record is not None and self.record.whole():
            self.record.write(Path(self.imatrix_out))


class Signal:
    """A signal: `name` is its word for `scan --method`, `--signal` and `fit --scan-method`, `help` what the
    CLI says of it; `description` the map's damage.method (its first word the name); `metric` the map's
    damage.metric; `mark` what a cell it priced carries as `method` in a map of its own (None: nothing)."""

    name: str
    help: str
    description: str
    metric: str
    mark: str | None = None

    def prices(self, formats: list, rounding: str) -> bool:
        """Whether it prices every one of `formats` under `rounding`."""
        raise NotImplementedError

    def refusal(self, formats: list, rounding: str) -> str:
        """Why it does not price `formats` under `rounding` (the first half of the one-line error)."""
        return f"the {self.name} signal does not price {rounding} rounding"

    def price(self, job: PricingJob, todo: list, done: Done) -> None:
        """Price every to-do cell (group index, Group, Format), calling `done` as each group's are final."""
        raise NotImplementedError
