"""cardfit: make an open LLM fit a fixed memory ceiling with the least quality lost, and prove it.

Every CLI command is a stage module you can call with the same arguments as its command:
`cardfit.budget(...)`, `scan`, `plan`, `refine`, `pack`, `check`, `compare`, `fit` (each module is
callable as its own stage function, so `cardfit.scan` is the module and `cardfit.scan(...)` runs a scan);
plus `open_model`, `size_report` and `uniform_recipe` (a shelf preset as a recipe). Each is imported when
first named, so `import cardfit.plan` does not load torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
_STAGES = ("budget", "scan", "plan", "refine", "pack", "check", "compare", "fit")
_NAMES = {"Budget": "budget", "compute_budget": "budget", "CardfitError": "errors", "uniform_recipe": "plan",
          "size_report": "sizes", "open_model": "sources"}
__all__ = ["budget", "compute_budget", "Budget", "scan", "plan", "refine", "uniform_recipe", "pack", "check", "compare",
           "fit", "size_report", "open_model", "CardfitError", "__version__"]


def __getattr__(name: str):
    if name in _STAGES:
        return importlib.import_module(f".{name}", __name__)
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module 'cardfit' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
