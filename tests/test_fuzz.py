"""The promise, fuzzed (issue 43): instead of listing hostile cases, hypothesis mutates every kind of
input a user hands cardfit — config.json, safetensors headers, GGUF headers and tensor tables, tokenizer
files, maps, recipes, imatrix files, calibration text, option values, output paths — and runs the real CLI
on it. Whatever it draws, the command keeps the promise of docs/reliability.md (`promise_problems`):

- it ends in exit 0 or exit 2, never a traceback, a crash, a hang or another code;
- exit 2: one line `error: problem — fix` on stderr, the last and only error line, and nothing this run
  made is left behind;
- exit 0: every number it wrote (JSON artifacts) or printed is finite, and it made only its declared outputs;
- every input is byte-identical afterwards.

Each command runs in a forked child of a server process (tests/hostile.py serve) that has imported
cardfit but never computed with torch, so an example costs the command's own time, and a native crash
(SIGSEGV, SIGABRT in ggml) is a reported exit code instead of a dead test process.

CI runs a fixed seed (derandomize) and a bounded number of examples per input kind, a few minutes in
all; `pytest tests/test_fuzz.py --fuzz-long` draws FUZZ_LONG_FACTOR times as many, at random
(CARDFIT_FUZZ_FACTOR=N: N times as many).
A failure hypothesis finds is pinned as an `@example` of the test that found it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FUZZ_LONG_FACTOR = 40


def fuzz(examples: int):
    """Hypothesis settings for one fuzz test: `examples` in CI (fixed seed), FUZZ_LONG_FACTOR times as many
    at random under --fuzz-long (conftest sets CARDFIT_FUZZ_LONG)."""
    factor = int(os.environ.get("CARDFIT_FUZZ_FACTOR") or (FUZZ_LONG_FACTOR if os.environ.get("CARDFIT_FUZZ_LONG") else 1))
    long = factor > 1
    return settings(max_examples=examples * factor, deadline=None, derandomize=not long,
                    database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# -- the running side -------------------------------------------------------------------------------

class Server:
    """tests/hostile.py serve, one per session: runs a command in a forked child, returns code/stdout/stderr."""

    def __init__(self, cache: Path):
        self.cache = cache
        env = {**os.environ, "CARDFIT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "hostile.py"), "serve"], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def run(self, argv: list, workdir: Path, timeout: float = 120) -> tuple[int | None, str, str]:
        self.proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "workdir": str(workdir),
                                          "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline())
        return reply["code"], reply["stdout"], reply["stderr"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def kit(tmp_path_factory) -> Path:
    """The hostile suite's kit: a tiny random Llama, its map, recipe, GGUF and imatrix."""
    return hostile.made_kit(tmp_path_factory.mktemp("fuzz"))


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("fuzz-cache"))
    yield server
    server.close()


_count = itertools.count()


class Trial(hostile.Workspace):
    """One example's workspace (the hostile suite's: `copy` takes a kit input), spoiled by the strategy,
    then one command."""

    def __init__(self, kit: Path):
        root = kit.parent / "trials" / f"t{next(_count)}"
        shutil.rmtree(root, ignore_errors=True)
        super().__init__(root, kit, None)

    def run(self, server: Server, argv: list, outputs: tuple[str, ...] = ()) -> tuple[int | None, str, str]:
        """Run `cardfit ARGV` in this workspace and assert the promise; `outputs` are the names (relative to
        the workspace) a successful run may create."""
        before = hostile.snapshot([self.root])
        code, stdout, stderr = server.run(argv, self.root)
        after = hostile.snapshot([self.root])
        problems = promise_problems(code, stdout, stderr, before, after, [self.root / o for o in outputs])
        assert not problems, f"cardfit {' '.join(map(str, argv))}\n-> {problems}\nstderr:\n{stderr[-3000:]}"
        shutil.rmtree(self.root, ignore_errors=True)
        return code, stdout, stderr


_LIBRARY_WARNING = re.compile(r"\w+Warning: |warnings\.warn\(|^WARNING[: ]|^W\d{4} ")  # Python, loggers, glog
_NON_FINITE = re.compile(r"(?<![\w.])[-+]?(nan|inf|infinity)(?![\w])", re.I)


def _strict_json(text: str):
    def refuse(word):
        raise ValueError(f"non-finite number {word} written")
    return json.loads(text, parse_constant=refuse)


def promise_problems(code, stdout: str, stderr: str, before: dict, after: dict, outputs: list[Path]) -> list[str]:
    """Every way a run broke docs/reliability.md's promise (empty: it kept it)."""
    problems = []
    if code is None:
        return ["hung"]
    if code not in (0, 2):
        problems.append(f"exit {code}")
    if "Traceback" in stderr or "Traceback" in stdout:
        problems.append("traceback")
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    if code == 2:
        if len(errors) != 1 or lines[-1] != errors[0]:
            problems.append(f"{len(errors)} error lines, last line {lines[-1] if lines else ''!r}")
        elif " — " not in errors[0]:
            problems.append("no fix given (problem — fix)")
    if code == 0:
        if errors:
            problems.append("exit 0 after an error line")
        if _NON_FINITE.search(stdout):
            problems.append(f"a non-finite number printed: {_NON_FINITE.search(stdout).group(0)!r}")
    if any(_LIBRARY_WARNING.search(line) for line in lines):  # cardfit's own `warning: …` lines are output
        problems.append("a library's warning reached the terminal")
    for path, digest in before.items():
        if after.get(path) != digest:
            problems.append(f"input changed: {Path(path).name}")
    allowed = {str(o) for o in outputs} if code == 0 else set()
    for path in after:
        if path not in before and not any(path == a or path.startswith(a + "/") or path == a + "/" for a in allowed):
            problems.append(f"left behind: {Path(path).name}")
    if code == 0:
        for path in after:
            if path not in before and path.endswith(".json"):
                try:
                    _strict_json(Path(path).read_text())
                except ValueError as e:
                    problems.append(f"{Path(path).name}: {e}")
    return problems


# -- values a hostile user types or a broken file holds ---------------------------------------------

hostile_numbers = st.one_of(
    st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63), 10 ** 30, 0.5, -0.0, 1e-300, 1e308,
                     math.nan, math.inf, -math.inf]),
    st.integers(-(2 ** 70), 2 ** 70), st.floats())
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), hostile_numbers, st.text(max_size=12),
              st.sampled_from(["Q4_K", "Q8_0", "F16", "W4A16-g128", "llama.cpp", "vllm", "model.layers.0", "*", ""])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)
option_words = st.one_of(
    st.sampled_from(["", " ", "0", "-1", "1", "2", "nan", "inf", "-inf", "1e400", "abc", "1GiB", "0GiB", "-3GB",
                     "1.5GB", "1e9", "100000000000", "99999999999999999999999", "1 GiB", "1GiBx", "6gib", "0x10",
                     "Q4_K", "q9", "W4A16", "auto", "cuda", "cuda:7", "cpu", "*=Q4_K", "=", "Q4_K,", ",",
                     "model.layers.0=Q2_K", "\x00", "é", "-", "--help"]),
    st.integers(-(2 ** 64), 2 ** 64).map(str), st.floats().map(repr), st.text(max_size=6))


def _leaves(doc, path=()):
    """Every (path, value) in a JSON document, containers included."""
    yield path, doc
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from _leaves(value, path + (key,))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield from _leaves(value, path + (i,))


# Edits are plain values (indices taken modulo what the document has), so a failing one can be pinned as an
# @example of the test that found it and replayed on the kit's own files.
json_edits = st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(["replace", "replace", "replace", "delete",
                                                                          "add"]), json_values), min_size=1, max_size=3)


def apply_edits(doc, edits):
    """Apply (spot, action, value) edits: the spot is an index into the document's paths, modulo their count."""
    for spot, action, value in edits:
        spots = [p for p, _ in _leaves(doc) if p]
        if not spots:
            break
        path = spots[spot % len(spots)]
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        if action == "replace":
            parent[last] = value
        elif action == "delete":
            del parent[last]
        elif isinstance(parent, dict):
            parent[f"{last}_x"] = value
        else:
            parent.insert(last, value)
    return doc


def _json_file(path: Path, doc) -> None:
    path.write_text(json.dumps(doc, allow_nan=True), encoding="utf-8")


# -- the kit's documents, read once ----------------------------------------------------------------

KIT = {}


def _kit_json(kit: Path, name: str):
    if name not in KIT:
        KIT[name] = json.loads((kit / name).read_text())
    return json.loads(json.dumps(KIT[name]))


def _gguf_fields(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """A GGUF's data offset and the integers of its header as (position, width): the tensor and metadata
    counts, every metadata entry's key length, type and (for an array) item type and length, every scalar
    value, and every tensor's name length, dimension count, dimensions, type and offset — the numbers a
    lying header lies with. An array's items are left out (49,152 token lengths would drown the rest)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base = reader.data.ctypes.data
    spots = [(8, 8), (16, 8)]  # tensor count, metadata count
    for field in reader.fields.values():
        parts = field.parts[:5] if len(field.parts) > 5 else field.parts  # arrays: not their items
        spots += [(part.ctypes.data - base, part.dtype.itemsize) for part in parts
                  if part.dtype.kind in "iu" and part.size == 1]
    for tensor in reader.tensors:
        for part in tensor.field.parts:
            if part.dtype.kind in "iu" and part.size <= 8:
                spots += [(part.ctypes.data - base + i * part.dtype.itemsize, part.dtype.itemsize)
                          for i in range(part.size)]
    return reader.data_offset, sorted(set(spots))


GGUF_SPOTS = {}


binary_edits = st.one_of(
    st.tuples(st.just("integer"), st.integers(0, 10 ** 6),  # a header integer (index into its spots) rewritten
              st.one_of(st.sampled_from([0, 1, 2, 3, 7, 255, 2 ** 32 - 1, 2 ** 31, 2 ** 64 - 1, 2 ** 63]),
                        st.integers(0, 2 ** 64 - 1))),
    st.tuples(st.just("flip"), st.integers(0, 10 ** 6), st.integers(1, 255)),  # a header byte xor'ed
    st.tuples(st.just("truncate"), st.floats(0, 0.999), st.just(0)),  # cut at a fraction of the file
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=64), st.just(0)))


def apply_binary(path: Path, edit, header_end: int, spots: list[tuple[int, int]]) -> None:
    data = bytearray(path.read_bytes())
    kind = edit[0]
    if kind == "integer":
        position, width = spots[edit[1] % len(spots)]
        data[position:position + width] = (edit[2] % 2 ** (8 * width)).to_bytes(width, "little")
    elif kind == "flip":
        data[edit[1] % header_end] ^= edit[2]
    elif kind == "truncate":
        del data[int(len(data) * edit[1]):]
    else:
        data += edit[1]
    path.write_bytes(bytes(data))


# -- the fuzzers ------------------------------------------------------------------------------------

SMALL_SCAN = ["--max-tokens", "48", "--seq-len", "16", "--formats", "Q8_0,Q4_0", "--out", "map.json"]


MODEL_COMMANDS = st.sampled_from(["budget", "sizes", "scan", "scan"])


def _model_command(command: str, model) -> list:
    return {"budget": ["budget", model, "--vram", "1GiB"], "sizes": ["sizes", model],
            "scan": ["scan", model, *SMALL_SCAN]}[command]


@fuzz(15)
@given(edits=json_edits, command=MODEL_COMMANDS)
@example(edits=[(48969, "delete", None), (73, "delete", None), (48969, "delete", None)], command="scan")  # found:
# intermediate_size deleted, transformers' default (11008) built, a shape ValueError mid-scan (exit 70)
def test_config_json_fuzzed(kit, server, edits, command):
    """config.json edited any way: budget, sizes and scan refuse it cleanly or work with finite numbers."""
    trial = Trial(kit)
    model = trial.copy("model")
    config = json.loads((model / "config.json").read_text())
    _json_file(model / "config.json", apply_edits(config, edits))
    trial.run(server, _model_command(command, model), outputs=("map.json",))


safetensors_edits = st.one_of(
    st.tuples(st.just("dtype"), st.integers(0, 999), st.sampled_from(["F16", "BF16", "F32", "F64", "I8", "U8", "I64",
                                                                      "BOOL", "F8_E4M3", "F4", "Q4", "", "f16"])),
    st.tuples(st.just("shape"), st.integers(0, 999), st.lists(st.integers(-2, 2 ** 40), max_size=4)),
    st.tuples(st.just("offsets"), st.integers(0, 999), st.lists(st.integers(-1, 2 ** 40), max_size=3)),
    st.tuples(st.just("delete"), st.integers(0, 999), st.none()),
    st.tuples(st.just("add"), st.integers(0, 999),
              st.sampled_from(["lm_head.weight", "model.layers.9.mlp.up_proj.weight", "x", "model.norm.bias",
                               "model.layers.0.mlp.extra_proj.weight", "model.layers.1.self_attn.q_proj.bias"])),
    st.tuples(st.just("rename"), st.integers(0, 999),
              st.sampled_from(["model.layers.7.self_attn.q_proj.weight", "junk", ""])),
    st.tuples(st.just("length"), st.integers(0, 2 ** 64 - 1), st.none()),
    st.tuples(st.just("truncate"), st.floats(0, 0.999), st.none()))


def apply_safetensors(path: Path, edit) -> None:
    """Apply one edit to a safetensors file. Lying edits (dtype, shape, offsets, length, truncate) change the
    header alone or cut the file; structural ones (delete, add, rename a tensor) write a valid file whose
    tensors the config does not explain, or that lacks one it needs. A tensor is an index modulo the names."""
    data = path.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8:8 + length]), data[8 + length:]
    kind, which, value = edit
    if kind == "length":
        path.write_bytes(struct.pack("<Q", which) + data[8:])
        return
    if kind == "truncate":
        path.write_bytes(data[:int(len(data) * which)])
        return
    names = sorted(k for k in header if k != "__metadata__")
    name = names[which % len(names)]
    bytes_of = {n: body[header[n]["data_offsets"][0]:header[n]["data_offsets"][1]] for n in names}
    if kind == "dtype":
        header[name]["dtype"] = value
    elif kind == "shape":
        header[name]["shape"] = value
    elif kind == "offsets":
        header[name]["data_offsets"] = value
    if kind in ("delete", "add", "rename"):
        if kind == "delete":
            del header[name], bytes_of[name]
        elif kind == "add":
            header[value], bytes_of[value] = dict(header[name]), bytes_of[name]
        else:
            header[value], bytes_of[value] = header.pop(name), bytes_of.pop(name)
        body, start = b"", 0  # laid out again, one after another, as safetensors requires
        for n, raw in bytes_of.items():
            header[n]["data_offsets"] = [start, start + len(raw)]
            body, start = body + raw, start + len(raw)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


@fuzz(15)
@given(edit=safetensors_edits, command=MODEL_COMMANDS)
@example(edit=("add", 0, "model.layers.0.mlp.extra_proj.weight"), command="scan")  # found: AttributeError mid-scan
def test_safetensors_header_fuzzed(kit, server, edit, command):
    """A safetensors file whose header lies (dtype, shape, offsets, names, length) or that is cut short."""
    trial = Trial(kit)
    model = trial.copy("model")
    apply_safetensors(model / "model.safetensors", edit)
    trial.run(server, _model_command(command, model), outputs=("map.json",))


def _gguf_spots(kit: Path, name: str):
    if name not in GGUF_SPOTS:
        GGUF_SPOTS[name] = _gguf_fields(kit / name)
    return GGUF_SPOTS[name]


@fuzz(8)
@given(edit=binary_edits, command=st.sampled_from(["sizes", "budget", "sizes", "budget", "scan", "check"]))
def test_gguf_header_fuzzed(kit, server, edit, command):
    """A GGUF whose header or tensor table lies (counts, lengths, dims, types, offsets) or that is cut short
    or grown: sizes, budget, scan and check (llama.cpp itself loads it) refuse it cleanly."""
    trial = Trial(kit)
    gguf = trial.copy("model.gguf")
    apply_binary(gguf, edit, *_gguf_spots(kit, "model.gguf"))
    if command == "check":
        trial.copy("model")
        argv = ["check", gguf, "--reference", "model", "--max-tokens", "32", "--seq-len", "16"]
    else:
        argv = _model_command(command, gguf)
    trial.run(server, argv, outputs=("map.json",))


@fuzz(15)
@given(edit=binary_edits)
@example(edit=("truncate", 0.3, 0))  # found: the tensor table cut short, gguf-py's IndexError in pack
def test_imatrix_fuzzed(kit, server, edit):
    """An imatrix file that lies or is cut short: pack refuses it before writing anything."""
    trial = Trial(kit)
    imatrix = trial.copy("imatrix.gguf")
    apply_binary(imatrix, edit, *_gguf_spots(kit, "imatrix.gguf"))
    trial.copy("model")
    trial.copy("recipe.json")
    trial.run(server, ["pack", "recipe.json", "--model", "model", "--imatrix", imatrix, "--method", "imatrix",
                       "--no-smoke", "--out", "out.gguf"], outputs=("out.gguf",))


cache_damage = st.tuples(st.sampled_from(["memo", "config.json", "tokenizer.json", "tokenizer_config.json",
                                          "cardfit-manifest.json", "model.safetensors", "hashes.json"]),
                        st.one_of(st.floats(0, 0.999), json_edits))


@fuzz(3)
@given(damage=cache_damage)
@example(damage=("tokenizer.json", 0.5))  # issue 43: a truncated tokenizer.json in the cache was a traceback
@example(damage=("memo", [(3, "replace", "x")]))  # issue 43: a corrupted header memo was a traceback
def test_cache_entries_damaged_are_rebuilt(kit, server, damage):
    """What cardfit keeps in its cache for a GGUF (the header memo, the f16 conversion, the hash index),
    damaged in any way between two runs: the second run still succeeds, rebuilding what it cannot trust."""
    trial = Trial(kit)
    argv = ["scan", kit / "model.gguf", *SMALL_SCAN]
    trial.run(server, argv, outputs=("map.json",))  # fills the cache
    trial = Trial(kit)
    gguf_cache = server.cache / "gguf"
    which, how = damage
    gguf = kit / "model.gguf"
    if which == "memo":  # the memo of this file (its key starts with the file's device and inode)
        inode = f"{gguf.stat().st_dev}:{gguf.stat().st_ino}|"
        target = next(m for m in (gguf_cache / "headers").glob("*.json") if inode in m.read_text()[:200])
    elif which == "hashes.json":
        target = gguf_cache / "hashes.json"
    else:  # its conversion, named by its content's sha256
        target = next(gguf_cache.glob(f"*-{hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}-f16")) / which
    if isinstance(how, float):
        raw = target.read_bytes()
        target.write_bytes(raw[:int(len(raw) * how)])
    else:
        try:
            _json_file(target, apply_edits(json.loads(target.read_text()), how))
        except (ValueError, UnicodeDecodeError):
            target.write_bytes(target.read_bytes()[:1])  # not JSON: the edit is a cut instead
    code, _, stderr = trial.run(server, argv, outputs=("map.json",))
    assert code == 0, stderr


@st.composite
def tokenizer_edits(draw):
    kind = draw(st.sampled_from(["truncate", "vocab", "added", "edit-config", "delete"]))
    if kind == "truncate":
        return (kind, draw(st.floats(0, 0.999)))
    if kind == "vocab":  # a token whose id is past the embedding's rows, or negative, or not an int
        return (kind, draw(st.sampled_from([49152, 49153, 10 ** 6, 2 ** 40, -1, 0.5, "7", None])))
    if kind == "added":
        return (kind, draw(st.sampled_from([49152, 10 ** 9, -5, 3])))
    if kind == "edit-config":
        return (kind, draw(st.sampled_from(["model_max_length", "bos_token", "eos_token", "tokenizer_class",
                                            "chat_template", "added_tokens_decoder"])), draw(json_values))
    return (kind, draw(st.sampled_from(["tokenizer.json", "tokenizer_config.json"])))


@fuzz(12)
@given(edit=tokenizer_edits())
@example(edit=("truncate", 0.0))  # found: an empty tokenizer.json, transformers' JSONDecodeError in scan
def test_tokenizer_files_fuzzed(kit, server, edit):
    """tokenizer.json / tokenizer_config.json cut short, deleted or disagreeing with the embedding."""
    trial = Trial(kit)
    model = trial.copy("model")
    tok, tok_config = model / "tokenizer.json", model / "tokenizer_config.json"
    kind = edit[0]
    if kind == "truncate":
        raw = tok.read_bytes()
        tok.write_bytes(raw[:int(len(raw) * edit[1])])
    elif kind == "vocab":
        doc = json.loads(tok.read_text())
        doc["model"]["vocab"]["<hostile>"] = edit[1]
        _json_file(tok, doc)
    elif kind == "added":
        doc = json.loads(tok.read_text())
        doc["added_tokens"].append({"id": edit[1], "content": "<hostile>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
        _json_file(tok, doc)
    elif kind == "edit-config":
        doc = json.loads(tok_config.read_text())
        doc[edit[1]] = edit[2]
        _json_file(tok_config, doc)
    else:
        (model / edit[1]).unlink()
    trial.run(server, ["scan", model, *SMALL_SCAN], outputs=("map.json",))


@fuzz(30)
@given(edits=json_edits, budget=st.sampled_from(["4MiB", "6MiB", "20MiB"]))
def test_maps_fuzzed(kit, server, edits, budget):
    """A map edited anywhere (values, keys, structure): plan refuses it cleanly or plans finite numbers."""
    trial = Trial(kit)
    _json_file(trial.root / "map.json", apply_edits(_kit_json(kit, "map.json"), edits))
    trial.run(server, ["plan", "map.json", "--weight-budget", budget, "--out", "recipe.json"],
              outputs=("recipe.json",))


@fuzz(15)
@given(edits=json_edits)
def test_recipes_fuzzed(kit, server, edits):
    """A recipe edited anywhere: pack refuses it cleanly, before writing, or packs what it says."""
    trial = Trial(kit)
    _json_file(trial.root / "recipe.json", apply_edits(_kit_json(kit, "recipe.json"), edits))
    trial.copy("model")
    trial.run(server, ["pack", "recipe.json", "--model", "model", "--no-smoke", "--out", "out.gguf"],
              outputs=("out.gguf",))


@fuzz(8)
@given(text=st.one_of(st.text(max_size=400), st.binary(max_size=400).map(lambda b: b.decode("latin-1"))),
       raw=st.booleans())
def test_calibration_text_fuzzed(kit, server, text, raw):
    """Calibration text of any content (empty, binary, one character, control codes) for scan."""
    trial = Trial(kit)
    model = trial.copy("model")
    calib = trial.root / "calib.txt"
    if raw:
        calib.write_bytes(text.encode("latin-1", errors="replace"))
    else:
        calib.write_text(text, encoding="utf-8", errors="surrogatepass")
    trial.run(server, ["scan", model, "--calibration", calib, *SMALL_SCAN], outputs=("map.json",))


# Every command's options that take a value a user types, with a run of the command that is cheap when the
# value is ordinary (the tiny model, few tokens), so what the fuzzer spends goes on the odd values. The third
# entry is what the command needs besides (a budget), left out when the fuzzed option is one that replaces it.
_BUDGETS = ("--weight-budget", "--size", "--vram")
OPTIONS = {
    "budget": (["budget", "model"], ["--vram", "--context", "--batch", "--kv-dtype", "--runtime", "--cuda-context",
                                     "--gpu-memory-utilization"], ["--vram", "1GiB"]),
    "plan": (["plan", "map.json", "--out", "planned.json"],
             ["--weight-budget", "--size", "--vram", "--context", "--batch", "--kv-dtype", "--pin", "--floor",
              "--formats", "--runtime", "--frontier"], ["--weight-budget", "6MiB"]),
    "scan": (["scan", "model", "--out", "map.json", "--max-tokens", "48", "--seq-len", "16"],
             ["--max-tokens", "--seq-len", "--batch", "--formats", "--group-by", "--rounding", "--method", "--dtype",
              "--memory-cap", "--device", "--weight-budget", "--signal", "--imatrix-out"], []),
    "pack": (["pack", "recipe.json", "--model", "model", "--out", "out.gguf"],
             ["--format", "--method", "--max-tokens", "--ceiling", "--device", "--gpu-memory"], []),
    "check": (["check", "model.gguf", "--reference", "model", "--max-tokens", "32", "--seq-len", "16"],
              ["--max-tokens", "--seq-len", "--ceiling", "--min-top1", "--max-kld", "--device", "--runtime"], []),
    "bench": (["bench", "model.gguf"], ["--vram", "--prompt-tokens", "--gen-tokens", "--batch", "--runtime"], []),
    "imatrix": (["imatrix", "model", "--out", "im.gguf", "--max-tokens", "48"],
                ["--max-tokens", "--seq-len", "--device"], []),
    "fit": (["fit", "model", "--out", "fit", "--max-tokens", "32"],
            ["--vram", "--size", "--context", "--batch", "--kv-dtype", "--format", "--method", "--formats",
             "--group-by", "--scan-method", "--workers", "--device"], ["--size", "2MiB"]),
}
OUTPUTS = ("planned.json", "map.json", "out.gguf", "im.gguf", "fit", "-")
# Values that are fine but make a command long: the fuzzer's budget is for odd values, not for real work.
SLOW = {("bench", "--gen-tokens"), ("bench", "--prompt-tokens"), ("scan", "--max-tokens"), ("check", "--max-tokens"),
        ("imatrix", "--max-tokens"), ("pack", "--max-tokens"), ("bench", "--batch"), ("fit", "--context")}


@fuzz(120)
@given(command_option=st.sampled_from([(c, o) for c in sorted(OPTIONS) for o in OPTIONS[c][1]]), value=option_words)
def test_option_values_fuzzed(kit, server, command_option, value):
    """Any value in any option of any command: refused in one line before work, or a run with finite output."""
    command, option = command_option
    base, _, besides = OPTIONS[command]
    if (command, option) in SLOW and value.strip().lstrip("+").isdigit() and 1000 < int(value) < 10 ** 12:
        value = str(int(value) % 1000)  # a real but long run teaches the fuzzer nothing
    trial = Trial(kit)
    for name in ("model", "map.json", "recipe.json", "model.gguf"):
        trial.copy(name)
    argv = list(base) + [option, value]
    if besides and not (besides[0] in _BUDGETS and option in _BUDGETS or besides[0] == option):
        argv += besides
    if command == "plan" and option == "--size":
        argv += ["--model", "model"]
    trial.run(server, argv, outputs=OUTPUTS + ((value,) if option in ("--frontier", "--imatrix-out") else ()))
