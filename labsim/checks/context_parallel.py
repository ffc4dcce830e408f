"""Checks for the long-context lab: one block of attention with its log-sum-exp, the exact
merge of two partial results, ring attention and Ulysses attention on ``NPROCS`` real gloo
processes, all against full attention of the whole sequence in float64 (forward only).

The oracle is ``labsim.parallel.context_parallel`` in the grader's process.  Besides values,
the multi-process rules hold the learner to the method:

- ring attention moves keys and values only point to point, each send to the next rank and
  each receive from the previous one, ``R - 1`` blocks of K and V in all (sending every block
  to every rank, or gathering them, fails); with the causal load-balanced split each rank
  computes at most the ``2R + 1`` chunk pairs on or below the diagonal (5 % slack): a rank
  that computes every pair and masks does twice the work;
- Ulysses moves data only by all-to-all, at most Q, K, V and the output once each, and each
  rank computes attention for ``1 / R`` of the heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close
from labsim.checks._ranks import launch_ranks, rank_outcomes, stub_outcomes
from labsim.context_parallel import zigzag_chunk_pairs, zigzag_positions

NPROCS = 4
TOL = close(rtol=1e-9, atol=1e-12)
FORBID = ("labsim.parallel.context_parallel:*",)
FLOPS_SLACK = 1.05
TIMEOUT_S = 90.0


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _compare_partial(got: Any, expected: Any) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        return "return (o, lse): the block's output and each row's log-sum-exp"
    for name, g, e in zip(("o", "lse"), got, expected):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(e.shape):
            return f"{name} must be a tensor of shape {tuple(e.shape)}"
        g = g.double()
        dead = torch.isinf(e) & (e < 0) if name == "lse" else torch.zeros_like(e, dtype=bool)
        if name == "lse" and not torch.equal(torch.isneginf(g), dead):
            return ("lse must be -inf exactly where a row sees none of the block's keys (and "
                    "finite elsewhere)")
        if bool(torch.isnan(g).any()):
            return (f"{name} has NaN: a row that sees no key gets o = 0 and lse = -inf "
                    "(exp(-inf - -inf) is NaN: guard it)")
        wrong = TOL(torch.where(dead, 0.0, g), torch.where(dead, 0.0, e))
        if wrong is not None:
            return f"{name}: {wrong}"
    return None


# -- one block ----------------------------------------------------------------------------------


def _partial_case(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_pos: list[int], k_pos: list[int], causal: bool) -> Case:
    from labsim.parallel.context_parallel import partial_attention

    args = (q, k, v, torch.tensor(q_pos), torch.tensor(k_pos), causal)
    return Case(name, args, expected=list(partial_attention(*args)), compare=_compare_partial)


def _partial_cases() -> list[Case]:
    g = torch.Generator().manual_seed(51)
    q, k, v = _randn(g, 1, 2, 4, 8), _randn(g, 1, 2, 6, 8), _randn(g, 1, 2, 6, 8)
    return [
        _partial_case("4 queries, 6 keys, not causal", q, k, v, [0, 1, 2, 3], list(range(6)),
                      False),
        _partial_case("causal, keys all before the queries: every key seen", q, k, v,
                      [10, 11, 12, 13], list(range(6)), True),
        _partial_case("causal, the diagonal block (positions 0-3 on 0-3)", q, k[..., :4, :],
                      v[..., :4, :], [0, 1, 2, 3], [0, 1, 2, 3], True),
        _partial_case("causal, queries 2-5 on keys 4-9: rows 2 and 3 see no key", q, k, v,
                      [2, 3, 4, 5], [4, 5, 6, 7, 8, 9], True),
        _partial_case("scores near +-1000 (exp overflows unless shifted)", 40 * q, 40 * k, v,
                      [0, 1, 2, 3], list(range(6)), False),
        _partial_case("zigzag chunk positions: queries 0,1 and 14,15 on keys 6,7 and 8,9",
                      q, k[..., :4, :], v[..., :4, :], [0, 1, 14, 15], [6, 7, 8, 9], True),
    ]


partial = Spec("partial_attention", _partial_cases, forbid=FORBID)
"""``partial_attention(q, k, v, q_pos, k_pos, causal) -> (o, lse)``: one block of attention
normalised over its own keys, and each row's log-sum-exp (``-inf`` and zero output for a row
that sees none of them)."""


# -- merge --------------------------------------------------------------------------------------


def _merge_case(name: str, o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor,
                l2: torch.Tensor) -> Case:
    from labsim.parallel.context_parallel import merge_attention

    return Case(name, (o1, l1, o2, l2), expected=list(merge_attention(o1, l1, o2, l2)),
                compare=_compare_partial)


def _merge_cases() -> list[Case]:
    from labsim.parallel.context_parallel import partial_attention

    g = torch.Generator().manual_seed(52)
    q, k, v = _randn(g, 2, 2, 5, 4), _randn(g, 2, 2, 8, 4), _randn(g, 2, 2, 8, 4)
    pos = torch.arange(5) + 3
    a = partial_attention(q, k[..., :4, :], v[..., :4, :], pos, torch.arange(4), True)
    b = partial_attention(q, k[..., 4:, :], v[..., 4:, :], pos, torch.arange(4, 8), True)
    big = (a[0], a[1] + 1000.0, b[0], b[1] + 1000.5)
    return [
        _merge_case("two halves of the keys: full attention", a[0], a[1], b[0], b[1]),
        _merge_case("the second block unseen by the first rows (lse -inf there)", *a, *b),
        _merge_case("log-sum-exps near 1000 (exp overflows unless shifted)", *big),
        _merge_case("negative log-sum-exps near -1000 (exp underflows to 0 unless shifted)",
                    a[0], a[1] - 1000.0, b[0], b[1] - 1000.0),
        _merge_case("merging with an empty partial (o 0, lse -inf) changes nothing", a[0], a[1],
                    torch.zeros_like(a[0]), torch.full_like(a[1], -math.inf)),
    ]


merge = Spec("merge_attention", _merge_cases, forbid=FORBID)
"""``merge_attention(o1, lse1, o2, lse2) -> (o, lse)``: attention over the union of two
disjoint key blocks from the two partial results (the online softmax's rescaling)."""


# -- the multi-process checks -------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """One multi-process case: batch, heads, tokens per rank, head dim, causal, seed."""

    batch: int
    heads: int
    tokens: int
    head_dim: int
    causal: bool
    seed: int


def positions(sizes: Sizes, rank: int, zigzag_split: bool) -> torch.Tensor:
    if zigzag_split and sizes.causal:
        return torch.tensor(zigzag_positions(rank, NPROCS, sizes.tokens))
    return torch.arange(rank * sizes.tokens, (rank + 1) * sizes.tokens)


def whole(sizes: Sizes) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sizes.seed)
    s = NPROCS * sizes.tokens
    return [_randn(g, sizes.batch, sizes.heads, s, sizes.head_dim) for _ in range(3)]


def _serial(sizes: Sizes, zigzag_split: bool) -> list[torch.Tensor]:
    """Each rank's rows of full attention on the whole sequence."""
    from labsim.parallel.context_parallel import partial_attention

    q, k, v = whole(sizes)
    pos = torch.arange(q.shape[-2])
    full, _ = partial_attention(q, k, v, pos, pos, sizes.causal)
    return [full[..., positions(sizes, r, zigzag_split), :] for r in range(NPROCS)]


def ring_flops(sizes: Sizes) -> int:
    """Matmul FLOPs one rank's ring attention needs: every pair of its query chunks and the
    key chunks on or below the diagonal (``2R + 1`` pairs of ``tokens / 2`` with the causal
    split), QK^T and PV."""
    bh, d = sizes.batch * sizes.heads, sizes.head_dim
    if not sizes.causal:
        return 4 * sizes.tokens * NPROCS * sizes.tokens * d * bh
    c = sizes.tokens // 2
    return zigzag_chunk_pairs(NPROCS) * 4 * c * c * d * bh


def cp_worker(rank: int, world: int, fn: Callable[..., Any], kind: str,
              jobs: Sequence[tuple], forbid: Sequence[str]) -> list[dict | Outcome]:
    """Every case on this rank: the learner's attention on its share, recorded (output,
    collectives with peers, matmul FLOPs, references)."""
    import torch.distributed as dist

    from labsim.checks._observe import watch
    from labsim.lab.comm import CommRecorder

    out: list[dict | Outcome] = []
    for raw in jobs:
        sizes = Sizes(*raw)
        where = positions(sizes, rank, kind == "ring")
        q, k, v = (t[..., where, :].contiguous() for t in whole(sizes))
        with CommRecorder() as rec, watch(tuple(forbid), ops=True) as seen:
            try:
                value = fn(q, k, v, sizes.causal)
                error = None
            except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                error = exc
        summary = seen.summary()
        if error is not None:
            out.append(Outcome.of_error(error))
        else:
            out.append({"out": value.detach() if isinstance(value, torch.Tensor) else value,
                        "comms": [[c.kind, c.numel] for c in rec.comms],
                        "messages": [[m[0], m[1], m[4]] for m in summary.get("messages", [])],
                        "flops": int(rec.flops), "references": list(summary["references"])})
        dist.barrier()
    return out


HANG = ("a rank waited for a message nobody sent: does every rank send to the next and receive "
        "from the previous one at every step, and run every collective?")


def _driver(kind: str) -> Callable[..., list[Outcome]]:
    def drive(fns: Sequence[Any], cases: Sequence[Case], spec: Spec) -> list[Outcome]:
        q = torch.zeros(1, NPROCS, 2, 2, dtype=torch.float64)
        stub = stub_outcomes([lambda: fns[0](q, q, q, True)], len(cases))
        if stub is not None:
            return stub
        jobs = [tuple(c.args[0]) for c in cases]
        ranks, failed = launch_ranks(cp_worker, NPROCS, (fns[0], kind, jobs, spec.forbid), spec,
                                     len(cases), TIMEOUT_S, HANG)
        if ranks is None:
            return failed
        return rank_outcomes(ranks, range(len(cases)), ("comms", "messages", "flops"),
                             lambda runs, i: [run["out"] for run in runs])
    return drive


def _compare_ranks(got: Any, expected: Any) -> str | None:
    if not isinstance(got, list) or len(got) != NPROCS:
        return f"expected one output per rank ({NPROCS})"
    for rank, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(e.shape):
            return f"rank {rank}: expected a tensor of shape {tuple(e.shape)}"
        wrong = TOL(g.double(), e)
        if wrong is not None:
            return f"rank {rank}: {wrong}"
    return None


def _cases(kind: str, sizes: Sequence[Sizes]) -> list[Case]:
    out = []
    for s in sizes:
        label = (f"{s.heads} heads, {NPROCS} x {s.tokens} tokens, d={s.head_dim}, "
                 + ("causal" + (" (load-balanced chunks)" if kind == "ring" else "")
                    if s.causal else "not causal"))
        out.append(Case(label, (astuple(s),), expected={
            "out": _serial(s, kind == "ring"), "flops": ring_flops(s),
            "block": s.batch * s.heads * s.tokens * s.head_dim}, compare=_values))
    return out


def _values(got: Any, expected: Any) -> str | None:
    return _compare_ranks(got, expected["out"])


def ring_rule(case: Case, out: Outcome) -> str | None:
    """K and V only point to point, to the next rank and from the previous, R - 1 blocks."""
    budget = 2 * (NPROCS - 1) * case.expected["block"]
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        kinds = sorted({str(k) for k, _ in seen["comms"]} - {"send", "recv", "barrier"})
        if kinds:
            return (f"ring attention passes K and V point to point (send/recv); rank {rank} "
                    f"issued {', '.join(kinds)}")
        sent = sum(int(n) for k, n in seen["comms"] if k == "send")
        if sent > budget:
            return (f"each rank passes on R - 1 = {NPROCS - 1} blocks of K and V "
                    f"({budget} elements); rank {rank} sent {sent}")
        peers = {("send", (rank + 1) % NPROCS), ("recv", (rank - 1) % NPROCS)}
        wrong = [(op, peer) for op, _, peer in seen["messages"]
                 if "send" in str(op) or "recv" in str(op)]
        stray = [(op.split("::")[-1], p) for op, p in wrong
                 if (("send" if "send" in op else "recv"), p) not in peers]
        if stray:
            return (f"a ring sends to the next rank and receives from the previous one; rank "
                    f"{rank} also talked to rank {stray[0][1]} ({stray[0][0]})")
    return None


def ring_flops_rule(case: Case, out: Outcome) -> str | None:
    """Each rank computes only the chunk pairs on or below the causal diagonal."""
    budget = case.expected["flops"]
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        if int(seen["flops"]) > FLOPS_SLACK * budget:
            return (f"rank {rank} executed {int(seen['flops'])} matmul FLOPs; its queries on "
                    f"the keys they can see need {budget}: skip every chunk pair whose keys "
                    "all come after its queries")
    return None


RING_SIZES = (Sizes(1, 2, 4, 8, False, 61), Sizes(2, 1, 3, 4, False, 62),
              Sizes(1, 2, 4, 8, True, 63), Sizes(2, 3, 6, 4, True, 64),
              Sizes(1, 1, 2, 16, True, 65))
ring = Spec("ring_attention", lambda: _cases("ring", RING_SIZES), drive=_driver("ring"),
            rules=(ring_rule, ring_flops_rule), forbid=FORBID, ops=False)
"""``ring_attention(q, k, v, causal)`` on 4 processes: this rank's rows of full attention,
K/V passed round the ring; with ``causal`` the rank holds chunks ``r`` and ``2R-1-r``."""


def ulysses_rule(case: Case, out: Outcome) -> str | None:
    """Data moves only by all-to-all (Q, K, V in, the output back); 1/R of the heads each."""
    budget = 4 * case.expected["block"]
    sizes = Sizes(*case.args[0])  # every score computed, masked or not: 4 s^2 d per head
    full = 4 * (NPROCS * sizes.tokens) ** 2 * sizes.head_dim * sizes.batch * sizes.heads
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        kinds = sorted({str(k) for k, _ in seen["comms"]} - {"all_to_all", "barrier"})
        if kinds:
            return (f"Ulysses moves Q, K, V and the output by all-to-all; rank {rank} issued "
                    f"{', '.join(kinds)}")
        moved = sum(int(n) for k, n in seen["comms"] if k == "all_to_all")
        if moved > budget:
            return (f"all-to-alls of Q, K, V and the output move {budget} elements per rank; "
                    f"rank {rank} moved {moved}")
        if int(seen["flops"]) > FLOPS_SLACK * full / NPROCS:
            return (f"each rank attends for {NPROCS}th of the heads: rank {rank} executed "
                    f"{int(seen['flops'])} matmul FLOPs, 1/{NPROCS} of full attention is "
                    f"{full // NPROCS}")
    return None


ULYSSES_SIZES = (Sizes(1, 4, 4, 8, False, 66), Sizes(2, 8, 3, 4, False, 67),
                 Sizes(1, 4, 4, 8, True, 68), Sizes(2, 8, 3, 4, True, 69),
                 Sizes(1, 4, 1, 16, True, 70))
ulysses = Spec("ulysses_attention", lambda: _cases("ulysses", ULYSSES_SIZES),
               drive=_driver("ulysses"), rules=(ulysses_rule,), forbid=FORBID, ops=False)
"""``ulysses_attention(q, k, v, causal)`` on 4 processes: this rank's contiguous block of
rows of full attention, through all-to-alls to heads and back."""
