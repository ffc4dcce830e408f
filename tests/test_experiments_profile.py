"""Profiling a real training step: every op's self time lands in one kind, the kinds the
simulator uses, and the trace is Chrome trace-event JSON."""

from __future__ import annotations

import json

import torch

from labsim.experiments.profile import KINDS, op_kind, profile_step
from labsim.lab.datasets import random_batch
from labsim.lab.models import GPT
from labsim.workload import Transformer


def test_op_kinds() -> None:
    assert op_kind("aten::addmm", False) == "matmul"
    assert op_kind("aten::bmm", False) == "attention"
    assert op_kind("aten::_scaled_dot_product_flash_attention_for_cpu", False) == "attention"
    assert op_kind("aten::gelu", False) == "elementwise"
    assert op_kind("aten::mul_", True) == "optimizer"
    assert op_kind("autograd::engine::evaluate_function: MmBackward0", False) == "framework"


def test_a_gpt_step_profile_sees_every_kind(tmp_path) -> None:
    cfg = Transformer(layers=2, hidden=64, heads=4, seq_len=64, vocab=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    idx, targets = random_batch(cfg, 2, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        opt.step()

    prof = profile_step(step)
    assert set(prof.seconds) == set(KINDS)
    assert all(prof.seconds[k] > 0 for k in ("matmul", "attention", "elementwise", "optimizer"))
    assert 0 < sum(prof.seconds.values()) <= prof.step_s * 1.05
    assert abs(sum(prof.fractions.values()) - 1) < 1e-9
    path = prof.to_chrome(tmp_path / "step.json")
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)


def test_this_device_as_a_gpu_and_the_comparison() -> None:
    from labsim.compute import kind_seconds
    from labsim.experiments.profile import compare_kinds, gpt_step, measured_device

    here = measured_device("cpu", n=128, nbytes=4e6)
    # measured rates (their size depends on the machine and its load; benchmarks/ prints them)
    assert 0 < here.peak("fp32") < 1e15 and 0 < here.memory_bandwidth_Bps < 1e14
    assert here.peak("tf32") == here.peak("fp32")
    cfg = Transformer(layers=1, hidden=64, heads=2, seq_len=32, vocab=128)
    prof = profile_step(gpt_step(cfg, 2))
    rows = compare_kinds(prof, kind_seconds(cfg, 2, here, precision="fp32"))
    assert [r["kind"] for r in rows] == list(KINDS)
    assert abs(sum(r["measured_share"] for r in rows) - 1) < 1e-9
    assert abs(sum(r["simulated_share"] for r in rows) - 1) < 1e-9
    assert rows[-1]["simulated_s"] == 0  # the simulator has no framework time
