"""The signal registry: a signal is one module and one registry line, and every door picks it up."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from cardfit.scan.signals import SIGNALS, Signal, default_signal, signal_of_map


def test_every_registered_signal_is_a_scan_method_a_fit_method_and_in_the_help(run_cli):
    from cardfit.fit import scan_methods
    from cardfit.scan import methods

    code, scan_help, _ = run_cli("scan", "--help")
    code2, fit_help, _ = run_cli("fit", "--help")
    assert code == code2 == 0
    flat = ["".join(text.replace("│", " ").split()) for text in (scan_help, fit_help)]  # however the help wraps
    assert list(SIGNALS) == ["fast", "weight", "magnitude"]
    for name, signal in SIGNALS.items():
        assert methods()[name] == signal.description and signal.description.split(" ")[0] == name
        assert name in scan_methods()
        assert "".join(f"{name} ({signal.help})".split()) in flat[0]
    assert "".join((", ".join(SIGNALS) + ": plan on that signal's prices alone").split()) in flat[1]


def test_the_default_signal_is_the_first_that_prices_the_rounding():
    from cardfit.formats import parse_formats

    assert default_signal(parse_formats("Q8_0,Q4_K"), "rtn").name == "fast"
    assert default_signal(parse_formats("Q8_0,Q4_K"), "gptq").name == "fast"  # a ggml type's GPTQ: its imatrix
    assert default_signal(parse_formats("W8A16,W4A16-g128"), "gptq").name == "weight"
    assert not SIGNALS["magnitude"].prices(parse_formats("Q4_K,IQ2_XXS"), "rtn")  # IQ2_XXS needs an imatrix
    assert signal_of_map({"damage": {"method": SIGNALS["weight"].description}}) is SIGNALS["weight"]
    assert signal_of_map({"damage": {"method": "exact"}}) is None and signal_of_map({"damage": 3}) is None


def test_the_magnitude_signal_is_the_plain_squared_rounding_error(tiny_models, tmp_path):
    """Every cell is Σ ||W - Q(W)||² over its group's matrices, computed here from the formats' round trips."""
    from cardfit.formats import get_format
    from cardfit.groups import scan_groups
    from cardfit.scan import scan
    from cardfit.sources import open_model

    model = tiny_models["llama"]
    result = scan(model, max_tokens=64, seq_len=32, formats="Q8_0,Q4_0", out=tmp_path / "m.json", method="magnitude",
                  progress=False)
    assert result["damage"] == {"metric": SIGNALS["magnitude"].metric, "method": SIGNALS["magnitude"].description}
    source = open_model(model)
    groups = scan_groups(source, "layer")
    for group, entry in zip(groups, result["groups"]):
        for name in ("Q8_0", "Q4_0"):
            fmt = get_format(name)
            want = sum(float((fmt.roundtrip(t.name, source.read(t.name)).double() - source.read(t.name).double())
                             .square().sum()) for t in group.quantizable if fmt.storage(t.name, t.shape) != "F32")
            cell = entry["cells"][name]
            assert cell["method"] == "magnitude" and cell["damage"] == pytest.approx(want, rel=1e-9)
    body = [e for e in result["groups"] if e["name"].startswith("layers.")]
    assert all(e["cells"]["Q4_0"]["damage"] > e["cells"]["Q8_0"]["damage"] > 0 for e in body)
    assert json.loads((tmp_path / "m.json").read_text()) == result


def test_a_rounding_a_signal_does_not_price_is_refused_with_those_that_do(tiny_models, tmp_path, run_cli):
    code, _, err = run_cli("scan", tiny_models["llama"], "--method", "magnitude", "--rounding", "imatrix",
                           "--formats", "Q8_0,Q4_0", "--out", tmp_path / "m.json")
    assert code == 2 and "magnitude signal prices plain RTN" in err and "use --method fast or weight or exact" in err
    assert not (tmp_path / "m.json").exists()


class Ones(Signal):
    """A toy signal: every cell priced by its format's bits alone."""

    name = "ones"
    help = "each format's bits, a toy"
    description = "ones (a toy)"
    metric = "bits"
    mark = "ones"

    def prices(self, formats, rounding):
        return True

    def price(self, job, todo, done):
        by_group = {}
        for index, group, fmt in todo:
            by_group.setdefault(index, {})[fmt.name] = 16.0 - fmt.bits
        for index, priced in by_group.items():
            done(index, priced)


REGISTERED_FIRST = textwrap.dedent('''
    import sys
    sys.path.insert(0, {here!r})
    from cardfit.scan.signals import SIGNALS
    from test_signals import Ones
    SIGNALS["ones"] = Ones()  # the registry line
    from cardfit.cli import main
    sys.exit(main(sys.argv[1:]))
''')


def test_a_new_signal_is_in_both_commands_help_from_its_registry_line(tmp_path):
    """Registered before the CLI is imported (as signals/__init__ registers), the help of scan and fit names it."""
    from pathlib import Path

    script = tmp_path / "ones.py"
    script.write_text(REGISTERED_FIRST.format(here=str(Path(__file__).parent)))

    def help_of(command):
        done = subprocess.run([sys.executable, str(script), command, "--help"], capture_output=True, text=True,
                              env={**os.environ, "COLUMNS": "400"})
        assert done.returncode == 0, done.stderr
        return done.stdout

    scan_help, fit_help = help_of("scan"), help_of("fit")
    assert "ones (each format's bits, a toy)" in scan_help and "fast, weight, magnitude, ones (default" in scan_help
    assert "fast, weight, magnitude, ones: plan on" in fit_help


def test_a_new_signal_is_a_scan_method_an_adaptive_signal_and_a_fit_method(tiny_models, tmp_path, monkeypatch):
    """One registry line: scan --method, --signal and fit --scan-method take it with no other edit."""
    import functools
    from pathlib import Path

    from cardfit import pack as pack_module
    from cardfit.fit import fit
    from cardfit.scan import scan

    monkeypatch.setitem(SIGNALS, "ones", Ones())
    monkeypatch.setattr(pack_module, "pack", functools.partial(pack_module.pack, smoke=False))  # a random model
    model = tiny_models["llama"]
    common = dict(formats="Q8_0,Q4_0", max_tokens=64, seq_len=32, progress=False)
    scanned = scan(model, out=tmp_path / "m.json", method="ones", **common)
    assert scanned["damage"] == {"metric": "bits", "method": "ones (a toy)"}
    assert {(c["damage"], c["method"]) for g in scanned["groups"] for c in g["cells"].values()} == {
        (7.5, "ones"), (11.5, "ones")}
    adaptive = scan(model, out=tmp_path / "a.json", method="adaptive", signal="ones", weight_budgets=[10**7], **common)
    assert adaptive["adaptive"]["signal"] == "ones"
    summary = fit(model, sizes="10MB", out=tmp_path / "fit", formats="Q8_0,Q4_0", max_tokens=512, scan_method="ones",
        progress=False, log=None)
    assert json.loads((tmp_path / "fit" / "sensitivity.json").read_text())["damage"]["method"] == "ones (a toy)"
    report = Path(summary["sizes"][0]["out"]) / "report.md"
    assert "every damage is the ones signal's estimate" in report.read_text()


def test_fit_refuses_a_signal_that_cannot_price_its_rounding_naming_fit_s_own_flag(tiny_models, tmp_path, run_cli):
    """fit's --method is the rounding; the fix names --scan-method values that price it, and nothing is left."""
    code, _, err = run_cli("fit", tiny_models["llama"], "--scan-method", "magnitude", "--method", "imatrix", "--size",
                           "10MB", "--formats", "Q8_0,Q4_0", "--out", tmp_path / "fit")
    assert code == 2 and "not imatrix" in err and "use --scan-method fast or weight or adaptive or exact" in err
    assert not (tmp_path / "fit").exists()
    code, _, err = run_cli("scan", tiny_models["llama"], "--method", "adaptive", "--signal", "magnitude", "--size",
                           "10MB", "--formats", "Q8_0,IQ2_XXS", "--out", tmp_path / "m.json")
    assert code == 2 and "cannot price IQ2_XXS, which rounds only with an importance matrix" in err
    assert "use --signal fast or weight" in err
