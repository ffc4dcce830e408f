"""Check for the mixture-of-experts lab's expert parallelism: the learner's all-to-all as an
autograd function and the expert-parallel MoE layer, on ``NPROCS`` real gloo processes,
against one process running the whole layer in float64.

Jobs (one launch for every case): ``"a2a"``, the all-to-all alone with uneven counts (zeros
included), its output and the gradient it sends back; ``"ep"``, the layer on a ``Sizes`` of
rows, hidden size, expert width, experts, top-k and a router skew, each rank holding
``tokens`` rows and ``E / NPROCS`` experts.  The values: each rank's output rows, its rows'
gradient, its experts' weight gradients, and the router's gradient summed over the ranks (the
router is replicated, each rank's gradient covers its own tokens).  The rules hold the
learner to the method (Megatron-Core's ``MoEAlltoAllTokenDispatcher``):

- every collective that carries token rows is an all-to-all, exactly two forward (dispatch
  and combine) and two backward, each moving no more than the rows this rank sends or
  receives (an all-gather of every token, or an all-to-all that sends every row everywhere,
  fails); at most three small collectives (counts: up to ``NPROCS * E`` numbers) forward;
- each rank executes the router's FLOPs on its own rows and its experts' FLOPs on the rows
  routed to them, forward and backward, within 5 %;
- nothing of ``labsim.parallel.expert_parallel`` is called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close
from labsim.checks._ranks import launch_ranks, rank_outcomes, stub_outcomes, unique_jobs
from labsim.checks.moe import layer_inputs

NPROCS = 4
TOL = close(rtol=1e-9, atol=1e-12)
FORBID = ("labsim.parallel.expert_parallel:*",)
FLOPS_SLACK = 1.05
SMALL_FORWARD = 3
TIMEOUT_S = 90.0  # a rank waiting in a collective the others never issue is stopped then
# rows rank r sends rank j in the all-to-all job (zeros included: gloo must pass them too)
A2A_COUNTS = ((1, 0, 2, 3), (0, 0, 1, 0), (2, 2, 0, 1), (3, 1, 1, 0))
A2A_WIDTH = 3


@dataclass(frozen=True)
class Sizes:
    """One expert-parallel case: rows per rank, hidden size, expert width, experts, top-k,
    seed, and a router skew towards expert 0."""

    tokens: int
    hidden: int
    ffn: int
    experts: int
    k: int
    seed: int
    skew: float = 0.0


SIZES = (Sizes(6, 8, 12, 8, 2, 41), Sizes(5, 6, 10, 8, 2, 42, skew=8.0),
         Sizes(4, 8, 8, 4, 1, 43))


def whole(sizes: Sizes) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The whole layer's inputs (``x`` of every rank's rows) and the upstream gradient."""
    inputs = layer_inputs(NPROCS * sizes.tokens, sizes.hidden, sizes.ffn, sizes.experts,
                          sizes.seed, sizes.skew)
    g = torch.Generator().manual_seed(sizes.seed + 1000)
    upstream = torch.randn(NPROCS * sizes.tokens, sizes.hidden, generator=g,
                           dtype=torch.float64)
    return inputs, upstream


def part(sizes: Sizes, rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Rank ``rank``'s inputs: its rows, the router, its experts; and its rows' upstream."""
    (x, w_router, w_in, w_out), upstream = whole(sizes)
    rows = slice(rank * sizes.tokens, (rank + 1) * sizes.tokens)
    per = sizes.experts // NPROCS
    held = slice(rank * per, (rank + 1) * per)
    return [x[rows], w_router, w_in[held], w_out[held]], upstream[rows]


def a2a_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows rank ``rank`` sends (row i of the block for rank j holds 100 r + 10 j + i)
    and the upstream gradient of what it receives."""
    rows = [torch.tensor([[100.0 * rank + 10 * j + i + c / 10 for c in range(A2A_WIDTH)]
                          for i in range(n)], dtype=torch.float64).reshape(n, A2A_WIDTH)
            for j, n in enumerate(A2A_COUNTS[rank])]
    received = sum(A2A_COUNTS[j][rank] for j in range(NPROCS))
    upstream = torch.arange(received * A2A_WIDTH, dtype=torch.float64).reshape(
        received, A2A_WIDTH) + rank
    return torch.cat(rows), upstream


def a2a_expected(rank: int) -> list[torch.Tensor]:
    """What rank ``rank`` receives (in source-rank order) and its rows' gradient."""
    got = torch.cat([a2a_inputs(j)[0][sum(A2A_COUNTS[j][:rank]):
                                      sum(A2A_COUNTS[j][:rank + 1])] for j in range(NPROCS)])
    # the gradient of a sent row is the upstream of where it landed
    grads = []
    for j, n in enumerate(A2A_COUNTS[rank]):
        start = sum(A2A_COUNTS[i][j] for i in range(rank))
        grads.append(a2a_inputs(j)[1][start:start + n])
    return [got, torch.cat(grads)]


def _serial(sizes: Sizes) -> dict[str, Any]:
    """Per rank: output rows, gradients (x, w_in, w_out), the rows it sends and receives,
    the FLOP budget; and the router's whole gradient."""
    from labsim.parallel.expert_parallel import moe_forward, top_k_route

    (x, w_router, w_in, w_out), upstream = whole(sizes)
    leaves = [t.clone().requires_grad_(True) for t in (x, w_router, w_in, w_out)]
    out = moe_forward(*leaves, sizes.k)
    (out * upstream).sum().backward()
    experts = top_k_route(x @ w_router.T, sizes.k)[1]
    per = sizes.experts // NPROCS
    ranks = []
    for r in range(NPROCS):
        rows = slice(r * sizes.tokens, (r + 1) * sizes.tokens)
        held = slice(r * per, (r + 1) * per)
        mine = experts[rows]
        received = int(((experts // per) == r).sum())
        budget = 3 * (2 * sizes.tokens * sizes.hidden * sizes.experts  # the router
                      + 4 * sizes.hidden * sizes.ffn * received)  # its experts' rows
        ranks.append({"out": out[rows].detach(), "x": leaves[0].grad[rows],
                      "w_in": leaves[2].grad[held], "w_out": leaves[3].grad[held],
                      "rows": max(mine.numel(), received), "flops": budget})
    return {"ranks": ranks, "w_router": leaves[1].grad}


# -- the driver (in the learner's process) ------------------------------------------------------


def _probe(fns: Sequence[Any]) -> None:
    """Call each exercise once without a process group: a stub raises NotImplementedError."""
    fns[0].apply(torch.zeros(1, 1), [1], [1])


def _probe_layer(fns: Sequence[Any]) -> None:
    inputs, _ = part(SIZES[2], 0)
    fns[1](*inputs, SIZES[2].k)


def ep_worker(rank: int, world: int, fns: Sequence[Any], jobs: Sequence[tuple],
              forbid: Sequence[str]) -> list[dict | Outcome]:
    """Every job on this rank, recorded (output, gradients, collectives, FLOPs, references)."""
    import torch.distributed as dist

    from labsim.checks.tensor_parallel.reference import record

    a2a, layer = fns
    out: list[dict | Outcome] = []
    for kind, raw in jobs:
        if kind == "a2a":
            x, upstream = a2a_inputs(rank)
            send = list(A2A_COUNTS[rank])
            recv = [A2A_COUNTS[j][rank] for j in range(world)]
            inputs = {"x": x}

            def call(x: torch.Tensor, send: list = send, recv: list = recv) -> Any:
                return a2a.apply(x, send, recv)
        else:
            sizes = Sizes(*raw)
            parts, upstream = part(sizes, rank)
            inputs = dict(zip(("x", "w_router", "w_in", "w_out"), parts))

            def call(x: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor,
                     w_out: torch.Tensor, k: int = sizes.k) -> Any:
                return layer(x, w_router, w_in, w_out, k)
        try:
            run = record(call, inputs, upstream, tuple(forbid))
        except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
            out.append(Outcome.of_error(exc))
        else:
            out.append({"out": run.out, "grads": dict(run.grads),
                        "forward": [list(c) for c in run.forward],
                        "backward": [list(c) for c in run.backward],
                        "flops": int(run.flops), "references": list(run.references)})
        dist.barrier()
    return out


HANG = ("a rank waited in a collective the others never issued: does every rank run every "
        "all-to-all, even one that sends or receives no rows (and its backward: run each local "
        "expert even on zero rows, so the combine's output needs a gradient on every rank)?")


def _drive(fns: Sequence[Any], cases: Sequence[Case], spec: Spec) -> list[Outcome]:
    stub = stub_outcomes([lambda: _probe(fns), lambda: _probe_layer(fns)], len(cases))
    if stub is not None:
        return stub
    jobs, index = unique_jobs(cases, lambda c: (str(c.args[0]), tuple(c.args[1])))
    ranks, failed = launch_ranks(ep_worker, NPROCS, (list(fns), jobs, spec.forbid), spec,
                                 len(cases), TIMEOUT_S, HANG)
    if ranks is None:
        return failed

    def value(runs: list[dict], i: int) -> list[Any]:
        what = str(cases[i].args[2])
        return [[run["out"], *run["grads"].values()] if what == "all" else
                [run["grads"].get("w_router")] if what == "router" else
                [run["out"]] if what == "out" else [run["grads"].get("x")] for run in runs]

    return rank_outcomes(ranks, index, ("forward", "backward", "flops"), value)


# -- cases, comparison and rules (in the grader's process) --------------------------------------


def _one(name: str) -> Callable[[Any, Any], str | None]:
    """Compare one tensor per rank (``expected["values"]``) with the ranks' results."""
    def compare(got: Any, expected: Any) -> str | None:
        if not isinstance(got, list) or len(got) != NPROCS:
            return f"expected one result per rank ({NPROCS})"
        for rank, (g, e) in enumerate(zip(got, expected["values"])):
            if g[0] is None:
                return f"rank {rank}: {name} is missing (None)"
            wrong = TOL(g[0], e)
            if wrong is not None:
                return f"rank {rank}: {name}: {wrong}"
        return None
    return compare


def _compare_a2a(got: Any, expected: Any) -> str | None:
    if not isinstance(got, list) or len(got) != NPROCS:
        return f"expected one result per rank ({NPROCS})"
    for rank, (g, e) in enumerate(zip(got, expected)):
        if g[0] is None:
            return f"rank {rank}: no gradient came back to the rows it sent"
        wrong = TOL(g[0], e)
        if wrong is not None:
            return f"rank {rank}: {wrong}"
    return None


def _compare_router(got: Any, expected: Any) -> str | None:
    if not isinstance(got, list) or len(got) != NPROCS or any(g[0] is None for g in got):
        return "every rank must return a gradient for the router's weight"
    wrong = TOL(sum(g[0] for g in got), expected)
    return None if wrong is None else f"the router's gradient summed over the ranks: {wrong}"


def _cases() -> list[Case]:
    cases = [Case("all-to-all of uneven row counts (zeros too): what each rank receives",
                  ("a2a", (), "out"), expected=[a2a_expected(r)[0] for r in range(NPROCS)],
                  compare=_compare_a2a),
             Case("all-to-all backward: each sent row's gradient comes back",
                  ("a2a", (), "x"), expected=[a2a_expected(r)[1] for r in range(NPROCS)],
                  compare=_compare_a2a)]
    for i, s in enumerate(SIZES):
        serial = _serial(s)
        label = (f"{s.experts} experts on {NPROCS} ranks, top-{s.k}, {s.tokens} tokens per "
                 f"rank" + (", a router favouring expert 0" if s.skew else ""))
        raw = dataclasses.astuple(s)
        expected = {"rows": [r["rows"] for r in serial["ranks"]],
                    "flops": [r["flops"] for r in serial["ranks"]]}
        if i == 0:
            cases += [
                Case(f"{label}: each rank's output rows", ("ep", raw, "out"),
                     expected={**expected, "values": [r["out"] for r in serial["ranks"]]},
                     compare=_one("output")),
                Case(f"{label}: each rank's rows' gradient", ("ep", raw, "x"),
                     expected={**expected, "values": [r["x"] for r in serial["ranks"]]},
                     compare=_one("gradient of x"))]
        cases.append(Case(f"{label}: outputs and every gradient", ("ep", raw, "all"),
                          expected={**expected, "values": [
                              [r["out"], r["x"], serial["w_router"] / NPROCS, r["w_in"],
                               r["w_out"]] for r in serial["ranks"]], "router": serial[
                                   "w_router"]},
                          compare=_all_compare))
    return cases


def _all_compare(got: Any, expected: Any) -> str | None:
    """Output, x, w_in and w_out per rank; the router's gradient summed over ranks."""
    if not isinstance(got, list) or len(got) != NPROCS or any(
            not isinstance(g, list) or len(g) != 5 for g in got):
        return "expected the output and four gradients on every rank"
    per_rank = [[g[0], g[1], g[3], g[4]] for g in got]
    want = [[v[0], v[1], v[3], v[4]] for v in expected["values"]]
    for rank, (g, e) in enumerate(zip(per_rank, want)):
        for name, gv, ev in zip(("output", "gradient of x", "gradient of w_in",
                                 "gradient of w_out"), g, e):
            if gv is None:
                return f"rank {rank}: {name} is missing (None)"
            wrong = TOL(gv, ev)
            if wrong is not None:
                return f"rank {rank}: {name}: {wrong}"
    return _compare_router([[g[2]] for g in got], expected["router"])


def comms_rule(case: Case, out: Outcome) -> str | None:
    """Token rows travel only by all-to-all, two each way, no more than this rank's rows."""
    if case.args[0] != "ep":
        return None
    sizes = Sizes(*case.args[1])
    small = NPROCS * sizes.experts
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        limit = case.expected["rows"][rank] * (sizes.hidden + 2)
        for phase in ("forward", "backward"):
            big = [(k, int(n)) for k, n in seen[phase] if int(n) > small]
            few = [(k, int(n)) for k, n in seen[phase] if int(n) <= small]
            if any(k != "all_to_all" for k, _ in big) or len(big) != 2:
                return (f"token rows travel by all-to-all: two {phase} (dispatch and "
                        f"combine{'' if phase == 'forward' else ', reversed'}); rank {rank} "
                        f"issued {big or 'none'} {phase}")
            over = [n for _, n in big if n > limit]
            if over:
                return (f"an all-to-all moves only the rows this rank sends or receives: rank "
                        f"{rank} moved {over[0]} elements, its rows are at most "
                        f"{case.expected['rows'][rank]} x {sizes.hidden}")
            if len(few) > (SMALL_FORWARD if phase == "forward" else 0):
                return (f"at most {SMALL_FORWARD} small collectives (the counts) forward and "
                        f"none backward; rank {rank} issued {few} {phase}")
    return None


def flops_rule(case: Case, out: Outcome) -> str | None:
    """Each rank computes the router on its rows and its experts on the rows sent to them."""
    if case.args[0] != "ep":
        return None
    for rank, seen in enumerate(out.observed.get("ranks", [])):
        budget = case.expected["flops"][rank]
        if int(seen["flops"]) > FLOPS_SLACK * budget:
            return (f"each rank runs its own experts on the rows routed to them: rank {rank} "
                    f"executed {int(seen['flops'])} matmul FLOPs, its router and experts' "
                    f"share is {budget}")
    return None


layer = Spec("expert_parallel", _cases, drive=_drive, rules=(comms_rule, flops_rule),
             forbid=FORBID, functions=2, ops=False)
"""``AllToAll`` (a ``torch.autograd.Function``: ``apply(x, send_counts, recv_counts)``) and
``ep_moe_layer(x, w_router, w_in, w_out, k)`` on 4 processes: equal to the whole layer, rows
sent by two all-to-alls each way.  One launch."""
