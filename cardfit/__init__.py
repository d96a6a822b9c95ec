"""cardfit: make an open LLM fit a fixed memory ceiling with the least quality lost, and prove it.

Every CLI command is a stage module you can call with the same arguments as its command:
`cardfit.budget(...)`, `scan`, `plan`, `refine`, `pack`, `check`, `compare`, `fit` (each module is
callable as its own stage function, so `cardfit.scan` is the module and `cardfit.scan(...)` runs a scan);
plus `open_model`, `size_report` and `uniform_recipe` (a shelf preset as a recipe).
"""

from . import budget, check, compare, fit, pack, plan, refine, scan
from .budget import Budget, compute_budget
from .errors import CardfitError
from .plan import uniform_recipe
from .sizes import size_report
from .sources import open_model

__version__ = "0.1.0"
__all__ = ["budget", "compute_budget", "Budget", "scan", "plan", "refine", "uniform_recipe", "pack", "check", "compare",
           "fit", "size_report", "open_model", "CardfitError", "__version__"]
