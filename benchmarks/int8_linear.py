"""Time one linear layer in fp32 and through the int8 paths available on this machine.

    python benchmarks/int8_linear.py [--features 2048] [--batches 1 16 128]

Compares ``nn.Linear`` (fp32 BLAS), the lab's exact int8 layer (int32 accumulation through
PyTorch's generic integer matmul), ``torch.ao.quantization.quantize_dynamic`` (FBGEMM) and
torchao's int8 paths when torchao is installed.  Prints median milliseconds per call and the
speed-up over fp32; figures depend on the CPU (AVX2, AVX-512 VNNI, AMX) and on its load.
"""

from __future__ import annotations

import argparse
import platform

import torch
from torch import nn

from labsim.checks.quantization.reference import quantize_model
from labsim.experiments.quantization import pytorch_dynamic_int8, time_models, torchao_int8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=2048)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    args = parser.parse_args()
    k = args.features
    layer = nn.Sequential(nn.Linear(k, k))
    calib = [torch.randn(256, k, generator=torch.Generator().manual_seed(0))]
    ao_a8w8, note = torchao_int8(layer)
    ao_w8, _ = torchao_int8(layer, weight_only=True)
    table = time_models(
        {
            "fp32 nn.Linear": layer,
            "lab Int8Linear (exact int32)": quantize_model(layer, calib),
            "quantize_dynamic (FBGEMM)": pytorch_dynamic_int8(layer)[0],
            "torchao int8 dyn. act. + weights": ao_a8w8,
            "torchao int8 weight-only": ao_w8,
        },
        batches=args.batches,
        features=k,
        repeat=args.repeat,
        max_seconds=3.0,
        threads=args.threads,
    )
    threads = args.threads or torch.get_num_threads()
    print(f"{k}x{k} linear layer; torch {torch.__version__}, "
          f"{torch.backends.cpu.get_cpu_capability()}, {threads} threads, "
          f"{platform.processor() or platform.machine()}; {note}")
    print(table)


if __name__ == "__main__":
    main()
