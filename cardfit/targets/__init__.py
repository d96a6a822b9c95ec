"""The runtime targets: one module each, one registry line each.

A target module defines `TARGET` (or `TARGETS`); listing it in `MODULES` is all it takes for
budget, plan, pack, check and fit to offer it (tests/test_targets.py holds that)."""

from __future__ import annotations

import importlib

from ..errors import CardfitError
from .base import OverheadSettings, Target

MODULES = ("llama_cpp", "vllm", "transformers", "bitsandbytes", "ollama")

TARGETS: dict[str, Target] = {}


def register(target: Target) -> Target:
    if target.name in TARGETS and TARGETS[target.name] is not target:
        raise ValueError(f"two targets are named {target.name}")
    TARGETS[target.name] = target
    return target


def _load() -> None:
    for name in MODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        for target in getattr(module, "TARGETS", ()) or (module.TARGET,):
            register(target)


def get_target(name: str) -> Target:
    if not TARGETS:
        _load()
    if name not in TARGETS:
        raise CardfitError(f"unknown runtime '{name}'", "use --runtime " + ", ".join(TARGETS))
    return TARGETS[name]


def all_targets(**having) -> list[Target]:
    """Every target, or those whose attributes are set (`budget=True`: has an overhead model, `packs=True`:
    has a file to write, `loads=True`: check can run it)."""
    if not TARGETS:
        _load()
    tests = {"budget": lambda t: t.overhead_terms is not None, "packs": lambda t: t.artifact is not None,
             "loads": lambda t: t.load is not None}
    return [t for t in TARGETS.values() if all(tests[k](t) == v for k, v in having.items())]


def for_artifact(kind: str) -> Target:
    """The runtime a kind of file is first made for (gguf: llama.cpp, compressed-tensors: vLLM): the target
    that names its own family."""
    for target in all_targets(packs=True):
        if target.artifact == kind and target.name == target.family:
            return target
    kinds = sorted({t.artifact for t in all_targets(packs=True)})
    raise CardfitError(f"unknown --format '{kind}'", "use --format " + " or --format ".join(kinds))


def default_reader(kind: str) -> Target:
    """The target `check` runs a kind of file in when no --runtime is given."""
    return next(t for t in all_targets(loads=True) if t.reads_by_default == kind)


def names(**having) -> list[str]:
    return [t.name for t in all_targets(**having)]


__all__ = ["Target", "OverheadSettings", "TARGETS", "MODULES", "register", "get_target", "all_targets", "for_artifact",
           "names"]
