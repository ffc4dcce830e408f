"""Int8 on the roofline: where decoding and training matmuls sit, and the speed-up bound.

Left: the GPU's roof at fp16 and at int8 (log-log, attainable FLOP/s against FLOP per byte),
with one decoder layer's decode step at several batch sizes (fp16 weights, int8 weights) and a
training matmul.  Right: the upper bound on decode speed-up from int8 weights against batch
size, for a few context lengths, with Claim 001-14's "3x faster" for reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

from labsim.hardware import GPU
from labsim.hardware import gpu as _gpu
from labsim.plots._figure import new_figure
from labsim.quantization import decode_cost, int8_decode_speedup, llama2_7b, matmul_cost
from labsim.workload import Transformer


def int8_decode(
    gpu: GPU | str = "H100-SXM",
    model: Transformer | None = None,
    *,
    batches: Sequence[int] = (1, 4, 16, 64, 256),
    context: int = 1024,
    contexts: Sequence[int] = (0, 1024, 8192),
    training_tokens: int = 8192,
) -> Figure:
    """Two panels: decode on the roofline, and the int8 speed-up bound against batch size."""
    g = _gpu(gpu)
    layer = model if model is not None else llama2_7b()
    fig = new_figure((11, 4.3), layout="constrained")
    ax, bx = fig.subplots(1, 2)
    x = np.logspace(-1, 4, 256)
    for dtype, style in (("fp16", "-"), ("int8", "--")):
        ax.loglog(x, np.minimum(g.peak(dtype), x * g.memory_bandwidth_Bps), "k" + style,
                  lw=1, label=f"roof, {dtype} peak {g.peak(dtype) / 1e12:.0f} T/s")
    for weights, compute, marker, colour in (
        ("fp16", "fp16", "o", "C0"),
        ("int8", "int8", "s", "C1"),
    ):
        pts = [decode_cost(g, layer, batch=b, context=context, weights=weights, compute=compute)
               for b in batches]
        ax.plot([p.intensity for p in pts], [p.flops / p.time_s for p in pts], marker,
                color=colour, label=f"decode, {weights} weights (batch {batches[0]}..."
                f"{batches[-1]}, context {context})")
    h = layer.hidden
    for dtype, colour in (("fp16", "C2"), ("int8", "C3")):
        mm = matmul_cost(g, training_tokens, h, h, dtype=dtype)
        ax.plot([mm.intensity], [mm.flops / mm.time_s], "*", ms=12, color=colour,
                label=f"training matmul {training_tokens}x{h}x{h}, {dtype}")
    ax.set_xlabel("arithmetic intensity (FLOP or OP per byte moved)")
    ax.set_ylabel("attainable FLOP/s (OP/s for int8)")
    ax.set_title(f"{g.name}: one {layer.name} layer on the roofline")
    ax.legend(fontsize=7, loc="lower right")

    bs = np.unique(np.logspace(0, np.log10(max(batches) * 4), 40).astype(int))
    for i, ctx in enumerate(contexts):
        for act, style in ((False, "-"), (True, ":")):
            s = [int8_decode_speedup(g, layer, batch=int(b), context=ctx, activations_int8=act)
                 for b in bs]
            kind = "W8A8" if act else "weight-only"
            bx.semilogx(bs, s, style, color=f"C{i}", label=f"context {ctx}, {kind}")
    bx.axhline(3.0, color="red", lw=0.8, ls="--", label='Claim 001-14: "3x faster"')
    bx.set_ylim(0.9, 4.2)
    bx.set_xlabel("batch (sequences decoded together)")
    bx.set_ylabel("upper bound on speed-up (x)")
    bx.set_title("int8 weights vs fp16: decode speed-up bound")
    bx.legend(fontsize=7)
    return fig
