"""Plots of data-parallel studies: exposed communication vs bucket size, scaling efficiency,
and ZeRO memory per GPU by stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from labsim.plots._figure import new_figure
from labsim.plots.series import efficiency


def bucket_curve(rows: Sequence[Mapping[str, float]], title: str = "") -> Figure:
    """Exposed and total communication seconds against bucket size (log-log)."""
    fig = new_figure((6, 3.4))
    ax = fig.subplots()
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
    return efficiency(series, "gpus", xlabel="GPUs (data parallel)",
                      title=title or "weak scaling of data parallelism")


