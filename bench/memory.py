"""Peak RSS of `scan` and `pack` on the embedded model, above a process that only imports the same
libraries, builds the empty model skeleton and reads the tokenizer (each in its own process,
measured by /usr/bin/time).

    python bench/memory.py
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from cardfit.default_model import default_model_dir

BASELINE = """
import sys
from transformers import AutoTokenizer
import cardfit.pack, gguf, llama_cpp
from cardfit.formats import ggml_lib
from cardfit.plan import uniform_recipe
from cardfit.engine.streamed import StreamedModel
from cardfit.sources import open_model
source = open_model(sys.argv[1])
StreamedModel(source); AutoTokenizer.from_pretrained(str(source.path)); uniform_recipe(source, "Q8_0"); ggml_lib.ggml()
"""
SCAN = """
import sys
from cardfit.scan import scan
scan(sys.argv[1], None, 512, "Q8_0,Q2_K", out=sys.argv[2], memory_cap=64 * 2**20, seq_len=256, batch=4,
     progress=False)
"""
PACK = """
import sys
from cardfit.pack import pack
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model
pack(uniform_recipe(open_model(sys.argv[1]), "Q8_0"), sys.argv[1], sys.argv[2], progress=False, smoke=False)
"""


def peak_rss(code: str, *args: str) -> int:
    result = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-c", code, *args],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return int(result.stderr.strip().splitlines()[-1]) * 1024


def main() -> None:
    model = str(default_model_dir())
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        base = peak_rss(BASELINE, model)
        scan = peak_rss(SCAN, model, str(Path(tmp) / "map.json"))
        pack = peak_rss(PACK, model, str(Path(tmp) / "model.gguf"))
    print(f"baseline {base / mib:.0f} MiB")
    print(f"scan (--memory-cap 64MiB, 512 tokens, Q8_0,Q2_K) {scan / mib:.0f} MiB, {(scan - base) / mib:.0f} MiB above")
    print(f"pack (uniform Q8_0 GGUF) {pack / mib:.0f} MiB, {(pack - base) / mib:.0f} MiB above")


if __name__ == "__main__":
    main()
