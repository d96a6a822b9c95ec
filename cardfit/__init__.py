"""cardfit: make an open LLM fit a fixed memory ceiling with the least quality lost, and prove it.

Every CLI command is a plain function here, taking the same arguments as its command:
`budget`, `scan`, `plan`, `refine`, `pack`, `check`, `compare`, `fit`; plus `open_model`, `size_report` and
`uniform_recipe` (a shelf preset as a recipe). The stage modules share these names, so reach a
module itself through `importlib.import_module("cardfit.scan")` or `from cardfit.scan import ...`.
"""

from .budget import Budget, budget, compute_budget
from .check import check
from .compare import compare
from .errors import CardfitError
from .fit import fit
from .pack import pack
from .plan import plan, uniform_recipe
from .refine import refine
from .scan import scan
from .sizes import size_report
from .sources import open_model

__version__ = "0.1.0"
__all__ = ["budget", "compute_budget", "Budget", "scan", "plan", "refine", "uniform_recipe", "pack", "check", "compare",
           "fit",
           "size_report", "open_model", "CardfitError", "__version__"]
