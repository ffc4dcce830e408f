"""One model, one table: your GPT's training step, measured in every lab with what it teaches.

Labs 00 to 05 each add a row to one table of the same small GPT (``TABLE_MODEL``, the "lab GPT"
of lab 00: 2 layers, hidden 128, 4 heads, 256 tokens, vocabulary 512; ``TABLE_BATCH``
sequences, AdamW) trained on this device with one technique switched on:

========  ===============================  ======================================================
lab       technique (``TECHNIQUES``)        how the step changes
========  ===============================  ======================================================
00        ``fp32``                          the baseline: fp32, attention written out
02        ``bf16``                          forward under ``torch.autocast(dtype=torch.bfloat16)``
03        ``checkpoint``                    every block checkpointed (``GPT(recompute=True)``)
04        ``sdpa``                          ``F.scaled_dot_product_attention`` (``GPT(flash=True)``)
04        ``your-attention``                your attention core, e.g. lab 04's FlashAttention-2
05        ``compile``                       ``torch.compile(model)``, as nanoGPT's ``train.py`` does
========  ===============================  ======================================================

A row holds the step's median time with its quartiles, the peak memory the step adds to what
the model and optimizer hold between steps (activations, gradients, temporaries:
``labsim.lab.profile.peak_bytes``), tokens per second, and the MFU on this device: model
FLOPs of the step counted once with ``FlopCounterMode`` (the baseline's forward and backward,
no recomputation; Chowdhery et al. 2022, Appendix B) over the step time and this device's
peak -- the roof you measured in lab 00 when you pass it, else a 512 x 512 fp32 matmul (4096 x
4096 in bf16 and fp32 on a GPU) timed here, on one thread.  Every row is timed on one thread
in interleaved rounds against the fp32 baseline built in the same cell
(``labsim.lab.timing``): the "vs fp32" column is that round-by-round comparison, and says "too
noisy to tell" when the rounds disagree.  A compiled step's first call (tracing and code
generation, or loading from Inductor's cache) is reported apart from its step time.

The table lives in ``my_gpt_step.json`` in the notebook's folder: each lab replaces its own
rows, a row measured on another device is marked, a lab whose rows are missing shows "not
measured yet -- run lab NN", and a folder that cannot be written to leaves the table
unsaved with a note.  No check reads it, and a graded run (``labsim grade``, ``labsim check``:
the guard is installed) measures nothing and touches no file.

``Table.summary()`` ends the table: what each technique bought here, and on an H100 by
labsim's step model (``labsim.estimate_step``) of GPT-2 124M with nanoGPT's 12 x 1024 tokens
per GPU.  There every technique after bf16 is priced on top of bf16 autocast, the way an H100
runs them (FlashAttention's kernels run in fp16 and bf16 only); ``torch.compile``, which the
step model does not price (it counts element-wise kernels as already fused, as Megatron-LM
runs them), is estimated from the element-wise share of that step and the traffic ratio of
lab 05's chain.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from labsim.bands import error_band
from labsim.cluster import Cluster
from labsim.compute import kind_seconds, softmax_seconds
from labsim.hardware import gpu as catalog_gpu
from labsim.lab import guard
from labsim.lab.datasets import random_batch
from labsim.lab.device import cpu_bf16_units, pick_device, synchronize
from labsim.lab.models import GPT, Block
from labsim.lab.profile import peak_bytes
from labsim.lab.timing import Comparison, compare, one_thread, spread, time_interleaved
from labsim.plan import Plan
from labsim.step import StepResult, estimate_step
from labsim.workload import Transformer

TABLE_MODEL = Transformer(layers=2, hidden=128, heads=4, seq_len=256, vocab=512,
                          tied_embeddings=True, name="lab GPT")  # lab 00's GPT, 495,104 params
TABLE_BATCH = 2  # sequences per step: 512 tokens
TABLE_FILE = "my_gpt_step.json"
FORMAT = "labsim my_gpt_step 1"
LR = 1e-3  # AdamW's learning rate (its value does not change the step's cost)

# The H100 column: GPT-2 124M at nanoGPT's per-GPU batch ("12 batch size * 1024 block size",
# karpathy/nanoGPT config/train_gpt2.py), one H100 SXM, one step per micro-batch.
H100_MODEL = Transformer.preset("gpt2-124m")
H100_MICRO_BATCH = 12
# Bytes per element of lab 05's bias + GELU + dropout + residual chain in fp32 with a 1-byte
# mask: 45 as separate ops, 13 fused (``labsim.fusion.chain_bytes`` of
# ``BIAS_GELU_DROPOUT_RESIDUAL``; tests/test_experiments_my_step.py checks the two agree).
EAGER_BYTES_PER_ELEMENT = 45
FUSED_BYTES_PER_ELEMENT = 13
# nanoGPT's README, "efficiency notes" (Dec 29, 2022): torch.compile cut the iteration time of
# its GPT-2 training "from ~250ms / iter to 135ms / iter" (attention written out in its model
# then, flash attention still on its to-do list; the GPU is not stated there).
NANOGPT_COMPILE_SPEEDUP = 250 / 135


@dataclass(frozen=True)
class Technique:
    """One row of the table: its key, the lab that measures it, and how the step changes."""

    key: str
    lab: str
    label: str
    autocast: bool = False
    recompute: bool = False
    flash: bool = False
    compiled: bool = False
    yours: bool = False


TECHNIQUES: dict[str, Technique] = {t.key: t for t in (
    Technique("fp32", "00", "fp32, written-out attention"),
    Technique("bf16", "02", "bf16 autocast", autocast=True),
    Technique("checkpoint", "03", "full activation checkpointing", recompute=True),
    Technique("sdpa", "04", "SDPA attention", flash=True),
    Technique("your-attention", "04", "your attention", yours=True),
    Technique("compile", "05", "torch.compile", compiled=True),
)}
LABS: dict[str, tuple[str, ...]] = {  # the labs that add rows, and their rows
    lab: tuple(k for k, t in TECHNIQUES.items() if t.lab == lab)
    for lab in dict.fromkeys(t.lab for t in TECHNIQUES.values())}
BASELINE = "fp32"


# ------------------------------------------------------------------------- the step


class PluggedBlock(Block):
    """A transformer block whose attention core, causal ``softmax(Q K^T / sqrt(d)) V`` over
    (B, nh, T, hd) tensors, is ``core(q, k, v)``: your own attention in the table's GPT."""

    def __init__(self, cfg: Transformer, core: Callable[..., torch.Tensor]) -> None:
        if cfg.positions != "learned" or cfg.kv_heads != cfg.heads:
            raise ValueError("PluggedBlock takes GPT-2 style blocks (learned positions, as many "
                             "K/V heads as query heads), like the table's model")
        super().__init__(cfg)
        self.core = core

    def attention(self, x: torch.Tensor, rope: Any, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        nh, hd = self.cfg.heads, self.cfg.head_dim
        q, k, v = (z.view(b, t, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
                   for z in self.qkv(x).split(h, dim=-1))
        y = self.core(q, k, v)  # (B, nh, T, hd)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


def _compile(model: torch.nn.Module) -> Callable[..., Any]:
    """``torch.compile(model)`` (one place, so that tests can stand in for the compiler)."""
    return torch.compile(model)


class GPTStep:
    """One AdamW training step of ``TABLE_MODEL`` with ``technique`` on ``device``: calling it
    runs forward, backward and the optimizer step, then frees the gradients (so that a step's
    peak memory counts them).  Every technique starts from the same weights and batch."""

    def __init__(self, technique: Technique, device: torch.device | str = "cpu", *,
                 attention: Callable[..., torch.Tensor] | None = None, seed: int = 0) -> None:
        self.technique, self.device = technique, torch.device(device)
        if technique.yours and attention is None:
            raise ValueError("the 'your-attention' step needs attention=")
        with torch.random.fork_rng(devices=[]):  # the notebook's random state is left alone
            torch.manual_seed(seed)
            model = GPT(TABLE_MODEL, flash=technique.flash, recompute=technique.recompute)
            for i, block in enumerate(model.blocks if technique.yours else []):
                plugged = PluggedBlock(TABLE_MODEL, attention)
                plugged.load_state_dict(block.state_dict())
                model.blocks[i] = plugged
        self.model = model.to(self.device)
        self.forward = _compile(self.model) if technique.compiled else self.model
        self.idx, self.targets = random_batch(TABLE_MODEL, TABLE_BATCH, seed=seed,
                                              device=self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def loss(self) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.technique.autocast):
            return self.forward(self.idx, self.targets)[1]

    def __call__(self) -> None:
        self.loss().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def probe(self) -> tuple[float, float]:
        """(loss, norm of all gradients) of one forward and backward, no optimizer step."""
        loss = self.loss()
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum())
                             for p in self.model.parameters() if p.grad is not None))
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach()), norm


def count_model_flops(device: torch.device | str = "cpu") -> float:
    """Model FLOPs of one step of ``TABLE_MODEL``: ``FlopCounterMode``'s count of the fp32
    baseline's forward and backward (every matmul and the attention scores; no recomputation),
    the MFU numerator of every row."""
    step = GPTStep(TECHNIQUES[BASELINE], device)
    with FlopCounterMode(display=False) as counter:
        step.loss().backward()
    return float(counter.get_total_flops())


# ------------------------------------------------------------------------- rows and the file


@dataclass(frozen=True)
class Peak:
    """This device's peak FLOP/s as the table uses it for MFU, and where it comes from."""

    flops: float
    source: str
    when: str = ""


@dataclass(frozen=True)
class Row:
    """One measured technique.  Times in seconds, memory in bytes; ``vs_fp32`` is the
    round-by-round comparison with the fp32 baseline timed in the same rounds (None for the
    baseline itself); ``compile_s`` the first call of a compiled step."""

    technique: str
    lab: str
    device: str
    step_s: float
    q1_s: float
    q3_s: float
    rounds: int
    peak_bytes: int
    tokens_per_s: float
    model_flops: float
    peak_flops: float
    mfu: float
    vs_fp32: Comparison | None = None
    compile_s: float | None = None
    note: str = ""
    when: str = ""
    torch_version: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["vs_fp32"] = None if self.vs_fp32 is None else asdict(self.vs_fp32)
        return out

    @classmethod
    def from_json(cls, data: Any) -> Row:
        if not isinstance(data, dict) or data.get("technique") not in TECHNIQUES:
            raise ValueError(f"a row names no technique of {tuple(TECHNIQUES)}: {data!r:.80}")
        try:
            values = dict(data)
            if values.get("vs_fp32") is not None:
                values["vs_fp32"] = Comparison(**values["vs_fp32"])
            row = cls(**values)
        except TypeError as exc:
            raise ValueError(f"row {data.get('technique')!r}: {exc}") from None
        numbers = (row.step_s, row.q1_s, row.q3_s, row.tokens_per_s, row.model_flops,
                   row.peak_flops, row.mfu, row.peak_bytes, row.rounds)
        if not all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in numbers):
            raise ValueError(f"row {row.technique!r} holds a time, rate or FLOP count that is "
                             "not a finite number >= 0")
        return row

    @property
    def label(self) -> str:
        return TECHNIQUES[self.technique].label


def device_label(device: torch.device | str | None = None) -> str:
    """The device a row was measured on, as the table names it: the GPU's name, or the CPU's
    model (from ``/proc/cpuinfo`` where Linux has it) on one thread."""
    device = torch.device(device) if device is not None else pick_device()
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return f"CPU {_cpu_model()} (1 thread)"


def _cpu_model() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def model_record() -> dict[str, Any]:
    """The table's model and batch as the file records them (a file for another is refused)."""
    cfg = TABLE_MODEL
    return {"layers": cfg.layers, "hidden": cfg.hidden, "heads": cfg.heads,
            "seq_len": cfg.seq_len, "vocab": cfg.vocab, "params": cfg.params,
            "batch": TABLE_BATCH, "optimizer": "AdamW"}


@dataclass
class Table:
    """The running table: rows by technique, this device's peak, notes of this session.

    ``device`` is the device this session runs on: rows measured elsewhere are marked.
    ``print(table)`` shows it; ``table.summary()`` adds what each technique bought here and
    on an H100; ``labsim.plots.my_step.table_figure(table)`` draws it."""

    device: str
    rows: dict[str, Row] = field(default_factory=dict)
    peaks: dict[str, Peak] = field(default_factory=dict)
    model_flops: float | None = None
    notes: list[str] = field(default_factory=list)
    path: Path | None = None

    # ---------------------------------------------------------------- file
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": model_record(), "model_flops": self.model_flops,
                "peaks": {k: asdict(v) for k, v in self.peaks.items()},
                "rows": [self.rows[k].to_json() for k in TECHNIQUES if k in self.rows]}

    def save(self, path: str | Path | None = None) -> bool:
        """Write the table to ``path`` (default: where it was read from); False, with a note,
        where the folder cannot be written to."""
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("no file to save to: pass path= (e.g. 'my_gpt_step.json')")
        try:
            target.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            self.notes.append(f"the table was not saved ({target}: {exc.strerror or exc}); "
                              "the rows above hold for this session only")
            return False
        self.path = target
        return True

    # ---------------------------------------------------------------- reading
    @property
    def title(self) -> str:
        return (f"Your GPT step ({TABLE_MODEL.layers} layers, hidden {TABLE_MODEL.hidden}, "
                f"{TABLE_BATCH} x {TABLE_MODEL.seq_len} tokens) on {self.device}")

    def elsewhere(self, row: Row) -> bool:
        """Whether ``row`` was measured on another device than this session's."""
        return row.device != self.device

    def plot_rows(self) -> list[dict[str, Any]]:
        """The measured rows as plain data for ``labsim.plots.my_step.table_figure``."""
        return [{"label": f"{r.lab} {r.label}", "step_s": r.step_s, "q1_s": r.q1_s,
                 "q3_s": r.q3_s, "peak_bytes": r.peak_bytes, "elsewhere": self.elsewhere(r)}
                for k, r in ((k, self.rows.get(k)) for k in TECHNIQUES) if r is not None]

    def lines(self) -> list[str]:
        """The table as lines of text (what ``str(table)`` joins)."""
        cfg = TABLE_MODEL
        flops = (f", {self.model_flops / 1e9:.3g} GFLOP per step (counted)"
                 if self.model_flops else "")
        out = [f"Your GPT step: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, "
               f"vocabulary {cfg.vocab}, {TABLE_BATCH} x {cfg.seq_len} tokens, AdamW; "
               f"{cfg.params:,} parameters{flops}"]
        peak = self.peaks.get(self.device)
        out.append(f"This device: {self.device}" + (
            f"; peak {peak.flops / 1e9:.3g} GFLOP/s ({peak.source})" if peak else ""))
        out.append(f"{'lab':>3}  {'technique':29} {'step: median (quartiles)':27} "
                   f"{'vs fp32, same rounds':24} {'step peak':>10} {'tokens/s':>9} {'MFU':>6}")
        for key, tech in TECHNIQUES.items():
            row = self.rows.get(key)
            if row is None:
                out.append(f"{tech.lab:>3}  {tech.label:29} not measured yet -- run lab "
                           f"{tech.lab}")
                continue
            mark = " *" if self.elsewhere(row) else ""
            out.append(f"{row.lab:>3}  {(row.label + mark):29} {_timing(row):27} "
                       f"{_versus(row):24} {_mb(row.peak_bytes):>10} "
                       f"{row.tokens_per_s:9,.0f} {row.mfu:6.1%}")
        for key in TECHNIQUES:
            row = self.rows.get(key)
            if row is None:
                continue
            if self.elsewhere(row):
                out.append(f"* {row.label}: measured on {row.device} ({row.when})")
            if row.compile_s is not None:
                out.append(f"{row.label}: first call {row.compile_s:.1f} s (compiling, or "
                           f"loading the compiled code from Inductor's cache), not in the step "
                           f"time{': ' + row.note if row.note else ''}")
            elif row.note:
                out.append(f"{row.label}: {row.note}")
        out.extend(self.notes)
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def __repr__(self) -> str:
        return (f"Table({self.device}: {len(self.rows)} of {len(TECHNIQUES)} techniques "
                f"measured{', file ' + str(self.path) if self.path else ''})")

    def summary(self) -> str:
        """What each technique bought: here (this table's rows against fp32) and on an H100
        (``h100_column``), with the assumptions of that column."""
        h100 = h100_column()
        base = self.rows.get(BASELINE)
        chip = one_h100().gpu
        lines = [
            "What each technique bought",
            f"  here: {self.device}, against fp32 timed in the same rounds; step peak memory",
            f"  H100: labsim.estimate_step, GPT-2 124M ({H100_MODEL.params / 1e6:.0f}M parameters),"
            f" {H100_MICRO_BATCH} x {H100_MODEL.seq_len} tokens, one H100 SXM, AdamW; "
            "activations + gradients",
            f"  H100 step times: {error_band('generic').describe()}; a model this small on one "
            "GPU is unlike those runs and can miss by more",
        ]
        elsewhere = False
        for key, tech in TECHNIQUES.items():
            if key == BASELINE:
                continue
            row, est = self.rows.get(key), h100.get(key)
            if row is None:
                here = f"not measured yet -- run lab {tech.lab}"
            else:
                here = _versus(row, long=True)
                if base is not None:
                    here += ", " + _ratio_text(base.peak_bytes, row.peak_bytes, "MB", 1e6)
                if row.compile_s is not None:
                    here += f"; first call {row.compile_s:.0f} s"
                if self.elsewhere(row) or (base is not None and self.elsewhere(base)):
                    here += " *"
                    elsewhere = True
            lines += [f"{tech.label} (lab {tech.lab})", f"  here: {here}",
                      f"  H100: {_h100_time(est)}; {_h100_memory(est, h100)}"]
        if elsewhere:
            lines.append("* a row of this comparison was measured on another device (see the "
                         "table)")
        lines += [
            f"fp32 on the H100: labsim runs fp32 matmuls on the TF32 tensor cores "
            f"({chip.peak('tf32') / 1e12:.0f} TFLOP/s dense), as "
            f"torch.set_float32_matmul_precision('high') allows; PyTorch's default keeps them "
            f"on the fp32 units ({chip.peak('fp32') / 1e12:.0f} TFLOP/s): against that "
            f"default, bf16 ({chip.peak('bf16') / 1e12:.0f} TFLOP/s) gains more than its line "
            "says.",
            "Checkpointing, SDPA and torch.compile on the H100 are priced on top of bf16 "
            "autocast, as an H100 runs them: FlashAttention runs in fp16 and bf16 only "
            "(flash-attention README).",
            f"torch.compile on the H100 is an estimate: labsim prices element-wise work as "
            f"fused kernels; if eager PyTorch moves {EAGER_BYTES_PER_ELEMENT}/"
            f"{FUSED_BYTES_PER_ELEMENT} of their bytes, as lab 05's chain does, the eager step "
            f"takes 1 + {EAGER_BYTES_PER_ELEMENT / FUSED_BYTES_PER_ELEMENT - 1:.2f} x "
            f"(element-wise share) times the compiled one. nanoGPT's README reports "
            f"{NANOGPT_COMPILE_SPEEDUP:.2f}x measured in its GPT-2 training (Dec 2022).",
        ]
        return "\n".join(lines)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _timing(row: Row) -> str:
    return f"{row.step_s * 1e3:.1f} ms ({row.q1_s * 1e3:.1f}-{row.q3_s * 1e3:.1f})"


def _versus(row: Row, long: bool = False) -> str:
    """The row against fp32 in the same rounds, in words ("1.42x faster", "too noisy")."""
    cmp = row.vs_fp32
    if cmp is None:
        return "the baseline" if long else "--"
    if not cmp.settled:
        return "too noisy to tell: rerun"
    if cmp.same_speed:
        return f"same time (within {(cmp.threshold - 1) * 100:.0f} %)"
    word = "faster" if cmp.fast == row.technique else "slower"
    return f"{cmp.ratio:.2f}x {word} ({cmp.low:.2f}-{cmp.high:.2f})"


def _ratio_text(before: float, after: float, unit: str, scale: float) -> str:
    return f"{before / scale:.1f} -> {after / scale:.1f} {unit}"


def _h100_time(est: H100Estimate | None) -> str:
    if est is None:
        return "not modelled"
    if est.speedup is None:
        return est.how
    word = "faster" if est.speedup >= 1 else "slower"
    ratio = est.speedup if est.speedup >= 1 else 1 / est.speedup
    if est.estimated:
        return f"~{ratio:.2f}x {word} than {H100_BASELINE_TEXT[est.technique]}"
    mfu = f", MFU {est.mfu:.0%}" if est.mfu is not None else ""
    return f"{ratio:.2f}x {word} than {H100_BASELINE_TEXT[est.technique]}{mfu}"


def _h100_memory(est: H100Estimate | None, column: dict[str, H100Estimate]) -> str:
    if est is None or est.memory_bytes is None:
        return "memory not modelled"
    base = column[est.baseline].memory_bytes if est.baseline else None
    if base is None:
        return f"{est.memory_bytes / 1e9:.1f} GB"
    return _ratio_text(base, est.memory_bytes, "GB", 1e9)


def load(path: str | Path = TABLE_FILE, device: torch.device | str | None = None) -> Table:
    """The table in ``path`` (an empty one if there is no such file), seen from ``device``
    (default: the device the labs pick).  A file that is not such a table raises
    ``ValueError`` saying how to start again."""
    path = Path(path)
    table = Table(device_label(device), path=path)
    if not path.exists():
        return table
    fix = (f"delete {path} (each lab measures its rows again) or move it aside, or pass "
           "path= to use another file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} cannot be read as the table ({exc}); {fix}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a table of this course (format "
                         f"{data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r}); {fix}")
    if data.get("model") != model_record():
        raise ValueError(f"{path} holds a table of another model ({data.get('model')!r}); "
                         f"{fix}")
    try:
        for name, peak in (data.get("peaks") or {}).items():
            table.peaks[str(name)] = Peak(**peak)
        for raw in data.get("rows") or []:
            row = Row.from_json(raw)
            table.rows[row.technique] = row
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}; {fix}") from None
    flops = data.get("model_flops")
    table.model_flops = float(flops) if isinstance(flops, (int, float)) else None
    return table


# ------------------------------------------------------------------------- measuring


def _lab_key(lab: str | int) -> str:
    key = f"{lab:02d}" if isinstance(lab, int) and not isinstance(lab, bool) else str(lab)
    if key not in LABS:
        raise ValueError(f"lab {lab!r} adds no row to the table; the labs that do are "
                         f"{', '.join(LABS)} (e.g. record('02'))")
    return key


def measure_peak(device: torch.device | str = "cpu") -> Peak:
    """This device's matmul peak, timed now on the current threads: the best of five
    512 x 512 fp32 products on a CPU; on a GPU the faster of 4096 x 4096 in fp32 and bf16."""
    device = torch.device(device)
    n = 512 if device.type == "cpu" else 4096
    dtypes = ["fp32"] if device.type == "cpu" else ["fp32", "bf16"]
    best = 0.0
    for name in dtypes:
        dt = torch.float32 if name == "fp32" else torch.bfloat16
        a, b = (torch.ones(n, n, device=device, dtype=dt) for _ in range(2))
        t = time_interleaved({name: lambda a=a, b=b: a @ b}, device=device, rounds=5)[name]
        best = max(best, 2 * n**3 / t.min_s)
    return Peak(best, f"best {n} x {n} {' or '.join(dtypes)} matmul, measured by the table",
                date.today().isoformat())


@dataclass(frozen=True)
class _Measured:
    first_s: float
    peak_bytes: int
    times: tuple[float, ...]


def _measure(steps: dict[str, Callable[[], None]], device: torch.device, rounds: int,
             max_seconds: float) -> tuple[dict[str, _Measured], dict[str, Any]]:
    """First call of each step (warm-up: Adam's state, a compile), its peak memory (second
    call), then interleaved rounds: as many as ``max_seconds`` of this process's CPU time
    allow by the second calls' CPU time, at least 3 and at most ``rounds``.  CPU time, not
    wall time: on a busy machine a round waits longer for a core but computes as much, and
    the verdict needs as many rounds as on a quiet one."""
    first: dict[str, float] = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step()
        synchronize(device)
        first[name] = time.perf_counter() - start
    memory: dict[str, int] = {}
    anchor = torch.empty(0, device=device)  # so that peak_bytes reads this device's memory
    start = time.process_time()
    for name, step in steps.items():
        memory[name] = peak_bytes(lambda _on, step=step: step(), anchor)
    per_round = time.process_time() - start  # under the profiler: an over-estimate
    n = max(3, min(rounds, int(max_seconds / max(per_round, 1e-9))))
    timings = time_interleaved(steps, device=device, warmup=0, rounds=n)
    out = {name: _Measured(first[name], memory[name], timings[name].times_s) for name in steps}
    return out, timings


def _bf16_note(device: torch.device) -> str:
    if device.type != "cpu":
        return ""
    units = cpu_bf16_units()
    h100 = catalog_gpu("H100-SXM")
    gpu_says = (f"an H100's tensor cores run bf16 at {h100.peak('bf16') / h100.peak('fp32'):.0f}x "
                "its fp32 rate (989 vs 67 TFLOP/s dense)")
    if units:
        return f"this CPU reports {', '.join(units)}; {gpu_says}"
    said = "does not say which bf16 units it has" if units is None else "reports no bf16 unit"
    return (f"this CPU {said} (labsim.lab.cpu_bf16_units()): autocast's bf16 matmuls convert "
            f"every value to fp32 before multiplying (lab 00, section 7), so they cannot beat "
            f"fp32 here; {gpu_says}")


def _inductor_cache() -> tuple[int, int]:
    """(hits, misses) of Inductor's compiled-graph cache so far in this process (torch's
    ``torch._dynamo.utils.counters``; (0, 0) where a torch version does not keep them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - every torch 2 has it
        return 0, 0
    return (int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            int(counters["inductor"].get("fxgraph_cache_miss", 0)))


def _compile_note(before: tuple[int, int]) -> str:
    hits, misses = (now - then for now, then in zip(_inductor_cache(), before))
    if not hits and not misses:
        return "no graph compiled or loaded: this process had compiled it already"
    if misses:
        return f"{misses} of {hits + misses} graphs compiled from scratch (cold cache)"
    return f"all {hits} graphs loaded from Inductor's cache on disk"


def _row(tech: Technique, lab: str, device: str, m: _Measured, flops: float, peak: Peak,
         vs: Comparison | None, note: str) -> Row:
    med = statistics.median(m.times)
    q1, q3 = spread(m.times)
    return Row(tech.key, lab, device, med, q1, q3, len(m.times), int(m.peak_bytes),
               TABLE_BATCH * TABLE_MODEL.seq_len / med, flops, peak.flops,
               flops / med / peak.flops, vs,
               compile_s=m.first_s if tech.compiled else None, note=note,
               when=date.today().isoformat(), torch_version=torch.__version__)


def _check_attention(attention: Any) -> Callable[..., torch.Tensor]:
    if not callable(attention):
        raise ValueError(
            f"attention={attention!r:.40}: pass your attention core as a function (q, k, v) -> "
            "output over (batch, heads, tokens, head_dim) tensors, causal, e.g. "
            "attention=lambda q, k, v: FlashAttention2.apply(q, k, v, True)")
    return attention


def record(lab: str | int, *, peak_flops: float | None = None,
           attention: Callable[..., torch.Tensor] | None = None,
           path: str | Path = TABLE_FILE, device: torch.device | str | None = None,
           rounds: int = 9, max_seconds: float = 3.0) -> Table:
    """Measure lab ``lab``'s rows of the table on ``device`` (default: the one the labs pick),
    each against the fp32 baseline in the same interleaved rounds on one thread, save them in
    ``path`` (replacing that lab's earlier rows) and return the table.

    ``peak_flops``: this device's peak for MFU, e.g. the roof you measured in lab 00 (kept in
    the file for later labs; without one the table measures a matmul).  ``attention``: lab
    04's core ``(q, k, v) -> out``, causal, e.g. ``lambda q, k, v: FlashAttention2.apply(q, k,
    v, True)``; it must give the written-out attention's loss and gradients.  ``rounds``,
    ``max_seconds``: at most that many rounds, fewer where a round takes more CPU time than
    ``max_seconds / rounds`` (at least 3)."""
    key = _lab_key(lab)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 3:
        raise ValueError(f"rounds={rounds!r}: must be a whole number >= 3 (quartiles and a "
                         "verdict need at least 3 rounds)")
    if not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
        raise ValueError(f"max_seconds={max_seconds!r}: must be a number of seconds > 0")
    if peak_flops is not None and not (isinstance(peak_flops, (int, float))
                                       and math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"peak_flops={peak_flops!r}: must be this device's peak in FLOP/s, a "
                         "number > 0 (e.g. the roof you measured in lab 00), or None")
    if attention is not None:
        attention = _check_attention(attention)
    dev = torch.device(device) if device is not None else pick_device()
    if guard.active() is not None:  # the grader's copy of the notebook: nothing to show
        table = Table(device_label(dev))
        table.notes.append("not measured: a graded run does not time the table (your rows "
                           "are those of your own run)")
        return table
    table = load(path, dev)
    label = table.device
    if peak_flops is not None:
        table.peaks[label] = Peak(float(peak_flops), f"your roof, lab {key}",
                                  date.today().isoformat())
    with one_thread():
        if label not in table.peaks:
            table.peaks[label] = measure_peak(dev)
        peak = table.peaks[label]
        table.model_flops = flops = count_model_flops(dev)
        steps: dict[str, Callable[[], None]] = {BASELINE: GPTStep(TECHNIQUES[BASELINE], dev)}
        notes: dict[str, str] = {}
        for name in LABS[key]:
            tech = TECHNIQUES[name]
            if name == BASELINE:
                continue
            if tech.yours:
                plugged = _your_step(attention, dev, steps[BASELINE], table.notes)
                if plugged is not None:
                    steps[name] = plugged
                continue
            steps[name] = GPTStep(tech, dev)
            if tech.autocast:
                notes[name] = _bf16_note(dev)
        cache_before = _inductor_cache()
        try:
            measured, timings = _measure(steps, dev, rounds, max_seconds)
        except RuntimeError as exc:  # torch.compile without a working compiler, say
            if "compile" not in steps:
                raise
            table.notes.append(f"torch.compile failed here: {str(exc).splitlines()[0][:160]}")
            steps.pop("compile")
            measured, timings = _measure(steps, dev, rounds, max_seconds)
    if "compile" in measured:
        notes["compile"] = _compile_note(cache_before)
    for name, m in measured.items():
        if name == BASELINE and key != TECHNIQUES[BASELINE].lab and BASELINE in table.rows:
            continue  # lab 00's baseline row stays; this one served the comparison
        vs = None if name == BASELINE else compare(timings, BASELINE, name)
        table.rows[name] = _row(TECHNIQUES[name], key, label, m, flops, peak, vs,
                                notes.get(name, ""))
    table.save(path)
    return table


def _your_step(attention: Callable[..., torch.Tensor] | None, device: torch.device,
               baseline: GPTStep, notes: list[str]) -> GPTStep | None:
    """The step with your attention plugged in, if it is written and gives the written-out
    attention's loss and gradients; else None and a note saying what to do."""
    label = TECHNIQUES["your-attention"].label
    if attention is None:
        notes.append(f"{label}: not measured -- pass attention=lambda q, k, v: "
                     "FlashAttention2.apply(q, k, v, True)")
        return None
    step = GPTStep(TECHNIQUES["your-attention"], device, attention=attention)
    try:
        got = step.probe()
    except NotImplementedError:
        notes.append(f"{label}: not measured yet -- finish the exercise, then run this cell "
                     "again")
        return None
    want = baseline.probe()
    if not all(math.isclose(g, w, rel_tol=1e-3, abs_tol=1e-6) for g, w in zip(got, want)):
        notes.append(f"{label}: not measured -- its loss and gradient norm ({got[0]:.6g}, "
                     f"{got[1]:.6g}) differ from the written-out attention's ({want[0]:.6g}, "
                     f"{want[1]:.6g}); is it causal? Fix it, then run this cell again")
        return None
    return step


# ------------------------------------------------------------------------- the H100 column


@dataclass(frozen=True)
class H100Estimate:
    """What labsim says one technique does on one H100 (``H100_MODEL``, ``H100_MICRO_BATCH``):
    step time, activations + gradients (bytes), MFU, and the speed-up over ``baseline``'s
    estimate (>1: faster).  ``estimated``: not the step model's own figure (compile)."""

    technique: str
    baseline: str | None
    step_s: float | None
    memory_bytes: float | None
    mfu: float | None
    speedup: float | None
    how: str
    estimated: bool = False


H100_PLANS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32", "attention": "standard"},
    "bf16": {"precision": "autocast-bf16", "attention": "standard"},
    "checkpoint": {"precision": "autocast-bf16", "attention": "standard", "recompute": "full"},
    "sdpa": {"precision": "autocast-bf16", "attention": "flash"},
}
H100_BASELINES = {"bf16": "fp32", "checkpoint": "bf16", "sdpa": "bf16", "compile": "bf16"}
H100_BASELINE_TEXT = {"bf16": "fp32 (TF32)", "checkpoint": "bf16", "sdpa": "bf16, written out",
                      "compile": "eager bf16"}


def one_h100() -> Cluster:
    """One H100 SXM on its own (no link carries anything in a one-GPU step)."""
    return Cluster("H100-SXM", 1, 1, "nvlink4", "ib-ndr", 1, name="one H100 SXM")


def h100_step(technique: str) -> StepResult:
    """labsim's closed-form step (``estimate_step``) of ``H100_MODEL`` on one H100 with
    ``technique``'s plan (``H100_PLANS``)."""
    if technique not in H100_PLANS:
        raise ValueError(f"technique {technique!r} has no H100 plan; those that do: "
                         f"{', '.join(H100_PLANS)}")
    plan = Plan(micro_batch=H100_MICRO_BATCH, **H100_PLANS[technique])
    return estimate_step(H100_MODEL, one_h100(), plan)


def elementwise_share(precision: str = "autocast-bf16", attention: str = "standard") -> float:
    """Share of labsim's one-H100 step that is memory-bound element-wise work: norms,
    activations, bias-dropout-residual adds, cross-entropy, and (written-out attention) the
    softmax and dropout over the scores (``labsim.compute.kind_seconds``, ``softmax_seconds``)."""
    gpu = one_h100().gpu
    kinds = kind_seconds(H100_MODEL, H100_MICRO_BATCH, gpu, attention=attention,
                         precision=precision)
    soft = (softmax_seconds(H100_MODEL, H100_MICRO_BATCH, gpu, precision=precision)
            if attention == "standard" else 0.0)
    return (kinds["elementwise"] + soft) / sum(kinds.values())


def h100_column() -> dict[str, H100Estimate]:
    """Every technique on one H100 by labsim: the step model where it prices the technique,
    the compile estimate (module doc) where it does not, "not modelled" for your attention."""
    results = {key: h100_step(key) for key in H100_PLANS}
    out: dict[str, H100Estimate] = {}
    for key, res in results.items():
        base = H100_BASELINES.get(key)
        mem = res.memory.activations + res.memory.grads if res.memory else None
        out[key] = H100Estimate(
            key, base, res.step_time_s, mem, res.mfu,
            results[base].step_time_s / res.step_time_s if base else None,
            "labsim.estimate_step")
    share = elementwise_share()
    speedup = 1 + (EAGER_BYTES_PER_ELEMENT / FUSED_BYTES_PER_ELEMENT - 1) * share
    bf16 = out["bf16"]
    out["compile"] = H100Estimate(
        "compile", "bf16", bf16.step_s, None, bf16.mfu, speedup,
        f"element-wise share {share:.0%} of the bf16 step, eager at "
        f"{EAGER_BYTES_PER_ELEMENT}/{FUSED_BYTES_PER_ELEMENT} of its traffic", estimated=True)
    out["your-attention"] = H100Estimate(
        "your-attention", None, None, None, None, None,
        "not modelled: labsim prices kernels, not a loop of tile ops")
    return out

