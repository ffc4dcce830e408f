"""Results recorded on a real GPU by ``benchmarks/gpu_record.py``, for labs run without one.

A lab's GPU cell measures on a CUDA device when there is one; on a CPU it shows what was
recorded instead, labelled with the GPU, driver, CUDA and torch versions and the date, so a
number is never presented as measured here when it was not.  Records are package data
(``labsim/data/gpu_records/NN_topic.json``, one per lab); ``gpu_record`` returns None when a
lab has none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from labsim.attention import attention_cost
from labsim.checkpointing import segment_peak_bytes
from labsim.cluster import Cluster
from labsim.compute import gemm_time, layer_cost, memory_time
from labsim.experiments.quantization import Table
from labsim.fusion import BIAS_GELU_DROPOUT_RESIDUAL, chain_launches, chain_time
from labsim.hardware import GPU, gpu, link
from labsim.plan import Plan
from labsim.quantization import matmul_cost
from labsim.step import estimate_step
from labsim.units import fmt_bandwidth, fmt_bytes, fmt_flops, fmt_time
from labsim.workload import Transformer


@dataclass(frozen=True)
class GpuRecord:
    """One lab's recorded measurements: ``environment`` (gpu, driver, cuda, torch, date) and
    the section's ``results`` as the script wrote them."""

    lab: str
    environment: dict[str, Any]
    results: dict[str, Any]

    @property
    def label(self) -> str:
        """'recorded on NVIDIA H200 (driver 580.x, CUDA 13.0, torch 2.11.0) on 2026-12-01'."""
        e = self.environment
        return (f"recorded on {e.get('gpu') or 'no GPU'} (driver {e.get('driver') or '?'}, "
                f"CUDA {e.get('cuda') or '?'}, torch {e.get('torch') or '?'}) on "
                f"{e.get('date') or '?'}")


def gpu_record(lab: str) -> GpuRecord | None:
    """The record of ``lab`` (e.g. ``"00_why_gpus"``), or None if none was recorded."""
    path = resources.files("labsim") / "data" / "gpu_records" / f"{lab}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text(encoding="utf-8"))
    if doc.get("status") != "measured" or doc.get("environment", {}).get("smoke"):
        return None  # a failed section, or toy sizes (``--smoke``), is not a measurement
    env = doc.pop("environment", {})
    return GpuRecord(lab, env, doc)


# -- the records beside labsim's predictions ----------------------------------------------------

@dataclass(frozen=True)
class RecordTable:
    """A recorded measurement beside what labsim predicts for the same GPU, as printable rows.

    ``rows`` hold text already formatted with units; ``str(table)`` gives the title, the
    record's label and the rows in aligned columns."""

    title: str
    label: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()

    def __str__(self) -> str:
        table = Table(self.columns, self.rows, title=f"{self.title}\n({self.label})")
        return "\n".join([repr(table), *self.notes])


def catalog_gpu(environment: dict[str, Any]) -> GPU:
    """The catalog GPU a record was made on: ``"NVIDIA H200"`` is ``gpu("H200")``."""
    name = str(environment.get("gpu") or "")
    short = name.removeprefix("NVIDIA ").strip()
    for candidate in (short, short.split(" ")[0]):
        try:
            return gpu(candidate)
        except (KeyError, ValueError):
            continue
    raise ValueError(f"the record was made on {name!r}, which labsim's GPU catalog does not "
                     "hold: add it to labsim.hardware.GPUS to compare with a prediction")


def _record(lab: str) -> GpuRecord:
    rec = gpu_record(lab)
    if rec is None:
        raise LookupError(f"no GPU record for {lab}: run benchmarks/gpu_record.py on a GPU")
    return rec


def _pct(x: float) -> str:
    return f"{x:.0%}"


def recorded_matmuls() -> RecordTable:
    """Lab 00: matmul FLOP/s by dtype and size, and the copy bandwidth, against the dense peak
    of the datasheet (the roofline's roof) and labsim's GEMM model (``compute.gemm_time``,
    isolated kernels: sustained fraction 1)."""
    rec = _record("00_why_gpus")
    chip = catalog_gpu(rec.environment)
    rows = []
    for m in rec.results["matmul"]:
        n, dtype = m["n"], m["dtype"]
        peak = chip.peak(dtype)
        model = (2.0 * n**3 / gemm_time(n, n, n, chip, dtype, sustained=1.0)
                 if dtype in ("bf16", "fp16") else None)
        rows.append((f"{dtype} {n}^3", fmt_flops(m["flops_per_s"]), fmt_flops(peak),
                     _pct(m["flops_per_s"] / peak), fmt_flops(model) if model else "-"))
    hbm = rec.results["hbm"]
    curve = memory_time(hbm["bytes_moved"], chip, sustained=1.0)
    rows.append((f"copy {fmt_bytes(hbm['bytes_moved'] / 2)}", fmt_bandwidth(hbm["bandwidth_Bps"]),
                 fmt_bandwidth(chip.memory_bandwidth_Bps),
                 _pct(hbm["bandwidth_Bps"] / chip.memory_bandwidth_Bps),
                 fmt_bandwidth(hbm["bytes_moved"] / curve)))
    for g in rec.results.get("gemm_shapes", ()):
        t_model = gemm_time(g["m"], g["n"], g["k"], chip, "bf16", sustained=1.0)
        rows.append((f"bf16 {g['gemm']} {g['m']}x{g['k']}x{g['n']}",
                     fmt_flops(g["flops_per_s"]), fmt_flops(chip.peak("bf16")),
                     _pct(g["flops_per_s"] / chip.peak("bf16")),
                     fmt_flops(2.0 * g["m"] * g["n"] * g["k"] / t_model)))
    return RecordTable(f"Matmuls and copies on {chip.name}: measured against the roofline",
                       rec.label, ("case", "measured", "datasheet peak", "of peak",
                                   "labsim GEMM model"), tuple(rows))


def recorded_layers() -> RecordTable:
    """Lab 02: the GPT step in fp32 and under bf16 autocast (the bf16 step against
    ``step.estimate_step`` on one GPU with the PyTorch FSDP profile), and one GPT layer's
    forward and backward in bf16 against the step model's compute (``compute.layer_cost``,
    isolated kernels: sustained fraction 1; with the GPU's sustained fraction the step model
    charges more, for what a whole training step adds)."""
    rec = _record("02_mixed_precision")
    chip = catalog_gpu(rec.environment)
    r = rec.results
    one_gpu = Cluster(chip, 1, 1, link("pcie5-x16"), link("pcie5-x16"))
    gpt = Transformer.preset(r["model"], seq_len=r["seq_len"])
    step = estimate_step(gpt, one_gpu, Plan(micro_batch=r["batch"], precision="bf16",
                                            software="fsdp")).step_time_s
    bf16_s = r["autocast-bf16"]["step_s"]
    rows = [(f"{r['model']} step, batch {r['batch']} x {r['seq_len']}, fp32",
             fmt_time(r["fp32"]["step_s"]), "-", f"peak {fmt_bytes(r['fp32']['peak_bytes'])}"),
            ("same step, bf16 autocast", fmt_time(bf16_s), f"step model {fmt_time(step)}",
             f"{bf16_s / step - 1:+.0%}; {r['speedup']:.2f}x faster than fp32; peak "
             f"{fmt_bytes(r['autocast-bf16']['peak_bytes'])}")]
    for layer in r.get("layer", ()):
        model = Transformer(layers=1, hidden=layer["hidden"], heads=layer["heads"],
                            seq_len=layer["seq_len"], vocab=50257, dropout=False)
        cost = layer_cost(model, layer["micro_batch"], chip, sustained=1.0)
        predicted = cost.forward.time_s + cost.backward.time_s
        measured = layer["forward_backward_s"]
        rows.append((f"layer h={layer['hidden']}, {layer['micro_batch']} x {layer['seq_len']} "
                     "fwd+bwd", fmt_time(measured), fmt_time(predicted),
                     f"{measured / predicted - 1:+.0%}; {fmt_flops(cost.model_flops / measured)}"))
    return RecordTable(f"Training steps and layers on {chip.name}", rec.label,
                       ("case", "measured", "labsim", "difference; model FLOP/s"),
                       tuple(rows),
                       ("(step: estimate_step on one GPU, PyTorch FSDP profile; layers: the "
                        "kernels alone, sustained fraction 1)",))


def recorded_checkpointing() -> RecordTable:
    """Lab 03: a 32-block residual MLP without checkpoints, with one every block and one every
    √n blocks: the allocator's peak against ``checkpointing.segment_peak_bytes`` (activations,
    bytes counted by ``experiments.checkpointing.block_bytes``) plus the gradients, and the
    time."""
    from labsim.experiments.checkpointing import block_bytes
    from labsim.lab.models import ResidualBlock

    rec = _record("03_checkpointing")
    r = rec.results
    saved, boundary = block_bytes(r["width"], r["rows"])
    depth, width = r["depth"], r["width"]
    with torch.device("meta"):  # the block's fp32 parameters, counted without allocating
        grads = depth * 4 * sum(p.numel() for p in ResidualBlock(width).parameters())
    base = r["none"]["step_s"]
    rows = []
    for label in ("none", "every layer", "every sqrt(n)"):
        if label not in r:
            continue
        m = r[label]
        predicted = segment_peak_bytes([saved] * depth, [boundary] * depth, m["starts"])
        rows.append((label, fmt_time(m["step_s"]), f"{m['step_s'] / base - 1:+.0%}",
                     fmt_bytes(m["peak_bytes"]), fmt_bytes(predicted),
                     fmt_bytes(predicted + grads)))
    return RecordTable(f"Checkpointing a {depth}-block residual MLP, width {width}, "
                       f"{r['rows']} tokens, fp32", rec.label,
                       ("checkpoints", "step", "time", "allocator peak",
                        "labsim: activations", "+ gradients"), tuple(rows))


def recorded_attention() -> RecordTable:
    """Lab 04: attention forward + backward by sequence length, naive against SDPA's backends:
    time, allocator peak, and that peak per attention score (O(N^2) memory is a constant)."""
    rec = _record("04_flash_attention")
    chip = catalog_gpu(rec.environment)
    r = rec.results
    batch, heads, d = r["batch"], r["heads"], r["head_dim"]
    rows = []
    for row in r["forward_backward"]:
        if "error" in row:
            rows.append((f"N={row['n']} {row['kernel']}", "not run", "-", row["error"][:40]))
            continue
        scores = batch * heads * row["n"] ** 2
        rows.append((f"N={row['n']} {row['kernel']}", fmt_time(row["time_s"]),
                     fmt_bytes(row["peak_bytes"]), f"{row['peak_bytes'] / scores:.2f}"))
    return RecordTable(f"Attention forward + backward on {chip.name}, bf16, batch {batch}, "
                       f"{heads} heads of {d}", rec.label,
                       ("case", "time", "allocator peak", "bytes per score"), tuple(rows))


def recorded_triton_forward() -> RecordTable:
    """Lab 04: the lab's Triton FlashAttention-2 forward against SDPA's forward, and against
    the roofline of the tiled kernel (``attention.attention_cost``, FlashAttention-1 block
    sizes for the 227 KB of shared memory one thread block may use on Hopper)."""
    rec = _record("04_flash_attention")
    chip = catalog_gpu(rec.environment)
    r = rec.results
    batch, heads, d = r["batch"], r["heads"], r["head_dim"]
    rows = []
    for row in r["triton_forward"]:
        case = f"N={row['n']} causal={row['causal']}"
        if "error" in row:
            rows.append((case, "failed", row["error"][:40], "-", "-"))
            continue
        cost = attention_cost(chip, row["n"], d, method="tiled", sram_bytes=227e3, heads=heads,
                              batch=batch, causal=row["causal"])
        rows.append((case, fmt_time(row["triton_s"]), fmt_time(row["sdpa_s"]),
                     fmt_time(cost.time_s), f"{row['max_abs_diff_vs_sdpa']:.1e}"))
    return RecordTable(f"The lab's Triton forward against SDPA's on {chip.name}, bf16",
                       rec.label, ("case", "Triton", "SDPA", "roofline", "max |difference|"),
                       tuple(rows))


# Bytes per element of the chain's tensors (lab 05's SIZES): fp32 data, a bool keep-mask,
# a bias too small to count.
_CHAIN_SIZES = {"x": 4, "bias": 0, "keep": 1, "residual": 4, "t1": 4, "t2": 4, "t3": 4,
                "t4": 4, "y": 4}


def recorded_fusion() -> RecordTable:
    """Lab 05: the bias-GELU-dropout-residual chain eager, under ``torch.compile``, compiled
    with CUDA graphs (``mode="reduce-overhead"``) and the eager chain replayed from a CUDA graph
    captured by hand, each issued back to back (time per call), against ``fusion.chain_time``'s
    memory traffic at the datasheet bandwidth (launch costs are an input of labsim's model,
    read off the smallest size here, not predicted)."""
    rec = _record("05_kernel_fusion")
    chip = catalog_gpu(rec.environment)
    ops = BIAS_GELU_DROPOUT_RESIDUAL
    rows = []

    def per_call(row: dict[str, Any], name: str) -> str:
        value = row.get(f"{name}_queued_s", row.get(f"{name}_s"))
        return "-" if value is None else fmt_time(value)

    for row in rec.results["chain"]:
        numel = row["rows"] * row["hidden"]
        sep, fus = (chain_time(ops, numel, _CHAIN_SIZES, fused=fused, launch_s=0.0,
                               bandwidth_Bps=chip.memory_bandwidth_Bps) for fused in (False, True))
        rows.append((f"{row['rows']} x {row['hidden']}", per_call(row, "eager"),
                     per_call(row, "graph_replay"), fmt_time(sep.traffic_s),
                     per_call(row, "compile"), per_call(row, "compile+cudagraphs"),
                     fmt_time(fus.traffic_s)))
    first = rec.results["chain"][0]
    launches = chain_launches(ops, fused=False)
    notes = [f"(smallest size: {fmt_time(first.get('eager_queued_s', first['eager_s']) / launches)}"
             f" per eager op for {launches} ops, host dispatch and launch: an input of labsim's "
             "model, not a prediction)"]
    return RecordTable(
        f"The element-wise chain on {chip.name}, fp32, time per call", rec.label,
        ("elements", "eager", "as a CUDA graph", "labsim: 5 kernels", "compiled",
         "reduce-overhead", "labsim: 1 kernel"), tuple(rows),
        (*notes, "(labsim: the kernels' memory traffic at the datasheet bandwidth; "
                 "reduce-overhead: torch.compile(mode=\"reduce-overhead\"))"))


def recorded_copies() -> RecordTable:
    """Lab 06: host-to-device copies, pageable and pinned, against the PCIe 5.0 x16 slot the
    GPU sits in, and a pinned copy on a side stream while the default stream computes."""
    rec = _record("06_data_loading")
    return copies_table(rec.results, rec.label)


def copies_table(r: dict[str, Any], label: str) -> RecordTable:
    """The table of ``experiments.loading.copy_overlap``'s results (recorded or measured
    here, ``label`` says which)."""
    slot = link("pcie5-x16")
    rows = [(f"{name} copy {fmt_bytes(r[name]['bytes'])}", fmt_time(r[name]["time_s"]),
             fmt_bandwidth(r[name]["bandwidth_Bps"]),
             _pct(r[name]["bandwidth_Bps"] / slot.bandwidth_Bps))
            for name in ("pageable", "pinned") if name in r]
    ov = r.get("overlap")
    if ov:
        rows += [("matmul alone", fmt_time(ov["compute_s"]), "-", "-"),
                 ("pinned copy on a side stream + matmul", fmt_time(ov["both_s"]),
                  f"max of the two: {fmt_time(max(ov['compute_s'], ov['copy_s']))}",
                  f"sum: {fmt_time(ov['compute_s'] + ov['copy_s'])}")]
    return RecordTable("Feeding the GPU: host-to-device copies", label,
                       ("case", "time", "bandwidth", f"of {slot.name}"), tuple(rows))


def recorded_nccl_demos() -> RecordTable:
    """Labs 07-11: the torch.distributed demos under ``torchrun --nproc_per_node=1`` on NCCL:
    exit status and the largest difference each reports (0 when right).  One GPU checks the
    NCCL code paths, not scaling."""
    rec = _record("08_data_parallel")
    rows = tuple((spec.split(":")[0].removeprefix("labsim."),
                  "ok" if d["returncode"] == 0 else f"exit {d['returncode']}",
                  d["result"] if d["result"] is not None else "-")
                 for spec, d in rec.results["demos"].items())
    return RecordTable(f"torchrun demos on {rec.results['backend'].upper()}", rec.label,
                       ("demo", "status", "largest difference"), rows)


def recorded_int8() -> RecordTable:
    """Lab 12: ``torch._int_mm`` (int8 in, int32 out) against a bf16 matmul of the same shape,
    each against its roofline (``quantization.matmul_cost``: datasheet peaks)."""
    rec = _record("12_int8_quantization")
    chip = catalog_gpu(rec.environment)
    rows = []
    for row in rec.results["int_mm"]:
        m, n, k = row["m"], row["n"], row["k"]
        i8 = matmul_cost(chip, m, n, k, dtype="int8")
        b16 = matmul_cost(chip, m, n, k, dtype="bf16")
        rows.append((f"{m} x {k} x {n}", fmt_time(row["int8_s"]), fmt_time(i8.time_s),
                     fmt_time(row["bf16_s"]), fmt_time(b16.time_s),
                     f"{row['speedup']:.2f}x", f"{b16.time_s / i8.time_s:.2f}x"))
    return RecordTable(f"int8 against bf16 matmuls on {chip.name}", rec.label,
                       ("shape", "int8 measured", "int8 roofline", "bf16 measured",
                        "bf16 roofline", "int8 speed-up", "roofline's"), tuple(rows))
