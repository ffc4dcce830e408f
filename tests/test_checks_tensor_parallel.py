"""Lab 10's checks: Megatron-style references pass; stubs fail without starting processes;
each cheapest shortcut fails, naming the rule it breaks (real processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import tensor_parallel as c
from labsim.parallel.tensor_parallel import (
    CopyToParallel,
    GatherFromSequence,
    ReduceFromParallel,
    ScatterToSequence,
    VocabParallelCrossEntropy,
    causal_attention,
)

pytestmark = pytest.mark.multiprocess


class F1(torch.autograd.Function):  # Megatron's f, as a learner writes it
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class G1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad


def mlp(x, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    return G1.apply(F.linear(F.gelu(F.linear(F1.apply(x), w_up, b_up)), w_down)) + b_down


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def whole_mlp_everywhere(x, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    """The shortcut: gather the weights and compute the whole MLP on every rank."""
    return F.linear(F.gelu(F.linear(x, _gather(w_up, 0), _gather(b_up, 0))),
                    _gather(w_down, 1), b_down)


def attention(x, w_qkv, b_qkv, w_o, b_o, head_dim):  # type: ignore[no-untyped-def]
    heads = causal_attention(F.linear(CopyToParallel.apply(x), w_qkv, b_qkv), head_dim)
    return ReduceFromParallel.apply(F.linear(heads, w_o)) + b_o


def sp_block(x, ln_w, ln_b, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    h = GatherFromSequence.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    y = ScatterToSequence.apply(F.linear(F.gelu(F.linear(h, w_up, b_up)), w_down))
    return x + y + b_down


def sp_by_all_reduce(x, ln_w, ln_b, w_up, b_up, w_down, b_down):  # type: ignore
    """The shortcut: all-reduce the MLP's output and keep this rank's rows."""
    h = GatherFromSequence.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    y = ReduceFromParallel.apply(F.linear(F.gelu(F.linear(h, w_up, b_up)), w_down))
    n, r = x.shape[0], dist.get_rank()
    return x + y[r * n:(r + 1) * n] + b_down


class CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start):  # type: ignore[no-untyped-def]
        return VocabParallelCrossEntropy.forward(ctx, logits, target, vocab_start)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return VocabParallelCrossEntropy.backward(ctx, grad)[:3]


class GatheredCE(torch.autograd.Function):
    """The shortcut: gather the whole logits and call F.cross_entropy."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start):  # type: ignore[no-untyped-def]
        whole = _gather(logits, 1).requires_grad_(True)
        with torch.enable_grad():
            loss = F.cross_entropy(whole, target, reduction="none")
        ctx.save_for_backward(whole, loss)
        ctx.v, ctx.start = logits.shape[1], vocab_start
        return loss.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        whole, loss = ctx.saved_tensors
        (g,) = torch.autograd.grad(loss, whole, grad)
        return g[:, ctx.start:ctx.start + ctx.v], None, None


def stub(*args):  # type: ignore[no-untyped-def]
    raise NotImplementedError


class Stub(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *args):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_references_pass(capsys: pytest.CaptureFixture[str]) -> None:
    c.parallel_mlp(F1, G1, mlp)
    c.head_parallel_attention(attention)
    c.sequence_parallel(GatherFromSequence, ScatterToSequence, sp_block)
    c.vocab_parallel_cross_entropy(CE)
    out = capsys.readouterr().out.splitlines()
    assert out == ["PASS parallel_mlp: 11/11 cases passed",
                   "PASS head_parallel_attention: 7/7 cases passed",
                   "PASS sequence_parallel: 11/11 cases passed",
                   "PASS vocab_parallel_cross_entropy: 8/8 cases passed"]


@pytest.mark.parametrize("call", [
    lambda: c.parallel_mlp(Stub, G1, mlp), lambda: c.parallel_mlp(F1, G1, stub),
    lambda: c.head_parallel_attention(stub), lambda: c.vocab_parallel_cross_entropy(Stub),
    lambda: c.sequence_parallel(Stub, Stub, stub)])
def test_stubs_fail_without_processes(call) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckFailed, match="(?s)0/.*NotImplementedError"):
        call()


def test_whole_mlp_on_every_rank_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="FAIL parallel_mlp") as err:
        c.parallel_mlp(F1, G1, whole_mlp_everywhere)
    assert "rule: the split MLP communicates once forward" in str(err.value)
    assert "all_gather" in str(err.value)


def test_f_without_its_all_reduce_fails() -> None:
    class Lazy(F1):
        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad

    with pytest.raises(CheckFailed, match="f backward: the gradient summed"):
        c.parallel_mlp(Lazy, G1, mlp)


def test_sequence_parallel_by_all_reduce_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="rule: sequence parallelism replaces each "
                       "all-reduce"):
        c.sequence_parallel(GatherFromSequence, ScatterToSequence, sp_by_all_reduce)


def test_gathering_the_logits_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="rule: the logits are never gathered"):
        c.vocab_parallel_cross_entropy(GatheredCE)
