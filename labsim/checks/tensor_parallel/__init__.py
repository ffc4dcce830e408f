"""Checks for lab 10 (tensor parallel): the learner's Megatron-style layers on real gloo
processes against one process running the whole layer in float64 (parallel = serial).

Each check is three parts: the cases (``reference.*_SPECS``, sizes and seeds), a worker driver
that runs the learner's code on ``NPROCS`` processes under ``labsim.lab.comm.CommRecorder``
and returns plain tensors, the communication it issued and its matmul FLOPs per rank
(``TPRun``), and the comparison with the serial oracle (``reference``) computed here.
Besides values, each check holds the learner to the method: the collectives of each phase
(Megatron's ``f`` and ``g``: one all-reduce forward and one backward per split block;
sequence parallelism: an all-gather and a reduce-scatter instead; vocabulary-parallel
cross-entropy: only all-reduces of a few numbers per token, never the logits) and 1/t of the
whole block's matmul FLOPs per rank (the block is split, not computed whole on every rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from labsim.checks._core import close
from labsim.checks._workers import check_outcomes, fail_if_stub, guard, run_workers
from labsim.checks.tensor_parallel.reference import (
    ATTENTION_SPECS,
    CE_SPECS,
    MLP_SPECS,
    SP_SPECS,
    Comms,
    Spec,
    TPRun,
    attention_part,
    attention_whole,
    ce_whole,
    mlp_part,
    mlp_whole,
    operator_inputs,
    randn,
    record,
    serial,
    serial_attention,
    serial_mlp,
    serial_sp_block,
    shard_grads,
    sp_part,
    sp_whole,
)

NPROCS = 2
TOL = close(rtol=1e-9, atol=1e-12)


def _comms_rule(rule: str) -> Callable[[Any, Any], str | None]:
    """Compare per-rank (forward, backward) communication with the rule's, naming it."""
    def compare(got: Any, expected: Any) -> str | None:
        for rank, (g, e) in enumerate(zip(got, expected)):
            if sorted(g[0]) != sorted(e[0]) or sorted(g[1]) != sorted(e[1]):
                return (f"rule: {rule}\n  rank {rank} issued forward {_show(g[0])}, backward "
                        f"{_show(g[1])}; expected forward {_show(e[0])}, backward "
                        f"{_show(e[1])}")
        return None
    return compare


def _show(comms: Comms) -> str:
    return "[" + ", ".join(f"{k} of {n} elements" for k, n in comms) + "]" if comms else \
        "nothing"


def _at_most(rule: str) -> Callable[[Any, Any], str | None]:
    def compare(got: Any, expected: Any) -> str | None:
        for rank, (g, e) in enumerate(zip(got, expected)):
            if g > 1.05 * e:
                return (f"rule: {rule}\n  rank {rank} executed {g} matmul FLOPs; 1/t of the "
                        f"whole block is {e}")
        return None
    return compare


def _runs(ranks: Sequence[Any], i: int) -> list[TPRun] | BaseException:
    """Case ``i`` on every rank, or the first rank's error."""
    runs = [r if isinstance(r, BaseException) else r[i] for r in ranks]
    bad = next((r for r in runs if isinstance(r, BaseException)), None)
    return bad if bad is not None else runs


def _field(runs: list[TPRun] | BaseException, get: Callable[[TPRun], Any]) -> Any:
    return runs if isinstance(runs, BaseException) else [get(r) for r in runs]


def _own_code_row(ranks: Sequence[Any]) -> tuple:
    """The row holding every rank, in every case, to code of its own: no call into labsim's
    reference (``labsim.parallel.tensor_parallel``)."""
    used = [sorted({name for run in r if not isinstance(run, BaseException)
                    for name in run.references}) if not isinstance(r, BaseException) else []
            for r in ranks]
    return ("your own code: it calls nothing of labsim.parallel.tensor_parallel", used,
            [[] for _ in ranks], lambda got, exp: None if got == exp else
            "rule: the exercise is to write it, not to call labsim's reference; your code "
            f"called {', '.join(next(g for g in got if g))}")


def _value_rows(label: str, runs: Any, want: list[TPRun], names: Sequence[str]) -> list:
    """Rows comparing outputs and the named gradients, every rank."""
    rows = [(f"{label}: output equals the serial block's", _field(runs, lambda r: r.out),
             [w.out for w in want], TOL)]
    for group in names:
        keys = group.split(",")
        rows.append((f"{label}: gradient of {', '.join(keys)} equals the serial block's",
                     _field(runs, lambda r, k=keys: [r.grads.get(n) for n in k]),
                     [[w.grads[n] for n in keys] for w in want], TOL))
    return rows


# -- Megatron's f and g, and the MLP ------------------------------------------------------------


def mlp_worker(rank: int, world: int, f: Any, g: Any, mlp: Callable[..., torch.Tensor],
               specs: Sequence[Spec]) -> list[TPRun | Exception]:
    """``f`` and ``g`` alone on a tensor different on every rank, then the learner's MLP on
    this rank's blocks of each case's whole MLP."""
    x, grad = operator_inputs(rank)
    out = [guard(record, lambda t, op=op: op.apply(t), {"x": x}, grad) for op in (f, g)]
    for spec in specs:
        whole = mlp_whole(spec)
        out.append(guard(record, mlp, mlp_part(whole, rank, world), whole["upstream"]))
    return out


def parallel_mlp(f: Any, g: Any, mlp: Callable[..., torch.Tensor],
                 timeout_s: float = 120.0) -> None:
    """``f`` and ``g``: Megatron's conjugate operators as ``torch.autograd.Function``s;
    ``mlp(x, w_up, b_up, w_down, b_down)``: ``GeLU(x A) B + b`` from this rank's blocks
    (``w_up``: rows = output features, ``w_down``: columns = input features), equal on every
    rank to the whole MLP, with one all-reduce forward and one backward."""
    title, n = "parallel_mlp", 12
    probe = torch.zeros(1, requires_grad=True)
    fail_if_stub(title, n, lambda: f.apply(probe), lambda: g.apply(probe),
                 lambda: mlp(*(mlp_part(mlp_whole(MLP_SPECS[1]), 0, 1).values())))
    ranks = run_workers(title, n, mlp_worker, NPROCS, (f, g, mlp, MLP_SPECS), timeout_s)
    world = NPROCS
    fr, gr = _runs(ranks, 0), _runs(ranks, 1)
    xs = [operator_inputs(r) for r in range(world)]
    total_x, total_grad = sum(x for x, _ in xs), sum(gr_ for _, gr_ in xs)
    numel = xs[0][0].numel()
    rows: list = [
        ("f forward returns its input unchanged", _field(fr, lambda r: r.out),
         [x for x, _ in xs], TOL),
        ("f backward: the gradient summed over the ranks", _field(fr, lambda r: r.grads["x"]),
         [total_grad] * world, TOL),
        ("g forward: the input summed over the ranks", _field(gr, lambda r: r.out),
         [total_x] * world, TOL),
        ("g backward: the gradient passes unchanged", _field(gr, lambda r: r.grads["x"]),
         [gd for _, gd in xs], TOL),
        ("f communicates only backward, g only forward (one all-reduce each)",
         fr if isinstance(fr, BaseException) else gr if isinstance(gr, BaseException) else
         [((a.forward, a.backward), (b.forward, b.backward)) for a, b in zip(fr, gr)],
         [(((), (("all_reduce", numel),)), ((("all_reduce", numel),), ()))] * world,
         lambda got, exp: None if got == exp else
         "rule: f is the identity forward and all-reduces backward; g all-reduces forward "
         f"and is the identity backward\n  got (f, g) x (forward, backward) = {got[0]}"),
    ]
    for i, spec in enumerate(MLP_SPECS):
        whole = mlp_whole(spec)
        ref = serial(serial_mlp, {k: v for k, v in whole.items() if k != "upstream"},
                     whole["upstream"])
        want = [shard_grads(ref, r, world, {"w_up": 0, "b_up": 0, "w_down": 1})
                for r in range(world)]
        runs = _runs(ranks, 2 + i)
        label = f"MLP {spec.seq}x{spec.batch} tokens, h={spec.hidden}, ffn={spec.ffn}"
        if i == 0:
            values = _value_rows(label, runs, want, ["x", "w_up,b_up,w_down,b_down"])
            rows.append(values[0])
            tokens = spec.seq * spec.batch * spec.hidden
            rows.append((f"{label}: one all-reduce forward (g) and one backward (f)",
                         _field(runs, lambda r: (r.forward, r.backward)),
                         [((("all_reduce", tokens),), (("all_reduce", tokens),))] * world,
                         _comms_rule("the split MLP communicates once forward (g: an "
                                     "all-reduce of the s*b*h output) and once backward "
                                     "(f: an all-reduce of the input's gradient)")))
            rows.append((f"{label}: each rank does 1/t of the whole MLP's matmul FLOPs",
                         _field(runs, lambda r: r.flops), [ref.flops / world] * world,
                         _at_most("each rank computes only its blocks of the MLP, not the "
                                  "whole MLP")))
            rows += values[1:]
        else:
            rows.append((f"{label}: output and every gradient equal the serial MLP's",
                         _field(runs, lambda r, keys=list(want[0].grads): (
                             r.out, [r.grads.get(k) for k in keys])),
                         [(w.out, list(w.grads.values())) for w in want], TOL))
    rows.append(_own_code_row(ranks))
    check_outcomes(title, rows)


# -- head-parallel attention -------------------------------------------------------------------


def attention_worker(rank: int, world: int, attention: Callable[..., torch.Tensor],
                     specs: Sequence[Spec]) -> list[TPRun | Exception]:
    """The learner's attention on this rank's heads of each case's whole layer."""
    out = []
    for spec in specs:
        whole = attention_whole(spec)
        head_dim = spec.hidden // spec.heads
        out.append(guard(record, lambda *a, d=head_dim: attention(*a, d),
                         attention_part(whole, rank, world), whole["upstream"]))
    return out


def head_parallel_attention(attention: Callable[..., torch.Tensor],
                            timeout_s: float = 120.0) -> None:
    """``attention(x, w_qkv, b_qkv, w_o, b_o, head_dim)``: causal self-attention over this
    rank's heads (``w_qkv``: its block of the head-major fused QKV rows; ``w_o``: the matching
    columns of the output projection), equal on every rank to the whole layer, with one
    all-reduce forward and one backward."""
    title, n = "head_parallel_attention", 8
    spec = ATTENTION_SPECS[1]
    fail_if_stub(title, n, lambda: attention(*attention_part(attention_whole(spec), 0, 1)
                                             .values(), spec.hidden // spec.heads))
    ranks = run_workers(title, n, attention_worker, NPROCS, (attention, ATTENTION_SPECS),
                        timeout_s)
    world = NPROCS
    rows: list = []
    for i, spec in enumerate(ATTENTION_SPECS):
        whole = attention_whole(spec)
        ref = serial(serial_attention(spec.hidden // spec.heads),
                     {k: v for k, v in whole.items() if k != "upstream"}, whole["upstream"])
        want = [shard_grads(ref, r, world, {"w_qkv": 0, "b_qkv": 0, "w_o": 1})
                for r in range(world)]
        runs = _runs(ranks, i)
        label = (f"{spec.heads} heads on {world} ranks, {spec.seq}x{spec.batch} tokens, "
                 f"h={spec.hidden}")
        if i == 0:
            values = _value_rows(label, runs, want, ["x", "w_qkv,b_qkv", "w_o,b_o"])
            rows.append(values[0])
            numel = spec.seq * spec.batch * spec.hidden
            rows.append((f"{label}: one all-reduce forward (g) and one backward (f)",
                         _field(runs, lambda r: (r.forward, r.backward)),
                         [((("all_reduce", numel),), (("all_reduce", numel),))] * world,
                         _comms_rule("head-parallel attention communicates once forward "
                                     "(g after the output projection) and once backward "
                                     "(f before the QKV projection)")))
            rows.append((f"{label}: each rank does 1/t of the projections' matmul FLOPs",
                         _field(runs, lambda r: r.flops), [ref.flops / world] * world,
                         _at_most("each rank computes only its own heads")))
            rows += values[1:]
        else:
            rows.append((f"{label}: output and every gradient equal the serial layer's",
                         _field(runs, lambda r, keys=list(want[0].grads): (
                             r.out, [r.grads.get(k) for k in keys])),
                         [(w.out, list(w.grads.values())) for w in want], TOL))
    rows.append(_own_code_row(ranks))
    check_outcomes(title, rows)


# -- sequence parallelism ----------------------------------------------------------------------


def sp_worker(rank: int, world: int, gather: Any, scatter: Any,
              block: Callable[..., torch.Tensor],
              specs: Sequence[Spec]) -> list[TPRun | Exception]:
    """The two operators alone (a shard, and a whole tensor, different on every rank), then
    the learner's block on this rank's slice of each case's sequence."""
    gen = torch.Generator().manual_seed(11 + rank)
    shard, whole_x = randn(gen, 2, 3, 4), randn(gen, 2 * world, 3, 4)
    out = [guard(record, lambda t: gather.apply(t), {"x": shard}, randn(gen, 2 * world, 3, 4)),
           guard(record, lambda t: scatter.apply(t), {"x": whole_x}, randn(gen, 2, 3, 4))]
    for spec in specs:
        whole = sp_whole(spec)
        s = spec.seq
        upstream = whole["upstream"][rank * s // world:(rank + 1) * s // world]
        out.append(guard(record, block, sp_part(whole, rank, world), upstream))
    return out


def sequence_parallel(gather: Any, scatter: Any, block: Callable[..., torch.Tensor],
                      timeout_s: float = 120.0) -> None:
    """``gather``: all-gather of the sequence (dimension 0) forward, reduce-scatter
    backward; ``scatter``: reduce-scatter forward, all-gather backward;
    ``block(x, ln_w, ln_b, w_up, b_up, w_down, b_down)``: this rank's rows of
    ``x + MLP(LayerNorm(x))`` from its rows of ``x``, the norm on the shard, the MLP split as
    in ``parallel_mlp``, and no all-reduce.  The replicated parameters' gradients (norm,
    output bias) on each rank are its share: summed over ranks they equal the serial ones."""
    title, n = "sequence_parallel", 12
    probe = torch.zeros(2, 1, requires_grad=True)
    spec = SP_SPECS[1]
    fail_if_stub(title, n, lambda: gather.apply(probe), lambda: scatter.apply(probe),
                 lambda: block(*sp_part(sp_whole(spec), 0, 1).values()))
    ranks = run_workers(title, n, sp_worker, NPROCS, (gather, scatter, block, SP_SPECS),
                        timeout_s)
    world = NPROCS
    gens = [torch.Generator().manual_seed(11 + r) for r in range(world)]
    data = [[randn(gn, 2, 3, 4), randn(gn, 2 * world, 3, 4), randn(gn, 2 * world, 3, 4),
             randn(gn, 2, 3, 4)] for gn in gens]  # shard, whole x, their upstreams
    gr, sr = _runs(ranks, 0), _runs(ranks, 1)
    full = torch.cat([d[0] for d in data])
    summed_up = sum(d[2] for d in data)
    summed_x = sum(d[1] for d in data)
    ag, rs = ("all_gather", 2 * world * 12), ("reduce_scatter", 2 * world * 12)
    rows: list = [
        ("all-gather forward: the shards in rank order", _field(gr, lambda r: r.out),
         [full] * world, TOL),
        ("all-gather backward: the gradient reduce-scattered", _field(gr, lambda r: r.grads["x"]),
         [summed_up[2 * r:2 * r + 2] for r in range(world)], TOL),
        ("reduce-scatter forward: the sum, this rank's rows", _field(sr, lambda r: r.out),
         [summed_x[2 * r:2 * r + 2] for r in range(world)], TOL),
        ("reduce-scatter backward: the gradient all-gathered", _field(sr, lambda r: r.grads["x"]),
         [torch.cat([d[3] for d in data])] * world, TOL),
        ("the operators: all-gather forward / reduce-scatter backward, and the reverse",
         gr if isinstance(gr, BaseException) else sr if isinstance(sr, BaseException) else
         [((a.forward, a.backward), (b.forward, b.backward)) for a, b in zip(gr, sr)],
         [(((ag,), (rs,)), ((rs,), (ag,)))] * world,
         lambda got, exp: None if got == exp else
         "rule: gather = all-gather forward, reduce-scatter backward; scatter = the "
         f"reverse (one collective each)\n  got (gather, scatter) x (forward, backward) = "
         f"{got[0]}"),
    ]
    sharded = {"x": 0, "w_up": 0, "b_up": 0, "w_down": 1}
    for i, spec in enumerate(SP_SPECS):
        whole = sp_whole(spec)
        ref = serial(serial_sp_block, {k: v for k, v in whole.items() if k != "upstream"},
                     whole["upstream"])
        s = spec.seq
        want = []
        for r in range(world):
            cut = shard_grads(ref, r, world, sharded)
            want.append(TPRun(ref.out[r * s // world:(r + 1) * s // world], cut.grads,
                              (), (), ref.flops))
        runs = _runs(ranks, 2 + i)
        label = f"SP block {spec.seq}x{spec.batch} tokens, h={spec.hidden}, ffn={spec.ffn}"
        shared = ["ln_w", "ln_b", "b_down"]
        summed = runs if isinstance(runs, BaseException) else (
            None if any(r.grads.get(k) is None for r in runs for k in shared) else
            [sum(r.grads[k] for r in runs) for k in shared])
        if i == 0:
            rows.append((f"{label}: output equals the serial block's rows",
                         _field(runs, lambda r: r.out), [w.out for w in want], TOL))
            numel = spec.seq * spec.batch * spec.hidden
            rows.append((f"{label}: an all-gather and a reduce-scatter each way, no "
                         "all-reduce", _field(runs, lambda r: (r.forward, r.backward)),
                         [((("all_gather", numel), ("reduce_scatter", numel)),
                           (("all_gather", numel), ("reduce_scatter", numel)))] * world,
                         _comms_rule("sequence parallelism replaces each all-reduce by a "
                                     "reduce-scatter and an all-gather of the s*b*h "
                                     "activations")))
            rows.append((f"{label}: each rank does 1/t of the MLP's matmul FLOPs",
                         _field(runs, lambda r: r.flops), [ref.flops / world] * world,
                         _at_most("each rank computes only its blocks of the MLP")))
            rows.append((f"{label}: gradients of x and the split weights equal the serial "
                         "block's", _field(runs, lambda r: [r.grads.get(k) for k in sharded]),
                         [[w.grads[k] for k in sharded] for w in want], TOL))
            rows.append((f"{label}: norm and output-bias gradients, summed over ranks, "
                         "equal the serial block's", summed,
                         [ref.grads[k] for k in shared], TOL))
        else:
            rows.append((f"{label}: output, gradients and summed shared gradients equal "
                         "the serial block's",
                         _field(runs, lambda r: (r.out, [r.grads.get(k) for k in sharded]))
                         if isinstance(runs, BaseException) or summed is None else
                         ([(r.out, [r.grads.get(k) for k in sharded]) for r in runs], summed),
                         ([(w.out, [w.grads[k] for k in sharded]) for w in want],
                          [ref.grads[k] for k in shared]), TOL))
    rows.append(_own_code_row(ranks))
    check_outcomes(title, rows)


# -- vocabulary-parallel cross-entropy ---------------------------------------------------------


def ce_worker(rank: int, world: int, ce: Any, specs: Sequence[Spec]) -> list[TPRun | Exception]:
    """The learner's cross-entropy on this rank's slice of each case's vocabulary."""
    out = []
    for spec in specs:
        whole = ce_whole(spec, world)
        v = spec.ffn // world
        part = {"logits": whole["logits"][:, rank * v:(rank + 1) * v], "target": whole["target"]}
        out.append(guard(record, lambda lg, tg, start=rank * v: ce.apply(lg, tg, start),
                         part, whole["upstream"]))
    return out


def _ce_rule(got: Any, expected: Any) -> str | None:
    for rank, (fwd, bwd) in enumerate(got):
        tokens = expected
        bad = [c for c in fwd if c[0] != "all_reduce" or c[1] > 2 * tokens]
        if bad or len(fwd) > 3 or bwd:
            return ("rule: the logits are never gathered; forward issues at most 3 "
                    "all-reduces of at most 2 numbers per token, backward nothing\n  rank "
                    f"{rank} issued forward {_show(fwd)}, backward {_show(bwd)}")
    return None


def vocab_parallel_cross_entropy(ce: Any, timeout_s: float = 120.0) -> None:
    """``ce.apply(logits, target, vocab_start)``: per-token cross-entropy from this rank's
    ``(tokens, V / t)`` slice of the logits (vocabulary ids ``vocab_start ..``), equal to
    ``F.cross_entropy`` on the whole logits, its gradient the slice of the whole gradient,
    without ever gathering the logits."""
    title, n = "vocab_parallel_cross_entropy", 9
    fail_if_stub(title, n, lambda: ce.apply(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                                            0))
    ranks = run_workers(title, n, ce_worker, NPROCS, (ce, CE_SPECS), timeout_s)
    world = NPROCS
    names = ["6 tokens, V=10", "logits near +-1000 (subtract the maximum)",
             "every target in the last rank's slice", "a single token"]
    rows: list = []
    for i, (spec, name) in enumerate(zip(CE_SPECS, names)):
        whole = ce_whole(spec, world)
        ref = serial(lambda lg, tg: F.cross_entropy(lg, tg, reduction="none"),
                     {"logits": whole["logits"], "target": whole["target"]}, whole["upstream"])
        v = spec.ffn // world
        runs = _runs(ranks, i)
        got = _field(runs, lambda r: (r.out, r.grads.get("logits")))
        want = [(ref.out, ref.grads["logits"][:, r * v:(r + 1) * v]) for r in range(world)]
        if i == 0:
            rows.append((f"{name}: loss per token equals F.cross_entropy",
                         _field(runs, lambda r: r.out), [ref.out] * world, TOL))
            rows.append((f"{name}: gradient equals this rank's slice of the whole gradient",
                         _field(runs, lambda r: r.grads.get("logits")),
                         [w[1] for w in want], TOL))
            rows.append((f"{name}: the logits are never gathered (all-reduces of a few "
                         "numbers per token; nothing backward)",
                         _field(runs, lambda r: (r.forward, r.backward)), spec.seq, _ce_rule))
        elif i == 1:
            rows.append((f"{name}: loss", _field(runs, lambda r: r.out), [ref.out] * world,
                         close(rtol=1e-9, atol=1e-9)))
            rows.append((f"{name}: gradient", _field(runs, lambda r: r.grads.get("logits")),
                         [w[1] for w in want], TOL))
        else:
            rows.append((f"{name}: loss and gradient", got, want, TOL))
    rows.append(("every case: at most 3 all-reduces, none backward",
                 next((r for r in ranks if isinstance(r, BaseException)), None) or
                 [[(r[i].forward, r[i].backward) if not isinstance(r[i], BaseException)
                   else ((), ()) for r in ranks] for i in range(len(CE_SPECS))],
                 None, lambda got, _: next(
                     (why for i, case in enumerate(got)
                      if (why := _ce_rule(case, CE_SPECS[i].seq))), None)))
    rows.append(_own_code_row(ranks))
    check_outcomes(title, rows)
