"""Outputs never clobber inputs: every command checks its `--out` against what it reads, before work.

`--force` replaces an earlier output; it must never replace the model, the recipe, the map or
any other input (an artifact renamed over `recipe.json` or a model's weights destroys what the
user came with). The check runs before any work, so a refusal costs nothing.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import CardfitError


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _inside(child: Path, parent: Path) -> bool:
    return parent in child.parents


def input_paths(path: str | Path | None) -> list[Path]:
    """An input as the paths it occupies: the path itself, and for a directory every entry in it
    (a hub snapshot's files are links into its blob store, so they are resolved too)."""
    if path is None:
        return []
    path = Path(path).expanduser()
    out = [path.absolute(), _followed(path)]
    if path.is_dir():
        for entry in path.iterdir():
            out += [entry.absolute(), _followed(entry)]
    return out


def _followed(path: Path) -> Path:
    """The path with its links followed, or as written where they loop (its reader then says so)."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return path.absolute()


def model_paths(source) -> list[Path]:
    """What a model source reads: its directory (or file) and, for a materialized GGUF, the GGUF too."""
    paths = input_paths(source.path)
    for origin in getattr(source, "origins", ()):
        paths += input_paths(origin.path)
    return paths


def resolved_output(out: str | Path, flag: str = "--out") -> Path:
    """`out` with every link followed; a path whose links loop is refused in one line (Path.resolve raises)."""
    try:
        return Path(out).expanduser().resolve()
    except (RuntimeError, OSError) as exc:
        raise CardfitError(f"{flag} {out} cannot be followed to a place ({exc})",
                           f"name a path without a symlink loop ({flag} another path)") from None


def distinct_outputs(outputs: dict[str, str | Path | None]) -> None:
    """Refuse two outputs of one command that are the same place (`plan --out X --frontier X` would keep only
    the last file written); `outputs` maps each flag to its path, None where not given."""
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        place = resolved_output(path, flag)
        if place in seen:
            raise CardfitError(f"{seen[place]} and {flag} are the same file ({path}): one would overwrite the other",
                               f"give {flag} another path")
        seen[place] = flag


def guard_output(out: str | Path, inputs: dict[str, list[Path]], kind: str = "file", flag: str = "--out",
                 writes: tuple[str, ...] = ()) -> Path:
    """Refuse `out` when it is, holds or lies inside any input, or is the wrong kind of thing.

    `inputs` maps a label ("the model", "the recipe") to the paths it occupies; `kind` is
    "file", "dir" (a directory replaced whole) or "workdir" (a directory the command writes the
    files named in `writes` into, leaving the rest alone; a name may be an fnmatch pattern)."""
    given = Path(out).expanduser()
    target = given.absolute()
    resolved = resolved_output(out, flag)
    if kind == "file" and str(out).endswith(("/", os.sep)):
        raise CardfitError(f"{flag} {out} ends in '/', a directory, and a file is written there",
                           f"name a file, e.g. {flag} {given / 'out.json'}")
    if kind == "file" and given.is_dir():
        raise CardfitError(f"{flag} {out} is a directory, and a file is written there",
                           f"name a file, e.g. {flag} {given / 'out'}")
    if kind in ("dir", "workdir") and given.exists() and not given.is_dir():
        raise CardfitError(f"{flag} {out} is a file, and a directory is written there",
                           f"name a directory, e.g. {flag} {given.with_suffix('')}-out")
    _refuse_unmakeable(target, flag, out)
    for label, paths in inputs.items():
        for path in paths:
            for candidate in (target, resolved):
                if _same(candidate, path):
                    raise CardfitError(f"{flag} {out} is {label}, which this command reads",
                                       f"write the output elsewhere ({flag} another path)")
                if _inside(candidate, path) and path.is_dir():
                    raise CardfitError(f"{flag} {out} lies inside {label} ({path})",
                                       f"write the output outside it ({flag} another path)")
                if kind != "workdir" and _inside(path, candidate):
                    raise CardfitError(f"{flag} {out} holds {label} ({path}), which writing it would destroy",
                                       f"write the output elsewhere ({flag} another path)")
        for name in writes:  # a name, or a glob pattern (fnmatch) of names, under the directory
            for base in (target, resolved):
                for path in paths:
                    hit = (_inside(path, base) and fnmatch.fnmatch(path.relative_to(base).as_posix(), name)) or (
                        not any(c in name for c in "*?[") and _same(base / name, path))
                    if hit:
                        raise CardfitError(f"{flag} {out} would overwrite {label} ({path.name})",
                                           f"write the output elsewhere ({flag} another path)")
    return given


def _refuse_unmakeable(target: Path, flag: str, out) -> None:
    """Refuse, before any work, an output whose directory cannot be made or written: a file standing where a
    directory of its path must be, or the nearest existing directory not writable by this user."""
    for place in target.parents:
        if place.name == ".." and not place.exists():  # making it would make the missing directory before ".."
            raise CardfitError(f"{flag} {out} climbs out of {place.parent}, which does not exist",
                               f"give {flag} without the detour, e.g. {flag} {os.path.normpath(out)}")
        if place.exists():
            if not place.is_dir():
                raise CardfitError(f"{flag} {out}: {place} is a file, and the output needs a directory there",
                                   f"give {flag} a path in a directory")
            if not os.access(place, os.W_OK | os.X_OK):
                raise CardfitError(f"{flag} {out}: {place} is not writable by this user",
                                   f"give {flag} a path in a directory you can write")
            return
        if place.is_symlink():  # a dangling link where a directory must be made
            raise CardfitError(f"{flag} {out}: {place} is a link to nothing", f"give {flag} a path in a directory")


@contextmanager
def work_directory(out: Path):
    """`out` made for the block (parents too); if the block fails before any file was written under it, the
    directories this made are removed again, so a refused or interrupted run leaves nothing behind (a run
    that wrote something, a scan's checkpoint say, leaves it for the rerun to continue)."""
    made = [p for p in (out, *out.absolute().parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield out
    except BaseException:
        if made and not any(p.is_file() or p.is_symlink() for p in made[-1].rglob("*")):
            shutil.rmtree(made[-1], ignore_errors=True)
        raise
