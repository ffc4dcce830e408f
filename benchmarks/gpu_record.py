"""Run every measurement the labs' GPU cells describe, once, and record it as data.

    python benchmarks/gpu_record.py [--out DIR] [--only 00,04,...] [--skip-torchrun]

On a CUDA GPU it measures, per lab, what the lab's GPU cells would show, and writes one JSON
file per lab (``NN_topic.json``) into ``DIR`` (default: the package's
``labsim/data/gpu_records/``), each labelled with the GPU's name, driver, CUDA and torch
versions and the date.  The labs read those files (``labsim.experiments.records``) and show
them, labelled, in their GPU cells when they run without a GPU, beside labsim's prediction for
the same GPU.  Without a GPU it runs what needs none (the torchrun demos on gloo) and says what
it skips; it then writes nowhere unless ``--out`` is given.

Sections (each stands alone; a failure is recorded with its error and the others go on):

* 00 matmul FLOP/s by dtype (fp32 without and with TF32, bf16, fp16, fp8 where the GPU has
  it) and size (4096 against 4097: wave quantisation), HBM bandwidth (device copy);
* 02 a GPT training step in fp32 and under autocast(bf16): time and peak memory;
* 03 checkpointing a residual MLP: none against every layer, peak memory and time;
* 04 attention forward + backward by sequence length: naive against each SDPA backend
  (math, memory-efficient, flash, cuDNN), time and peak memory; the lab's Triton
  FlashAttention-2 forward against SDPA's forward, time and largest difference;
* 05 the lab's element-wise chain: eager, ``torch.compile``, and compiled with CUDA graphs
  (``mode="reduce-overhead"``), by tensor size;
* 06 host-to-device copies: pageable against pinned, and a pinned copy on a side stream while
  the default stream computes (overlap);
* 12 ``torch._int_mm`` (int8 tensor cores) against a bf16 matmul;
* 07-11 the torch.distributed demos of ``labsim.parallel`` and the ring reference under
  ``torchrun --nproc_per_node=1`` (NCCL on a GPU): correctness of the NCCL paths, not
  scaling.

Budget: about 8 minutes on an H200 (every size below was chosen for that).
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


def need_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip("no CUDA GPU")
    return torch.device("cuda")


def cuda_time(fn: Callable[[], Any], warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of ``fn`` on the GPU, timed with CUDA events (queued throughput)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def peak_bytes(fn: Callable[[], Any]) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


# -- sections ---------------------------------------------------------------------------------

def lab00() -> dict:
    dev = need_cuda()
    out: dict[str, Any] = {"matmul": [], "hbm": {}}
    dtypes = [("fp32", torch.float32, False), ("tf32", torch.float32, True),
              ("bf16", torch.bfloat16, False), ("fp16", torch.float16, False)]
    for n in (4096, 4097, 8192):
        for name, dtype, tf32 in dtypes:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            t = cuda_time(lambda a=a, b=b: a @ b)
            out["matmul"].append({"dtype": name, "n": n, "time_s": t,
                                  "flops_per_s": 2 * n**3 / t})
        torch.backends.cuda.matmul.allow_tf32 = False
    if hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(dev) >= (8, 9):
        n = 8192
        a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=dev)
        t = cuda_time(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,
                                               out_dtype=torch.bfloat16))
        out["matmul"].append({"dtype": "fp8", "n": n, "time_s": t, "flops_per_s": 2 * n**3 / t})
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x))
    out["hbm"] = {"bytes_moved": 2 * x.numel(), "time_s": t, "bandwidth_Bps": 2 * x.numel() / t}
    return out


def lab02() -> dict:
    dev = need_cuda()
    from labsim.lab.datasets import random_batch
    from labsim.lab.models import GPT
    from labsim.workload import Transformer

    cfg = Transformer.preset("gpt2-124m")
    out = {}
    for mode in ("fp32", "autocast-bf16"):
        torch.manual_seed(0)
        model = GPT(cfg, flash=True).to(dev)
        idx, targets = random_batch(cfg, 8, 1024, device=dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, idx=idx, targets=targets, opt=opt, mode=mode) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "fp32"):
                _, loss = model(idx, targets)
            loss.backward()
            opt.step()

        out[mode] = {"step_s": cuda_time(step, 2, 5), "peak_bytes": peak_bytes(step)}
        del model, opt
    out["speedup"] = out["fp32"]["step_s"] / out["autocast-bf16"]["step_s"]
    return out


def lab03() -> dict:
    dev = need_cuda()
    from labsim.checkpointing import every_k
    from labsim.checks.checkpointing import forward_segments
    from labsim.lab.models import residual_mlp

    blocks = residual_mlp(32, 1024).to(dev)
    x = torch.randn(16384, 1024, device=dev)
    out = {}
    for label, starts in (("none", None), ("every layer", every_k(32, 1))):
        def step(starts=starts) -> None:
            blocks.zero_grad(set_to_none=True)
            forward_segments(blocks, x, starts).square().mean().backward()
        out[label] = {"step_s": cuda_time(step, 2, 5), "peak_bytes": peak_bytes(step)}
    return out


def lab04() -> dict:
    dev = need_cuda()
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    rows = []
    for n in (512, 1024, 2048, 4096, 8192):
        q, k, v = (torch.randn(4, 16, n, 64, device=dev, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
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
                rows.append({"n": n, "kernel": name, "time_s": cuda_time(fn, 2, 5),
                             "peak_bytes": peak_bytes(fn)})
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                rows.append({"n": n, "kernel": name, "error": str(exc).splitlines()[0][:200]})
            torch.cuda.empty_cache()
    return {"forward_backward": rows, "triton_forward": triton_forward(dev)}


def triton_forward(dev: torch.device) -> list[dict] | str:
    """Lab 04's Triton FlashAttention-2 forward (``experiments.attention``) against SDPA's
    forward: time and largest difference from SDPA, bf16, causal and not."""
    try:
        from labsim.experiments.attention import triton_flash_forward
        run = triton_flash_forward()
    except ImportError as exc:
        return f"triton is not importable: {exc}"
    import torch.nn.functional as F

    rows = []
    for n in (1024, 4096, 8192):
        q, k, v = (torch.randn(4, 16, n, 64, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        for causal in (False, True):
            row: dict[str, Any] = {"n": n, "causal": causal}
            try:
                out, _ = run(q, k, v, is_causal=causal)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                row["max_abs_diff_vs_sdpa"] = float((out.float() - ref.float()).abs().max())
                row["triton_s"] = cuda_time(
                    lambda q=q, k=k, v=v, c=causal: run(q, k, v, is_causal=c), 2, 5)
                row["sdpa_s"] = cuda_time(
                    lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c), 2, 5)
            except Exception as exc:  # a compile or launch failure is the finding to record
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            torch.cuda.empty_cache()
    return rows


def lab05() -> dict:
    dev = need_cuda()
    from labsim.experiments.fusion import bias_gelu_dropout_residual, chain_inputs

    rows = []
    eager = bias_gelu_dropout_residual
    compiled = torch.compile(eager)
    graphs = torch.compile(eager, mode="reduce-overhead")
    for rows_n in (16, 256, 4096, 65536):
        inp = chain_inputs(rows_n, 4096, device=dev)
        row = {"elements": inp.numel}
        for name, fn in (("eager", eager), ("compile", compiled), ("compile+cudagraphs", graphs)):
            row[f"{name}_s"] = cuda_time(lambda fn=fn, inp=inp: fn(*inp.args), 3, 20)
        rows.append(row)
    return {"chain": rows}


def lab06() -> dict:
    dev = need_cuda()
    nbytes = 256 * 3 * 224 * 224 * 4  # an ImageNet batch of 256, fp32
    pageable = torch.empty(nbytes // 4)
    pinned = torch.empty(nbytes // 4).pin_memory()
    out = {}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        t = cuda_time(lambda host=host: host.to(dev, non_blocking=True), 2, 10)
        out[name] = {"bytes": nbytes, "time_s": t, "bandwidth_Bps": nbytes / t}
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    compute = cuda_time(lambda: a @ a, 2, 5)
    copy = out["pinned"]["time_s"]

    def both() -> None:
        with torch.cuda.stream(side):
            x = pinned.to(dev, non_blocking=True)
        a @ a
        torch.cuda.current_stream().wait_stream(side)
        x.record_stream(torch.cuda.current_stream())

    out["overlap"] = {"compute_s": compute, "copy_s": copy, "both_s": cuda_time(both, 2, 5)}
    return out


def lab12() -> dict:
    dev = need_cuda()
    if not hasattr(torch, "_int_mm"):
        raise Skip("this torch has no torch._int_mm")
    rows = []
    for m, n, k in ((32, 8192, 8192), (4096, 8192, 8192)):
        a8 = torch.randint(-128, 127, (m, k), device=dev, dtype=torch.int8)
        b8 = torch.randint(-128, 127, (k, n), device=dev, dtype=torch.int8)
        a16, b16 = a8.to(torch.bfloat16), b8.to(torch.bfloat16)
        t8 = cuda_time(lambda a8=a8, b8=b8: torch._int_mm(a8, b8))
        t16 = cuda_time(lambda a16=a16, b16=b16: a16 @ b16)
        rows.append({"m": m, "n": n, "k": k, "int8_s": t8, "bf16_s": t16,
                     "int8_ops_per_s": 2 * m * n * k / t8, "speedup": t16 / t8})
    return {"int_mm": rows}


def parallel(skip_torchrun: bool) -> dict:
    if skip_torchrun:
        raise Skip("--skip-torchrun")
    demos = ["labsim.parallel.data_parallel:demo", "labsim.parallel.zero:demo",
             "labsim.parallel.tensor_parallel:demo", "labsim.parallel.pipeline:demo",
             "labsim.checks.collectives.reference:demo"]
    out = {"backend": "nccl" if torch.cuda.is_available() else "gloo", "demos": {}}
    for spec in demos:
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
             "--master_port=29531", "-m", "labsim.lab.worker", spec],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("rank 0:")]
        out["demos"][spec] = {"returncode": run.returncode,
                              "result": lines[0].split(":", 1)[1].strip() if lines else None,
                              "stderr_tail": run.stderr[-400:] if run.returncode else ""}
    return out


# -- the record ---------------------------------------------------------------------------------

def environment() -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "date": datetime.date.today().isoformat(), "host": platform.node()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, sm_count=props.multi_processor_count,
                   memory_bytes=props.total_memory, cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout else None
        except OSError:
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
    args = parser.parse_args(argv)
    out_dir = args.out or (DEFAULT_OUT if torch.cuda.is_available() else None)
    sections: dict[str, Callable[[], dict]] = {
        "00": lab00, "02": lab02, "03": lab03, "04": lab04, "05": lab05, "06": lab06,
        "12": lab12, "parallel": lambda: parallel(args.skip_torchrun)}
    chosen = [s for s in args.only.split(",") if s] or list(sections)
    env = environment()
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
