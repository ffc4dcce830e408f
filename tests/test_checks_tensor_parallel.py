"""Lab 10's checks: Megatron-style references pass; stubs fail without starting processes;
each cheapest shortcut fails, naming the rule it breaks (real processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import tensor_parallel as c
from labsim.course.notebook import as_shown
from labsim.parallel.tensor_parallel import CopyToParallel, ReduceFromParallel

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


def reference_mlp(x, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    """The shortcut: labsim's own operators instead of the learner's."""
    h = F.gelu(F.linear(CopyToParallel.apply(x), w_up, b_up))
    return ReduceFromParallel.apply(F.linear(h, w_down)) + b_down


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def whole_mlp_everywhere(x, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    """The shortcut: gather the weights and compute the whole MLP on every rank."""
    return F.linear(F.gelu(F.linear(x, _gather(w_up, 0), _gather(b_up, 0))),
                    _gather(w_down, 1), b_down)


def attention(x, w_qkv, b_qkv, w_o, b_o, head_dim):  # type: ignore[no-untyped-def]
    s, b, _ = x.shape
    qkv = F.linear(F1.apply(x), w_qkv, b_qkv)
    n = qkv.shape[-1] // (3 * head_dim)
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.reshape(s, b, n, 3, head_dim).unbind(3))
    heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return G1.apply(F.linear(heads.permute(2, 0, 1, 3).reshape(s, b, -1), w_o)) + b_o


class Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        out = x.new_empty((x.shape[0] * dist.get_world_size(), *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out


class Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return Gather.backward(ctx, x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return Gather.forward(ctx, grad)


def sp_block(x, ln_w, ln_b, w_up, b_up, w_down, b_down):  # type: ignore[no-untyped-def]
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    y = Scatter.apply(F.linear(F.gelu(F.linear(h, w_up, b_up)), w_down))
    return x + y + b_down


def sp_by_all_reduce(x, ln_w, ln_b, w_up, b_up, w_down, b_down):  # type: ignore
    """The shortcut: all-reduce the MLP's output and keep this rank's rows."""
    h = Gather.apply(F.layer_norm(x, x.shape[-1:], ln_w, ln_b))
    y = G1.apply(F.linear(F.gelu(F.linear(h, w_up, b_up)), w_down))
    n, r = x.shape[0], dist.get_rank()
    return x + y[r * n:(r + 1) * n] + b_down


class CE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start):  # type: ignore[no-untyped-def]
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        exp = (logits - m[:, None]).exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total)
        local = target - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)[:, None]
        picked = (logits - m[:, None]).gather(-1, index)[:, 0] * mine
        dist.all_reduce(picked)
        ctx.save_for_backward(exp / total[:, None], index, mine)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        softmax, index, mine = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, index, mine[:, None].to(softmax.dtype))
        return (softmax - onehot) * grad[:, None], None, None


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
    c.sequence_parallel(Gather, Scatter, sp_block)
    c.vocab_parallel_cross_entropy(CE)
    out = as_shown(capsys.readouterr().out).splitlines()
    assert out == ["PASS parallel_mlp: 8/8 cases passed",
                   "PASS head_parallel_attention: 5/5 cases passed",
                   "PASS sequence_parallel: 10/10 cases passed",
                   "PASS vocab_parallel_cross_entropy: 6/6 cases passed"]


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
    assert "0/8 cases passed" in str(err.value)
    assert "breaks a rule of this exercise: the split MLP communicates once" in str(err.value)
    assert "all_gather" in str(err.value)


def test_f_without_its_all_reduce_fails() -> None:
    class Lazy(F1):
        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            return grad

    with pytest.raises(CheckFailed, match="(?s)0/8.*f is the identity forward and one "
                       "all-reduce of the gradient backward"):
        c.parallel_mlp(Lazy, G1, mlp)


def test_sequence_parallel_by_all_reduce_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="(?s)0/10.*breaks a rule of this exercise: "
                       "sequence parallelism replaces each all-reduce"):
        c.sequence_parallel(Gather, Scatter, sp_by_all_reduce)


def test_calling_labsims_reference_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="(?s)0/8.*calls labsim's own reference "
                       "`labsim.parallel.tensor_parallel.CopyToParallel`"):
        c.parallel_mlp(F1, G1, reference_mlp)


def test_gathering_the_logits_fails_on_its_rule() -> None:
    with pytest.raises(CheckFailed, match="(?s)0/6.*breaks a rule of this exercise: the "
                       "logits are never gathered"):
        c.vocab_parallel_cross_entropy(GatheredCE)
