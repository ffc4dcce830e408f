"""The driver of lab 10's checks: every job of a check's cases, launched once on real gloo
processes, each learner call recorded (``reference.record``: its output, its inputs'
gradients, its collectives per phase, its matmul FLOPs, the references it called) and
returned per case as plain data (``Outcome``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec
from labsim.checks._ranks import launch_ranks, rank_outcomes, stub_outcomes, unique_jobs
from labsim.checks.tensor_parallel.reference import (
    ATTENTION_SPECS,
    MLP_SPECS,
    SP_SPECS,
    TPRun,
    attention_part,
    attention_whole,
    job_call,
    job_inputs,
    mlp_part,
    mlp_whole,
    record,
    sp_part,
    sp_whole,
)
from labsim.checks.tensor_parallel.reference import Spec as Sizes

Job = tuple[str, tuple]


def sizes_of(raw: Sequence[Any]) -> Sizes | None:
    """The ``Spec`` of sizes a case's args carry as a tuple (empty for the operators)."""
    return Sizes(*raw) if raw else None


def pick(out: Any, grads: Mapping[str, Any], what: str) -> Any:
    """What a case compares of one rank's run: its output, the named gradients, or both."""
    if what == "out":
        return out
    if what == "all":
        return [out, [grads.get(k) for k in grads]]
    names = what.split(":", 1)[1].split(",")
    return [grads.get(n) for n in names]


def _probe(kind: str, fn: Any) -> None:
    """Call the exercise once without a process group: a stub raises NotImplementedError."""
    if kind in ("f", "g", "gather", "scatter"):
        fn.apply(torch.zeros(2, 1, requires_grad=True))
    elif kind == "mlp":
        fn(*mlp_part(mlp_whole(MLP_SPECS[1]), 0, 1).values())
    elif kind == "attention":
        spec = ATTENTION_SPECS[1]
        fn(*attention_part(attention_whole(spec), 0, 1).values(), spec.hidden // spec.heads)
    elif kind == "sp":
        fn(*sp_part(sp_whole(SP_SPECS[1]), 0, 1).values())
    elif kind == "ce":
        fn.apply(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 0)


def tp_worker(rank: int, world: int, fns: Sequence[Any], roles: Mapping[str, int],
              jobs: Sequence[Job], forbid: Sequence[str] = ()) -> list[dict | Outcome]:
    """Every job on this rank: the learner's function (``fns[roles[kind]]``) on this rank's
    inputs, back-propagated, recorded as plain data (or the error it raised, as an
    ``Outcome``)."""
    import torch.distributed as dist

    out: list[dict | Outcome] = []
    for kind, raw in jobs:
        sizes = sizes_of(raw)
        inputs, upstream = job_inputs(kind, sizes, rank, world)
        call = job_call(kind, sizes, rank, world, fns[roles[kind]])
        try:
            run = record(call, inputs, upstream, tuple(forbid))
        except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
            out.append(Outcome.of_error(exc))
        else:
            out.append(_plain_run(run))
        dist.barrier()
    return out


def _plain_run(run: TPRun) -> dict:
    return {"out": run.out, "grads": dict(run.grads),
            "forward": [list(c) for c in run.forward],
            "backward": [list(c) for c in run.backward],
            "flops": int(run.flops), "references": list(run.references)}


def driver(roles: Mapping[str, int], nprocs: int,
           timeout_s: float = 180.0) -> Callable[..., list[Outcome]]:
    """A driver launching every job of a check's cases once, ``roles``: kind -> which of the
    check's functions runs it."""
    def drive(fns: Sequence[Any], cases: Sequence[Case], spec: Spec) -> list[Outcome]:
        stub = stub_outcomes([lambda k=kind, i=i: _probe(k, fns[i]) for kind, i in roles.items()],
                             len(cases))
        if stub is not None:
            return stub
        jobs, index = unique_jobs(cases, lambda c: (str(c.args[0]), tuple(c.args[1])))
        ranks, failed = launch_ranks(tp_worker, nprocs, (list(fns), dict(roles), jobs,
                                                         spec.forbid), spec, len(cases),
                                     timeout_s)
        if ranks is None:
            return failed
        return rank_outcomes(ranks, index, ("forward", "backward", "flops"), lambda runs, i: [
            pick(run["out"], run["grads"], str(cases[i].args[2])) for run in runs])
    return drive


