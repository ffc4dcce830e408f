"""The catalog's entries: every GPU and link labsim knows, each from its datasheet.

Read them through ``labsim.hardware`` (``gpu``, ``link``, ``GPUS``, ``LINKS``).
"""

from __future__ import annotations

from labsim.devices import GPU, Link

T = 1e12
CATALOG_GPUS: tuple[GPU, ...] = (
    GPU(
        "V100-32GB",
        {"fp64": 7.8 * T, "fp32": 15.7 * T, "fp16": 125 * T},
        32e9,
        900e9,
        "NVIDIA V100 datasheet (SXM2): 125 TFLOPS tensor FP16, 15.7 FP32, 900 GB/s HBM2",
        sram_bytes=80 * 128e3,
        compute_capability=7.0,
        tdp_W=300,
        tdp_source="NVIDIA Tesla V100 datasheet: max power consumption 300 W (SXM2; PCIe 250 W)",
    ),
    GPU(
        "A100-40GB",
        {
            "fp64": 9.7 * T,
            "fp32": 19.5 * T,
            "tf32": 156 * T,
            "fp16": 312 * T,
            "bf16": 312 * T,
            "int8": 624 * T,
        },
        40e9,
        1555e9,
        "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS BF16/FP16 dense (624 with sparsity), "
        "1,555 GB/s HBM2",
        sram_bytes=108 * 192e3,
        compute_capability=8.0,
        tdp_W=400,
        tdp_source="NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): max TDP "
                   "400 W (SXM4; PCIe 250-300 W)",
    ),
    GPU(
        "A100-80GB",
        {
            "fp64": 9.7 * T,
            "fp32": 19.5 * T,
            "tf32": 156 * T,
            "fp16": 312 * T,
            "bf16": 312 * T,
            "int8": 624 * T,
        },
        80e9,
        2039e9,
        "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS BF16/FP16 dense (624 with sparsity), "
        "2,039 GB/s HBM2e",
        sram_bytes=108 * 192e3,
        compute_capability=8.0,
        tdp_W=400,
        tdp_source="NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4): max TDP "
                   "400 W (SXM4 80GB)",
    ),
    GPU(
        "H100-SXM",
        {
            "fp64": 33.5 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        80e9,
        3.35e12,
        "NVIDIA H100 datasheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989.4 dense, "
        "3.35 TB/s HBM3",
        sram_bytes=132 * 256e3,
        compute_capability=9.0,
        tdp_W=700,
        tdp_source="NVIDIA H100 datasheet: max TDP up to 700 W, configurable (SXM5)",
    ),
    GPU(
        "H100-SXM-HBM2e",
        {
            "fp64": 33.5 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        96e9,
        2.4e12,
        "pytorch/torchtitan docs/performance.md (December 2024 runs, Meta's Grand Teton hosts): "
        "'Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth'; "
        "peaks: H100 SXM5's (NVIDIA H100 datasheet), see notes",
        sram_bytes=132 * 256e3,
        notes="the SXM H100 of Meta's Grand Teton hosts with HBM2e instead of HBM3, run at a 500 W "
        "cap; no datasheet gives its compute peak: torchtitan's docs say 'the actual peak "
        "TFLOPs number is between SXM and NVL, and we don't know its exact value', so the SXM "
        "peaks are kept (an upper bound). torchtitan's earlier docs call the part 'H100 (94GB "
        "memory)' and 'SXM H100(95GB)' (April-August 2024)",
        compute_capability=9.0,
        tdp_W=500,
        tdp_source="500 W, pytorch/torchtitan docs/performance.md: 'We used the default 500W power "
                   "limit, although tuning it up to 700W TDP can potentially provide further "
                   "speedups'",
    ),
    GPU(
        "H100-NVL",
        {
            "fp64": 30 * T,
            "fp32": 60 * T,
            "tf32": 417.5 * T,
            "fp16": 835.5 * T,
            "bf16": 835.5 * T,
            "fp8": 1670.5 * T,
            "int8": 1670.5 * T,
        },
        94e9,
        3.9e12,
        "NVIDIA H100 datasheet (H100 NVL column): BF16/FP16 1,671 TFLOPS with sparsity = "
        "835.5 dense, TF32 835 with sparsity = 417.5 dense, FP8 3,341 with sparsity, FP32 60, "
        "94 GB HBM3 at 3.9 TB/s; PCIe card, NVLink bridge 600 GB/s between a pair",
        sram_bytes=132 * 256e3,
        notes="a PCIe card whose NVLink bridge joins two cards; no NVSwitch node of 8",
        compute_capability=9.0,
        tdp_W=400,
        tdp_source="NVIDIA H100 datasheet (H100 NVL): max TDP 350-400 W (configurable); the "
                   "upper figure is used",
    ),
    GPU(
        "H800",
        {
            "fp64": 1 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        80e9,
        3.35e12,
        "NVIDIA H800 datasheet (SXM): FP64 1 TFLOPS, BF16/FP16 1,979 TFLOPS with sparsity = "
        "989.4 dense, FP8 3,958 with sparsity, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s "
        "(bidirectional)",
        sram_bytes=132 * 256e3,
        notes="H100 SXM5 silicon with FP64 cut to 1 TFLOPS and NVLink cut to 8 links (400 GB/s "
        "bidirectional, link nvlink4-h800)",
        compute_capability=9.0,
        tdp_W=700,
        tdp_source="NVIDIA H800 datasheet (SXM): max TDP up to 700 W (configurable)",
    ),
    GPU(
        "B200",
        {
            "fp64": 37 * T,
            "fp32": 75 * T,
            "tf32": 1100 * T,
            "fp16": 2250 * T,
            "bf16": 2250 * T,
            "fp8": 4500 * T,
            "int8": 4500 * T,
        },
        180e9,
        8e12,
        "NVIDIA HGX B200 specifications (per GPU of the 8-GPU board): FP16/BF16 4.5 PFLOPS with "
        "sparsity = 2.25 dense, TF32 2.2 with sparsity = 1.1 dense, FP8 9 with sparsity = 4.5 "
        "dense, INT8 9 POPS with sparsity, FP32 75 TFLOPS, FP64 37; DGX B200 datasheet: "
        "1,440 GB HBM3e in all (180 GB a GPU), 64 TB/s (8 TB/s a GPU); NVLink 5 1.8 TB/s "
        "(bidirectional)",
        notes="FP4/FP6 units not in the catalog's dtypes; the GPU carries 192 GB of HBM3e, of "
        "which the HGX/DGX B200 sheets state 180 GB usable",
        compute_capability=10.0,
        tdp_W=1000,
        tdp_source="NVIDIA HGX B200 specifications: max TDP up to 1,000 W per GPU",
    ),
    GPU(
        "H100-PCIe",
        {
            "fp64": 25.6 * T,
            "fp32": 51.2 * T,
            "tf32": 378 * T,
            "fp16": 756 * T,
            "bf16": 756 * T,
            "fp8": 1513 * T,
            "int8": 1513 * T,
        },
        80e9,
        2.0e12,
        "NVIDIA H100 datasheet (PCIe): BF16 1,513 TFLOPS with sparsity = 756 dense, 2 TB/s HBM2e",
        sram_bytes=114 * 256e3,
        compute_capability=9.0,
        tdp_W=350,
        tdp_source="NVIDIA H100 PCIe product brief PB-11133-001_v02: maximum TDP 350 W",
    ),
    GPU(
        "H200",
        {
            "fp64": 33.5 * T,
            "fp32": 66.9 * T,
            "tf32": 494.7 * T,
            "fp16": 989.4 * T,
            "bf16": 989.4 * T,
            "fp8": 1978.9 * T,
            "int8": 1978.9 * T,
        },
        141e9,
        4.8e12,
        "NVIDIA H200 datasheet (SXM): same compute as H100 SXM, 141 GB HBM3e at 4.8 TB/s",
        sram_bytes=132 * 256e3,
        compute_capability=9.0,
        tdp_W=700,
        tdp_source="NVIDIA H200 datasheet: max TDP up to 700 W, configurable (SXM)",
    ),
    GPU(
        "MI250X",
        {
            "fp64": 47.9 * T,
            "fp32": 47.9 * T,
            "fp16": 383 * T,
            "bf16": 383 * T,
            "int8": 383 * T,
        },
        128e9,
        3.2768e12,
        "AMD Instinct MI250X datasheet: 383 TFLOPS FP16/BF16 matrix, 47.9 TFLOPS FP32 vector "
        "(95.7 FP32 *matrix*), 128 GB HBM2e, 3.2768 TB/s",
        notes="fp32 is the vector rate; the 95.7 TFLOP/s figure is the FP32 matrix-core rate",
        tdp_W=560,
        tdp_source="AMD Instinct MI250X data sheet: total board power 500 W, 560 W peak (OAM); "
                   "the peak is used",
    ),
    GPU(
        "RTX-4090",
        {
            "fp32": 82.6 * T,
            "tf32": 82.6 * T,
            "fp16": 165.2 * T,
            "bf16": 165.2 * T,
            "fp8": 330.3 * T,
            "int8": 660.6 * T,
        },
        24e9,
        1008e9,
        "NVIDIA Ada Lovelace architecture whitepaper (RTX 4090): FP16/BF16 tensor 165.2 TFLOPS "
        "dense with FP32 accumulate (330.3 with FP16 accumulate), 82.6 FP32, 24 GB GDDR6X, "
        "1,008 GB/s",
        sram_bytes=128 * 128e3,
        compute_capability=8.9,
        tdp_W=450,
        tdp_source="NVIDIA GeForce RTX 4090 specifications: total graphics power 450 W",
    ),
    GPU(
        "A6000",
        {
            "fp32": 38.7 * T,
            "tf32": 77.4 * T,
            "fp16": 154.8 * T,
            "bf16": 154.8 * T,
            "int8": 309.7 * T,
        },
        48e9,
        768e9,
        "NVIDIA RTX A6000 datasheet: 38.7 TFLOPS FP32, tensor 309.7 TFLOPS with sparsity = "
        "154.8 dense FP16/BF16, 48 GB GDDR6, 768 GB/s",
        sram_bytes=84 * 128e3,
        compute_capability=8.6,
        tdp_W=300,
        tdp_source="NVIDIA RTX A6000 datasheet: max power consumption 300 W",
    ),
)

G = 1e9
# NCCL src/graph/tuning.cc, hwLat[hw][RING][SIMPLE]: per-step latency of a ring step, in s.
# ``nccl_Bps``: NCCL's topology bandwidth (src/graph/topo.h): NVLink SM70/SM80 20 GB/s, SM90
# 20.6 GB/s and SM100 40.1 GB/s per link times the links; PCIe width x speed / 80 (Gen3 x16 12,
# Gen4 24, Gen5 48);
# a NIC its speed in Mb/s / 8000.
_NCCL_RING_LAT_NVLINK = 3.4e-6
_NCCL_RING_LAT_PCI = 5.7e-6
_NCCL_RING_LAT_NET = 14e-6
CATALOG_LINKS: tuple[Link, ...] = (
    Link(
        "nvlink2",
        150 * G,
        _NCCL_RING_LAT_NVLINK,
        "V100 SXM2: 6 NVLink2 links x 25 GB/s per direction (NVIDIA V100 datasheet: 300 GB/s "
        "bidirectional)",
        nccl_efficiency=120 / 150,
        efficiency_source="NCCL's own topology bandwidth (6 links x SM70_NVLINK_BW 20 GB/s, "
        "src/graph/topo.h); no nccl-tests figure",
        kind="nvlink", nccl_Bps=6 * 20 * G,
    ),
    Link(
        "nvlink3",
        300 * G,
        _NCCL_RING_LAT_NVLINK,
        "A100 SXM4: 12 NVLink3 links x 25 GB/s = 300 GB/s per direction (600 GB/s "
        "bidirectional, NVIDIA A100 datasheet)",
        nccl_efficiency=230 / 300,
        efficiency_source="NCCL maintainers (nccl-tests issues): ~230 GB/s all-reduce busbw "
        "on an 8xA100 NVLink node for >= 8 GB messages",
        kind="nvlink", nccl_Bps=12 * 20 * G,
    ),
    Link(
        "nvlink4",
        450 * G,
        _NCCL_RING_LAT_NVLINK,
        "H100 SXM5: 18 NVLink4 links x 25 GB/s = 450 GB/s per direction (900 GB/s "
        "bidirectional, NVIDIA H100 datasheet)",
        nccl_efficiency=370 / 450,
        efficiency_source="NCCL maintainers (nccl-tests issues): ~370 GB/s ring all-reduce "
        "busbw on an 8xH100 NVLink node (~20 % protocol overhead)",
        kind="nvlink", nccl_Bps=18 * 20.6 * G,
    ),
    Link(
        "nvlink4-h800",
        200 * G,
        _NCCL_RING_LAT_NVLINK,
        "H800 SXM5: 8 NVLink4 links x 25 GB/s = 200 GB/s per direction (400 GB/s "
        "bidirectional, NVIDIA H800 datasheet)",
        nccl_efficiency=370 / 450,
        efficiency_source="assumed equal to H100's NVLink4 fraction (~370 of 450 GB/s ring "
        "all-reduce busbw); no nccl-tests figure for the H800",
        kind="nvlink", nccl_Bps=8 * 20.6 * G,
    ),
    Link(
        "nvlink5",
        900 * G,
        _NCCL_RING_LAT_NVLINK,
        "B200 (HGX B200): 18 NVLink5 links x 50 GB/s = 900 GB/s per direction (1.8 TB/s "
        "bidirectional, NVIDIA HGX B200 specifications)",
        nccl_efficiency=370 / 450,
        efficiency_source="assumed equal to H100's NVLink4 fraction (~370 of 450 GB/s); no "
        "nccl-tests figure for NVLink5 here",
        kind="nvlink", nccl_Bps=18 * 40.1 * G,
    ),
    Link(
        "pcie3-x16",
        15.75 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 3.0 x16: 8 GT/s x 16 lanes x 128/130 encoding = 15.75 GB/s per direction",
        nccl_efficiency=12 / 15.75,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 12 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=12 * G,
    ),
    Link(
        "pcie4-x16",
        31.5 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 4.0 x16: 16 GT/s x 16 lanes x 128/130 encoding = 31.5 GB/s per direction",
        nccl_efficiency=24 / 31.5,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 24 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=24 * G,
    ),
    Link(
        "pcie5-x16",
        63 * G,
        _NCCL_RING_LAT_PCI,
        "PCIe 5.0 x16: 32 GT/s x 16 lanes x 128/130 encoding = 63 GB/s per direction",
        nccl_efficiency=48 / 63,
        efficiency_source="NCCL's own topology bandwidth for the slot (src/graph/topo.cc: width x "
        "speed / 80 = 48 GB/s): PCIe's TLP and flow-control overhead; no nccl-tests figure",
        kind="pcie", nccl_Bps=48 * G,
    ),
    Link(
        "ib-hdr",
        25 * G,
        _NCCL_RING_LAT_NET,
        "InfiniBand HDR: 200 Gb/s = 25 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="assumed equal to NDR's measured fraction (46-48 of 50 GB/s)",
        kind="net", nccl_Bps=25 * G,
    ),
    Link(
        "opa-100",
        12.5 * G,
        _NCCL_RING_LAT_NET,
        "Intel Omni-Path Architecture 100: 100 Gb/s = 12.5 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="port: assumed equal to InfiniBand NDR's measured fraction (46-48 "
        "of 50 GB/s). Channel: 2.54 GB/s, fitted to BigScience's all-reduce of 4 GB on 4 "
        "Jean Zay nodes of 8 A100 (bigscience experiments/bandwidth, Jan 2022, NCCL 2.10.3 "
        "through IB verbs on hfi1, no GPUDirect RDMA): 1.529 s on 2 channels, busbw 5.07 GB/s, "
        "40 % of one port; 4 V100 nodes on 4 channels reached 10.6 GB/s, so the channel, not "
        "the port, is the limit",
        kind="net", nccl_Bps=12.5 * G, nccl_channel_Bps=2.54 * G,
    ),
    Link(
        "ib-ndr",
        50 * G,
        _NCCL_RING_LAT_NET,
        "InfiniBand NDR: 400 Gb/s = 50 GB/s per port per direction",
        nccl_efficiency=47 / 50,
        efficiency_source="NCCL maintainers (nccl-tests issues): 46-48 GB/s busbw per "
        "400 Gb/s NIC",
        kind="net", nccl_Bps=50 * G,
    ),
)
