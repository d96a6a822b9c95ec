"""The planner is exact: it equals brute force, proves optimality, and names the minimum."""

import itertools

import numpy as np
import pytest

from cardfit.errors import CardfitError
from cardfit.solver import Problem, frontier, minimum_bytes, optimum, solve


def random_problem(rng, groups, formats):
    size = np.sort(rng.integers(100, 10_000, size=(groups, formats)), axis=1)[:, ::-1].copy()
    damage = np.sort(rng.random((groups, formats)) ** 3, axis=1)
    # shuffle some columns so that larger is not always better (non-monotone cells happen in real maps)
    if rng.random() < 0.3:
        damage[:, 0] = rng.random(groups)
    return Problem([f"g{i}" for i in range(groups)], [f"f{j}" for j in range(formats)], damage, size,
                   np.ones((groups, formats), dtype=bool), [])


def brute_force(problem, budget):
    best = None
    for choice in itertools.product(range(len(problem.formats)), repeat=len(problem.groups)):
        b = sum(problem.bytes[g, c] for g, c in enumerate(choice))
        if b <= budget:
            d = sum(problem.damage[g, c] for g, c in enumerate(choice))
            if best is None or d < best - 1e-12:
                best = d
    return best


def test_plan_equals_brute_force_on_200_random_instances():
    rng = np.random.default_rng(0)
    for _ in range(200):
        problem = random_problem(rng, int(rng.integers(2, 6)), int(rng.integers(2, 5)))
        lo, hi = problem.bytes.min(axis=1).sum(), problem.bytes.max(axis=1).sum()
        budget = int(rng.integers(lo - 500, hi + 1))
        expected = brute_force(problem, budget)
        got = optimum(problem, budget)
        if expected is None:
            assert got is None
        else:
            assert got is not None and abs(got.damage - expected) < 1e-9 and got.bytes <= budget
            assert got.gap == 0.0


def test_infeasible_names_the_exact_minimum():
    rng = np.random.default_rng(1)
    problem = random_problem(rng, 4, 3)
    minimum = int(problem.bytes.min(axis=1).sum())
    assert minimum_bytes(problem) == minimum
    with pytest.raises(CardfitError, match="minimum achievable is"):
        solve(problem, minimum - 1)
    assert solve(problem, minimum).bytes == minimum


def test_same_format_constraint_holds():
    rng = np.random.default_rng(2)
    problem = random_problem(rng, 4, 3)
    problem.same_format = [[0, 1, 2]]
    budget = int(problem.bytes.mean(axis=1).sum())
    sol = optimum(problem, budget)
    assert sol.choice[0] == sol.choice[1] == sol.choice[2]


def test_frontier_is_exact_and_monotone():
    rng = np.random.default_rng(3)
    problem = random_problem(rng, 4, 3)
    points = frontier(problem)
    assert points[0]["bytes"] <= problem.bytes.max(axis=1).sum()
    assert points[-1]["bytes"] == minimum_bytes(problem)
    for a, b in zip(points, points[1:]):
        assert b["bytes"] < a["bytes"] and b["damage"] >= a["damage"] - 1e-12
    for p in points:  # each point is the optimum at its own budget
        assert abs(brute_force(problem, p["bytes"]) - p["damage"]) < 1e-9


def test_plan_on_a_real_scan(tiny_models, tmp_path, run_cli):
    import json

    from test_scan import run_scan, small_text

    out = tmp_path / "map.json"
    data = run_scan(tiny_models["llama"], small_text(tmp_path), out)
    problem = Problem.from_map(data)
    budget = int((problem.bytes.min(axis=1).sum() + problem.bytes.max(axis=1).sum()) / 2)
    code, stdout, err = run_cli("plan", out, "--weight-budget", str(budget), "--out", tmp_path / "r.json",
                                "--pin", "lm_head=Q8_0")
    assert code == 0, err
    recipe = json.loads((tmp_path / "r.json").read_text())
    assert recipe["bytes"] <= budget and recipe["solver"]["proven_optimal"]
    assert next(g for g in recipe["groups"] if g["name"] == "lm_head")["format"] == "Q8_0"
    assert "predicted damage" in stdout
    code, _, err = run_cli("plan", out, "--weight-budget", "1000", "--out", tmp_path / "r2.json")
    assert code == 2 and "minimum achievable is" in err and not (tmp_path / "r2.json").exists()


def test_plan_size_is_the_whole_files_and_needs_the_model(tiny_models, tmp_path, run_cli):
    """`plan --size` budgets the whole file: the model's GGUF header is reserved beside the tensors; without
    --model, or beside another budget, it is refused in one line and nothing is written."""
    import json

    from cardfit.pack import reserve_bytes
    from cardfit.sources import open_model

    from test_scan import run_scan, small_text

    model = tiny_models["llama"]
    out = tmp_path / "map.json"
    data = run_scan(model, small_text(tmp_path), out)
    problem = Problem.from_map(data)
    reserve = reserve_bytes(open_model(model), "llama.cpp")
    size = reserve + int((problem.bytes.min(axis=1).sum() + problem.bytes.max(axis=1).sum()) / 2)
    recipe_path = tmp_path / "r.json"
    code, _, err = run_cli("plan", out, "--size", str(size), "--model", model, "--out", recipe_path)
    assert code == 0, err
    recipe = json.loads(recipe_path.read_text())
    assert recipe["budget"] == {"weight_budget_bytes": size, "file_size_bytes": size}
    assert recipe["reserved_bytes"] == reserve and recipe["bytes"] + reserve <= size
    for args, said in ((["--size", str(size)], "add --model"),
                       (["--size", str(size), "--model", model, "--weight-budget", "1MiB"], "give one of them"),
                       (["--size", str(size), "--model", model, "--vram", "1GiB"], "give one of them")):
        code, _, err = run_cli("plan", out, *args, "--out", tmp_path / "r2.json")
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r2.json").exists()


def test_frontier_plot_renders(tmp_path):
    from cardfit.plots import plot_frontier

    rng = np.random.default_rng(4)
    problem = random_problem(rng, 5, 3)
    points = frontier(problem)
    path = tmp_path / "frontier.png"
    plot_frontier(points, problem, path, chosen=(points[1]["bytes"], points[1]["damage"]))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_recipe_says_what_is_stored(tiny_model, calib_text, tmp_path):
    """A norm planned "at Q2_K" is stored F32: the recipe's `stored_as`, plan's summary and fit's report say so."""
    from pathlib import Path
    from types import SimpleNamespace

    from cardfit.fit import render_report
    from cardfit.plan import plan, render_recipe
    from cardfit.scan import scan

    data = scan(tiny_model("llama"), calib_text, max_tokens=128, seq_len=64, formats="Q8_0,Q2_K",
                out=tmp_path / "map.json", progress=False)
    low, high = (sum(g["bytes"][f] for g in data["groups"]) for f in ("Q2_K", "Q8_0"))
    recipe = plan(tmp_path / "map.json", (low + high) // 2)
    storage = {g["name"]: g["storage"] for g in data["groups"]}
    groups = {g["name"]: g for g in recipe["groups"]}
    for name, g in groups.items():
        assert g["stored_as"] == storage[name][g["format"]]  # the map's own storage at the chosen format
    norm = groups["norm"]
    assert norm["stored_as"] == ["F32"] and norm["bytes"] == norm["largest_bytes"]
    layer = groups["layers.0"]
    assert layer["format"] in ("Q8_0", "Q2_K") and "F32" in layer["stored_as"]  # its matrices, and its norms

    summary = render_recipe(recipe)
    assert "1 at F32" in summary and "at Q2_K" not in summary  # rows of 64 that Q2_K cannot block store as Q4_0
    downgrades = sum(1 for g in recipe["groups"] if g["format"] == "Q2_K" and g["bytes"] < g["largest_bytes"])
    assert f"downgrades from Q8_0: {downgrades}" in summary

    b = SimpleNamespace(vram_bytes=2**30, context=512, batch=1, kv_dtype="f16", kv_bytes=0, runtime="llama.cpp",
                        overhead_bytes=0, weight_budget_bytes=recipe["budget"]["weight_budget_bytes"])
    packed = {"format": "gguf", "method": "rtn", "counted_bytes": recipe["bytes"], "margin_bytes": 0}
    report = render_report(b, data, recipe, packed, None, Path("model.gguf"))
    assert "| norm | F32 |" in report and "| group | stored as |" in report
    assert f"| layers.0 | {'Q8_0' if layer['format'] == 'Q8_0' else 'Q4_0'} |" in report

    # a map without `storage` (older scans) plans as before, without `stored_as`
    for g in data["groups"]:
        g.pop("storage")
    old = plan(data, (low + high) // 2)
    assert all("stored_as" not in g for g in old["groups"])
    assert [(g["name"], g["format"], g["bytes"]) for g in old["groups"]] == \
        [(g["name"], g["format"], g["bytes"]) for g in recipe["groups"]]
    assert "downgrades from Q8_0" in render_recipe(old)


def test_the_solver_is_quiet_and_the_terminal_is_not(capfd):
    """What C code prints to descriptor 1 inside solver_quiet (HiGHS's debug lines) never reaches the terminal,
    even from C's buffer; what is printed before and after it does."""
    import ctypes

    from cardfit.solver import solver_quiet

    libc = ctypes.CDLL(None)
    print("before", flush=True)
    with solver_quiet():
        libc.printf(b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
    print("after", flush=True)
    assert capfd.readouterr().out == "before\nafter\n"
