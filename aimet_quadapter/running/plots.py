"""Figures people would rather look at than read: the paper's Fig. 4 and Fig. 5, for our runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: runs happen on headless machines
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def save_figure(fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_phase1_curves(losses: dict[str, list[float]], path: str | Path, sites: Sequence[str] | None = None) -> Path:
    """Phase-1 loss per step for ``sites`` (default: the first and the last site, as in Fig. 5)."""
    names = list(sites) if sites else ([next(iter(losses)), list(losses)[-1]] if losses else [])
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * max(len(names), 1), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names):
        ax.plot(losses[name])
        ax.set(yscale="log", xlabel="step", ylabel="block L2 error")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    return save_figure(fig, path)


def plot_channel_ranges(
    before: tuple[torch.Tensor, torch.Tensor], after: tuple[torch.Tensor, torch.Tensor], path: str | Path, title: str
) -> Path:
    """Per-channel min/max of an activation before and after Quadapter (Fig. 4); dotted: the tensor's range."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2), sharey=False)
    for ax, (lo, hi), label in zip(axes, (before, after), ("before Quadapter", "after Quadapter")):
        lo, hi = lo.cpu(), hi.cpu()
        x = range(len(lo))
        ax.plot(x, hi.numpy(), lw=0.8, color="tab:red", label="per-channel max")
        ax.plot(x, lo.numpy(), lw=0.8, color="tab:blue", label="per-channel min")
        ax.axhline(float(hi.max()), ls=":", color="tab:red")
        ax.axhline(float(lo.min()), ls=":", color="tab:blue")
        ax.set_title(f"{title}: {label}", fontsize=9)
        ax.set_xlabel("channel")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save_figure(fig, path)
