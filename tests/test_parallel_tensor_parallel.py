"""Megatron's tensor-parallel layer by hand (labsim.parallel.tensor_parallel): on 2 and 4
real processes, with and without sequence parallelism, outputs and gradients equal one
process; without ``f`` they do not; PyTorch's DTensor plan communicates the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labsim.lab import launch
from labsim.parallel import tensor_parallel as tp


def _demos(rank: int, world: int) -> tuple[float, float]:
    """The demo as written, then with ``f``'s backward all-reduce removed."""
    from labsim.parallel import tensor_parallel

    right = tensor_parallel.demo(rank, world)
    tensor_parallel.CopyToParallel.backward = staticmethod(lambda ctx, grad, *a: (grad, None))
    return right, tensor_parallel.demo(rank, world)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layer_equals_one_process_and_needs_f(world: int) -> None:
    result = launch(_demos, world, timeout_s=120)
    assert all(right < 1e-12 for right, _ in result)
    assert all(broken > 1e-3 for _, broken in result)  # the input gradient misses t-1 parts


def _counts(rank: int, world: int) -> dict[str, tuple]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from labsim.lab.comm import CommRecorder

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for sp in (False, True):
        torch.manual_seed(0)
        whole = tp.Block(16, 4).double()
        x = torch.randn(8, 2, 16, dtype=torch.float64)
        part = slice(rank * 8 // world, (rank + 1) * 8 // world)
        for name, layer in (("mine", tp.ParallelBlock(whole, rank, world, sp)),
                            ("dtensor", tp.dtensor_block(whole, mesh, sp))):
            px = (x[part] if sp else x).clone().requires_grad_(True)
            with CommDebugMode() as cdm, CommRecorder() as rec:
                y = layer(px)
                rec.phase = "backward"
                y.square().sum().backward()
            out[f"{name} sp={sp}"] = (rec.count("forward"), rec.count("backward"),
                                      sum(cdm.get_comm_counts().values()), y.detach())
    return out


@pytest.mark.multiprocess
def test_two_all_reduces_each_way_or_gathers_and_scatters_like_dtensor() -> None:
    result = launch(_counts, 2, timeout_s=120)
    for rank in result:
        for sp, fwd in ((False, {"all_reduce": 2}),
                        (True, {"all_gather": 2, "reduce_scatter": 2})):
            mine, dt = rank[f"mine sp={sp}"], rank[f"dtensor sp={sp}"]
            assert mine[0] == mine[1] == dt[0] == dt[1] == fwd
            assert mine[2] == dt[2] == 2 * sum(fwd.values())  # CommDebugMode agrees
            assert torch.allclose(mine[3], dt[3], rtol=1e-12, atol=1e-12)


def _cross_entropy(rank: int, world: int) -> tuple[float, float]:
    torch.manual_seed(0)
    logits = torch.randn(5, 8, dtype=torch.float64) * 30
    target = torch.tensor([0, 7, 3, 4, 1])
    whole = logits.clone().requires_grad_(True)
    F.cross_entropy(whole, target, reduction="sum").backward()
    v = 8 // world
    mine = logits[:, rank * v:(rank + 1) * v].clone().requires_grad_(True)
    loss = tp.VocabParallelCrossEntropy.apply(mine, target, rank * v)
    loss.sum().backward()
    ref = F.cross_entropy(logits, target, reduction="none")
    return (float((loss - ref).abs().max()),
            float((mine.grad - whole.grad[:, rank * v:(rank + 1) * v]).abs().max()))


@pytest.mark.multiprocess
def test_vocab_parallel_cross_entropy_equals_the_whole_softmax() -> None:
    assert all(max(r) < 1e-12 for r in launch(_cross_entropy, 2, timeout_s=120))


def test_split_mlp_blocks_and_rejects_uneven() -> None:
    up, down = nn.Linear(4, 12), nn.Linear(12, 4)
    part = tp.split_mlp(up, down, 1, 3)
    assert torch.equal(part.up.weight, up.weight[4:8])
    assert torch.equal(part.down.weight, down.weight[:, 4:8])
    with pytest.raises(ValueError, match="not divisible"):
        tp.split_mlp(up, down, 0, 5)
    with pytest.raises(ValueError, match="heads"):
        tp.ParallelBlock(tp.Block(16, 4), 0, 3)


def test_attention_layout_is_head_major() -> None:
    """A contiguous block of the fused QKV features is whole heads: attention over the first
    half of the features is the first half of the heads' outputs."""
    torch.manual_seed(0)
    qkv = torch.randn(5, 2, 2 * 3 * 4, dtype=torch.float64)
    both = tp.causal_attention(qkv, 4)
    first = tp.causal_attention(qkv[..., :12], 4)
    assert both.shape == (5, 2, 8) and torch.allclose(both[..., :4], first)
