"""Two axes on one device mesh (labsim.parallel.mesh): MeshGPT has exactly labsim's parameter
count and runs whole or split; the library's 2 x 2 layout (FSDP2 over "dp", tensor
parallelism over "tp") trains exactly like one process, and without FSDP's averaging it does
not."""

from __future__ import annotations

import pytest
import torch

from labsim.lab import launch
from labsim.parallel import mesh
from labsim.workload import Transformer

CONFIGS = [Transformer(layers=1, hidden=32, heads=4, seq_len=16, vocab=64, dropout=False),
           Transformer(layers=3, hidden=48, heads=6, seq_len=8, vocab=100, ffn_hidden=80),
           Transformer(layers=2, hidden=256, heads=8, seq_len=128, vocab=512, dropout=False)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"l{c.layers}h{c.hidden}")
def test_meshgpt_has_labsims_parameter_count(cfg: Transformer) -> None:
    assert sum(p.numel() for p in mesh.MeshGPT(cfg).parameters()) == cfg.params


def test_meshgpt_is_gpt2_style_only() -> None:
    with pytest.raises(ValueError, match="GPT-2-style"):
        mesh.MeshGPT(Transformer.preset("llama2-7b", layers=1))


def test_every_split_linear_exists_and_heads_follow_q() -> None:
    """The plan's paths name real modules; the attention holds as many heads as Q's width
    allows (whole: cfg.heads; a column split in two: half), so a split model runs."""
    cfg = CONFIGS[0]
    model = mesh.MeshGPT(cfg)
    names = {n for n, _ in model.blocks[0].named_modules()}
    assert set(mesh.COLWISE) | set(mesh.ROWWISE) <= names
    tokens, targets = mesh.global_batch(cfg, 2)
    loss = model(tokens, targets)
    assert loss.ndim == 0 and 3.5 < float(loss.detach()) < 4.8  # about ln(64) at the start
    attn = model.blocks[0].attn
    half = cfg.hidden // 2
    for lin in (attn.q, attn.k, attn.v):  # keep the first half of the heads
        lin.weight.data, lin.bias.data = lin.weight.data[:half], lin.bias.data[:half]
    attn.o.weight.data = attn.o.weight.data[:, :half]
    x = torch.randn(2, cfg.seq_len, cfg.hidden)
    assert attn(x).shape == x.shape


def test_global_batch_is_the_same_for_a_seed() -> None:
    a, b = mesh.global_batch(CONFIGS[0], 4), mesh.global_batch(CONFIGS[0], 4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].shape == (4, CONFIGS[0].seq_len) and int(a[0].max()) < CONFIGS[0].vocab


def _demo_and_unaveraged(rank: int, world: int) -> tuple[float, float]:
    """The demo, then again with FSDP2 told not to average the gradients over "dp"."""
    from torch.distributed.fsdp import FSDPModule

    from labsim.parallel import mesh as m

    right = m.demo(rank, world)
    original = m.parallelize_2d

    def summing(model, dp, tp):  # noqa: ANN001, ANN202
        device_mesh = original(model, dp, tp)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
        return device_mesh

    m.parallelize_2d = summing
    return right, m.demo(rank, world)


@pytest.mark.multiprocess
def test_two_by_two_equals_one_process_and_needs_the_average() -> None:
    result = launch(_demo_and_unaveraged, 4, timeout_s=180)
    assert all(right < 1e-12 for right, _ in result)
    assert all(summed > 1e-3 for _, summed in result)
