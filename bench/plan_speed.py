"""Planner speed: random 500-group x 8-format instances solved to proven optimality.

    python bench/plan_speed.py [--groups 500] [--formats 8] [--trials 5]
"""

import argparse
import time

import numpy as np

from cardfit.solver import Problem, optimum


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--formats", type=int, default=8)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| trial | groups x formats | budget position | seconds | gap |")
    print("|---|---|---|---|---|")
    for trial in range(args.trials):
        size = np.sort(rng.integers(10**6, 10**8, size=(args.groups, args.formats)), axis=1)[:, ::-1].copy()
        damage = np.sort(rng.random((args.groups, args.formats)) ** 3, axis=1)
        problem = Problem([f"g{i}" for i in range(args.groups)], [f"f{j}" for j in range(args.formats)], damage,
                          size, np.ones_like(size, dtype=bool), [])
        lo, hi = size.min(axis=1).sum(), size.max(axis=1).sum()
        position = 0.2 + 0.15 * trial
        budget = int(lo + position * (hi - lo))
        start = time.time()
        solution = optimum(problem, budget)
        spent = time.time() - start
        print(f"| {trial} | {args.groups} x {args.formats} | {position:.2f} | {spent:.2f} | {solution.gap} |", flush=True)


if __name__ == "__main__":
    main()
