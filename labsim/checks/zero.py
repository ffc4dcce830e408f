"""Checks for lab 09 (ZeRO and FSDP): a learner's ZeRO-1 Adam on 2 real gloo processes
against ``torch.optim.Adam`` in one process on the whole batch, and the ZeRO formulas against
``labsim.training_memory`` (Rajbhandari et al. 2020).

ZeRO-1 must be seen to shard: in ``step()`` the recorder must see the gradients
reduce-scattered (no all-reduce larger than one shard), and the optimizer may keep between
steps at most a shard of the parameters and its two Adam moments -- measured from the tensors
its own code created that are still alive, not from what it says it holds.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from labsim.checks._core import Case, Outcome, Spec, close
from labsim.checks._observe import watch
from labsim.checks.data_parallel import (
    FORBID,
    INIT_SEED,
    _guard,
    _launch,
    _not_done,
    _outcomes,
    _refs,
    _spread,
    batches,
)
from labsim.lab.profile import OpLog
from labsim.memory import training_memory
from labsim.parallel.data_parallel import (
    TrainingRun,
    TrapNet,
    broadcast_parameters,
    lm_loss,
    parameters_of,
    shard,
)

LR = 0.05
SLACK_BYTES = 4096
REDUCE_SCATTER = ("c10d::reduce_scatter_", "c10d::_reduce_scatter_base_",
                  "c10d::reduce_scatter_tensor_coalesced_")
FORBID_ZERO = (*FORBID, "labsim.parallel.zero:ZeroAdam",
               "torch.distributed.optim.zero_redundancy_optimizer:ZeroRedundancyOptimizer")
FORBID_FORMULA = ("labsim.memory:*",)


@dataclass(frozen=True)
class AdamRun(TrainingRun):
    """A training run with a learner's ZeRO-1 Adam: also the bytes of tensors the optimizer
    created and still holds after the last step (``held_bytes``), what the recorder saw in each
    ``step()`` (``steps``) and the references the tripwire caught."""

    held_bytes: int = 0
    steps: list[dict] = field(default_factory=list)
    references: list[str] = field(default_factory=list)


def trainable_bytes() -> int:
    """Bytes of TrapNet's trainable parameters (float64)."""
    return sum(p.numel() * p.element_size() for p in TrapNet().double().parameters()
               if p.requires_grad)


def held_limit(world: int = 2) -> int:
    """What ZeRO-1 may keep between steps: a 1/N shard of the parameters and its two Adam
    moments, 3/N of the parameters' bytes (plus a little for step counters)."""
    return math.ceil(3 * trainable_bytes() / world) + SLACK_BYTES


def serial_adam(lr: float = LR) -> TrainingRun:
    """One process, whole batches, ``torch.optim.Adam``: the oracle of the ZeRO-1 check."""
    torch.manual_seed(INIT_SEED)
    model = TrapNet().double()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for b in batches():
        loss = lm_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return TrainingRun(losses, parameters_of(model))


def _at_most(got: Any, limit: Any) -> str | None:
    if isinstance(got, bool) or not isinstance(got, int):
        return f"expected a number of bytes, got {type(got).__name__}"
    if got > limit:
        return (f"the optimizer keeps {got} bytes of tensors between steps; ZeRO-1 keeps at "
                f"most {limit} (a 1/N shard and its two moments): the whole Adam state is "
                "not sharded")
    return None


def _sharded_adam_cases() -> list[Case]:
    ref = serial_adam()
    names = ["losses of 3 steps equal Adam in one process on the whole batch",
             "final parameters equal unsharded Adam's",
             "both ranks hold identical parameters (the shards were all-gathered)",
             "the frozen layer is not changed",
             "the layer unused in forward is not changed"]
    exp = [ref.losses, ref.params, 0.0, ref.params["frozen.weight"],
           ref.params["unused.weight"]]
    cases = [Case(n, (i,), expected=e) for i, (n, e) in enumerate(zip(names, exp))]
    cases.append(Case("the optimizer holds about 1/N of Adam's state (measured)", (5,),
                      expected=held_limit(), compare=_at_most))
    return cases


def _sharded_adam_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                        ) -> list[Outcome]:
    cls = fns[0]
    stub = _not_done([lambda: cls([], 0.1)])
    ranks = stub or _launch(zero1_worker, (cls, spec.forbid))
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    r0, r1 = ranks
    bad = next((r for r in (r0, r1) if isinstance(r, Outcome)), None)
    observed = {"references": _refs(r0, r1),
                "steps": [r.steps if isinstance(r, AdamRun) else [] for r in (r0, r1)]}
    if bad is not None:
        return _outcomes([bad] * len(cases), observed)
    values = [r0.losses, r0.params, r1.spread, r0.params["frozen.weight"],
              r1.params["unused.weight"], max(r0.held_bytes, r1.held_bytes)]
    return _outcomes([values[int(c.args[0])] for c in cases], observed)


def reduce_scatter_rule(case: Case, out: Outcome) -> str | None:
    """Gradients are reduce-scattered in ``step()``; no all-reduce carries more than a shard."""
    shard_bytes = math.ceil(trainable_bytes() / 2)
    for rank, steps in enumerate(out.observed.get("steps", [])):
        for i, seen in enumerate(steps):
            msgs = seen.get("messages", [])
            big = [m[1] for m in msgs if m[0] == "c10d::allreduce_" and m[1] > shard_bytes]
            if big:
                return (f"rank {rank}, step {i + 1}: an all-reduce of {big[0]} bytes; ZeRO-1 "
                        "reduce-scatters the gradients (each rank receives only its shard)")
            if not any(m[0] in REDUCE_SCATTER for m in msgs):
                return (f"rank {rank}, step {i + 1}: no reduce-scatter; ZeRO-1 reduce-scatters "
                        "the gradients (dist.reduce_scatter_tensor)")
    return None


sharded_adam = Spec("sharded_adam", _sharded_adam_cases, drive=_sharded_adam_drive,
                    compare=close(rtol=1e-9, atol=1e-12), rules=(reduce_scatter_rule,),
                    forbid=FORBID_ZERO)
"""``cls(params, lr)`` with ``step()`` and ``zero_grad()``: trains exactly like unsharded
Adam on the whole batch, reduce-scatters the gradients and holds about 1/N of Adam's state."""


def _zero_memory_cases() -> list[Case]:
    specs = [("ZeRO paper: 7.5B on 64 GPUs, baseline", 7.5e9, 64, 0),
             ("7.5B on 64 GPUs, P_os", 7.5e9, 64, 1),
             ("7.5B on 64 GPUs, P_os+g", 7.5e9, 64, 2),
             ("7.5B on 64 GPUs, P_os+g+p", 7.5e9, 64, 3),
             ("one GPU: no stage saves anything", 1e9, 1, 3),
             ("175B on 1024 GPUs, P_os+g+p", 175e9, 1024, 3),
             ("1.5B on 8 GPUs, P_os+g", 1.5e9, 8, 2)]
    return [Case(name, (p, dp, s), expected=training_memory(p, zero_stage=s, dp=dp)
                 .model_states) for name, p, dp, s in specs]


zero_memory = Spec("zero_memory", _zero_memory_cases, compare=close(rtol=1e-9),
                   forbid=FORBID_FORMULA, ops=False)
"""``fn(params, dp, stage)``: bytes per GPU of model states (weights, gradients, Adam) in
mixed precision (2 + 2 + 12 bytes per parameter) under ZeRO ``stage`` over ``dp``."""


def _comm_volume_cases() -> list[Case]:
    specs = [("plain DP, 8 GPUs", 1e9, 8, 0), ("ZeRO-1, 8 GPUs", 1e9, 8, 1),
             ("ZeRO-2, 64 GPUs", 7.5e9, 64, 2), ("ZeRO-3, 64 GPUs", 7.5e9, 64, 3),
             ("ZeRO-3, 2 GPUs", 1e6, 2, 3), ("one GPU: nothing to send", 1e9, 1, 3)]
    return [Case(name, (p, n, s), expected=(3 if s == 3 else 2) * (n - 1) / n * p)
            for name, p, n, s in specs]


comm_volume = Spec("comm_volume", _comm_volume_cases, compare=close(rtol=1e-9), ops=False)
"""``fn(params, dp, stage)``: elements each GPU sends per step for the gradient and
parameter traffic of ZeRO ``stage`` with ring collectives over ``dp`` GPUs: all-reduce
2(N-1)/N Psi for stages 0-2 (reduce-scatter + all-gather), 3(N-1)/N Psi for stage 3
(parameters all-gathered in forward and again in backward, gradients reduce-scattered)."""


def zero1_worker(rank: int, world: int, cls: Callable[..., Any],
                 forbid: Sequence[str] = ()) -> AdamRun | Outcome:
    """Train with ``cls(trainable_params, lr=LR)``: ``step()`` reduces the gradients, updates
    this rank's shard and all-gathers.  Every tensor the optimizer's code creates is noted;
    those created before the last step and still alive at the end (parameters and gradients
    aside) are what it holds."""
    torch.manual_seed(INIT_SEED + rank)
    model = TrapNet().double()
    broadcast_parameters(model)
    refs: list[str] = []
    logs = []
    with watch(forbid, keep_created=True) as seen:
        opt = _guard(cls, [p for p in model.parameters() if p.requires_grad], LR)
    refs += seen.summary()["references"]
    logs.append(seen.log)
    if isinstance(opt, Outcome):
        return opt
    losses, steps = [], []
    last = len(batches()) - 1
    for i, b in enumerate(batches()):
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        with watch(forbid, keep_created=True) as seen:
            err = _guard(opt.step)
            if not isinstance(err, Outcome):
                err = _guard(opt.zero_grad)
        summary = seen.summary()
        refs += summary["references"]
        steps.append({"messages": summary["messages"]})
        if i < last:
            logs.append(seen.log)
        if isinstance(err, Outcome):
            return err
        for p in model.parameters():
            p.grad = None
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    gc.collect()
    params = list(model.parameters())
    merged = OpLog(keep_created=True)
    for log in logs:
        merged.created.extend(log.created)
    return AdamRun(losses, parameters_of(model), _spread(model),
                   held_bytes=merged.held_bytes(params), steps=steps,
                   references=sorted(set(refs)))
