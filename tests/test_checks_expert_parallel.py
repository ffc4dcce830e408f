"""The mixture-of-experts lab's expert-parallel check on 4 real processes: the solution and an
honest variant pass; gathering every token, broadcasting every row, labsim's own all-to-all
and a rank that skips a collective fail, each naming what is wrong."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import expert_parallel as c
from labsim.parallel.expert_parallel import AllToAll as ReferenceAllToAll

from .solution_cells import exercises

pytestmark = pytest.mark.multiprocess
S = exercises("13_mixture_of_experts")
A2A = S["AllToAll"]


def _fails(fns, *words: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckFailed) as err:
        c.layer(*fns)
    text = str(err.value)
    for w in words:
        assert w in text, text
    return text


def _route(x, w_router, k):  # type: ignore[no-untyped-def]
    top, experts = torch.topk(x @ w_router.T, k)
    return torch.softmax(top, -1), experts


def _expert(rows, w_in, w_out):  # type: ignore[no-untyped-def]
    return F.linear(F.gelu(F.linear(rows, w_in)), w_out)


def test_the_solution_passes(capsys: pytest.CaptureFixture[str]) -> None:
    c.layer(A2A, S["ep_moe_layer"])
    assert "PASS expert_parallel: 7/7" in capsys.readouterr().out


def gate_travels_with_the_row(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    """Honest: each routed row carries its weight as an extra column; the expert's rank
    weights the result before the combine."""
    world, local = dist.get_world_size(), w_in.shape[0]
    weights, experts = _route(x, w_router, k)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token = torch.arange(x.shape[0]).repeat_interleave(k)[order]
    per_expert = torch.bincount(flat, minlength=local * world)
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert)
    send = per_expert.view(world, local).sum(1).tolist()
    recv = got.view(world, local).sum(1).tolist()
    rows = A2A.apply(torch.cat([x[token], weights.flatten()[order, None]], 1), send, recv)
    which = torch.arange(local).repeat(world).repeat_interleave(got)
    out = torch.zeros(rows.shape[0], x.shape[1], dtype=x.dtype)
    for e in range(local):
        idx = torch.nonzero(which == e, as_tuple=True)[0]
        out = out.index_copy(0, idx, _expert(rows[idx, :-1], w_in[e], w_out[e]) * rows[idx, -1:])
    return torch.zeros_like(x).index_add(0, token, A2A.apply(out, recv, send))


def test_the_weight_sent_with_the_row_passes() -> None:
    c.layer(A2A, gate_travels_with_the_row)


def gather_everything(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    """The shortcut: all-gather every token and every expert, run the whole layer."""
    def gather(t):  # type: ignore[no-untyped-def]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)
    xs, wi, wo = gather(x), gather(w_in), gather(w_out)
    weights, experts = _route(xs, w_router, k)
    out = torch.zeros_like(xs)
    for e in range(wi.shape[0]):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        out = out.index_add(0, token, _expert(xs[token], wi[e], wo[e]) * weights[token, slot, None])
    r, n = dist.get_rank(), x.shape[0]
    return out[r * n:(r + 1) * n]


def test_gathering_every_token_and_expert_fails() -> None:
    _fails((A2A, gather_everything), "token rows travel by all-to-all")


def broadcast_rows(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    """The shortcut: every rank's tokens to every rank by all-to-all, partial sums back."""
    world, local, n = dist.get_world_size(), w_in.shape[0], x.shape[0]
    rank = dist.get_rank()
    everyone = A2A.apply(x.repeat(world, 1), [n] * world, [n] * world)
    weights, experts = _route(everyone, w_router, k)
    out = torch.zeros_like(everyone)
    for e in range(local):
        token, slot = torch.nonzero(experts == rank * local + e, as_tuple=True)
        out = out.index_add(0, token, _expert(everyone[token], w_in[e], w_out[e])
                            * weights[token, slot, None])
    back = A2A.apply(out, [n] * world, [n] * world)
    return back.view(world, n, -1).sum(0)


def test_sending_every_row_everywhere_fails() -> None:
    _fails((A2A, broadcast_rows), "moves only the rows this rank sends or receives")


def test_labsims_all_to_all_fails() -> None:
    _fails((ReferenceAllToAll, S["ep_moe_layer"]), "labsim.parallel.expert_parallel")


def skips_idle_experts(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    """A learner's bug: experts with no rows are skipped, so on a rank that receives nothing
    the combine's input needs no gradient and its backward never runs there."""
    world, local = dist.get_world_size(), w_in.shape[0]
    weights, experts = _route(x, w_router, k)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    token = torch.arange(x.shape[0]).repeat_interleave(k)[order]
    per_expert = torch.bincount(flat, minlength=local * world)
    got = torch.empty_like(per_expert)
    dist.all_to_all_single(got, per_expert)
    send = per_expert.view(world, local).sum(1).tolist()
    recv = got.view(world, local).sum(1).tolist()
    rows = A2A.apply(x[token].detach(), send, recv)
    which = torch.arange(local).repeat(world).repeat_interleave(got)
    out = torch.zeros_like(rows)
    for e in range(local):
        idx = torch.nonzero(which == e, as_tuple=True)[0]
        if idx.numel():
            out = out.index_copy(0, idx, _expert(rows[idx], w_in[e], w_out[e]))
    back = A2A.apply(out, recv, send)
    return torch.zeros_like(x).index_add(0, token, back * weights.flatten()[order, None])


def test_a_rank_that_skips_a_collective_is_stopped_with_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(c, "TIMEOUT_S", 20.0)
    _fails((A2A, skips_idle_experts), "every rank run every all-to-all")
