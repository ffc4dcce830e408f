"""The long-context lab's checks: the solution and honest variants pass; a softmax that
overflows, a merge that averages, an all-gather or all-to-everyone exchange dressed as a ring,
a ring that computes every chunk pair, an all-gathered Ulysses and labsim's own functions
fail, naming what is wrong."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from labsim.checks import CheckFailed
from labsim.checks import context_parallel as c
from labsim.parallel import context_parallel as ref

from .solution_cells import exercises

S = exercises("14_long_context")


def _fails(spec, fn, *words: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckFailed) as err:
        spec(fn)
    text = str(err.value)
    for w in words:
        assert w in text, text
    return text


def test_the_block_and_merge_solutions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    c.partial(S["partial_attention"])
    c.merge(S["merge_attention"])
    out = capsys.readouterr().out
    assert "PASS partial_attention: 6/6" in out and "PASS merge_attention: 5/5" in out


def test_an_unshifted_softmax_fails_on_large_scores() -> None:
    def naive(q, k, v, q_pos, k_pos, causal):  # type: ignore[no-untyped-def]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        e = s.exp()
        total = e.sum(-1)
        return torch.nan_to_num(e / total[..., None]) @ v, total.log()
    _fails(c.partial, naive, "1000")


def test_a_row_that_sees_nothing_must_not_be_nan() -> None:
    def unguarded(q, k, v, q_pos, k_pos, causal):  # type: ignore[no-untyped-def]
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - lse[..., None]) @ v, lse
    _fails(c.partial, unguarded, "NaN")


def test_averaging_two_partials_fails() -> None:
    def average(o1, l1, o2, l2):  # type: ignore[no-untyped-def]
        return (o1 + o2) / 2, torch.logaddexp(l1, l2)
    _fails(c.merge, average, "o:")


def test_a_merge_through_exp_overflows() -> None:
    def direct(o1, l1, o2, l2):  # type: ignore[no-untyped-def]
        total = l1.exp() + l2.exp()
        return (l1.exp()[..., None] * o1 + l2.exp()[..., None] * o2) / total[..., None], \
            total.log()
    _fails(c.merge, direct)


def test_labsims_block_and_merge_fail() -> None:
    _fails(c.partial, ref.partial_attention, "labsim.parallel.context_parallel")
    _fails(c.merge, ref.merge_attention, "labsim.parallel.context_parallel")


# -- on 4 processes -----------------------------------------------------------------------------

partial = S["partial_attention"]
merge = S["merge_attention"]


def _positions(j, n, world, causal):  # type: ignore[no-untyped-def]
    if not causal:
        return torch.arange(j * n, (j + 1) * n)
    h = n // 2
    return torch.cat([torch.arange(j * h, j * h + h),
                      torch.arange((2 * world - 1 - j) * h, (2 * world - j) * h)])


@pytest.mark.multiprocess
def test_the_ring_and_ulysses_solutions_pass(capsys: pytest.CaptureFixture[str]) -> None:
    c.ring(S["ring_attention"])
    c.ulysses(S["ulysses_attention"])
    out = capsys.readouterr().out
    assert "PASS ring_attention: 5/5" in out and "PASS ulysses_attention: 5/5" in out


def gather_kv(q, k, v, causal):  # type: ignore[no-untyped-def]
    """The all-gather method: every block of K and V at once (Llama 3's CP, not a ring)."""
    world, n = dist.get_world_size(), q.shape[-2]
    ks = [torch.empty_like(k) for _ in range(world)]
    vs = [torch.empty_like(v) for _ in range(world)]
    dist.all_gather(ks, k.contiguous())
    dist.all_gather(vs, v.contiguous())
    rank = dist.get_rank()
    qp = _positions(rank, n, world, causal)
    kp = torch.cat([_positions(j, n, world, causal) for j in range(world)])
    o, _ = partial(q, torch.cat(ks, -2), torch.cat(vs, -2), qp, kp, causal)
    return o


@pytest.mark.multiprocess
def test_an_all_gather_is_not_a_ring() -> None:
    _fails(c.ring, gather_kv, "point to point")


def send_to_everyone(q, k, v, causal):  # type: ignore[no-untyped-def]
    """All-gather by hand: each rank sends its block straight to every other rank."""
    world, rank, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]
    kv = torch.stack([k, v]).contiguous()
    blocks = {rank: kv}
    ops = []
    for j in range(world):
        if j != rank:
            blocks[j] = torch.empty_like(kv)
            ops += [dist.P2POp(dist.isend, kv, j), dist.P2POp(dist.irecv, blocks[j], j)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    qp = _positions(rank, n, world, causal)
    out = None
    for j in range(world):
        part = partial(q, blocks[j][0], blocks[j][1], qp, _positions(j, n, world, causal),
                       causal)
        out = part if out is None else merge(*out, *part)
    return out[0]


@pytest.mark.multiprocess
def test_sending_every_block_to_every_rank_fails() -> None:
    _fails(c.ring, send_to_everyone, "receives from the previous one")


def every_pair(q, k, v, causal):  # type: ignore[no-untyped-def]
    """A ring that computes all of each step's block and masks: twice the causal work."""
    world, rank, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]
    qp = _positions(rank, n, world, causal)
    kv = torch.stack([k, v]).contiguous()
    out = None
    for step in range(world):
        src = (rank - step) % world
        if step < world - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, nxt, (rank - 1) % world)])
        part = partial(q, kv[0], kv[1], qp, _positions(src, n, world, causal), causal)
        out = part if out is None else merge(*out, *part)
        if step < world - 1:
            for r in reqs:
                r.wait()
            kv = nxt
    return out[0]


@pytest.mark.multiprocess
def test_a_ring_that_masks_instead_of_skipping_fails_on_the_flops() -> None:
    _fails(c.ring, every_pair, "skip every chunk pair")


@pytest.mark.multiprocess
def test_gathered_heads_are_not_ulysses() -> None:
    def gather_all(q, k, v, causal):  # type: ignore[no-untyped-def]
        world, rank, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]

        def gather(t):  # type: ignore[no-untyped-def]
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            return torch.cat(parts, -2)
        pos = torch.arange(world * n)
        o, _ = partial(q, gather(k), gather(v), pos[rank * n:(rank + 1) * n], pos, causal)
        return o
    _fails(c.ulysses, gather_all, "by all-to-all")


@pytest.mark.multiprocess
def test_labsims_ring_fails() -> None:
    _fails(c.ring, ref.ring_attention, "labsim.parallel.context_parallel")


def _on_a_thread(fn):  # type: ignore[no-untyped-def]
    import threading

    def run(*args):  # type: ignore[no-untyped-def]
        box = {}
        t = threading.Thread(target=lambda: box.update(out=fn(*args)))
        t.start()
        t.join()
        return box["out"]
    return run


def test_a_block_computed_on_another_thread_fails() -> None:
    _fails(c.partial, _on_a_thread(S["partial_attention"]), "thread")


@pytest.mark.multiprocess
def test_ring_blocks_computed_on_another_thread_fail() -> None:
    threaded = _on_a_thread(partial)

    def ring(q, k, v, causal):  # type: ignore[no-untyped-def]
        world, rank, n = dist.get_world_size(), dist.get_rank(), q.shape[-2]
        qp = _positions(rank, n, world, causal)
        kv = torch.stack([k, v]).contiguous()
        out = None
        for step in range(world):
            src = (rank - step) % world
            if step < world - 1:
                nxt = torch.empty_like(kv)
                reqs = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, kv, (rank + 1) % world),
                    dist.P2POp(dist.irecv, nxt, (rank - 1) % world)])
            part = threaded(q, kv[0], kv[1], qp, _positions(src, n, world, causal), causal)
            out = part if out is None else merge(*out, *part)
            if step < world - 1:
                for r in reqs:
                    r.wait()
                kv = nxt
        return out[0]
    _fails(c.ring, ring, "thread")
