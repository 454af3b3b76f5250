"""The learning curve the example scripts write (needs matplotlib)."""
from __future__ import annotations

import os

import torch

__all__ = ["plot_curve"]


def plot_curve(frames: list[int], returns: list[float], window: int, target: float, path: str, title: str) -> None:
    """Every episode's return and the mean of the last ``window`` against frames, with the
    ``target`` line, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(frames, returns, ".", ms=3, alpha=0.4, label="episode return")
    if returns:
        r = torch.tensor(returns)
        smooth = [r[max(0, i - window + 1): i + 1].mean().item() for i in range(len(r))]
        ax.plot(frames, smooth, lw=2, label=f"mean of last {window}")
    ax.axhline(target, color="k", ls="--", lw=1, label=f"target {target:g}")
    ax.set_xlabel("frames")
    ax.set_ylabel("return")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
