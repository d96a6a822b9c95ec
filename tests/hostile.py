"""The hostile-input suite: bad inputs and faults a user can throw at every command, and the promise
each must keep (docs/reliability.md): exit 2 (130 for Ctrl-C, 143 for SIGTERM), one line on stderr,
no traceback, every input byte-identical afterwards, nothing half-written left behind.

Each case runs the real CLI entry point in a forked child of a process that has imported cardfit
(so a case costs milliseconds, not an interpreter start), with its stdout and stderr captured at
the file-descriptor level: what a user's terminal would show, warnings from libraries included.
The inputs come from a kit built once (a tiny random Llama, its map, recipe, GGUF and imatrix) and
are copied into each case's own workspace, where the case spoils them.

`python tests/hostile.py build KIT` builds the kit; `tools/reliability_doc.py` runs every case and
writes the counts into docs/reliability.md; tests/test_hostile.py runs them under pytest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CASE_TIMEOUT = 180


# -- the kit ----------------------------------------------------------------------------------------

def build_kit(kit: Path) -> None:
    """Everything the cases spoil, made once: run in its own process (torch's thread pools must not
    exist in the process that forks the cases)."""
    sys.path.insert(0, str(TESTS))
    from conftest import _save_tiny

    from cardfit.imatrix import collect_imatrix
    from cardfit.pack import pack
    from cardfit.plan import plan, uniform_recipe
    from cardfit.scan import scan
    from cardfit.sources import open_model
    from cardfit.text import load_text

    kit.mkdir(parents=True, exist_ok=True)
    model = _save_tiny("llama", kit / "model")
    (kit / "calib.txt").write_text(load_text(None)[0][:6000], encoding="utf-8")
    (kit / "heldout.txt").write_text(load_text(None, default="heldout")[0][:6000], encoding="utf-8")
    sensitivity = scan(model, kit / "calib.txt", max_tokens=128, formats="Q8_0,Q4_K", seq_len=64,
                       out=kit / "map.json", progress=False)
    low = sum(g["bytes"]["Q4_K"] for g in sensitivity["groups"])
    high = sum(g["bytes"]["Q8_0"] for g in sensitivity["groups"])
    plan(kit / "map.json", (low + high) // 2)  # must succeed
    recipe = plan(kit / "map.json", high * 2)
    (kit / "recipe.json").write_text(json.dumps(recipe, indent=2))
    pack(recipe, model, kit / "model.gguf", progress=False, smoke=False)
    collect_imatrix(model, kit / "calib.txt", max_tokens=128, seq_len=64, out=kit / "imatrix.gguf", progress=False)
    (kit / "uniform-embedded.json").write_text(json.dumps(uniform_recipe(open_model(None), "Q8_0")))
    ct = uniform_recipe(open_model(model), "W4A16-g128")
    (kit / "recipe-ct.json").write_text(json.dumps(ct))


def made_kit(parent: Path) -> Path:
    """The kit built under `parent` in a fresh process (as build_kit requires), for a pytest fixture."""
    kit = parent / "kit"
    done = subprocess.run([sys.executable, str(TESTS / "hostile.py"), "build", str(kit)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return kit


# -- a case's workspace -----------------------------------------------------------------------------

class Workspace:
    """One case's directory: copies of the kit's inputs, spoiled as the case likes."""

    def __init__(self, root: Path, kit: Path, smallfs: Path | None):
        self.root, self.kit, self.smallfs = root, kit, smallfs
        root.mkdir(parents=True)
        self.watched = [root]

    def copy(self, name: str) -> Path:
        target = self.root / name
        if not target.exists():
            source = self.kit / name
            (shutil.copytree if source.is_dir() else shutil.copy)(source, target)
        return target

    def model(self) -> Path:
        return self.copy("model")

    def path(self, name: str) -> Path:
        return self.root / name

    def write(self, name: str, content: str | bytes) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
        return path

    def json_of(self, name: str) -> dict:
        return json.loads((self.kit / name).read_text())

    def spoiled(self, name: str, change: Callable[[dict], object], out_name: str | None = None) -> Path:
        """A copy of a kit JSON with `change` applied (its return value replaces the document if not None)."""
        data = self.json_of(name)
        replaced = change(data)
        data = data if replaced is None else replaced
        return self.write(out_name or name, json.dumps(data, allow_nan=True))

    def config_model(self, change: Callable[[dict], object]) -> Path:
        """The tiny model with its config.json edited."""
        model = self.model()
        config = json.loads((model / "config.json").read_text())
        replaced = change(config)
        config = config if replaced is None else replaced
        (model / "config.json").write_text(json.dumps(config))
        return model

    def full_disk(self, leave: int = 0) -> Path:
        """A directory on a small filesystem with `leave` bytes free (None when none can be mounted)."""
        if self.smallfs is None:
            return None
        self.watched.append(self.smallfs)
        stat = os.statvfs(self.smallfs)
        free = stat.f_bavail * stat.f_frsize
        filler = self.smallfs / "filler"
        with open(filler, "wb") as fh:
            fh.write(b"\0" * max(0, free - leave))
        with contextlib.suppress(OSError):
            with open(filler, "ab") as fh:  # the last partial block
                while True:
                    fh.write(b"\0" * 512)
                    fh.flush()
                    if os.statvfs(self.smallfs).f_bavail * stat.f_frsize <= leave:
                        break
        return self.smallfs


@dataclass
class Case:
    klass: str
    name: str
    build: Callable[[Workspace], list]
    expect: int = 2
    needle: str | None = None  # a word the error line must contain
    disk: bool = False  # needs a small filesystem

    @property
    def id(self) -> str:
        return f"{self.klass}/{self.name}"


@dataclass
class Result:
    case: Case
    code: int | None
    stdout: str
    stderr: str
    problems: list[str] = field(default_factory=list)

    @property
    def line(self) -> str:
        lines = [l for l in self.stderr.splitlines() if l.strip()]
        return lines[-1] if lines else ""


# -- running ---------------------------------------------------------------------------------------

def snapshot(roots: list[Path]) -> dict[str, str]:
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_dir():
                out[str(path) + "/"] = "dir"
    return out


def run_forked(argv: list[str], workdir: Path, timeout: float = CASE_TIMEOUT) -> tuple[int | None, str, str]:
    """`cardfit ARGV` in a forked child, as the console script runs it; stdout/stderr at fd level."""
    out_path, err_path = workdir.parent / (workdir.name + ".stdout"), workdir.parent / (workdir.name + ".stderr")
    pid = os.fork()
    if pid == 0:  # the child: become the command
        code = 1
        try:
            os.chdir(workdir)
            for fd, path in ((1, out_path), (2, err_path)):
                handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(handle, fd)
                os.close(handle)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            from cardfit.cli import main

            code = main([str(a) for a in argv])
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    deadline = time.time() + timeout
    status = None
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = None
    code = None if status is None else os.waitstatus_to_exitcode(status)
    read = lambda p: p.read_text(errors="replace") if p.exists() else ""  # noqa: E731
    stdout, stderr = read(out_path), read(err_path)
    for p in (out_path, err_path):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return code, stdout, stderr


def judge(case: Case, code, stdout: str, stderr: str, before: dict, after: dict) -> list[str]:
    """Every way the promise can be broken, as readable problems (empty: the case passed)."""
    problems = []
    if code is None:
        problems.append(f"hung (killed after {CASE_TIMEOUT} s)")
    elif code != case.expect:
        problems.append(f"exit {code}, expected {case.expect}")
    if "Traceback" in stderr or "Traceback" in stdout:
        problems.append("traceback")
    lines = [l for l in stderr.splitlines() if l.strip()]
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    elif case.expect == 2 and not lines[0].startswith("error: "):
        problems.append("stderr line does not start with 'error: '")
    elif case.expect == 2 and " — " not in lines[0]:
        problems.append("no fix given (problem — fix)")
    if case.needle and (not lines or case.needle.lower() not in lines[-1].lower()):
        problems.append(f"error line lacks {case.needle!r}")
    for path, digest in before.items():
        if after.get(path) != digest:
            problems.append(f"input changed: {Path(path).name}")
    for path in after:
        if path not in before:
            problems.append(f"left behind: {Path(path).name}")
    return problems


def run_case(case: Case, kit: Path, root: Path, smallfs: Path | None = None) -> Result:
    ws = Workspace(root / case.id.replace("/", "__"), kit, smallfs)
    try:
        argv = case.build(ws)
        if argv is None:
            return Result(case, None, "", "", ["no small filesystem here"])
        before = snapshot(ws.watched)
        code, stdout, stderr = run_forked(argv, ws.root)
        after = snapshot(ws.watched)
        return Result(case, code, stdout, stderr, judge(case, code, stdout, stderr, before, after))
    finally:
        if smallfs is not None:
            for entry in smallfs.iterdir():
                (shutil.rmtree if entry.is_dir() else os.unlink)(entry)


@contextlib.contextmanager
def small_filesystem(parent: Path, size: str = "256k"):
    """A tmpfs of `size` (root only); yields None where none can be mounted."""
    mount = parent / "smallfs"
    mount.mkdir(parents=True, exist_ok=True)
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                        capture_output=True).returncode == 0
    try:
        yield mount if ok else None
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


# -- the cases --------------------------------------------------------------------------------------

CASES: list[Case] = []


def case(klass: str, name: str, expect: int = 2, needle: str | None = None, disk: bool = False):
    def register(build):
        CASES.append(Case(klass, name, build, expect, needle, disk))
        return build
    return register


def add(klass: str, name: str, build, needle: str | None = None, expect: int = 2, disk: bool = False):
    CASES.append(Case(klass, name, build, expect, needle, disk))


COMMANDS = ("budget", "sizes", "scan", "plan", "refine", "pack", "imatrix", "check", "fit", "compare", "bench")

# 1. usage: what the CLI parser itself must refuse in one line
add("usage", "bare-cardfit", lambda ws: [], "no command")
add("usage", "unknown-command", lambda ws: ["frobnicate"], "no such command")
add("usage", "unknown-global-option", lambda ws: ["--verbose", "budget"], "no such option")
for _cmd in COMMANDS:
    add("usage", f"{_cmd}-unknown-option", lambda ws, c=_cmd: [c, "--no-such-flag"], "no such option")
add("usage", "budget-missing-vram", lambda ws: ["budget"], "--vram")
add("usage", "plan-missing-map", lambda ws: ["plan"], "MAP")
add("usage", "pack-missing-recipe", lambda ws: ["pack", "--out", "x.gguf"], "RECIPE")
add("usage", "pack-missing-out", lambda ws: ["pack", ws.copy("recipe.json")], "--out")
add("usage", "check-missing-artifact", lambda ws: ["check"], "ARTIFACT")
add("usage", "refine-missing-map", lambda ws: ["refine", ws.copy("recipe.json")], "--map")
add("usage", "bench-missing-artifact", lambda ws: ["bench"], "ARTIFACT")
add("usage", "context-not-a-number", lambda ws: ["budget", "--vram", "6GiB", "--context", "abc"], "--context")
add("usage", "batch-not-a-number", lambda ws: ["budget", "--vram", "6GiB", "--batch", "x"], "--batch")
add("usage", "max-tokens-float", lambda ws: ["scan", "--max-tokens", "1.5"], "--max-tokens")
add("usage", "ceiling-not-a-number", lambda ws: ["check", "a.gguf", "--ceiling", "high"], "--ceiling")
add("usage", "extra-argument", lambda ws: ["budget", "default", "--vram", "6GiB", "surplus"], "unexpected extra argument")
add("usage", "option-missing-value", lambda ws: ["budget", "--vram"], "--vram")
add("usage", "flag-given-a-value", lambda ws: ["budget", "--vram", "6GiB", "--json=yes"], "--json")

# 2. values: numbers and names out of range
_budget = ["budget", "--vram", "6GiB"]
for _name, _args, _needle in [
    ("batch-zero", ["scan", "--batch", "0"], "--batch"),
    ("max-tokens-zero", ["scan", "--max-tokens", "0"], "--max-tokens"),
    ("max-tokens-negative", ["imatrix", "--max-tokens", "-8"], "--max-tokens"),
    ("seq-len-one", ["scan", "--seq-len", "1"], "--seq-len"),
    ("check-ceiling-nan", ["check", "a.gguf", "--ceiling", "nan"], "--ceiling"),
    ("check-ceiling-inf", ["check", "a.gguf", "--ceiling", "inf"], "--ceiling"),
    ("check-ceiling-below-one", ["check", "a.gguf", "--ceiling", "0.5"], "--ceiling"),
    ("pack-ceiling-nan", ["pack", "r.json", "--out", "m.gguf", "--ceiling", "nan"], "--ceiling"),
    ("min-top1-above-one", ["check", "a.gguf", "--min-top1", "2"], "--min-top1"),
    ("min-top1-nan", ["check", "a.gguf", "--min-top1", "nan"], "--min-top1"),
    ("max-kld-negative", ["check", "a.gguf", "--max-kld", "-1"], "--max-kld"),
    ("max-kld-nan", ["check", "a.gguf", "--max-kld", "nan"], "--max-kld"),
    ("gpu-utilization-zero", _budget + ["--runtime", "vllm", "--gpu-memory-utilization", "0"], "utilization"),
    ("gpu-utilization-above-one", _budget + ["--gpu-memory-utilization", "1.5"], "utilization"),
    ("gpu-utilization-nan", _budget + ["--gpu-memory-utilization", "nan"], "utilization"),
    ("vram-words", ["budget", "--vram", "lots"], "--vram"),
    ("vram-negative", ["budget", "--vram", "-4GiB"], "--vram"),
    ("vram-zero", ["budget", "--vram", "0"], "--vram"),
    ("vram-nan", ["budget", "--vram", "nanGiB"], "--vram"),
    ("vram-huge", ["budget", "--vram", "1e999GiB"], "--vram"),
    ("vram-unit-typo", ["budget", "--vram", "6GiBB"], "--vram"),
    ("context-negative", _budget + ["--context", "-5"], "context"),
    ("context-zero", _budget + ["--context", "0"], "context"),
    ("kv-dtype-unknown", _budget + ["--kv-dtype", "q3"], "kv"),
    ("budget-runtime-unknown", _budget + ["--runtime", "tensorrt"], "runtime"),
    ("cuda-context-words", _budget + ["--cuda-context", "big"], "--cuda-context"),
    ("refine-top-zero", ["refine", "r.json", "--map", "m.json", "--top", "0"], "--top"),
    ("refine-rounds-zero", ["refine", "r.json", "--map", "m.json", "--rounds", "0"], "--rounds"),
    ("bench-gen-tokens-zero", ["bench", "a.gguf", "--gen-tokens", "0"], "--gen-tokens"),
    ("bench-runtime-unknown", ["bench", "a.gguf", "--runtime", "mlx"], "runtime"),
    ("compare-scan-tokens-zero", ["compare", "--scan-tokens", "0"], "--scan-tokens"),
]:
    add("values", _name, lambda ws, a=_args: list(a), _needle)


@case("values", "formats-duplicate", needle="twice")
def _(ws):
    return ["scan", ws.model(), "--formats", "Q8_0,q8_0", "--out", ws.path("m.json")]


@case("values", "formats-empty", needle="formats")
def _(ws):
    return ["scan", ws.model(), "--formats", ",", "--out", ws.path("m.json")]


@case("values", "formats-unknown", needle="unknown format")
def _(ws):
    return ["scan", ws.model(), "--formats", "Q8_0,Q9_K", "--out", ws.path("m.json")]


@case("values", "formats-mixed-runtimes", needle="runtimes")
def _(ws):
    return ["scan", ws.model(), "--formats", "Q8_0,W4A16", "--out", ws.path("m.json"), "--calibration",
            ws.copy("calib.txt"), "--max-tokens", "64", "--seq-len", "32"]


@case("values", "scan-group-by-unknown", needle="--group-by")
def _(ws):
    return ["scan", ws.model(), "--group-by", "expert", "--out", ws.path("m.json")]


@case("values", "scan-rounding-unknown", needle="rounding")
def _(ws):
    return ["scan", ws.model(), "--rounding", "smart", "--out", ws.path("m.json")]


@case("values", "scan-method-unknown", needle="--method")
def _(ws):
    return ["scan", ws.model(), "--method", "magic", "--out", ws.path("m.json")]


@case("values", "scan-device-gpu", needle="device")
def _(ws):
    return ["scan", ws.model(), "--device", "gpu", "--out", ws.path("m.json")]


@case("values", "scan-device-cuda-absent", needle="cuda")
def _(ws):
    return ["scan", ws.model(), "--device", "cuda", "--out", ws.path("m.json")]


@case("values", "scan-memory-cap-words", needle="--memory-cap")
def _(ws):
    return ["scan", ws.model(), "--memory-cap", "plenty", "--out", ws.path("m.json")]


@case("values", "plan-weight-budget-words", needle="--weight-budget")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "lots", "--out", ws.path("r.json")]


@case("values", "plan-weight-budget-negative", needle="--weight-budget")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "-1", "--out", ws.path("r.json")]


@case("values", "plan-no-budget", needle="budget")
def _(ws):
    return ["plan", ws.copy("map.json"), "--out", ws.path("r.json")]


@case("values", "plan-budget-below-minimum", needle="no recipe fits")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1KiB", "--out", ws.path("r.json")]


@case("values", "plan-pin-unknown-group", needle="layers.99")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--pin", "layers.99=Q8_0", "--out",
            ws.path("r.json")]


@case("values", "plan-pin-malformed", needle="--pin")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--pin", "embed", "--out", ws.path("r.json")]


@case("values", "plan-floor-unknown-format", needle="unknown format")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--floor", "embed=Q9", "--out",
            ws.path("r.json")]


@case("values", "plan-format-not-in-map", needle="not in the map")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--formats", "Q2_K", "--out", ws.path("r.json")]


@case("values", "plan-runtime-unknown", needle="runtime")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--runtime", "mlx", "--out", ws.path("r.json")]


@case("values", "plan-runtime-of-other-files", needle="vllm")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--runtime", "vllm", "--out", ws.path("r.json")]


@case("values", "pack-format-unknown", needle="format")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.path("m.gguf"), "--format", "onnx"]


@case("values", "pack-format-other-runtime", needle="compressed-tensors")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.path("m"), "--format",
            "compressed-tensors"]


@case("values", "pack-method-unknown", needle="--method")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.path("m.gguf"), "--method", "best"]


@case("values", "pack-gptq-for-gguf", needle="--method")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.path("m.gguf"), "--method", "gptq"]


@case("values", "check-runtime-unknown", needle="--runtime")
def _(ws):
    return ["check", ws.copy("model.gguf"), "--runtime", "onnxruntime"]


@case("values", "fit-format-unknown", needle="--format")
def _(ws):
    return ["fit", ws.model(), "--vram", "1GiB", "--format", "exl2", "--out", ws.path("fit")]


@case("values", "fit-own-model-without-vram", needle="--vram")
def _(ws):
    return ["fit", ws.model(), "--out", ws.path("fit")]


@case("values", "compare-baseline-unknown", needle="baseline")
def _(ws):
    return ["compare", ws.model(), "--baselines", "int3", "--out", ws.path("cmp")]


@case("values", "compare-preset-unknown", needle="preset")
def _(ws):
    return ["compare", ws.model(), "--presets", "Q4_K_XL", "--baselines", "none", "--out", ws.path("cmp")]


# 3. configs: config.json values a model directory may carry
def _cfg(name: str, change, needle: str | None = None):
    add("configs", name, lambda ws, c=change: ["budget", "--vram", "6GiB", "--config", ws.config_model(c)], needle)


def _set(**values):
    return lambda cfg: cfg.update(values)


def _drop(*keys):
    return lambda cfg: [cfg.pop(k, None) for k in keys] and None


_cfg("head-dim-negative", _set(head_dim=-64), "head_dim")
_cfg("head-dim-zero", _set(head_dim=0), "head_dim")
_cfg("kv-heads-negative", _set(num_key_value_heads=-2), "num_key_value_heads")
_cfg("kv-heads-above-heads", _set(num_key_value_heads=8), "num_key_value_heads")
_cfg("heads-not-multiple-of-kv", _set(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads")
_cfg("sliding-window-negative", _set(sliding_window=-4096, use_sliding_window=True, model_type="mistral"),
     "sliding_window")
_cfg("heads-above-hidden", lambda cfg: cfg.update(num_attention_heads=128, num_key_value_heads=128, head_dim=None),
     "num_attention_heads")
_cfg("hidden-size-string", _set(hidden_size="64"), "hidden_size")
_cfg("hidden-size-float", _set(hidden_size=64.5), "hidden_size")
_cfg("hidden-size-bool", _set(hidden_size=True), "hidden_size")
_cfg("layers-huge", _set(num_hidden_layers=100_000_000), "num_hidden_layers")
_cfg("layers-negative", _set(num_hidden_layers=-2), "num_hidden_layers")
_cfg("vocab-missing", _drop("vocab_size"), "vocab_size")
_cfg("vocab-zero", _set(vocab_size=0), "vocab_size")
_cfg("model-type-list", _set(model_type=["llama"]), "model_type")
_cfg("model-type-unknown", _set(model_type="frobnicator"), "frobnicator")
_cfg("model-type-missing", _drop("model_type"), "model_type")
_cfg("layer-types-length", _set(layer_types=["full_attention"]), "layer_types")
_cfg("layer-types-unknown-word", _set(layer_types=["full_attention", "warp_attention"]), "layer")
_cfg("intermediate-string", _set(intermediate_size="big"), "intermediate_size")
_cfg("tie-word-embeddings-string", _set(tie_word_embeddings="yes"), "tie_word_embeddings")
_cfg("config-a-list", lambda cfg: [cfg], "JSON object")
_cfg("jamba-period-zero", _set(model_type="jamba", attn_layer_period=0, attn_layer_offset=0), "attn_layer_period")
_cfg("qwen3-next-interval-zero", _set(model_type="qwen3_next", full_attention_interval=0, linear_num_key_heads=2,
                                      linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8),
     "full_attention_interval")
_cfg("gemma3-pattern-zero", _set(model_type="gemma3_text", sliding_window=32, sliding_window_pattern=0),
     "sliding_window_pattern")
_cfg("nemotron-pattern-length", _set(model_type="nemotron_h", hybrid_override_pattern="M*M"),
     "hybrid_override_pattern")
_cfg("mla-rank-negative", _set(model_type="deepseek_v2", kv_lora_rank=-1, qk_rope_head_dim=16), "kv_lora_rank")


@case("configs", "config-not-json", needle="JSON")
def _(ws):
    model = ws.model()
    (model / "config.json").write_text("{not json")
    return ["budget", "--vram", "6GiB", "--config", model]


@case("configs", "config-empty-file", needle="JSON")
def _(ws):
    model = ws.model()
    (model / "config.json").write_text("")
    return ["budget", "--vram", "6GiB", "--config", model]


@case("configs", "config-binary", needle="JSON")
def _(ws):
    model = ws.model()
    (model / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    return ["budget", "--vram", "6GiB", "--config", model]


@case("configs", "config-is-a-directory", needle="config")
def _(ws):
    model = ws.model()
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    return ["budget", "--vram", "6GiB", "--config", model]


@case("configs", "scan-config-bad-at-the-door", needle="head_dim")
def _(ws):
    model = ws.config_model(_set(head_dim=-16))
    return ["scan", model, "--out", ws.path("m.json"), "--calibration", ws.copy("calib.txt")]


@case("configs", "model-path-missing", needle="no model")
def _(ws):
    return ["sizes", ws.path("nowhere")]


@case("configs", "hub-id-not-cached", needle="cache")
def _(ws):
    return ["sizes", "no-such-org/no-such-model"]


# 4. weights: the tensors themselves
def _weights(name: str, spoil, needle: str | None = None, command=("sizes",)):
    def build(ws, spoil=spoil, command=command):
        model = ws.model()
        spoil(model)
        return [*command, model] if command[0] != "scan" else [*command, model, "--out", ws.path("m.json")]
    add("weights", name, build, needle)


def _truncate(model: Path):
    shard = model / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])


def _corrupt_header(model: Path):
    shard = model / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:24] = b"#" * 16
    shard.write_bytes(bytes(data))


def _huge_header(model: Path):
    shard = model / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = struct.pack("<Q", 2 ** 62)
    shard.write_bytes(bytes(data))


def _index_missing_shard(model: Path):
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))


def _pickle_only(model: Path):
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not-loaded")


def _no_weights(model: Path):
    (model / "model.safetensors").unlink()


def _vocab_rows(model: Path):
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = 50000
    (model / "config.json").write_text(json.dumps(config))


def _layer_count(model: Path):
    config = json.loads((model / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (model / "config.json").write_text(json.dumps(config))


def _hidden_mismatch(model: Path):
    config = json.loads((model / "config.json").read_text())
    config["hidden_size"] = 128
    (model / "config.json").write_text(json.dumps(config))


for _name, _spoil, _needle in [("truncated-shard", _truncate, "truncated"),
                               ("corrupt-header", _corrupt_header, "safetensors"),
                               ("header-length-absurd", _huge_header, "safetensors"),
                               ("index-names-missing-shard", _index_missing_shard, "missing"),
                               ("pickle-only", _pickle_only, "pickle"),
                               ("no-weights", _no_weights, "safetensors"),
                               ("vocab-rows-mismatch", _vocab_rows, "vocab"),
                               ("layer-count-mismatch", _layer_count, "layer"),
                               ("hidden-size-mismatch", _hidden_mismatch, "hidden")]:
    _weights(_name, _spoil, _needle)
for _name, _spoil, _needle in [("scan-truncated-shard", _truncate, "truncated"),
                               ("scan-pickle-only", _pickle_only, "pickle"),
                               ("scan-vocab-rows-mismatch", _vocab_rows, "vocab"),
                               ("scan-layer-count-mismatch", _layer_count, "layer")]:
    _weights(_name, _spoil, _needle, command=("scan",))


@case("weights", "check-pickle-only-reference-dir", needle="pickle")
def _(ws):
    model = ws.model()
    _pickle_only(model)
    return ["check", model, "--runtime", "bitsandbytes"]


@case("weights", "check-pickle-only-artifact", needle="pickle")
def _(ws):
    model = ws.model()
    _pickle_only(model)
    return ["check", model, "--smoke"]


@case("weights", "gguf-garbage", needle="GGUF")
def _(ws):
    return ["sizes", ws.write("bad.gguf", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)]


@case("weights", "gguf-empty", needle="GGUF")
def _(ws):
    return ["budget", "--vram", "6GiB", "--config", ws.write("empty.gguf", b"")]


@case("weights", "gguf-truncated", needle="GGUF")
def _(ws):
    data = (ws.kit / "model.gguf").read_bytes()
    return ["sizes", ws.write("cut.gguf", data[: len(data) // 3])]


@case("weights", "check-gguf-garbage", needle="GGUF")
def _(ws):
    return ["check", ws.write("bad.gguf", b"GGUF" + b"\0" * 100), "--smoke"]


@case("weights", "check-no-artifact", needle="no artifact")
def _(ws):
    return ["check", ws.path("absent.gguf"), "--smoke"]


@case("weights", "bench-gguf-garbage", needle="GGUF")
def _(ws):
    return ["bench", ws.write("bad.gguf", b"GGUF" + b"\0" * 100)]


# 5. texts: calibration and held-out text
def _text(name: str, content, needle: str | None, command: str = "scan"):
    def build(ws, content=content, command=command):
        path = content(ws) if callable(content) else ws.write("text.txt", content)
        if command == "scan":
            return ["scan", ws.model(), "--calibration", path, "--out", ws.path("m.json")]
        if command == "imatrix":
            return ["imatrix", ws.model(), "--calibration", path, "--out", ws.path("i.gguf")]
        return ["check", ws.copy("model.gguf"), "--reference", ws.model(), "--text", path]
    add("texts", name, build, needle)


_text("empty", "", "empty")
_text("whitespace", "   \n\n\t  ", "empty")
_text("binary", b"\x00\x01\x02\x03" * 500, "binary")
_text("not-utf8", "caf\xe9 au lait ".encode("latin-1") * 200, "UTF-8")
_text("shorter-than-a-chunk", "Just a few words.", "chunk")
_text("missing-file", lambda ws: ws.path("absent.txt"), "absent.txt")
_text("a-directory", lambda ws: ws.path("."), "text")
_text("imatrix-empty", "", "empty", "imatrix")
_text("imatrix-binary", b"\xff\xd8\xff\xe0" * 400, "binary", "imatrix")
_text("check-heldout-empty", "", "empty", "check")
_text("check-heldout-not-utf8", b"\xc3\x28" * 300, "UTF-8", "check")


@case("maps", "stderr-nan-is-refused", needle="stderr")
def _(ws):
    bad = ws.spoiled("map.json", _cell0(lambda c: c.update(stderr=float("nan"))))
    return ["plan", bad, "--weight-budget", "1GiB", "--out", ws.path("r.json")]


@case("texts", "max-tokens-below-one-chunk", needle="chunk")
def _(ws):
    return ["scan", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens", "16", "--seq-len", "64",
            "--out", ws.path("m.json")]


# 6. maps: sensitivity maps edited, truncated or made for something else
def _map(name: str, change, needle: str | None = None):
    add("maps", name, lambda ws, c=change: ["plan", ws.spoiled("map.json", c), "--weight-budget", "1GiB", "--out",
                                            ws.path("recipe-out.json")], needle)


def _group0(change):
    return lambda m: change(m["groups"][0])


def _cell0(change):
    return lambda m: change(m["groups"][1]["cells"]["Q8_0"])


_map("missing-rounding", lambda m: m.pop("rounding") and None, "rounding")
_map("missing-calibration", lambda m: m.pop("calibration") and None, "calibration")
_map("missing-model", lambda m: m.pop("model") and None, "model")
_map("missing-groups", lambda m: m.pop("groups") and None, "groups")
_map("missing-formats", lambda m: m.pop("formats") and None, "formats")
_map("null-group-name", _group0(lambda g: g.update(name=None)), "name")
_map("group-name-number", _group0(lambda g: g.update(name=7)), "name")
_map("bytes-2-to-the-70", _group0(lambda g: g["bytes"].update(Q8_0=2 ** 70)), "bytes")
_map("bytes-negative", _group0(lambda g: g["bytes"].update(Q8_0=-1)), "bytes")
_map("bytes-float", _group0(lambda g: g["bytes"].update(Q8_0=1.5)), "bytes")
_map("bytes-missing-format", _group0(lambda g: g["bytes"].pop("Q4_K") and None), "Q4_K")
_map("all-damages-1e308", lambda m: [c.update(damage=1e308) for g in m["groups"] for c in g["cells"].values()]
     and None, "damage")
_map("damage-nan", _cell0(lambda c: c.update(damage=float("nan"))), "damage")
_map("damage-infinite", _cell0(lambda c: c.update(damage=float("inf"))), "damage")
_map("damage-negative", _cell0(lambda c: c.update(damage=-0.5)), "damage")
_map("damage-string", _cell0(lambda c: c.update(damage="0.1")), "damage")
_map("damage-null", _cell0(lambda c: c.update(damage=None)), "damage")
_map("top1-above-one", _cell0(lambda c: c.update(top1=3.0)), "top1")
_map("cell-unknown-format", lambda m: m["groups"][1]["cells"].update(Q9_K={"damage": 0.1}) and None, "Q9_K")
_map("formats-empty", lambda m: m.update(formats=[]), "formats")
_map("formats-duplicate", lambda m: m.update(formats=["Q8_0", "Q8_0"]), "twice")
_map("formats-unknown", lambda m: m.update(formats=["Q8_0", "Q9_K"]), "Q9_K")
_map("group-twice", lambda m: m["groups"].append(m["groups"][0]) and None, "twice")
_map("fingerprint-not-a-hash", lambda m: m["model"].update(fingerprint="abc"), "fingerprint")
_map("version-2", lambda m: m.update(cardfit_map=2), "version")
_map("runtime-unknown", lambda m: m.update(runtime="mlx"), "runtime")
_map("a-list", lambda m: [m], "JSON object")
_map("a-string", lambda m: "cardfit", "JSON object")
_map("incomplete-cells", lambda m: m["groups"][1]["cells"].pop("Q4_K") and None, "incomplete")


@case("maps", "not-json", needle="JSON")
def _(ws):
    return ["plan", ws.write("map.json", "{\"cardfit_map\": 1, "), "--weight-budget", "1GiB", "--out",
            ws.path("r.json")]


@case("maps", "truncated-file", needle="JSON")
def _(ws):
    text = (ws.kit / "map.json").read_text()
    return ["plan", ws.write("map.json", text[: len(text) // 2]), "--weight-budget", "1GiB", "--out",
            ws.path("r.json")]


@case("maps", "missing-file", needle="no sensitivity map")
def _(ws):
    return ["plan", ws.path("absent.json"), "--weight-budget", "1GiB", "--out", ws.path("r.json")]


@case("maps", "a-directory", needle="map")
def _(ws):
    ws.path("dir.json").mkdir()
    return ["plan", ws.path("dir.json"), "--weight-budget", "1GiB", "--out", ws.path("r.json")]


@case("maps", "plan-model-mismatch", needle="another model")
def _(ws):
    other = ws.spoiled("map.json", lambda m: m["model"].update(fingerprint="sha256:" + "0" * 64))
    return ["plan", other, "--weight-budget", "1GiB", "--model", ws.model(), "--out", ws.path("r.json")]


@case("maps", "scan-resume-of-garbage", needle="JSON")
def _(ws):
    return ["scan", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens", "128", "--seq-len", "64",
            "--formats", "Q8_0,Q4_K", "--out", ws.write("map.json", "garbage"), "--resume"]


@case("maps", "scan-resume-other-job", needle="another model")
def _(ws):
    return ["scan", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens", "128", "--seq-len", "64",
            "--formats", "Q8_0,Q2_K", "--out", ws.copy("map.json"), "--resume"]


@case("maps", "refine-map-garbage", needle="damage")
def _(ws):
    bad = ws.spoiled("map.json", _cell0(lambda c: c.update(damage=-1)))
    return ["refine", ws.copy("recipe.json"), "--map", bad, "--model", ws.model(), "--out", ws.path("r2.json")]


# 7. recipes: edited, truncated or made for something else
def _recipe(name: str, change, needle: str | None = None):
    add("recipes", name, lambda ws, c=change: ["pack", ws.spoiled("recipe.json", c), "--model", ws.model(), "--out",
                                               ws.path("out.gguf")], needle)


def _rgroup0(change):
    return lambda r: change(r["groups"][0])


_recipe("missing-bytes", lambda r: r.pop("bytes") and None, "bytes")
_recipe("missing-predicted-damage", lambda r: r.pop("predicted_damage") and None, "predicted_damage")
_recipe("missing-budget", lambda r: r.pop("budget") and None, "budget")
_recipe("missing-map-section", lambda r: r.pop("map") and None, "map")
_recipe("missing-runtime", lambda r: r.pop("runtime") and None, "runtime")
_recipe("null-format", _rgroup0(lambda g: g.update(format=None)), "format")
_recipe("unknown-format", _rgroup0(lambda g: g.update(format="Q9_K")), "Q9_K")
_recipe("format-of-other-runtime", _rgroup0(lambda g: g.update(format="W4A16-g128")), "W4A16")
_recipe("group-bytes-negative", _rgroup0(lambda g: g.update(bytes=-5)), "bytes")
_recipe("bytes-not-the-sum", lambda r: r.update(bytes=r["bytes"] + 1), "sum")
_recipe("bytes-2-to-the-70", lambda r: r.update(bytes=2 ** 70), "bytes")
_recipe("budget-zero", lambda r: r["budget"].update(weight_budget_bytes=0), "weight_budget_bytes")
_recipe("budget-2-to-the-70", lambda r: r["budget"].update(weight_budget_bytes=2 ** 70), "weight_budget_bytes")
_recipe("budget-string", lambda r: r["budget"].update(weight_budget_bytes="1GiB"), "weight_budget_bytes")
_recipe("version-9", lambda r: r.update(cardfit_recipe=9), "version")
_recipe("runtime-unknown", lambda r: r.update(runtime="mlx"), "runtime")
_recipe("groups-empty", lambda r: r.update(groups=[]), "groups")
_recipe("group-twice", lambda r: r["groups"].append(r["groups"][0]) and None, "twice")
_recipe("damage-nan", _rgroup0(lambda g: g.update(damage=float("nan"))), "damage")
_recipe("damage-missing", _rgroup0(lambda g: g.pop("damage") and None), "damage")
_recipe("group-missing", lambda r: r["groups"].pop(1) and r.update(bytes=sum(g["bytes"] for g in r["groups"])),
        "names no format")
_recipe("other-model", lambda r: r["map"]["model"].update(fingerprint="sha256:" + "1" * 64), "another model")
_recipe("a-list", lambda r: [r], "JSON object")


@case("recipes", "not-json", needle="JSON")
def _(ws):
    return ["pack", ws.write("recipe.json", "{\"cardfit_recipe\""), "--model", ws.model(), "--out", ws.path("o.gguf")]


@case("recipes", "missing-file", needle="no recipe")
def _(ws):
    return ["pack", ws.path("absent.json"), "--model", ws.model(), "--out", ws.path("o.gguf")]


@case("recipes", "check-recipe-garbage", needle="recipe")
def _(ws):
    return ["check", ws.copy("model.gguf"), "--smoke", "--recipe", ws.write("r.json", "[]")]


@case("recipes", "refine-recipe-garbage", needle="bytes")
def _(ws):
    return ["refine", ws.spoiled("recipe.json", lambda r: r.pop("bytes") and None), "--map", ws.copy("map.json"),
            "--model", ws.model(), "--out", ws.path("r2.json")]


# 8. outputs: --out pointing at inputs, at the wrong kind of thing, or nowhere writable
@case("outputs", "pack-over-its-recipe", needle="recipe")
def _(ws):
    recipe = ws.copy("recipe.json")
    return ["pack", recipe, "--model", ws.model(), "--out", recipe, "--force"]


@case("outputs", "pack-over-model-weights", needle="model")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.model() / "model.safetensors", "--force"]


@case("outputs", "pack-over-model-config", needle="model")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.model() / "config.json", "--force"]


@case("outputs", "pack-into-model-dir", needle="model")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.model() / "new.gguf"]


@case("outputs", "pack-ct-over-model-dir", needle="model")
def _(ws):
    return ["pack", ws.copy("recipe-ct.json"), "--model", ws.model(), "--out", ws.model(), "--force"]


@case("outputs", "pack-ct-over-dir-holding-model", needle="model")
def _(ws):
    ws.model()
    return ["pack", ws.copy("recipe-ct.json"), "--model", ws.model(), "--out", ws.root, "--force"]


@case("outputs", "pack-over-its-imatrix", needle="imatrix")
def _(ws):
    imatrix = ws.copy("imatrix.gguf")
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--imatrix", imatrix, "--out", imatrix, "--force"]


@case("outputs", "pack-over-calibration", needle="calibration")
def _(ws):
    calib = ws.copy("calib.txt")
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--method", "imatrix", "--calibration", calib,
            "--out", calib, "--force"]


@case("outputs", "pack-gguf-onto-existing-directory", needle="directory")
def _(ws):
    ws.path("outdir").mkdir()
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.path("outdir"), "--force"]


@case("outputs", "pack-ct-onto-existing-file", needle="file")
def _(ws):
    return ["pack", ws.copy("recipe-ct.json"), "--model", ws.model(), "--out", ws.write("afile", "x"), "--force"]


@case("outputs", "pack-existing-without-force", needle="--force")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.write("out.gguf", "old")]


@case("outputs", "pack-parent-is-a-file", needle="directory")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", ws.write("afile", "x") / "m.gguf"]


@case("outputs", "pack-unwritable-place", needle="/proc")
def _(ws):
    return ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out", "/proc/cardfit/m.gguf"]


@case("outputs", "plan-over-its-map", needle="map")
def _(ws):
    m = ws.copy("map.json")
    return ["plan", m, "--weight-budget", "1GiB", "--out", m]


@case("outputs", "plan-frontier-over-map", needle="map")
def _(ws):
    m = ws.copy("map.json")
    return ["plan", m, "--weight-budget", "1GiB", "--out", ws.path("r.json"), "--frontier", m]


@case("outputs", "plan-plot-over-map", needle="map")
def _(ws):
    m = ws.copy("map.json")
    return ["plan", m, "--weight-budget", "1GiB", "--out", ws.path("r.json"), "--plot", m]


@case("outputs", "plan-onto-a-directory", needle="directory")
def _(ws):
    ws.path("d").mkdir()
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--out", ws.path("d")]


@case("outputs", "plan-over-model-config", needle="model")
def _(ws):
    return ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--model", ws.model(),
            "--out", ws.model() / "config.json"]


@case("outputs", "scan-over-calibration", needle="calibration")
def _(ws):
    calib = ws.copy("calib.txt")
    return ["scan", ws.model(), "--calibration", calib, "--out", calib]


@case("outputs", "scan-over-model-weights", needle="model")
def _(ws):
    return ["scan", ws.model(), "--out", ws.model() / "model.safetensors", "--resume"]


@case("outputs", "scan-onto-a-directory", needle="directory")
def _(ws):
    ws.path("d").mkdir()
    return ["scan", ws.model(), "--out", ws.path("d")]


@case("outputs", "scan-existing-without-resume", needle="--resume")
def _(ws):
    return ["scan", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens", "128", "--seq-len", "64",
            "--formats", "Q8_0,Q4_K", "--out", ws.copy("map.json")]


@case("outputs", "refine-over-its-recipe", needle="recipe")
def _(ws):
    r = ws.copy("recipe.json")
    return ["refine", r, "--map", ws.copy("map.json"), "--model", ws.model(), "--out", r]


@case("outputs", "refine-over-its-map", needle="map")
def _(ws):
    m = ws.copy("map.json")
    return ["refine", ws.copy("recipe.json"), "--map", m, "--model", ws.model(), "--out", m]


@case("outputs", "imatrix-over-gguf-model", needle="model")
def _(ws):
    g = ws.copy("model.gguf")
    return ["imatrix", g, "--out", g]


@case("outputs", "imatrix-not-gguf-name", needle=".gguf")
def _(ws):
    return ["imatrix", ws.model(), "--out", ws.path("imatrix.dat")]


@case("outputs", "check-report-over-artifact", needle="artifact")
def _(ws):
    g = ws.copy("model.gguf")
    return ["check", g, "--smoke", "--out", g]


@case("outputs", "check-report-over-heldout", needle="held-out")
def _(ws):
    t = ws.copy("heldout.txt")
    return ["check", ws.copy("model.gguf"), "--smoke", "--text", t, "--out", t]


@case("outputs", "fit-out-a-file", needle="file")
def _(ws):
    return ["fit", ws.model(), "--vram", "1GiB", "--out", ws.write("notadir", "x")]


@case("outputs", "fit-out-the-model", needle="model")
def _(ws):
    return ["fit", ws.model(), "--vram", "1GiB", "--out", ws.model()]


@case("outputs", "fit-over-calibration", needle="calibration")
def _(ws):
    ws.write("run/recipe.json", (ws.kit / "calib.txt").read_text())
    return ["fit", ws.model(), "--vram", "1GiB", "--out", ws.path("run"), "--calibration", ws.path("run/recipe.json")]


@case("outputs", "fit-corrupt-state", needle="fit.json")
def _(ws):
    ws.write("run/fit.json", "{\"pack\": [1, 2")
    return ["fit", ws.model(), "--vram", "1GiB", "--out", ws.path("run"), "--max-tokens", "64"]


@case("outputs", "fit-state-wrong-shape", needle="fit.json")
def _(ws):
    ws.write("run/fit.json", json.dumps({"pack": 7, "check": "yes"}))
    return ["fit", ws.model(), "--vram", "1GiB", "--out", ws.path("run"), "--max-tokens", "64"]


@case("outputs", "compare-out-a-file", needle="file")
def _(ws):
    return ["compare", ws.model(), "--out", ws.write("notadir", "x")]


@case("outputs", "compare-out-the-model", needle="model")
def _(ws):
    return ["compare", ws.model(), "--out", ws.model()]


# 9. disk: a filesystem that fills up mid-write
@case("disk", "plan-json-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=0)
    return None if full is None else ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--out",
                                      full / "recipe.json"]


@case("disk", "plan-frontier-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=0)
    return None if full is None else ["plan", ws.copy("map.json"), "--weight-budget", "1GiB", "--out",
                                      ws.path("r.json"), "--frontier", full / "frontier.json"]


@case("disk", "pack-gguf-header-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=4096)
    return None if full is None else ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out",
                                      full / "m.gguf", "--no-smoke"]


@case("disk", "pack-gguf-on-a-small-disk", needle="space", disk=True)
def _(ws):
    full = ws.full_disk(leave=200_000)
    return None if full is None else ["pack", ws.copy("recipe.json"), "--model", ws.model(), "--out",
                                      full / "m.gguf", "--no-smoke"]


@case("disk", "pack-compressed-tensors-on-a-small-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=100_000)
    return None if full is None else ["pack", ws.copy("recipe-ct.json"), "--model", ws.model(), "--out",
                                      full / "ct", "--no-smoke"]


@case("disk", "scan-map-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=0)
    return None if full is None else ["scan", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens",
                                      "64", "--seq-len", "32", "--formats", "Q8_0", "--out", full / "m.json"]


@case("disk", "imatrix-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=0)
    return None if full is None else ["imatrix", ws.model(), "--calibration", ws.copy("calib.txt"), "--max-tokens",
                                      "64", "--seq-len", "32", "--out", full / "i.gguf"]


@case("disk", "check-report-on-a-full-disk", needle="disk", disk=True)
def _(ws):
    full = ws.full_disk(leave=0)
    return None if full is None else ["check", ws.copy("model.gguf"), "--smoke", "--text", ws.copy("heldout.txt"),
                                      "--max-tokens", "64", "--seq-len", "32", "--ceiling", "1e12",
                                      "--out", full / "c.json"]


# -- signals (run in tests/test_hostile.py as real processes) -----------------------------------------
SIGNAL_CASES = [("pack", signal.SIGINT, 130), ("pack", signal.SIGTERM, 143), ("scan", signal.SIGINT, 130),
                ("scan", signal.SIGTERM, 143), ("fit", signal.SIGTERM, 143), ("imatrix", signal.SIGINT, 130)]


def classes() -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in CASES:
        counts[c.klass] = counts.get(c.klass, 0) + 1
    counts["signals"] = len(SIGNAL_CASES)
    return counts


def run_all(kit: Path, root: Path, only: list[str] | None = None) -> list[Result]:
    """Every case (or those whose id contains one of `only`), each in its own workspace under `root`."""
    import cardfit.cli  # noqa: F401  imported once here, so each forked case starts warm
    import cardfit.scan  # noqa: F401

    results = []
    with small_filesystem(root) as smallfs:
        for c in CASES:
            if only and not any(o in c.id for o in only):
                continue
            if c.disk and smallfs is None:
                results.append(Result(c, None, "", "", ["skipped: no small filesystem can be mounted here"]))
                continue
            results.append(run_case(c, kit, root / "cases", smallfs))
    return results


def serve() -> None:
    """Run commands for another process (tests/test_fuzz.py): one JSON line in ({"argv": [...], "workdir": DIR}),
    one JSON line out ({"code", "stdout", "stderr"}), each command in a forked child of this process, which
    has imported cardfit but never computed with torch (a fork after torch's thread pools exist can hang)."""
    import cardfit.cli  # noqa: F401  imported once here, so each forked command starts warm
    import cardfit.scan  # noqa: F401

    reply = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        code, stdout, stderr = run_forked(request["argv"], Path(request["workdir"]), request.get("timeout", 120))
        reply.write(json.dumps({"code": code, "stdout": stdout, "stderr": stderr}) + "\n")
        reply.flush()


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        serve()
        return 0
    if len(argv) == 2 and argv[0] == "build":
        build_kit(Path(argv[1]))
        return 0
    if len(argv) >= 3 and argv[0] == "run":  # run KIT RESULTS.json [ID-FILTER...]
        kit, out = Path(argv[1]), Path(argv[2])
        root = out.parent / "hostile-runs"
        shutil.rmtree(root, ignore_errors=True)
        results = run_all(kit, root, argv[3:])
        out.write_text(json.dumps([{"id": r.case.id, "class": r.case.klass, "code": r.code, "line": r.line,
                                    "stderr": r.stderr[-4000:], "problems": r.problems} for r in results], indent=1))
        shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"{len(CASES)} cases + {len(SIGNAL_CASES)} signals:", classes())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
