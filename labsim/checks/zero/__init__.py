"""Checks for lab 09 (ZeRO and FSDP): a learner's ZeRO-1 optimizer (``cls(params,
optimizer_cls, **kwargs)``, wrapping any ``torch.optim`` class) on 2 real gloo processes against
the unsharded optimizer in one process on the whole batch, a learner's ZeRO-3 layer
(``zero3.py``: ``zero3_linear``) the same way, and the ZeRO formulas against
``labsim.training_memory`` (Rajbhandari et al. 2020).

Two optimizers are tried: Adam, and AdamW with weight decay over two parameter groups with
their own learning rates; in the second step one block gets no gradient (as a layer a step did
not use), which ``torch.optim`` skips -- a sharded optimizer that treats it as a zero gradient
keeps it moving on Adam's momentum and fails.  ZeRO-1 must be seen to shard: in ``step()`` the
recorder must see the gradients reduce-scattered (no all-reduce larger than one shard), and
the optimizer may keep between steps at most about half of the parameters' bytes in state on
either rank -- measured from the tensors its own code created that are still alive, not from
what it says it holds.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
from labsim.checks.zero.zero3 import REDUCE_SCATTER, zero3_linear
from labsim.collectives.bandwidth import sent_factor
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
FORBID_ZERO = (*FORBID, "labsim.parallel.zero:ShardedOptimizer",
               "torch.distributed.optim.zero_redundancy_optimizer:ZeroRedundancyOptimizer")
FORBID_FORMULA = ("labsim.memory:*",)


@dataclass(frozen=True)
class AdamRun(TrainingRun):
    """A training run with a learner's ZeRO-1 optimizer: also the bytes of tensors the optimizer
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


CONFIGS = ("Adam", "AdamW, weight decay 0.1, two parameter groups")
DROPPED_STEP = 1  # in this step (0-based) the second block gets no gradient


def optimizer_args(config: str, model: nn.Module) -> tuple[list[Any], type, dict[str, Any]]:
    """(params or parameter groups, optimizer class, keyword arguments) of ``config``."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if config == CONFIGS[0]:
        return [p for _, p in trainable], torch.optim.Adam, {"lr": LR}
    blocks = [p for n, p in trainable if n.startswith("blocks.")]
    rest = [p for n, p in trainable if not n.startswith("blocks.")]
    return ([{"params": blocks, "lr": 2 * LR}, {"params": rest}], torch.optim.AdamW,
            {"lr": LR, "weight_decay": 0.1})


def _drop_unused(model: nn.Module, step: int) -> None:
    """The second block was not used in step ``DROPPED_STEP``: no gradient, on every rank."""
    if step == DROPPED_STEP:
        for p in model.blocks[1].parameters():
            p.grad = None


def serial_run(config: str) -> TrainingRun:
    """One process, whole batches, the unsharded optimizer of ``config``: the oracle."""
    torch.manual_seed(INIT_SEED)
    model = TrapNet().double()
    params, cls, kwargs = optimizer_args(config, model)
    opt = cls(params, **kwargs)
    losses = []
    for i, b in enumerate(batches()):
        loss = lm_loss(model, b)
        loss.backward()
        _drop_unused(model, i)
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


def _sharded_cases() -> list[Case]:
    cases = []
    for c, config in enumerate(CONFIGS):
        ref = serial_run(config)
        cases += [Case(f"{config}: losses of 3 steps equal the unsharded optimizer on the "
                       "whole batch", (c, "losses"), expected=ref.losses),
                  Case(f"{config}: final parameters equal the unsharded optimizer's (a block "
                       "without a gradient in step 2 left alone)", (c, "params"),
                       expected=ref.params),
                  Case(f"{config}: both ranks hold identical parameters (all-gathered)",
                       (c, "spread"), expected=0.0)]
    ref = serial_run(CONFIGS[0])
    cases += [Case("the frozen layer is not changed", (0, "frozen"),
                   expected=ref.params["frozen.weight"]),
              Case("the layer unused in forward is not changed", (0, "unused"),
                   expected=ref.params["unused.weight"]),
              Case("the optimizer holds about 1/N of Adam's state (measured)", (0, "held"),
                   expected=held_limit(), compare=_at_most)]
    return cases


def _pick(what: str, r0: AdamRun, r1: AdamRun) -> Any:
    """The value case ``what`` compares, from the two ranks' runs of one optimizer."""
    if what == "held":
        return max(r0.held_bytes, r1.held_bytes)
    return {"losses": r0.losses, "params": r0.params, "spread": r1.spread,
            "frozen": r0.params["frozen.weight"], "unused": r1.params["unused.weight"]}[what]


def _sharded_drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
                   ) -> list[Outcome]:
    cls = fns[0]
    stub = _not_done([lambda: cls([], torch.optim.Adam, lr=0.1),
                      lambda: cls.step(object.__new__(cls))])  # a stub step raises at once
    ranks = stub or _launch(zero1_worker, (cls, spec.forbid), spec.title)
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    runs0, runs1 = ranks
    runs = [*runs0, *runs1]
    observed = {"references": _refs(*runs),
                "steps": [r.steps if isinstance(r, AdamRun) else [] for r in runs]}
    out = []
    for case in cases:
        c, what = int(case.args[0]), case.args[1]
        r0, r1 = runs0[c], runs1[c]
        bad = next((r for r in (r0, r1) if isinstance(r, Outcome)), None)
        value: Any = bad if bad is not None else _pick(what, r0, r1)
        out += _outcomes([value], observed)
    return out


def sent_bytes(messages: Sequence[Sequence[Any]], world: int) -> float:
    """Bytes one rank sends for the recorded ``c10d`` calls, each priced as its bandwidth-
    optimal ring or chain moves it, on average over the ranks: an all-reduce of S bytes
    2(N-1)/N S; a reduce-scatter (S its input), an all-gather (S its output), a broadcast or a
    reduce (each rank but one passes S on) (N-1)/N S; a send S; receives and barriers nothing.
    So broadcasting each shard from its owner (``ZeroRedundancyOptimizer``'s way) costs what
    one all-gather does."""
    total = 0.0
    for m in messages:
        op, out_bytes, in_bytes = m[0], m[1], m[2]
        factor = sent_factor(op, world)  # labsim.collectives.bandwidth: the ring's share
        if factor is not None:
            total += factor * (in_bytes if op in REDUCE_SCATTER else out_bytes)
    return total


def reduce_scatter_rule(case: Case, out: Outcome, world: int = 2) -> str | None:
    """Gradients are reduce-scattered in ``step()`` -- the reduce-scatters carry at least the
    gradients' bytes, no all-reduce carries more than a shard -- and each rank sends no more
    per step than ZeRO-1 needs: 2 (N-1)/N Psi (a reduce-scatter of the gradients and an
    all-gather of the parameters, Rajbhandari et al. 2020 section 7.1), plus 5 % and a page
    for padding."""
    psi = trainable_bytes()
    shard_bytes = math.ceil(psi / world)
    limit = 2 * (world - 1) / world * psi * 1.05 + SLACK_BYTES
    for run, steps in enumerate(out.observed.get("steps", [])):
        rank = run // len(CONFIGS)
        for i, seen in enumerate(steps):
            msgs = seen.get("messages", [])
            big = [m[1] for m in msgs if m[0] == "c10d::allreduce_" and m[1] > shard_bytes]
            if big:
                return (f"rank {rank}, step {i + 1}: an all-reduce of {big[0]} bytes; ZeRO-1 "
                        "reduce-scatters the gradients (each rank receives only its shard)")
            scattered = sum(m[2] for m in msgs if m[0] in REDUCE_SCATTER)
            grads = seen.get("grad_bytes", psi)
            if scattered < grads:
                return (f"rank {rank}, step {i + 1}: reduce-scatters of {scattered} bytes for "
                        f"{grads} bytes of gradients; ZeRO-1 reduce-scatters the gradients "
                        "themselves (dist.reduce_scatter_tensor), so each rank receives only "
                        "the sum of its shard")
            sent = sent_bytes(msgs, world)
            if sent > limit:
                return (f"rank {rank}, step {i + 1}: sent {sent:,.0f} bytes, {sent / psi:.2f} "
                        f"x the parameters' {psi:,} bytes; ZeRO-1 sends 2(N-1)/N of them "
                        f"({2 * (world - 1) / world * psi:,.0f} bytes on {world} ranks): one "
                        "reduce-scatter of the gradients and one all-gather of the parameters")
    return None


sharded_optimizer = Spec("sharded_optimizer", _sharded_cases, drive=_sharded_drive,
                         compare=close(rtol=1e-9, atol=1e-12), rules=(reduce_scatter_rule,),
                         forbid=FORBID_ZERO,
                         gives=("labsim.parallel.data_parallel:broadcast_parameters",))
"""``cls(params, optimizer_cls, **kwargs)`` (params: parameters or parameter groups) with
``step()`` and ``zero_grad()``: trains exactly like ``optimizer_cls`` unsharded on the whole
batch, reduce-scatters the gradients and holds about 1/N of the optimizer's state."""


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


def zero_comm_volume(params: float, dp: int, stage: int, micro_batches: int = 1) -> float:
    """Elements each GPU sends per optimizer step on rings over ``dp`` GPUs, ``micro_batches``
    accumulated per step, gradients never kept unsharded: stages 0-1 accumulate locally and
    communicate once, 2 (N-1)/N Psi (an all-reduce, or a reduce-scatter + an all-gather);
    stage 2 keeps only a gradient shard, so every micro-batch's gradient is reduce-scattered,
    (k + 1) (N-1)/N Psi; stage 3 also gathers every layer for each micro-batch's forward and
    backward, 3 k (N-1)/N Psi (Rajbhandari et al. 2020, section 7; PyTorch FSDP2's
    ``set_requires_gradient_sync``: skipping the reduction means unsharded gradients)."""
    ring = (dp - 1) / dp * params
    k = micro_batches
    return {0: 2 * ring, 1: 2 * ring, 2: (k + 1) * ring, 3: 3 * k * ring}[stage]


def _comm_volume_cases() -> list[Case]:
    specs = [("plain DP, 8 GPUs", 1e9, 8, 0, 1), ("ZeRO-1, 8 GPUs", 1e9, 8, 1, 1),
             ("ZeRO-2, 64 GPUs", 7.5e9, 64, 2, 1), ("ZeRO-3, 64 GPUs", 7.5e9, 64, 3, 1),
             ("ZeRO-3, 2 GPUs", 1e6, 2, 3, 1), ("one GPU: nothing to send", 1e9, 1, 3, 4),
             ("plain DP, 8 micro-batches: still one all-reduce", 1e9, 8, 0, 8),
             ("ZeRO-1, 4 micro-batches", 1e9, 8, 1, 4),
             ("ZeRO-2, 4 micro-batches: a reduce-scatter per micro-batch", 1e9, 8, 2, 4),
             ("ZeRO-3, 4 micro-batches: gathers and reduce-scatter per micro-batch",
              7.5e9, 64, 3, 4)]
    return [Case(name, (p, n, s, k), expected=zero_comm_volume(p, n, s, k))
            for name, p, n, s, k in specs]


comm_volume = Spec("comm_volume", _comm_volume_cases, compare=close(rtol=1e-9), ops=False,
                   forbid=("labsim.checks.zero:zero_comm_volume",))
"""``fn(params, dp, stage, micro_batches)``: elements each GPU sends per optimizer step for
the gradient and parameter traffic of ZeRO ``stage`` with ring collectives over ``dp`` GPUs
and ``micro_batches`` accumulated per step (see ``zero_comm_volume``)."""


def zero1_worker(rank: int, world: int, cls: Callable[..., Any],
                 forbid: Sequence[str] = ()) -> list[AdamRun | Outcome]:
    """One run per entry of ``CONFIGS`` (see ``zero1_run``)."""
    return [zero1_run(rank, world, cls, config, forbid) for config in CONFIGS]


def zero1_run(rank: int, world: int, cls: Callable[..., Any], config: str,
              forbid: Sequence[str] = ()) -> AdamRun | Outcome:
    """Train with ``cls(params, optimizer_cls, **kwargs)`` of ``config``: ``step()`` reduces
    the gradients, updates what this rank owns and all-gathers.  Every tensor the optimizer's
    code creates is noted; those created before the last step and still alive at the end
    (parameters and gradients aside) are what it holds."""
    torch.manual_seed(INIT_SEED + rank)
    model = TrapNet().double()
    broadcast_parameters(model)
    params, optimizer_cls, kwargs = optimizer_args(config, model)
    refs: list[str] = []
    logs = []
    with watch(forbid, keep_created=True) as seen:
        opt = _guard(lambda: cls(params, optimizer_cls, **kwargs))
    refs += seen.summary()["references"]
    logs.append(seen.log)
    if isinstance(opt, Outcome):
        return opt
    losses, steps = [], []
    last = len(batches()) - 1
    for i, b in enumerate(batches()):
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        _drop_unused(model, i)
        grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                         if p.grad is not None)
        with watch(forbid, keep_created=True) as seen:
            err = _guard(opt.step)
            if not isinstance(err, Outcome):
                err = _guard(opt.zero_grad)
        summary = seen.summary()
        refs += summary["references"]
        steps.append({"messages": summary["messages"], "grad_bytes": grad_bytes})
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
                   held_bytes=merged.settled_held_bytes(params), steps=steps,
                   references=sorted(set(refs)))
