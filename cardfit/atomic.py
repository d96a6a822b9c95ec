"""Write-to-temp-then-rename, so an interrupted run never leaves a half-written output."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from .errors import CardfitError


def _check_parent(path: Path) -> None:
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CardfitError(f"cannot create directory {parent} ({exc.strerror})", "choose a writable --out") from None
    if not os.access(parent, os.W_OK):
        raise CardfitError(f"cannot write to {parent}", "choose a writable --out")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary file path beside `path`; rename over it only on success."""
    with atomic_paths(path) as (tmp,):
        yield tmp


@contextlib.contextmanager
def atomic_paths(*paths: str | Path | None):
    """Several outputs of one command as one: temporary paths beside each (None stays None), all renamed
    into place only once every one is written, so a failure part-way leaves none of them."""
    targets = [None if p is None else Path(p) for p in paths]
    temps: list[Path | None] = []
    try:
        for path in targets:
            if path is None:
                temps.append(None)
                continue
            _check_parent(path)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
            os.close(fd)
            temps.append(Path(tmp))
        yield temps
        for tmp, path in zip(temps, targets):
            if tmp is not None:
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; outputs are ordinary files
                os.replace(tmp, path)
    except BaseException:
        for tmp in temps:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path, keep_whole: Callable[[Path], bool] | None = None):
    """Yield a temporary directory beside `path`; it becomes `path` only on success. `keep_whole`: `path`
    is a cache entry named by its content, so one another process finished first, and that keep_whole
    says is whole, is kept and ours dropped; replacing it would pull files from under a process reading
    them (two scans started together on one GGUF). An entry that is not whole is replaced."""
    path = Path(path)
    _check_parent(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent))

    def theirs_kept() -> bool:
        return keep_whole is not None and path.is_dir() and keep_whole(path)

    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if theirs_kept():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if path.exists():
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError:  # another process renamed its copy into place between the check and here
            if not theirs_kept():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | Path, obj) -> None:
    """`obj` as JSON at `path`, atomically; a NaN or an infinity is never written (a map, recipe or report
    holding one was computed from inputs that disagree): refused naming where it is."""
    try:
        text = json.dumps(obj, indent=2, sort_keys=False, allow_nan=False)
    except ValueError:
        from .errors import CardfitError

        raise CardfitError(f"{Path(path).name} would hold a number that is not finite, at {_non_finite(obj)}",
                           "the inputs disagree with each other (a model file, its config or a map); check "
                           "them, or report it if they are whole") from None
    write_text(path, text + "\n")


def _non_finite(obj, at: str = "") -> str:
    """Where in `obj` the first NaN or infinity is (a JSON-pointer-like path), '' if nowhere."""
    import math

    if isinstance(obj, float) and not math.isfinite(obj):
        return at or "/"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found = _non_finite(value, f"{at}/{key}")
        if found:
            return found
    return ""
