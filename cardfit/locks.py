"""One run at a time per output: a second command writing the same map, directory or file is refused.

Two scans on one `--out` would each checkpoint over the other's work and both exit 0. Each command holds an
exclusive, non-blocking `flock` on a lock file named by its output's resolved path (and a shared one on each
directory above it), kept under
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
    from .cache import cache_root

    folder = cache_root() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (hashlib.sha256(str(place).encode()).hexdigest()[:32] + ".lock")


@contextmanager
def holding(outputs: dict[str, str | Path | None], command: str):
    """Hold every given output (flag -> path, None where not given) for the block, or refuse in one line naming
    the run that holds one. Each output's directories are held shared, so a run writing a directory (fit's,
    compare's) and a run writing anything inside it refuse each other too. Never waits: a lock held elsewhere
    is a refusal, so two runs never wait on each other."""
    places = sorted({resolved_output(path, flag): flag for flag, path in outputs.items() if path is not None}.items())
    held = {place for place, _ in places}
    with ExitStack() as stack:
        for place, flag in places:
            for folder in sorted(set(place.parents) - held - {Path(place.anchor)}):
                stack.enter_context(_shared(folder, place, flag))
            stack.enter_context(_held(place, flag, command))
        yield


@contextmanager
def _shared(folder: Path, place: Path, flag: str):
    """A shared hold on `folder` for an output inside it; refused while a run holds the folder itself."""
    with _flock(folder, fcntl.LOCK_SH, lambda holder: CardfitError(
            f"{flag} {place} lies inside {folder}, which {holder} is writing",
            f"wait for that run to finish, or give {flag} a path outside {folder}")):
        yield


@contextmanager
def _held(place: Path, flag: str, command: str):
    """The exclusive hold on an output; the lock file then names this run for a refused one's message."""
    with _flock(place, fcntl.LOCK_EX, lambda holder: CardfitError(
            f"{flag} {place} is being written by {holder} (or a run writing inside it)",
            f"wait for that run to finish, or give {flag} another path")) as handle:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} (cardfit {command})")
        handle.flush()
        yield


@contextmanager
def _flock(place: Path, mode: int, refusal):
    """`place`'s lock file held in `mode` without waiting, or `refusal(holder)` raised, the holder read from the
    file (the last exclusive holder's line); closing the file releases the lock."""
    handle = open(_lock_file(place), "a+", encoding="utf-8")
    try:
        try:
            fcntl.flock(handle.fileno(), mode | fcntl.LOCK_NB)
        except BlockingIOError:  # held whole by another run, or shared by runs writing inside it
            handle.seek(0)
            raise refusal(handle.read().strip() or "another cardfit run") from None
        yield handle
    finally:
        handle.close()
