"""ZeRO memory per GPU by stage (0-3), for one model and GPU count: stacked bars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure


def zero_bars(rows: Sequence[Mapping[str, float]], capacity_bytes: float | None = None,
              title: str = "") -> Figure:
    """Stacked bars of params / grads / optimizer bytes per GPU for each row's ``label``."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
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


