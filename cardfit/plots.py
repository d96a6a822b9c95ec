"""Pictures: the Pareto frontier with the shelf's uniform formats on the same axes."""

from __future__ import annotations

from pathlib import Path

from .atomic import atomic_path


def plot_frontier(points: list[dict], problem, path: str | Path, chosen: tuple[int, float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = 2**20
    ax.step([p["bytes"] / mib for p in points], [p["damage"] for p in points], where="post",
            label="cardfit optimum (exact frontier)")
    for j, f in enumerate(problem.formats):
        if problem.allowed[:, j].all():
            ax.scatter(problem.bytes[:, j].sum() / mib, problem.damage[:, j].sum(), marker="s", zorder=3)
            ax.annotate(f"uniform {f}", (problem.bytes[:, j].sum() / mib, problem.damage[:, j].sum()),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    if chosen:
        ax.scatter(chosen[0] / mib, chosen[1], marker="*", s=160, color="red", zorder=4, label="chosen recipe")
    ax.set_xlabel("weights (MiB)")
    ax.set_ylabel("predicted damage (summed KL, nats/token)")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)
