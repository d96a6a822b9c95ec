"""The adaptive scan's two rules: how wrong the scaled signal is, and which estimated cells can decide a plan."""

import math

import numpy as np
import pytest

from cardfit.scan.adaptive import BAND, deciding_cells, optimist_cells, scaled_estimates, signal_error
from cardfit.solver import Problem


def cell(damage: float, signal: float, measured: bool) -> dict:
    out = {"damage": damage, "stderr": None, "top1": None, "signal": signal}
    return out if measured else {**out, "method": "estimate"}


def test_signal_error_is_the_leave_one_out_log_error_of_the_scaled_estimate():
    """Group a has two measured cells (each predicted by the other: log ratios 0.2 and -0.2 apart by 0.4);
    group b one (predicted by the pooled median of a's ratios, 0.0). RMS of (0.4, -0.4, 0.3)."""
    groups = [{"cells": {"A": cell(math.exp(0.2), 1.0, True), "B": cell(math.exp(-0.2) * 2, 2.0, True),
                         "C": cell(5.0, 5.0, False)}},
              {"cells": {"A": cell(math.exp(0.3) * 3, 3.0, True), "B": cell(1.0, 1.0, False)}}]
    want = math.sqrt((0.4 ** 2 + 0.4 ** 2 + 0.3 ** 2) / 3)
    assert signal_error(groups, ["A", "B", "C"]) == pytest.approx(want)
    assert signal_error(groups[1:], ["A", "B", "C"]) is None  # one measured cell predicts nothing
    # the estimates are scaled by their own group's measured cells, or the pooled median without any
    estimates = scaled_estimates(groups, ["A", "B", "C"])
    assert estimates[(0, "C")] == pytest.approx(5.0)  # geometric mean of e^0.2 and e^-0.2
    assert estimates[(1, "B")] == pytest.approx(math.exp(0.3))


def test_cells_under_the_engine_s_resolution_neither_scale_nor_judge_the_signal():
    """A measured damage under RESOLUTION of the largest (a format on the grid the weights already lie on) may be
    arithmetic: with
    it the error would be dominated by a ratio that says nothing of the signal; without it the group's scale and
    the error come from the cells that carry damage."""
    from cardfit.scan.adaptive import RESOLUTION

    tiny = RESOLUTION / 10 * 3.0  # under the share of the largest measured damage (group b's 3.0)
    groups = [{"cells": {"A": cell(math.exp(0.1), 1.0, True), "B": cell(2 * math.exp(-0.1), 2.0, True),
                         "C": cell(tiny, tiny / 20, True), "D": cell(4.0, 4.0, False)}},
              {"cells": {"A": cell(3.0, 3.0, True)}}]
    assert signal_error(groups, list("ABCD")) == pytest.approx(math.sqrt((0.2 ** 2 + 0.2 ** 2 + 0.0) / 3))
    assert scaled_estimates(groups, list("ABCD"))[(0, "D")] == pytest.approx(4.0)


def problem(damage) -> Problem:
    """Three groups, formats big (2 bytes) and small (1 byte)."""
    damage = np.array(damage, dtype=float)
    g = damage.shape[0]
    return Problem([f"g{i}" for i in range(g)], ["big", "small"], damage, np.tile([2, 1], (g, 1)),
                   np.ones_like(damage, dtype=bool), [])


def test_a_cell_is_measured_when_its_optimistic_damage_would_enter_the_plan():
    """Budget 5 bytes: two groups stay big, one goes small — the one whose small costs least (g2, 0.10).
    g1's small is estimated at 0.12, within the band of 0.10: it could be the cheaper, so it is measured,
    with g2's estimated big that the plan through it takes. g0's small (1.0) is far outside."""
    p = problem([[0.0, 1.0], [0.0, 0.12], [0.0, 0.10]])
    estimated = {(g, j) for g in range(3) for j in range(2)} - {(0, 0), (1, 0), (2, 1)}
    choice = [0, 0, 1]
    error = 0.1  # exp(2 * 0.1) = 1.22: 0.12 / 1.22 = 0.098 < 0.10
    assert math.exp(BAND * error) > 0.12 / 0.10
    assert deciding_cells(p, [5], [choice], estimated, error) == {(1, 1), (2, 0)}  # (2, 0): the optimist's
    # a more accurate signal clears it: 0.12 / exp(2 * 0.05) = 0.109 > 0.10
    assert deciding_cells(p, [5], [choice], estimated, 0.05) == set()
    # an estimated chosen cell is always measured; with no error known yet, only the choices are
    estimated |= {(2, 1)}
    assert deciding_cells(p, [5], [choice], estimated, None) == {(2, 1)}
    assert (2, 1) in deciding_cells(p, [5], [choice], estimated, 0.05)
    # once the choices are measured and still no error is known, every estimated cell is
    assert deciding_cells(p, [5], [choice], estimated - {(2, 1)}, None) == estimated - {(2, 1)}


def test_cells_each_within_the_band_that_together_hide_a_better_plan_are_measured():
    """Budget 5 of 7 bytes: h going tiny (measured 0.19) frees the two bytes, or g0 and g1 going small
    (estimated 0.11 each, truly 0.08). Lowered one at a time by the band (1.22) the pair costs 0.20 and is
    not taken; lowered together 0.18 — so both are measured, though neither alone would be."""
    from dataclasses import replace

    from cardfit.solver import optimum

    damage = np.array([[0.0, 0.11, 9.0], [0.0, 0.11, 9.0], [0.0, 9.0, 0.19]])
    size = np.array([[2, 1, 1], [2, 1, 1], [3, 2, 1]])
    allowed = np.array([[True, True, False], [True, True, False], [True, False, True]])
    p = Problem(["g0", "g1", "h"], ["big", "small", "tiny"], damage, size, allowed, [])
    estimated, choice, error = {(0, 1), (1, 1)}, [0, 0, 2], 0.1
    assert list(optimum(p, 5).choice) == choice
    for g, j in estimated:  # alone, neither enters the plan
        lowered = replace(p, damage=damage.copy())
        lowered.damage[g, j] /= math.exp(BAND * error)
        assert list(optimum(lowered, 5).choice) == choice
    assert deciding_cells(p, [5], [choice], estimated, error) == {(0, 1), (1, 1)}
    assert optimist_cells(p, [5], estimated, math.exp(BAND * error)) == {(0, 1), (1, 1)}


def test_the_dual_bound_prunes_only_cells_the_plan_would_not_take(monkeypatch):
    """On random plans, with vLLM-style tied groups too: the cells found with the dual bound's pruning are
    exactly those found by solving again for every cell, from fewer solves; the bound is a true lower bound."""
    from dataclasses import replace

    import cardfit.scan.adaptive
    from cardfit.scan.adaptive import dual_bound
    from cardfit.solver import optimum

    solves = []
    monkeypatch.setattr(cardfit.scan.adaptive, "optimum", lambda *a, **k: solves.append(1) or optimum(*a, **k))
    rng = np.random.default_rng(7)
    bits = np.array([8.5, 6.56, 5.5, 4.5, 3.44, 2.63])
    solved_for_every_cell = 0
    for trial in range(12):
        g = int(rng.integers(4, 9))
        size = (rng.integers(1, 6, size=(g, 1)) * 1000 * bits[None, :] / 8).astype(np.int64)
        damage = np.exp(-0.8 * bits[None, :]) * rng.lognormal(0, 1, (g, 1)) * rng.lognormal(0, 0.3, (g, 6))
        allowed = rng.random((g, 6)) > 0.1
        allowed[:, -1] = True
        tied = [[0, 1]] if trial % 3 == 0 else []
        p = Problem([f"g{i}" for i in range(g)], [f"f{j}" for j in range(6)], damage, size, allowed, tied)
        budget = int(size[:, -1].sum() + rng.random() * (size[:, 0].sum() - size[:, -1].sum()))
        choice = optimum(p, budget).choice
        lam, least = dual_bound(p, budget)
        assert least.sum() - lam * budget <= sum(damage[i, c] for i, c in enumerate(choice)) + 1e-15
        estimated = {(i, j) for i in range(g) for j in range(6)} - {(i, c) for i, c in enumerate(choice)}
        error = 0.3
        brute = set()
        for i, j in estimated:
            lowered = replace(p, damage=damage.copy())
            lowered.damage[i, j] = damage[i, j] / math.exp(BAND * error)
            solved = optimum(lowered, budget)
            if allowed[i, j] and solved is not None and solved.choice[i] == j:
                brute.add((i, j))
        found = deciding_cells(p, [budget], [choice], estimated, error)
        assert found == brute | optimist_cells(p, [budget], estimated, math.exp(BAND * error)), trial
        before = len(solves)
        with monkeypatch.context() as large:  # a plan too large to solve per cell: the bound alone (a superset)
            large.setattr("cardfit.scan.adaptive.SOLVE_CELLS", 0)  # and the optimist's one solve
            assert deciding_cells(p, [budget], [choice], estimated, error) >= brute and len(solves) == before + 1
        solved_for_every_cell += len(estimated)
    assert len(solves) < solved_for_every_cell / 2


def test_the_pricing_clock_says_what_is_left_by_the_work_done():
    """At the first group and each further quarter: the share of the work (values x formats) and the time
    taken, then the rest at the pace since the first group (what came before it is paid once); nothing once all
    is priced."""
    from types import SimpleNamespace

    from cardfit.groups import Group
    from cardfit.scan import PricingClock

    def tensor(*shape):
        return SimpleNamespace(shape=shape, name="w")

    groups = [Group("embed", [tensor(100, 10)], -1), Group("layers.0", [tensor(10, 10), tensor(10)], 0),
              Group("layers.1", [tensor(30, 10)], 1)]
    todo = [(0, groups[0], "A"), (1, groups[1], "A"), (1, groups[1], "B"), (2, groups[2], "A")]
    said, now = [], iter([0.0, 10.0, 20.0, 30.0])
    clock = PricingClock(groups, todo, said.append, clock=lambda: next(now))
    clock.priced(1)  # 2 x 100 of 1,500 values x formats: the first group, said
    clock.priced(0)  # 1,200 of 1,500: a quarter more, said
    clock.priced(2)  # all: nothing left to say
    assert said == ["priced 13% of the cells' work in 10 s",
                    "priced 80% of the cells' work in 20 s: about 0.1 minutes left"]
    said.clear()
    clock = PricingClock(groups, todo, said.append, clock=lambda: 1.0)
    clock.priced(2)
    clock.priced(1)  # 500 of 1,500 after 300: under a quarter more, not said
    assert len(said) == 1
    said.clear()
    now = iter([0.0, 100.0, 1100.0])  # a 100-second walk, then 1,000 values x formats in 1,000 s
    clock = PricingClock(groups, [(0, groups[0], "A"), (2, groups[2], "A"), (1, groups[1], "A")], said.append,
                         clock=lambda: next(now))
    clock.priced(2)  # 300 of 1,400
    clock.priced(0)  # 1,300: 1,000 more in 1,000 s, so the last 100 take 100 s (not 1,100 s x 100 / 1,300)
    assert said == ["priced 21% of the cells' work in 100 s",
                    "priced 93% of the cells' work in 1100 s: about 1.7 minutes left"]
