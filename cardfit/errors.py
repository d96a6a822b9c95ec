"""The one exception type a user ever sees.

Anything the user can fix (bad path, bad units, a model we cannot read) is raised as
`CardfitError`; the CLI prints its single line and exits 2. Everything else is a bug
and keeps its traceback.
"""


class CardfitError(Exception):
    """A problem with the user's input, stated as `problem — fix`."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(problem if not fix else f"{problem} — {fix}")
