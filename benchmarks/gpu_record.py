"""Run every measurement the labs' GPU cells describe, once, and record it as data.

    python benchmarks/gpu_record.py [--out DIR] [--only 00,04,...] [--skip-torchrun] [--smoke]

On a CUDA GPU it measures, per lab, what the lab's GPU cells would show, and writes one JSON
file per lab (``NN_topic.json``) into ``DIR`` (default: the package's
``labsim/data/gpu_records/``), each labelled with the GPU's name, driver, CUDA and torch
versions and the date.  The labs read those files (``labsim.experiments.records``) and show
them, labelled, in their GPU cells when they run without a GPU, beside labsim's prediction for
the same GPU.  Without a GPU it runs what needs none (the torchrun demos on gloo) and says what
it skips; it then writes nowhere unless ``--out`` is given.  ``--smoke`` runs every section
at toy sizes on whatever device there is (the CPU included), so each code path is exercised
before the one run on a GPU; its figures mean nothing.

Sections (each stands alone; a failure is recorded with its error and the others go on):

* 00 matmul FLOP/s by dtype (fp32 without and with TF32, bf16, fp16, fp8 where the GPU has
  it) and size (4096 against 4097: a row that breaks 16-byte alignment), HBM bandwidth
  (device copy); the bf16 GEMMs of a GPT-3 layer under 8-way tensor parallelism;
* 02 a GPT training step in fp32 and under autocast(bf16): time and peak memory; one
  transformer layer's forward + backward in bf16 at GPT-3-like widths (the step model's
  compute, measured);
* 03 checkpointing a residual MLP: none, every layer and every √n layers, peak memory and
  time;
* 04 attention forward + backward by sequence length: naive against each SDPA backend
  (math, memory-efficient, flash, cuDNN), time and peak memory; the lab's Triton
  FlashAttention-2 forward against SDPA's forward, time and largest difference;
* 05 the lab's element-wise chain: eager, eager replayed from a CUDA graph, ``torch.compile``,
  and compiled with CUDA graphs (``mode="reduce-overhead"``), by tensor size;
* 06 host-to-device copies: pageable against pinned, and a pinned copy on a side stream while
  the default stream computes (overlap);
* 12 ``torch._int_mm`` (int8 tensor cores) against a bf16 matmul;
* 07-11 the torch.distributed demos of ``labsim.parallel`` and the ring reference under
  ``torchrun --nproc_per_node=1`` (NCCL on a GPU): correctness of the NCCL paths, not
  scaling.

Budget: about 4 minutes on an H200 (every size below was chosen for that).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT_OUT = ROOT / "labsim" / "data" / "gpu_records"
LABS = {"00": "00_why_gpus", "02": "02_mixed_precision", "03": "03_checkpointing",
        "04": "04_flash_attention", "05": "05_kernel_fusion", "06": "06_data_loading",
        "07": "07_collectives", "12": "12_int8_quantization", "parallel": "08_data_parallel"}


class Skip(Exception):
    """A measurement that cannot run here, with the reason."""


class Bench:
    """Where the sections run and at what size: a CUDA device at full size, or (``smoke``)
    toy sizes on any device, the CPU included, timed with the wall clock."""

    def __init__(self, smoke: bool = False) -> None:
        self.smoke = smoke
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")

    def need_gpu(self) -> torch.device:
        if not (self.cuda or self.smoke):
            raise Skip("no CUDA GPU")
        return self.device

    def size(self, full: Any, smoke: Any) -> Any:
        return smoke if self.smoke else full

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any], warmup: int = 3, repeat: int = 10) -> float:
        """Median seconds of ``fn``: CUDA events on a GPU (queued throughput), else the wall
        clock."""
        if self.smoke:
            warmup, repeat = 1, 2
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeat):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]

    def peak_bytes(self, fn: Callable[[], Any]) -> int | None:
        """Bytes allocated at the peak of ``fn`` above what was allocated before (None on a
        CPU: PyTorch keeps no such count there)."""
        if not self.cuda:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated() - base)

    def empty_cache(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


# -- sections ---------------------------------------------------------------------------------

def lab00(b: Bench) -> dict:
    dev = b.need_gpu()
    out: dict[str, Any] = {"matmul": [], "hbm": {}}
    dtypes = [("fp32", torch.float32, False), ("tf32", torch.float32, True),
              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)]
    for n in b.size((4096, 4097, 8192), (64, 65)):
        for name, dtype, tf32 in dtypes:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            x = torch.randn(n, n, device=dev, dtype=dtype)
            y = torch.randn(n, n, device=dev, dtype=dtype)
            t = b.time(lambda x=x, y=y: x @ y)
            out["matmul"].append({"dtype": name, "n": n, "time_s": t,
                                  "flops_per_s": 2 * n**3 / t})
        torch.backends.cuda.matmul.allow_tf32 = False
    if b.cuda and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(dev) >= (8, 9):
        n = b.size(8192, 64)
        x = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        y = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        t = b.time(lambda: torch._scaled_mm(x, y, scale_a=one, scale_b=one,
                                            out_dtype=torch.bfloat16))
        out["matmul"].append({"dtype": "fp8", "n": n, "time_s": t, "flops_per_s": 2 * n**3 / t})
    out["gemm_shapes"] = gemm_shapes(b, dev)
    x = torch.empty(b.size(2**30, 2**20), dtype=torch.uint8, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    t = b.time(lambda: y.copy_(x))
    out["hbm"] = {"bytes_moved": 2 * x.numel(), "time_s": t, "bandwidth_Bps": 2 * x.numel() / t}
    return out


def gemm_shapes(b: Bench, dev: torch.device) -> list[dict]:
    """bf16 products of the shapes one GPT-3 175B layer runs per GPU under 8-way tensor
    parallelism (h = 12288, 2048 or 8192 tokens): QKV, attention output, MLP up and down."""
    h, tp = b.size(12288, 64), 8
    rows = []
    dtype = torch.bfloat16 if b.cuda else torch.float32
    for tokens in b.size((2048, 8192), (16,)):
        for name, k, n in (("qkv", h, 3 * h // tp), ("attn_out", h // tp, h),
                           ("mlp_up", h, 4 * h // tp), ("mlp_down", 4 * h // tp, h)):
            x = torch.randn(tokens, k, device=dev, dtype=dtype)
            w = torch.randn(k, n, device=dev, dtype=dtype)
            t = b.time(lambda x=x, w=w: x @ w)
            rows.append({"gemm": name, "m": tokens, "k": k, "n": n, "time_s": t,
                         "flops_per_s": 2 * tokens * k * n / t})
    return rows


def lab02(b: Bench) -> dict:
    dev = b.need_gpu()
    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT
    from labsim.workload import Transformer

    cfg = Transformer.preset("gpt2-124m", **b.size({}, {"layers": 2, "hidden": 64,
                                                         "heads": 4, "kv_heads": 4, "vocab": 512}))
    batch, seq = b.size((8, 1024), (2, 64))
    out: dict[str, Any] = {"model": cfg.name, "batch": batch, "seq_len": seq}
    for mode in ("fp32", "autocast-bf16"):
        torch.manual_seed(0)
        model = GPT(cfg, flash=True).to(dev)
        idx, targets = random_batch(cfg, batch, seq, device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, idx=idx, targets=targets, opt=opt, mode=mode) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=mode != "fp32"):
                _, loss = model(idx, targets)
            loss.backward()
            opt.step()

        out[mode] = {"step_s": b.time(step, 2, 5), "peak_bytes": b.peak_bytes(step)}
        del model, opt
    out["speedup"] = out["fp32"]["step_s"] / out["autocast-bf16"]["step_s"]
    out["layer"] = layer_rows(b, dev)
    return out


def layer_rows(b: Bench, dev: torch.device) -> list[dict]:
    """One pre-norm GPT layer (``labsim.lab.models.Block``, SDPA causal attention, no dropout)
    with bf16 weights and activations, forward + backward, at GPT-3-like widths and 2048
    tokens of context: the compute the step model charges for one layer and micro-batch."""
    from labsim.lab.models import Block
    from labsim.workload import Transformer

    rows = []
    shapes = b.size(((4096, 32, 2048, 4), (8192, 64, 2048, 2), (12288, 96, 2048, 1)),
                    ((64, 4, 64, 2),))
    for hidden, heads, seq, micro_batch in shapes:
        cfg = Transformer(layers=1, hidden=hidden, heads=heads, seq_len=seq, vocab=50257,
                          dropout=False)
        torch.manual_seed(0)
        block = Block(cfg, flash=True).to(dev, torch.bfloat16)
        x = torch.randn(micro_batch, seq, hidden, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        grad = torch.randn_like(x)

        def fwd_bwd(block=block, x=x, grad=grad) -> None:
            block(x).backward(grad)

        def fwd(block=block, x=x) -> None:
            with torch.no_grad():
                block(x)

        rows.append({"hidden": hidden, "heads": heads, "seq_len": seq,
                     "micro_batch": micro_batch, "forward_s": b.time(fwd, 2, 5),
                     "forward_backward_s": b.time(fwd_bwd, 2, 5),
                     "peak_bytes": b.peak_bytes(fwd_bwd)})
        del block, x, grad
        b.empty_cache()
    return rows


def lab03(b: Bench) -> dict:
    dev = b.need_gpu()
    from labsim.checkpointing import every_k, sqrt_segments
    from labsim.checks.checkpointing import forward_segments
    from labsim.lab.models import residual_mlp

    depth, width, rows = 32, b.size(1024, 32), b.size(16384, 64)
    blocks = residual_mlp(depth, width).to(dev)
    x = torch.randn(rows, width, device=dev)
    out: dict[str, Any] = {"depth": depth, "width": width, "rows": rows,
                           "peak": "allocated above the weights and the batch, gradients "
                                   "included (none held before the step)"}
    for label, starts in (("none", None), ("every layer", every_k(depth, 1)),
                          ("every sqrt(n)", sqrt_segments(depth))):
        def step(starts=starts) -> None:
            forward_segments(blocks, x, starts).square().mean().backward()

        def clean_step(step=step) -> None:
            blocks.zero_grad(set_to_none=True)  # freed before the clock and the peak start
            step()

        t = b.time(clean_step, 2, 5)
        blocks.zero_grad(set_to_none=True)
        out[label] = {"starts": list(starts or [0]), "step_s": t,
                      "peak_bytes": b.peak_bytes(step)}
        blocks.zero_grad(set_to_none=True)
    return out


def lab04(b: Bench) -> dict:
    dev = b.need_gpu()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    dtype = torch.bfloat16 if b.cuda else torch.float32
    rows = []
    for n in b.size((512, 1024, 2048, 4096, 8192), (64,)):
        q, k, v = (torch.randn(4, 16, n, 64, device=dev, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)

        def naive(q=q, k=k, v=v, grad=grad) -> None:
            s = (q @ k.transpose(-1, -2)) / 8.0
            (torch.softmax(s.float(), -1).to(q.dtype) @ v).backward(grad)

        cases: dict[str, Callable[[], None]] = {"naive": naive}
        for name, backend in backends.items():
            def sdpa(backend=backend, q=q, k=k, v=v, grad=grad) -> None:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v).backward(grad)
            cases[name] = sdpa
        for name, fn in cases.items():
            try:
                rows.append({"n": n, "kernel": name, "time_s": b.time(fn, 2, 5),
                             "peak_bytes": b.peak_bytes(fn)})
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                rows.append({"n": n, "kernel": name, "error": str(exc).splitlines()[0][:200]})
            b.empty_cache()
    return {"batch": 4, "heads": 16, "head_dim": 64, "dtype": str(dtype).split(".")[-1],
            "forward_backward": rows, "triton_forward": triton_forward(b, dev)}


def triton_forward(b: Bench, dev: torch.device) -> list[dict] | str:
    """Lab 04's Triton FlashAttention-2 forward (``experiments.attention``) against SDPA's
    forward: time and largest difference from SDPA, bf16, causal and not."""
    try:
        from labsim.experiments.attention import triton_flash_forward
        run = triton_flash_forward()
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    import torch.nn.functional as F

    dtype = torch.bfloat16 if b.cuda else torch.float32
    rows = []
    for n in b.size((1024, 4096, 8192), (64,)):
        q, k, v = (torch.randn(4, 16, n, 64, device=dev, dtype=dtype) for _ in range(3))
        for causal in (False, True):
            row: dict[str, Any] = {"n": n, "causal": causal}
            try:
                out, _ = run(q, k, v, is_causal=causal)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                row["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
                row["triton_s"] = b.time(
                    lambda q=q, k=k, v=v, c=causal: run(q, k, v, is_causal=c), 2, 5)
                row["sdpa_s"] = b.time(
                    lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c), 2, 5)
            except Exception as exc:  # a compile or launch failure is the finding to record
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            b.empty_cache()
    return rows


def lab05(b: Bench) -> dict:
    dev = b.need_gpu()
    from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs
    from labsim.lab.device import time_queued

    rows = []
    eager = bias_gelu_dropout_residual
    compiled = torch.compile(eager, dynamic=False)
    graphs = torch.compile(eager, mode="reduce-overhead", dynamic=False)
    hidden = b.size(4096, 64)
    calls = b.size(200, 3)
    for rows_n in b.size((16, 1024, 65536), (4,)):
        inp = chain_inputs(rows_n, hidden, device=dev)
        row: dict[str, Any] = {"rows": rows_n, "hidden": hidden}
        for name, fn in (("eager", eager), ("compile", compiled), ("compile+cudagraphs", graphs)):
            if name == "compile+cudagraphs" and not b.cuda:
                continue
            row[f"{name}_s"] = b.time(lambda fn=fn, inp=inp: fn(*inp.args), 3, 20)
            # back to back, one synchronisation at the end: the queue's throughput
            row[f"{name}_queued_s"] = time_queued(lambda fn=fn, inp=inp: fn(*inp.args),
                                                  device=dev, calls=calls, warmup=3)
        if b.cuda:  # the eager chain captured once with static inputs and replayed
            try:
                row.update(graph_replay(eager, inp.args, b, calls))
            except Exception as exc:  # a capture failure is the finding to record
                row["graph_replay_error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    return {"chain": rows, "timing": "*_s: CUDA events around one call (median); "
                                     "*_queued_s: wall clock per call over back-to-back calls"}


def graph_replay(fn: Callable[..., Any], args: tuple, b: Bench, calls: int) -> dict:
    """``fn(*args)`` captured in a CUDA graph (warmed up on a side stream, as PyTorch's CUDA
    graph notes require) and replayed: time per replay, alone and back to back."""
    from labsim.lab.device import time_queued

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return {"graph_replay_s": b.time(graph.replay, 3, 20),
            "graph_replay_queued_s": time_queued(graph.replay, device=b.device, calls=calls,
                                                 warmup=3)}


def lab06(b: Bench) -> dict:
    from labsim.experiments.loading import IMAGENET_BATCH_BYTES, copy_overlap

    dev = b.need_gpu()
    return copy_overlap(dev, b.time, nbytes=b.size(IMAGENET_BATCH_BYTES, 4096),
                        side=b.size(8192, 64))


def lab12(b: Bench) -> dict:
    dev = b.need_gpu()
    if not hasattr(torch, "_int_mm"):
        raise Skip("this torch has no torch._int_mm")
    rows = []
    low = torch.bfloat16 if b.cuda else torch.float32
    for m, n, k in b.size(((32, 8192, 8192), (4096, 8192, 8192)), ((32, 64, 64),)):
        a8 = torch.randint(-128, 127, (m, k), device=dev, dtype=torch.int8)
        b8 = torch.randint(-128, 127, (k, n), device=dev, dtype=torch.int8)
        a16, b16 = a8.to(low), b8.to(low)
        t8 = b.time(lambda a8=a8, b8=b8: torch._int_mm(a8, b8))
        t16 = b.time(lambda a16=a16, b16=b16: a16 @ b16)
        rows.append({"m": m, "n": n, "k": k, "int8_s": t8, "bf16_s": t16,
                     "int8_ops_per_s": 2 * m * n * k / t8, "speedup": t16 / t8})
    return {"int_mm": rows}


def parallel(skip_torchrun: bool) -> dict:
    if skip_torchrun:
        raise Skip("--skip-torchrun")
    demos = ["labsim.parallel.data_parallel:demo", "labsim.parallel.zero:demo",
             "labsim.parallel.tensor_parallel:demo", "labsim.parallel.pipeline:demo",
             "labsim.checks.collectives.reference:demo"]
    out: dict[str, Any] = {"backend": "nccl" if torch.cuda.is_available() else "gloo",
                           "demos": {}}
    for spec in demos:
        try:
            run = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                 "--master_port=29531", "-m", "labsim.lab.worker", spec],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                    OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            out["demos"][spec] = {"returncode": None, "result": None,
                                  "stderr_tail": "timed out after 60 s"}
            continue
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("rank 0:")]
        out["demos"][spec] = {"returncode": run.returncode,
                              "result": lines[0].split(":", 1)[1].strip() if lines else None,
                              "stderr_tail": run.stderr[-400:] if run.returncode else ""}
    return out


# -- the record ---------------------------------------------------------------------------------

def environment(smoke: bool) -> dict:
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                           "date": datetime.date.today().isoformat()}
    if smoke:
        env["smoke"] = True  # toy sizes: records.gpu_record refuses such a file
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            fields = [f.strip() for f in smi.stdout.splitlines()[0].split(",")]
            env.update(driver=fields[0], max_sm_clock=fields[1], power_limit=fields[2])
        except (OSError, IndexError, subprocess.TimeoutExpired):
            env["driver"] = None
    else:
        env["gpu"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where the JSON files go (default with a GPU: {DEFAULT_OUT})")
    parser.add_argument("--only", default="", help="comma-separated sections, e.g. 00,04")
    parser.add_argument("--skip-torchrun", action="store_true")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on any device: exercises every path, measures nothing")
    args = parser.parse_args(argv)
    bench = Bench(smoke=args.smoke)
    out_dir = args.out or (DEFAULT_OUT if bench.cuda and not bench.smoke else None)
    sections: dict[str, Callable[[], dict]] = {
        "00": lambda: lab00(bench), "02": lambda: lab02(bench), "03": lambda: lab03(bench),
        "04": lambda: lab04(bench), "05": lambda: lab05(bench), "06": lambda: lab06(bench),
        "12": lambda: lab12(bench), "parallel": lambda: parallel(args.skip_torchrun)}
    chosen = [s for s in args.only.split(",") if s] or list(sections)
    env = environment(args.smoke)
    print(f"device: {env['gpu'] or 'no CUDA GPU'} | torch {env['torch']}", flush=True)
    skipped = 0
    for key in chosen:
        start = time.perf_counter()
        try:
            result: dict[str, Any] = {"status": "measured", **sections[key]()}
        except Skip as why:
            result, skipped = {"status": "skipped", "reason": str(why)}, skipped + 1
        except Exception as exc:  # noqa: BLE001 - one section's failure is data, not a stop
            result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-2000:]}
        result["wall_s"] = round(time.perf_counter() - start, 2)
        print(f"{LABS[key]:<22} {result['status']:<9} {result['wall_s']:7.1f} s  "
              f"{result.get('reason') or result.get('error') or ''}", flush=True)
        if out_dir is not None and result["status"] != "skipped":
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"{LABS[key]}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"environment": env, "section": key, **result},
                                      indent=1) + "\n")
            tmp.replace(path)
    if out_dir is None:
        print("no GPU and no --out: nothing written")
    print(f"{len(chosen) - skipped} section(s) ran, {skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
