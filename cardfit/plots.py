"""Pictures: the Pareto frontier, the sensitivity heat map, and the comparison with the shelf."""

from __future__ import annotations

from pathlib import Path

from .atomic import atomic_path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, dpi: int) -> None:
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)


def plot_frontier(points: list[dict], problem, path: str | Path, chosen: tuple[int, float] | None = None) -> None:
    plt = _pyplot()

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
    _save(fig, path, dpi=120)


def plot_sensitivity(sensitivity: dict, path: str | Path) -> None:
    """Groups x formats, damage on a log colour scale: where the model is fragile at a glance."""
    plt = _pyplot()
    import numpy as np
    from matplotlib.colors import LogNorm

    formats = sensitivity["formats"]
    names = [g["name"] for g in sensitivity["groups"]]
    damage = np.array([[g["cells"].get(f, {}).get("damage", np.nan) for f in formats]
                       for g in sensitivity["groups"]], dtype=float)
    positive = damage[np.isfinite(damage) & (damage > 0)]
    floor = positive.min() if positive.size else 1e-6
    shown = np.where(damage > 0, damage, floor)
    fig, ax = plt.subplots(figsize=(2.2 + 0.9 * len(formats), 1.5 + 0.22 * len(names)))
    image = ax.imshow(shown, aspect="auto", cmap="magma_r",
                      norm=LogNorm(vmin=floor, vmax=max(float(np.nanmax(shown)), floor * 10)))
    ax.set_xticks(range(len(formats)), formats)
    ax.set_yticks(range(len(names)), names, fontsize=7)
    ax.set_xlabel("format")
    ax.set_title(f"damage (mean KL, nats/token) — {sensitivity['model']['name']}", fontsize=9)
    fig.colorbar(image, ax=ax, label="KL(P_ref || P_q)")
    fig.tight_layout()
    _save(fig, path, dpi=110)


def plot_compare(rows: list[dict], path: str | Path) -> None:
    """Bytes against measured KLD: the shelf (presets, uniform 4-bit rows) and cardfit at each of its sizes."""
    plt = _pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    mib = 2**20
    kinds = (("shelf", "s", "llama.cpp preset"), ("baseline", "^", "uniform 4-bit (W4A16, NF4)"),
             ("uniform-body", "D", "best uniform body + embed/head type"),
             ("weight-allocator", "v", "weight-error allocator"),
             ("cardfit", "*", "cardfit at <= that size"))  # the F16 floor (~1e-6) would only flatten the axis
    for kind, marker, label in kinds:
        picked = [r for r in rows if r["kind"] == kind and "kld_mean" in r]
        if not picked:
            continue
        ax.scatter([r["bytes"] / mib for r in picked], [r["kld_mean"] for r in picked], marker=marker,
                   s=90 if marker == "*" else 40, label=label, zorder=3)
        if kind in ("shelf", "baseline"):
            for n, r in enumerate(picked):
                ax.annotate(r.get("preset") or r["name"].replace("W4A16-g128 ", "").replace("bitsandbytes ", ""),
                            (r["bytes"] / mib, r["kld_mean"]), textcoords="offset points",
                            xytext=(6, 4) if kind == "shelf" else (6 + 34 * (n % 2), -3), fontsize=8)
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("measured mean KLD vs reference (nats/token)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    _save(fig, path, dpi=120)
