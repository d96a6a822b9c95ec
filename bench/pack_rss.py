"""Peak RSS of `pack` (uniform Q8_0 GGUF of the embedded model) above a process that imports the same
libraries and reads the tokenizer. Run: python bench/pack_rss.py"""
import subprocess, sys, json
from cardfit.default_model import default_model_dir
d = str(default_model_dir())
base = """
import sys
from transformers import AutoTokenizer
from cardfit.sources import open_model
from cardfit.plan import uniform_recipe
import cardfit.pack, gguf, llama_cpp
src = open_model(sys.argv[1]); AutoTokenizer.from_pretrained(str(src.path)); uniform_recipe(src, "Q8_0")
from cardfit.formats import ggml_lib; ggml_lib.ggml()
"""
run = """
import sys
from cardfit.sources import open_model
from cardfit.plan import uniform_recipe
from cardfit.pack import pack
pack(uniform_recipe(open_model(sys.argv[1]), "Q8_0"), sys.argv[1], sys.argv[2], progress=False, smoke=False, force=True)
"""
def measure(code, *args):
    r = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stderr.strip().splitlines()[-1]) * 1024
b = measure(base, d); s = measure(run, d, "/tmp/exp/packrss.gguf")
print("baseline MiB", b/2**20, "pack MiB", s/2**20, "delta", (s-b)/2**20)
