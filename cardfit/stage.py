"""A pipeline stage is a module you can call: `cardfit.scan(...)` runs the stage, `cardfit.scan.map_header`
is still the module's, and `import cardfit.scan` never finds a function where a module should be."""

from __future__ import annotations

import sys
import types


class StageModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return getattr(self, self.__name__.rsplit(".", 1)[1])(*args, **kwargs)


def callable_stage(module_name: str) -> None:
    """Make the module `module_name` callable as its own same-named function (cardfit.fit -> fit.fit)."""
    sys.modules[module_name].__class__ = StageModule
