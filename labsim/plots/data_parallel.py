"""Plots of data-parallel studies: exposed communication vs bucket size, scaling efficiency,
and ZeRO memory per GPU by stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure


def bucket_curve(rows: Sequence[Mapping[str, float]], title: str = "") -> Figure:
    """Exposed and total communication seconds against bucket size (log-log)."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = [r["bucket_bytes"] / 1e6 for r in rows]
    ax.loglog(x, [r["comm_s"] for r in rows], "o-", label="communication (all buckets)")
    ax.loglog(x, [max(r["exposed_s"], 1e-6) for r in rows], "s-", label="exposed (not hidden)")
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("seconds per step")
    ax.set_title(title or "exposed communication vs DDP bucket size", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def scaling_curves(series: Mapping[str, Sequence[Mapping[str, float]]],
                   title: str = "") -> Figure:
    """Scaling efficiency against GPU count, one line per labelled series."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for label, rows in series.items():
        ax.semilogx([r["gpus"] for r in rows], [r["efficiency"] for r in rows], "o-",
                    label=label, base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs (data parallel)")
    ax.set_ylabel("scaling efficiency")
    ax.set_title(title or "weak scaling of data parallelism", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def zero_bars(rows: Sequence[Mapping[str, float]], capacity_bytes: float | None = None,
              title: str = "") -> Figure:
    """Stacked bars of params / grads / optimizer bytes per GPU for each row's ``label``."""
    fig, ax = plt.subplots(figsize=(6, 3.4))
    labels = [str(r["label"]) for r in rows]
    bottom = [0.0] * len(rows)
    for key, colour in (("params", "#4C72B0"), ("grads", "#DD8452"),
                        ("optimizer", "#8172B3")):
        vals = [r[key] / 1e9 for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=key, color=colour)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, b in enumerate(bottom):
        ax.text(i, b, f"{b:.3g} GB", ha="center", va="bottom", fontsize=8)
    if capacity_bytes:
        ax.axhline(capacity_bytes / 1e9, color="red", ls="--", lw=1, label="GPU memory")
    ax.set_ylabel("GB per GPU (model states)")
    ax.set_title(title or "ZeRO: model states per GPU", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
