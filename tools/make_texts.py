"""Rebuild cardfit/data/{calibration,heldout}.txt from the Python 3.11 documentation sources.

Origin: Debian's python3.11-doc package (`apt-get download python3.11-doc`), which ships the
reStructuredText sources of docs.python.org under html/_sources. The documentation is
distributed under the PSF License Agreement (see docs/data.md). Code blocks, directives and
markup are stripped so what remains is the prose.

    python tools/make_texts.py /path/to/extracted/usr/share/doc/python3.11/html/_sources
"""

import re
import sys
from pathlib import Path

CALIBRATION = ["tutorial", "howto"]
HELDOUT = ["faq"]


def prose(rst: str) -> str:
    out, skipping, indent = [], False, 0
    for line in rst.splitlines():
        stripped = line.strip()
        lead = len(line) - len(line.lstrip())
        if skipping:
            if stripped and lead <= indent:
                skipping = False
            else:
                continue
        if stripped.startswith(".. ") or stripped.endswith("::"):
            if stripped.endswith("::") and not stripped.startswith(".. "):
                text = stripped[:-2].rstrip()
                if text:
                    out.append(text + ":")
            skipping, indent = True, lead
            continue
        if re.fullmatch(r"[=\-~^*#+`'\"]{3,}", stripped) or stripped.startswith((">>>", "...", "|")):
            continue
        line = re.sub(r":[a-z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`", r"\1", stripped)
        line = re.sub(r"`([^`<]*?)\s*<[^>]*>`_+", r"\1", line)
        line = line.replace("``", "").replace("**", "").replace("*", "").replace("`", "")
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def collect(root: Path, folders) -> str:
    parts = []
    for folder in folders:
        for path in sorted((root / folder).glob("*.rst.txt")):
            parts.append(prose(path.read_text(encoding="utf-8")))
    return "\n".join(parts)


if __name__ == "__main__":
    root = Path(sys.argv[1])
    data = Path(__file__).resolve().parent.parent / "cardfit" / "data"
    (data / "calibration.txt").write_text(collect(root, CALIBRATION), encoding="utf-8")
    (data / "heldout.txt").write_text(collect(root, HELDOUT), encoding="utf-8")
