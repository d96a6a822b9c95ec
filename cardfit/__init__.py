"""cardfit: make an open LLM fit a fixed memory ceiling with the least quality lost, and prove it.

Every CLI command is a plain function here: `budget`, `size_report`, `open_model`, ...
"""

from .budget import Budget, budget, compute_budget
from .errors import CardfitError
from .sizes import size_report
from .sources import open_model

__version__ = "0.1.0"
__all__ = ["budget", "compute_budget", "Budget", "size_report", "open_model", "CardfitError", "__version__"]
