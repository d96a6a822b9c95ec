"""Runtime targets: one registry, and a runtime added by one module that every stage then offers."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

from cardfit.errors import CardfitError
from cardfit.targets import TARGETS, all_targets, get_target, register

# What the embedded model's uniform Q4_K recipe and its GGUF were, byte for byte, before targets
# existed (commit ac6667d): the refactor changed where facts live, not what is written.
GOLDEN = {"Q4_K recipe": "2cc63744a09b6e9d6459cdb7b63907ea086d7d1b347fca0bbd9131a70f84676d",
          "Q4_K gguf": "195d0ee9ad760d1ec645af85e85c3e619f388f8cd1b68d6509d905004cd8a4e8"}


def test_every_target_module_registers_and_names_are_unique():
    names = [t.name for t in all_targets()]
    assert len(names) == len(set(names))
    assert {"llama.cpp", "vllm", "vllm-cpu", "transformers", "bitsandbytes", "ollama"} <= set(names)
    with pytest.raises(CardfitError, match="unknown runtime 'mlx'"):
        get_target("mlx")


def test_formats_a_target_serves_are_formats_of_its_family():
    from cardfit.formats import get_format

    for target in all_targets(packs=True):
        for name in target.formats:
            assert get_format(name).runtime == target.family, (target.name, name)


@pytest.fixture()
def lite_target():
    """A runtime added at run time: a llama.cpp build that loads only Q8_0 and Q4_K, with its own overhead."""
    base = get_target("llama.cpp")
    target = replace(base, name="llama.cpp-lite", summary="a test runtime", formats=("Q8_0", "Q4_K"),
                     kv_dtypes=("f16",), overhead_terms=lambda g, vram, ctx, s: {"everything": 100 * 2**20})
    register(target)
    yield target
    TARGETS.pop(target.name)


def test_a_registered_target_is_offered_by_budget_plan_and_pack(lite_target, tiny_model, tmp_path, calib_text):
    """No edit outside the target: budget prices its overhead, plan keeps to its menu, pack writes its file."""
    from cardfit.budget import budget
    from cardfit.pack import pack
    from cardfit.plan import plan
    from cardfit.scan import scan

    model = tiny_model("llama")
    b = budget(model, "1GiB", 256, runtime="llama.cpp-lite")
    assert b.overhead_terms == {"everything": 100 * 2**20}
    with pytest.raises(CardfitError, match="llama.cpp-lite cannot hold its KV cache as q8_0"):
        budget(model, "1GiB", 256, kv_dtype="q8_0", runtime="llama.cpp-lite")
    sensitivity = scan(model, calib_text, max_tokens=128, formats="Q8_0,Q4_K,Q2_K", seq_len=64,
                       out=tmp_path / "map.json", progress=False)
    smallest = sum(min(g["bytes"].values()) for g in sensitivity["groups"])
    recipe = plan(tmp_path / "map.json", smallest * 4, runtime="llama.cpp-lite")
    assert recipe["served_by"] == "llama.cpp-lite"
    assert {g["format"] for g in recipe["groups"]} <= {"Q8_0", "Q4_K"}
    with pytest.raises(CardfitError, match="no recipe fits"):  # Q2_K is on the map, not on its menu
        plan(tmp_path / "map.json", smallest + 1024, runtime="llama.cpp-lite")
    report = pack(recipe, model, tmp_path / "lite.gguf", progress=False, smoke=False)
    assert (tmp_path / "lite.gguf").stat().st_size == report["file_bytes"]


def test_ollama_gets_the_gguf_and_a_modelfile_with_the_budgets_context(tiny_model, tmp_path, calib_text, run_cli):
    from cardfit.scan import scan

    model = tiny_model("llama")
    scan(model, calib_text, max_tokens=128, formats="Q8_0,Q4_K", seq_len=64, out=tmp_path / "map.json",
         progress=False)
    code, out, err = run_cli("plan", tmp_path / "map.json", "--vram", "2GiB", "--context", "4096", "--config", model,
                             "--runtime", "ollama", "--out", tmp_path / "recipe.json")
    assert code == 0, err
    recipe = json.loads((tmp_path / "recipe.json").read_text())
    assert recipe["served_by"] == "ollama" and recipe["runtime"] == "llama.cpp"
    code, out, err = run_cli("pack", tmp_path / "recipe.json", "--model", model, "--out", tmp_path / "o" / "m.gguf",
                             "--no-smoke")
    assert code == 0, err
    assert (tmp_path / "o" / "Modelfile").read_text() == "FROM ./m.gguf\nPARAMETER num_ctx 4096\n"
    code, _, err = run_cli("budget", "--vram", "2GiB", "--config", model, "--runtime", "ollama", "--kv-dtype", "bf16")
    assert code == 2 and "ollama cannot hold its KV cache as bf16" in err


def test_the_embedded_models_recipe_and_gguf_are_byte_identical_to_before_targets(tmp_path):
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe
    from cardfit.sources import open_model

    recipe = uniform_recipe(open_model(None), "Q4_K")
    before = json.loads(json.dumps(recipe))  # the recipe as it was, before maps and recipes recorded a weights sample
    assert before["map"]["model"].pop("weights") == open_model(None).weights_sample()
    assert hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest() == GOLDEN["Q4_K recipe"]
    pack(recipe, None, tmp_path / "Q4_K.gguf", progress=False, smoke=False)  # general.name is the file stem
    assert hashlib.sha256((tmp_path / "Q4_K.gguf").read_bytes()).hexdigest() == GOLDEN["Q4_K gguf"]


def test_no_module_outside_the_targets_names_a_runtime():
    """Runtime names live in cardfit/targets; elsewhere only as prose (docstrings, messages, comments)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).parent.parent / "cardfit"
    offenders = []
    for path in root.rglob("*.py"):
        if "targets" in path.parts or path.name in ("vllm_driver.py", "vllm_env.py"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in TARGETS
                                                     for c in [node.left, *node.comparators])):
                offenders.append(f"{path.name}:{node.lineno}")
            if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in TARGETS
                                                  for k in node.keys):
                offenders.append(f"{path.name}:{node.lineno}")
    assert offenders == [], offenders


def test_group_ids_parse_and_format_in_one_place():
    from cardfit.groups import EMBED, LM_HEAD, NORM, GroupId, group_of

    layer = GroupId.layer_group(7)
    assert layer == "layers.7" and layer.kind == "layer" and layer.layer == 7
    assert GroupId("layers.7") == layer and GroupId("layers.7").layer == 7
    fixed = GroupId.fixed_group(3)
    assert fixed == "layers.3.fixed" and fixed.kind == "fixed" and fixed.layer == 3
    tensor = GroupId.tensor_group("model.layers.12.self_attn.q_proj.weight")
    assert tensor.kind == "tensor" and tensor.layer == 12 and tensor.tensor.endswith("q_proj.weight")
    assert group_of("blk.5.attn_q.weight") == "layers.5" and group_of("token_embd.weight") is EMBED
    assert group_of("lm_head.weight") is LM_HEAD and group_of("model.norm.weight") is NORM
    names = ["norm", "layers.10", "lm_head", "layers.2", "embed", "layers.2.fixed"]
    assert sorted(names, key=lambda n: GroupId(n).sort_key) == ["embed", "layers.2", "layers.2.fixed", "layers.10",
                                                               "norm", "lm_head"]
    assert json.dumps({layer: 1}) == '{"layers.7": 1}'  # a str: maps and recipes keep their names byte for byte


def test_no_module_builds_or_parses_group_names_by_hand():
    import pathlib
    import re

    root = pathlib.Path(__file__).parent.parent / "cardfit"
    pattern = re.compile(r'f"layers\.\{|\.split\("\."\)\[1\]|startswith\("layers\."\)')
    offenders = [f"{p.name}:{n}" for p in root.rglob("*.py") if p.name != "groups.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == [], offenders


def test_docs_formats_describes_the_schemas():
    """Every field docs/formats.md shows in its map and recipe examples is a field of the schema that reads
    them, and every field the schemas require is shown: the document and the code cannot drift apart."""
    import pathlib
    import re

    from cardfit.schemas import Recipe, SensitivityMap

    doc = (pathlib.Path(__file__).parent.parent / "docs" / "formats.md").read_text()
    blocks = re.findall(r"```json\n(.*?)```", doc, re.S)
    shown = {}
    for block in blocks:
        data = json.loads(block)
        kind = "map" if "cardfit_map" in data else "recipe" if "cardfit_recipe" in data else None
        if kind:
            shown[kind] = data
    for kind, schema in (("map", SensitivityMap), ("recipe", Recipe)):
        fields = schema.model_fields
        assert set(shown[kind]) <= set(fields), (kind, set(shown[kind]) - set(fields))
        required = {name for name, f in fields.items() if f.is_required()}
        assert required <= set(shown[kind]), (kind, required - set(shown[kind]))
        group_fields = fields["groups"].annotation.__args__[0].model_fields if hasattr(
            fields["groups"].annotation, "__args__") else None
        example_group = shown[kind]["groups"][0]
        if group_fields:
            assert set(example_group) <= set(group_fields), (kind, set(example_group) - set(group_fields))


def test_the_package_does_not_shadow_its_stage_modules():
    import importlib
    import types

    import cardfit

    for name in ("budget", "scan", "plan", "refine", "pack", "check", "compare", "fit"):
        module = importlib.import_module(f"cardfit.{name}")
        assert getattr(cardfit, name) is module and isinstance(module, types.ModuleType)
        assert callable(module)
    assert cardfit.plan.uniform_recipe is cardfit.uniform_recipe
    budget = cardfit.budget(None, "1GiB", 1024)  # the stage runs when the module is called
    assert budget.weight_budget_bytes > 0
