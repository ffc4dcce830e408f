"""What a step costs, as a learner reads it: ``StepResult``.

``result_from`` turns an evaluated schedule (its end, each stage's compute-busy seconds) and the
step's ``StepCosts`` into step time, tokens/s, MFU/HFU, the memory breakdown, a time breakdown
and an error band from the validation on published runs (``labsim.bands``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from labsim.bands import ErrorBand, error_band
from labsim.memory import MemoryBreakdown
from labsim.plan import Plan
from labsim.step.costs import StepCosts
from labsim.trace import Span, Trace


@dataclass(frozen=True)
class StepResult:
    """Outcome of ``simulate_step`` or ``estimate_step``.

    step_time_s: one optimizer step (``band``: how far to trust it); tokens_per_s: global
        tokens per second;
    model_flops_per_gpu_s: model FLOP/s per GPU (no recomputation counted);
    mfu / hfu: model / hardware FLOPs utilisation against the dense peak of the plan's
        16-bit (or fp32) dtype, with ``Plan(fp8=...)`` too (NeMo quotes an FP8 run's MFU
        against the FP8 peak: half of this on an H100);
    bubble_fraction: idle fraction of the stages' compute from the step's start to the last
        backward, averaged over stages;
    memory: ``MemoryBreakdown`` of the first stage's GPU (None when not asked for);
    fits: memory.total <= GPU memory; breakdown: seconds by kind on stage 0 (empty for the
        closed form); trace: every op, message, bucket and optimizer step (built on first use;
        empty for the closed form); costs: the ``StepCosts`` it was computed from.
    """

    step_time_s: float
    tokens_per_s: float
    model_flops_per_gpu_s: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory: MemoryBreakdown | None
    fits: bool
    gpu_memory_bytes: float
    plan: Plan = field(repr=False)
    span_source: object = field(default=None, repr=False, compare=False)
    costs: StepCosts | None = field(default=None, repr=False, compare=False)

    @cached_property
    def spans(self) -> list:
        """Raw spans (stage, stream, kind, start, end, label, bytes), built on first use."""
        src = self.span_source
        return list(src() if callable(src) else (src or []))

    @cached_property
    def breakdown(self) -> dict[str, float]:
        """Seconds by span kind on stage 0 (empty for the closed form)."""
        out: dict[str, float] = {}
        for s, _, kind, a, b, _, _ in self.spans:
            if s == 0:
                out[kind] = out.get(kind, 0.0) + b - a
        return out

    @cached_property
    def trace(self) -> Trace:
        """The step's ``Trace`` (built from the raw spans on first access)."""
        chunked = self.plan.virtual_stages > 1
        return Trace((Span(s, stream, kind, a, b, label if isinstance(label, str) else
                           _label(label, chunked), nbytes)
                      for s, stream, kind, a, b, label, nbytes in self.spans), detail="op",
                     rank_label="pipeline stage")

    @property
    def band(self) -> ErrorBand:
        """How far to trust ``step_time_s``: the median and largest error of published runs
        of this software's stack predicted with that stack left out of the fit
        (``labsim.bands``); a mixture-of-experts model's says how few published MoE runs
        stand behind its MoE layers."""
        band = error_band(self.plan.software)
        if self.costs is not None and self.costs.model.experts:
            return replace(band, basis=band.basis + "; its MoE layers checked on three "
                                                    "published runs only (Mixtral 8x7B, "
                                                    "Grok-1; docs/step.md section 3)")
        return band

    def __getstate__(self) -> dict:
        """Pickle the spans, not the engine that can build them (to send a result from a
        worker process)."""
        state = dict(self.__dict__)
        state["span_source"] = self.spans
        for built in ("spans", "trace"):
            state.pop(built, None)
        return state

    @property
    def peak_memory_bytes(self) -> float:
        """Peak bytes per GPU (first pipeline stage)."""
        return float(self.memory.total)

    def __repr__(self) -> str:
        if self.memory is None:
            mem = "memory not estimated"
        else:
            mem = (f"memory {self.peak_memory_bytes / 1e9:.4g} GB of "
                   f"{self.gpu_memory_bytes / 1e9:.4g} GB: "
                   + ("fits" if self.fits else "DOES NOT FIT"))
        return (
            f"StepResult(step {self.step_time_s:.4g} s (typically ±{self.band.typical:.0%}), "
            f"{self.tokens_per_s:.4g} tokens/s, "
            f"{self.model_flops_per_gpu_s / 1e12:.4g} TFLOP/s/GPU, MFU {self.mfu:.1%}, "
            f"HFU {self.hfu:.1%}, bubble {self.bubble_fraction:.1%}, {mem})"
        )

    def _repr_html_(self) -> str:
        rows = [("step time", f"{self.step_time_s:.4g} s, {self.band.describe()}"),
                ("tokens/s", f"{self.tokens_per_s:,.0f}"),
                ("model TFLOP/s per GPU", f"{self.model_flops_per_gpu_s / 1e12:.1f}"),
                ("MFU / HFU", f"{self.mfu:.1%} / {self.hfu:.1%}"),
                ("pipeline bubble", f"{self.bubble_fraction:.1%}")]
        if self.memory is not None:
            m = self.memory
            rows.append(("memory per GPU (first stage)",
                         f"{m.total / 1e9:.3g} GB of {self.gpu_memory_bytes / 1e9:.3g} GB "
                         f"({'fits' if self.fits else '<b>does not fit</b>'}): params "
                         f"{m.params / 1e9:.3g}, grads {m.grads / 1e9:.3g}, optimizer "
                         f"{m.optimizer / 1e9:.3g}, activations {m.activations / 1e9:.3g} GB"))
        rows += [(f"stage 0: {k}", f"{v:.4g} s") for k, v in
                 sorted(self.breakdown.items(), key=lambda kv: -kv[1])]
        body = "".join(f"<tr><td>{k}</td><td>{v}</td></tr>" for k, v in rows)
        return f"<table><caption>training step</caption>{body}</table>"


def _label(raw: tuple, chunked: bool) -> str:
    """A raw op label (kind, micro-batch, chunk[, "send"]) as text: "F3", "B0 chunk 5"."""
    text = f"{raw[0]}{raw[1]}" + (f" chunk {raw[2]}" if chunked else "")
    return f"send {text}" if len(raw) > 3 else text


def result_from(costs: StepCosts, step_s: float, busy: list[float], compute_end: float,
                memory: MemoryBreakdown | None, spans: object) -> StepResult:
    """The ``StepResult`` of a step of ``step_s`` seconds whose stages computed ``busy``
    seconds each until ``compute_end``."""
    plan, model, gpu = costs.plan, costs.model, costs.cluster.gpu
    flops_model, flops_hw = costs.flops
    gpus = costs.cluster.world_size
    peak = gpu.peak(plan.numerics.peak_dtype(gpu)) * gpus
    bubble = sum(1.0 - b / compute_end for b in busy) / len(busy) if compute_end > 0 else 0.0
    return StepResult(
        step_time_s=step_s,
        tokens_per_s=plan.global_batch * model.seq_len / step_s,
        model_flops_per_gpu_s=flops_model / step_s / gpus,
        mfu=flops_model / step_s / peak,
        hfu=flops_hw / step_s / peak,
        bubble_fraction=max(0.0, bubble),
        memory=memory,
        fits=memory is None or memory.total <= gpu.memory_bytes,
        gpu_memory_bytes=gpu.memory_bytes,
        plan=plan,
        span_source=spans,
        costs=costs,
    )

