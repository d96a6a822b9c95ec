"""One run at a time per output: a second command writing the same map, directory or file is refused.

Two scans on one `--out` would each checkpoint over the other's work and both exit 0. Each command holds an
exclusive, non-blocking `flock` on a lock file named by its output's resolved path, kept under
`$CARDFIT_CACHE/locks` (never beside the user's files, so nothing is left there); the kernel releases it
when the process ends, however it ends. The file records who holds it, for the refusal's message.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .errors import CardfitError
from .paths import resolved_output


def _lock_file(place: Path) -> Path:
    from .default_model import cache_root

    folder = cache_root() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (hashlib.sha256(str(place).encode()).hexdigest()[:32] + ".lock")


@contextmanager
def holding(outputs: dict[str, str | Path | None], command: str):
    """Hold every given output (flag -> path, None where not given) for the block, or refuse in one line naming
    the run that holds one. Locks are taken in path order, so two runs never wait on each other."""
    places = sorted({resolved_output(path, flag): flag for flag, path in outputs.items() if path is not None}.items())
    with ExitStack() as stack:
        for place, flag in places:
            stack.enter_context(_held(place, flag, command))
        yield


@contextmanager
def _held(place: Path, flag: str, command: str):
    path = _lock_file(place)
    handle = open(path, "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another cardfit run"
            raise CardfitError(f"{flag} {place} is being written by {holder}",
                               f"wait for that run to finish, or give {flag} another path") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} (cardfit {command})")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock
