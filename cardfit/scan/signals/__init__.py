"""The cheap signals a scan prices cells by, one module each: the registry is the one list of them that
`scan --method/--signal`, `fit --scan-method`, the CLI's help and the adaptive scan read."""

from __future__ import annotations

from .base import Done, PricingJob, Signal
from .fisher import FisherSignal
from .magnitude import MagnitudeSignal
from .weight import WeightSignal

SIGNALS: dict[str, Signal] = {s.name: s for s in (
    FisherSignal(),
    WeightSignal(),
    MagnitudeSignal(),
)}


def signal_of_map(data: dict) -> Signal | None:
    """The signal a map's cells were all priced by (the first word of its damage.method), or None (exact,
    adaptive, or not a map)."""
    method = data.get("damage", {}).get("method") if isinstance(data, dict) and isinstance(data.get("damage"), dict) else None
    return SIGNALS.get(method.split(" ", 1)[0]) if isinstance(method, str) and method else None


def adaptive_signal(data: dict) -> str | None:
    """The signal an adaptive map's unmeasured cells were priced by (a map written before the key was recorded:
    the weight signal, the only one then), or None for a map that is not adaptive."""
    adaptive = data.get("adaptive") if isinstance(data, dict) else None
    if not isinstance(adaptive, dict) or not adaptive:
        return None
    signal = adaptive.get("signal", "weight")
    return signal if isinstance(signal, str) else None


def default_signal(formats: list, rounding: str) -> Signal:
    """What prices an adaptive scan's unmeasured cells when none is asked: the first registered that prices them."""
    return next(s for s in SIGNALS.values() if s.prices(formats, rounding))


def help_text() -> str:
    """Every signal's name and help, for the CLI's."""
    return "; ".join(f"{s.name} ({s.help})" for s in SIGNALS.values())


__all__ = ["SIGNALS", "Signal", "PricingJob", "Done", "signal_of_map", "adaptive_signal", "default_signal",
           "help_text"]
