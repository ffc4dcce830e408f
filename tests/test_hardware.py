"""The catalog holds the datasheet figures of reference.md, dense peaks only."""

from __future__ import annotations

import pytest

import labsim
from labsim.hardware import GPU, GPUS, LINKS

T, G = 1e12, 1e9


@pytest.mark.parametrize(
    "name, dtype, peak, memory, bandwidth",
    [
        ("H100-SXM", "bf16", 989.4 * T, 80 * G, 3.35e12),
        ("A100-80GB", "bf16", 312 * T, 80 * G, 2.039e12),
        ("A100-40GB", "tf32", 156 * T, 40 * G, 1.555e12),
        ("H200", "bf16", 989.4 * T, 141 * G, 4.8e12),
        ("V100-32GB", "fp16", 125 * T, 32 * G, 900 * G),
        ("MI250X", "fp16", 383 * T, 128 * G, 3.2768e12),
        ("RTX-4090", "fp32", 82.6 * T, 24 * G, 1008 * G),
        ("H100-PCIe", "bf16", 756 * T, 80 * G, 2.0e12),
        ("A6000", "fp32", 38.7 * T, 48 * G, 768 * G),
    ],
)
def test_datasheet_figures(name: str, dtype: str, peak: float, memory: float,
                           bandwidth: float) -> None:
    chip = labsim.gpu(name)
    assert chip.peak(dtype) == pytest.approx(peak)
    assert chip.memory_bytes == memory
    assert chip.memory_bandwidth_Bps == pytest.approx(bandwidth)
    assert chip.source


def test_dense_not_sparse() -> None:
    # The seeds' "A100 624" and "H100 2000" FP16 TFLOPS are the 2:4-sparsity figures.
    assert labsim.gpu("A100-80GB").peak("fp16") == 312 * T
    assert labsim.gpu("H100-SXM").peak("fp16") < 1000 * T
    # MI250X: 95.7 TFLOP/s FP32 is the matrix-core rate; the catalog keeps the vector 47.9.
    assert labsim.gpu("MI250X").peak("fp32") == 47.9 * T


def test_lookup_case_insensitive_and_passthrough() -> None:
    assert labsim.gpu("h100-sxm") is labsim.gpu("H100-SXM")
    chip = labsim.gpu("H200")
    assert labsim.gpu(chip) is chip
    assert labsim.link("NVLINK4").bandwidth_Bps == 450 * G


def test_unknown_names_list_the_catalog() -> None:
    with pytest.raises(ValueError) as err:
        labsim.gpu("B300")
    for name in ("H100-SXM", "A100-80GB", "MI250X"):
        assert name in str(err.value)
    with pytest.raises(ValueError, match="ib-ndr"):
        labsim.link("ethernet")


def test_required_names_present() -> None:
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200",
                 "MI250X", "RTX-4090", "A6000"):
        assert name.lower() in GPUS
    for name in ("nvlink2", "nvlink3", "nvlink4", "pcie3-x16", "pcie4-x16", "pcie5-x16",
                 "ib-hdr", "ib-ndr", "opa-100"):
        assert name in LINKS
    assert labsim.link("opa-100").bandwidth_Bps == 12.5 * G
    assert labsim.link("opa-100").kind == "net"
    assert labsim.link("ib-hdr").bandwidth_Bps == 25 * G
    assert labsim.link("ib-ndr").bandwidth_Bps == 50 * G


def test_missing_unit_and_bad_specs() -> None:
    with pytest.raises(ValueError, match="no bf16"):
        labsim.gpu("V100-32GB").peak("bf16")
    with pytest.raises(ValueError, match="dtype keys"):
        GPU("x", {"fp4": 1.0}, 1, 1, "")
    with pytest.raises(ValueError, match="> 0"):
        GPU("x", {"fp32": 1.0}, 0, 1, "")
    assert labsim.gpu("H100-SXM").ridge_point("bf16") == pytest.approx(989.4 / 3.35)


def test_catalog_is_read_only() -> None:
    with pytest.raises(TypeError):
        GPUS["x"] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        labsim.gpu("H200").peak_flops["bf16"] = 0  # type: ignore[index]


@pytest.mark.parametrize(
    "name, bf16, fp8, memory, bandwidth, tdp",
    [
        # torchtitan docs: 96GB HBM2e, 2.4 TB/s, 500 W cap; peak unpublished: SXM's kept
        ("H100-SXM-HBM2e", 989.4 * T, 1978.9 * T, 96 * G, 2.4e12, 500),
        # H100 datasheet, NVL: 1,671 / 3,341 TFLOPS with sparsity, 94 GB, 3.9 TB/s, 350-400 W
        ("H100-NVL", 835.5 * T, 1670.5 * T, 94 * G, 3.9e12, 400),
        # H800 datasheet (SXM): H100 SXM's tensor peaks, 80 GB HBM3, 3.35 TB/s, 700 W
        ("H800", 989.4 * T, 1978.9 * T, 80 * G, 3.35e12, 700),
        # HGX B200: 4.5 / 9 PFLOPS with sparsity, 180 GB and 8 TB/s a GPU, 1,000 W
        ("B200", 2250 * T, 4500 * T, 180 * G, 8e12, 1000),
    ],
)
def test_new_variants_dense_and_sourced(name: str, bf16: float, fp8: float, memory: float,
                                        bandwidth: float, tdp: float) -> None:
    chip = labsim.gpu(name)
    assert chip.peak("bf16") == pytest.approx(bf16)
    assert chip.peak("fp8") == pytest.approx(fp8)
    assert chip.peak("fp8") == pytest.approx(2 * chip.peak("bf16"), rel=1e-3)
    assert chip.memory_bytes == memory
    assert chip.memory_bandwidth_Bps == pytest.approx(bandwidth)
    assert chip.tdp_W == tdp
    assert chip.source and chip.tdp_source


def test_new_variants_not_sparse_and_classed() -> None:
    # the sheets' headline figures are with 2:4 sparsity; the catalog keeps half of them
    assert labsim.gpu("B200").peak("bf16") < 4000 * T
    assert labsim.gpu("H100-NVL").peak("bf16") < 1000 * T
    assert labsim.gpu("H800").peak("fp64") == 1 * T  # H800's FP64 cut
    assert labsim.gpu("B200").arch == "blackwell"
    for name in ("H100-SXM-HBM2e", "H100-NVL", "H800"):
        assert labsim.gpu(name).arch == "hopper"


def test_new_nvlink_variants() -> None:
    assert labsim.link("nvlink5").bandwidth_Bps == 900 * G  # 1.8 TB/s bidirectional
    assert labsim.link("nvlink5").nccl_Bps == pytest.approx(18 * 40.1 * G)
    assert labsim.link("nvlink4-h800").bandwidth_Bps == 200 * G  # 400 GB/s bidirectional
    assert labsim.link("nvlink4-h800").kind == "nvlink"


def test_hopper_variants_use_h100_efficiency() -> None:
    from labsim.compute import EFFICIENCY, efficiency
    for name in ("H100-SXM-HBM2e", "H100-NVL", "H800"):
        assert efficiency(labsim.gpu(name)) is EFFICIENCY["h100-sxm"]
    assert "b200" not in EFFICIENCY  # no published B200 GEMM measurement: the generic set
