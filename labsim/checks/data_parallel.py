"""Checks for lab 08 (data parallel): the learner's DDP on 2 real gloo processes against one
process on the whole batch (parallel = serial is the oracle).

The model (``TrapNet``, float64) carries a frozen layer, a layer unused in forward and tied
embedding/output weights.  Each check is one launch; a worker that raises or hangs ends the
check with a FAIL line within ``timeout_s``.  The recorder watches every collective at the
dispatcher: bucketed DDP must issue, per step, one all-reduce per bucket -- the buckets its
contract defines for the cap, with their sizes -- and launch every bucket whose gradients are
all produced in backward *during* backward (Li et al. 2020, "PyTorch Distributed").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome
from labsim.checks._observe import watch
from labsim.parallel.data_parallel import (
    DataParallelBucket,
    TrainingRun,
    TrapNet,
    lm_loss,
    make_tokens,
    parameters_of,
    serial_reference,
    shard,
)

NPROCS = 2
BATCH, STEPS, LR, INIT_SEED = 8, 3, 0.1, 1000
TOL = close(rtol=1e-9, atol=1e-12)
CAPS = (1.0, 600.0, 1e9)
ACCUMULATE_CAP = 600.0
_P = "labsim.parallel.data_parallel"
FORBID = (f"{_P}:broadcast_parameters", f"{_P}:average_gradients", f"{_P}:DataParallelNaive",
          f"{_P}:DataParallelBucket", f"{_P}:serial_reference",
          "torch.nn.parallel.distributed:DistributedDataParallel")
FORBID_ACCUMULATE = tuple(t for t in FORBID if not t.endswith("DataParallelBucket"))


@dataclass(frozen=True)
class DdpRun(TrainingRun):
    """One rank's run under a learner's data parallelism: also ``spread_after_sync`` (rank 0
    minus this rank right after ``sync_parameters``, or the error it raised as an
    ``Outcome``), what the recorder saw on each step (``steps``: ``watch`` summaries) and the
    references the tripwire caught."""

    spread_after_sync: Any = 0.0
    steps: list[dict] = field(default_factory=list)
    references: list[str] = field(default_factory=list)


def batches(steps: int = STEPS, batch: int = BATCH) -> list[torch.Tensor]:
    """The global batches every driver and the serial reference train on."""
    return [make_tokens(100 + s, batch) for s in range(steps)]


def _serial(accumulate: int = 1) -> TrainingRun:
    return serial_reference(INIT_SEED, batches(), lr=LR, accumulate=accumulate)


def expected_buckets(cap: float) -> list[tuple[int, bool]]:
    """The buckets the exercise's contract defines for ``cap``: trainable parameters of
    ``TrapNet`` (float64) in reverse order, closed once they hold >= ``cap`` bytes.  Each is
    ``(nbytes, complete)``: ``complete`` when every parameter in it gets a gradient in
    backward (a bucket holding the unused layer can only be launched at the end)."""
    model = TrapNet().double()
    unused = {id(p) for p in model.unused.parameters()}
    out: list[tuple[int, bool]] = []
    size, complete = 0, True
    for p in reversed([p for p in model.parameters() if p.requires_grad]):
        size += p.numel() * p.element_size()
        complete = complete and id(p) not in unused
        if size >= cap:
            out.append((size, complete))
            size, complete = 0, True
    if size:
        out.append((size, complete))
    return out


# --------------------------------------------------------------------------------------
# Driving a launch from the notebook (or the sandbox)


def _not_done(probes: Sequence[Callable[[], Any]]) -> Outcome | None:
    """An outcome when an exercise still raises NotImplementedError (no processes started)."""
    for probe in probes:
        try:
            probe()
        except NotImplementedError as exc:
            return Outcome.of_error(exc)
        except Exception:  # noqa: BLE001, S110 - expected: no process group in this process
            pass
    return None


def _launch(fn: Any, args: tuple, title: str, timeout_s: float = 120.0) -> Any:
    from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

    try:
        return launch(fn, NPROCS, args=args, timeout_s=timeout_s, progress=title)
    except (LaunchTimeout, WorkerError) as exc:
        return Outcome.of_error(exc)


def _outcomes(values: Sequence[Any], observed: dict) -> list[Outcome]:
    out = []
    for v in values:
        if isinstance(v, Outcome):
            out.append(Outcome(None, v.error, v.error_types, v.message, observed))
        else:
            out.append(plain_outcome(v, observed))
    return out


def _refs(*runs: Any) -> list[str]:
    """What the watches of every run saw: references called, rules broken outside the
    function (an error outcome carries them in its observations)."""
    found = set()
    for run in runs:
        if isinstance(run, DdpRun):
            found.update(run.references)
        elif isinstance(run, Outcome):
            found.update(map(str, run.observed.get("references", [])))
    return sorted(found)


def _first_error(*runs: Any) -> Outcome | None:
    return next((r for r in runs if isinstance(r, Outcome)), None)


# --------------------------------------------------------------------------------------
# naive DDP


def _naive_cases() -> list[Case]:
    ref = _serial()
    names = ["replicas equal rank 0's after sync_parameters",
             "losses of 3 steps equal one process on the whole batch",
             "final parameters (tied embedding/head included) equal the serial run",
             "both ranks hold identical parameters after training",
             "the frozen layer is not changed",
             "the layer unused in forward is not changed"]
    exp = [0.0, ref.losses, ref.params, 0.0, ref.params["frozen.weight"],
           ref.params["unused.weight"]]
    return [Case(n, (i,), expected=e) for i, (n, e) in enumerate(zip(names, exp))]


def _naive_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                 ) -> list[Outcome]:
    sync, average = fns
    stub = _not_done([lambda: sync(nn.Linear(1, 1)), lambda: average(nn.Linear(1, 1))])
    ranks = stub or _launch(naive_worker, (sync, average, spec.forbid), spec.title)
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    r0, r1 = ranks
    observed = {"references": _refs(r0, r1)}
    bad = _first_error(r0, r1)
    if bad is not None:
        return [bad] * len(cases)
    values = [r0.spread_after_sync, r0.losses, r0.params, r1.spread,
              r0.params["frozen.weight"], r1.params["unused.weight"]]
    return _outcomes([values[int(c.args[0])] for c in cases], observed)


naive_ddp = Spec("naive_ddp", _naive_cases, drive=_naive_drive, compare=TOL, forbid=FORBID,
                 functions=2)
"""``sync_parameters(model)`` must make every replica equal to rank 0's;
``average_gradients(model)`` after backward must leave every rank with the gradient of the
whole batch, so 2 ranks on 2 shards train exactly like one process on the batch."""


# --------------------------------------------------------------------------------------
# bucketed DDP

SCENARIOS = [("one bucket per parameter", 1.0, "one"), ("600-byte buckets", 600.0, "one"),
             ("one bucket for everything (launched at the end)", 1e9, "one"),
             ("two backward passes before finish (no no_sync), 600-byte buckets", 600.0,
              "double"),
             ("two backward passes, the first inside no_sync(), 600-byte buckets", 600.0,
              "no_sync")]


def _bucketed_cases() -> list[Case]:
    ref, ref2 = _serial(), _serial(accumulate=2)
    cases = []
    for i, (name, _, mode) in enumerate(SCENARIOS):
        r = ref if mode == "one" else ref2
        cases.append(Case(f"{name}: final parameters equal the serial run", (i, "params"),
                          expected=r.params))
        cases.append(Case(f"{name}: losses equal, ranks identical", (i, "losses"),
                          expected=(r.losses, 0.0)))
    return cases


def _bucketed_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                    ) -> list[Outcome]:
    cls = fns[0]
    stub = _not_done([lambda: cls(nn.Linear(1, 1), 100.0)])
    ranks = stub or _launch(bucket_worker, (cls, [(c, d) for _, c, d in SCENARIOS],
                                            spec.forbid), spec.title)
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    runs0, runs1 = ranks
    observed = {"references": _refs(*runs0, *runs1),
                "steps": [r.steps if isinstance(r, DdpRun) else [] for r in runs0]}
    out = []
    for c in cases:
        i, what = int(c.args[0]), c.args[1]
        r0, r1 = runs0[i], runs1[i]
        bad = _first_error(r0, r1)
        value: Any = bad if bad is not None else (
            r0.params if what == "params" else (r0.losses, r1.spread))
        out += _outcomes([value], observed)
    return out


def bucket_rule(case: Case, out: Outcome) -> str | None:
    """One all-reduce per bucket per step, of the bucket's size, launched during backward
    for every bucket whose gradients backward produces (see ``expected_buckets``)."""
    i = int(case.args[0])
    _, cap, mode = SCENARIOS[i]
    buckets = expected_buckets(cap)
    want = sorted(n for n, _ in buckets)
    complete = sum(c for _, c in buckets)
    for step, seen in enumerate(out.observed.get("steps", [[]] * len(SCENARIOS))[i]):
        sizes = sorted(m[1] for m in seen.get("messages", []) if m[0] == "c10d::allreduce_")
        during = sum(1 for m in seen.get("messages", [])
                     if m[0] == "c10d::allreduce_" and m[3])
        where = f"cap {cap:g} B, step {step + 1}"
        if mode == "double":
            if len(sizes) > 2 * len(want) or not set(sizes) <= set(want):
                return (f"{where}: all-reduces of {sizes[:8]} bytes; expected at most two per "
                        f"bucket, of the bucket sizes {want[:8]}")
            continue
        if sizes != want:
            quiet = " (backward inside no_sync() launches nothing)" if mode == "no_sync" else ""
            return (f"{where}: {len(sizes)} all-reduce(s) of {sizes[:8]} bytes; the contract's "
                    f"buckets are {len(want)} of {want[:8]} bytes (one all-reduce per bucket)"
                    + quiet)
        if during < complete:
            return (f"{where}: {during} of the {complete} buckets whose gradients backward "
                    "produces were launched during backward; launch each from the gradient "
                    "hooks as soon as it is full (overlap)")
    return None


bucketed_ddp = Spec("bucketed_ddp", _bucketed_cases, drive=_bucketed_drive, compare=TOL,
                    rules=(bucket_rule,), forbid=FORBID)
"""``cls(module, bucket_cap_bytes)`` wraps a model; gradient hooks launch each full bucket's
all-reduce asynchronously during backward and ``finish_gradient_synchronization()`` waits
before the optimizer step; inside ``no_sync()`` the hooks launch nothing.  Tried with a
bucket per parameter, a few buckets, one bucket for everything, and two backward passes before
one synchronization, without and with ``no_sync()`` around the first (with it, still one
all-reduce per bucket per step)."""


# --------------------------------------------------------------------------------------
# gradient accumulation

KS = (2, 4)


def _accumulation_cases() -> list[Case]:
    ref = _serial()
    nb = len(expected_buckets(ACCUMULATE_CAP))
    cases = []
    for k in KS:
        cases += [Case(f"k={k}: parameters equal one process on the big batch", (k, "params"),
                       expected=ref.params),
                  Case(f"k={k}: losses equal the big batch", (k, "losses"),
                       expected=ref.losses),
                  Case(f"k={k}: all-reduces per step = buckets (communication once per step)",
                       (k, "allreduces"), expected=[nb] * STEPS)]
    return cases


def _accumulation_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                        ) -> list[Outcome]:
    fn = fns[0]
    stub = _not_done([lambda: fn(None, None, [])])
    ranks = stub or _launch(accumulate_worker, (fn, KS, spec.forbid), spec.title)
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    runs0 = dict(zip(KS, ranks[0]))
    observed = {"references": _refs(*ranks[0], *ranks[1])}
    out = []
    for c in cases:
        r = runs0[int(c.args[0])]
        if isinstance(r, Outcome):
            out += _outcomes([r], observed)
            continue
        counts = [sum(1 for m in s.get("messages", []) if m[0] == "c10d::allreduce_")
                  for s in r.steps]
        value = {"params": r.params, "losses": r.losses, "allreduces": counts}[c.args[1]]
        out += _outcomes([value], observed)
    return out


accumulation = Spec("accumulation", _accumulation_cases, drive=_accumulation_drive,
                    compare=TOL, forbid=FORBID_ACCUMULATE,
                    gives=(f"{_P}:DataParallelBucket", f"{_P}:broadcast_parameters"))
"""``fn(ddp, optimizer, micro_batches)``: one optimizer step of gradient accumulation over
``micro_batches`` (token tensors) with ``ddp.no_sync()`` on all but the last, the loss of each
scaled by 1/k; returns the step's loss.  Must equal the big batch, with one all-reduce per
bucket per step whatever k."""


# --------------------------------------------------------------------------------------
# Worker drivers: run inside ``labsim.lab.launch`` workers with the learner's functions
# shipped by value, train ``TrapNet`` (float64, so rounding cannot hide a bug) on shards of
# fixed batches and return what the checks compare with ``serial_reference``.  Replicas start
# from different seeds per rank on purpose: only a broadcast makes them equal.


def _model(rank: int) -> nn.Module:
    torch.manual_seed(INIT_SEED + rank)  # rank 0 starts like the serial reference
    return TrapNet().double()


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _spread(model: nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    return float((flat - ref).abs().max())


def _guard(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or an ``Outcome`` of the error it raised (plain: it pickles)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
        return Outcome.of_error(exc)


def _scaled_loss(model: nn.Module, tokens: torch.Tensor, k: int) -> torch.Tensor:
    return lm_loss(model, tokens) / k


def _backward(ddp: Any, loss: torch.Tensor) -> None:
    loss.backward()


def _backward_quiet(ddp: Any, loss: torch.Tensor) -> None:
    with ddp.no_sync():
        loss.backward()


def naive_worker(rank: int, world: int, sync: Callable, average: Callable,
                 forbid: Sequence[str] = ()) -> DdpRun | Outcome:
    """``sync(model)`` then SGD steps with ``average(model)`` after each backward."""
    model = _model(rank)
    refs: list[str] = []
    with watch(forbid, ops=False) as seen:
        res = _guard(sync, model)
    refs += seen.summary()["references"]
    after_sync = res if isinstance(res, Outcome) else _spread(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for b in batches():
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        with watch(forbid, ops=False) as seen:
            res = _guard(average, model)
        refs += seen.summary()["references"]
        if isinstance(res, Outcome):
            return with_references(res, refs)
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(float(loss.detach())))
    return DdpRun(losses, parameters_of(model), _spread(model), spread_after_sync=after_sync,
                  references=sorted(set(refs)))


def bucket_worker(rank: int, world: int, cls: Callable,
                  scenarios: Sequence[tuple[float, str]],
                  forbid: Sequence[str] = ()) -> list[DdpRun | Outcome]:
    """For each (cap, mode): ``cls(model, cap)``, SGD steps with one backward (``"one"``;
    two, on two halves of the shard, for ``"double"``, the first inside ``ddp.no_sync()`` for
    ``"no_sync"``) then ``finish_gradient_synchronization()`` before each optimizer step;
    each step watched."""
    out: list[DdpRun | Outcome] = []
    for cap, mode in scenarios:
        model = _model(rank)
        with watch(forbid, ops=False) as seen:
            ddp = _guard(cls, model, cap)
        refs = list(seen.summary()["references"])
        if isinstance(ddp, Outcome):
            out.append(with_references(ddp, refs))
            continue
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
        losses, steps, err = [], [], None
        for b in batches():
            parts = [shard(b, rank, world)] if mode == "one" else shard(b, rank, world).chunk(2)
            with watch(forbid) as seen:
                total = 0.0
                for j, part in enumerate(parts):
                    loss = _guard(_scaled_loss, ddp, part, len(parts))
                    err = loss if isinstance(loss, Outcome) else _guard(
                        _backward_quiet if mode == "no_sync" and j == 0 else _backward,
                        ddp, loss)
                    if isinstance(err, Outcome):
                        break
                    total += float(loss.detach())
                if not isinstance(err, Outcome):
                    err = _guard(ddp.finish_gradient_synchronization)
            summary = seen.summary()
            refs += summary.pop("references")
            steps.append({"messages": summary["messages"]})
            if isinstance(err, Outcome):
                break
            opt.step()
            opt.zero_grad()
            losses.append(total)
        if isinstance(err, Outcome):
            out.append(with_references(err, refs))
            continue
        out.append(DdpRun([_global_mean(v) for v in losses], parameters_of(model),
                          _spread(model), steps=steps, references=sorted(set(refs))))
    return out


def with_references(outcome: Outcome, refs: Sequence[str]) -> Outcome:
    """An error ``outcome`` that also carries what the watch saw (``references``)."""
    from dataclasses import replace

    seen = list(dict.fromkeys([*outcome.observed.get("references", []), *refs]))
    return replace(outcome, observed={**outcome.observed, "references": seen})


def accumulate_worker(rank: int, world: int, fn: Callable, ks: Sequence[int],
                      forbid: Sequence[str] = (), cap: float = ACCUMULATE_CAP
                      ) -> list[DdpRun | Outcome]:
    """For each ``k``: ``fn(ddp, optimizer, micro_batches)`` per step on a
    ``DataParallelBucket`` over this rank's shard cut into ``k`` micro-batches."""
    out: list[DdpRun | Outcome] = []
    for k in ks:
        ddp = DataParallelBucket(_model(rank), bucket_cap_bytes=cap)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=LR)
        losses, steps, refs, err = [], [], [], None
        for b in batches():
            with watch(forbid) as seen:
                res = _guard(fn, ddp, opt, list(shard(b, rank, world).chunk(k)))
            summary = seen.summary()
            refs += summary["references"]
            steps.append({"messages": summary["messages"]})
            value = res if isinstance(res, Outcome) else _guard(float, res)
            if isinstance(value, Outcome):
                err = value
                break
            losses.append(_global_mean(value))
        out.append(with_references(err, refs) if err is not None else DdpRun(
            losses, parameters_of(ddp.module), _spread(ddp), steps=steps,
            references=sorted(set(refs))))
    return out
