"""Checks for lab 09 (ZeRO and FSDP): a learner's ZeRO-1 Adam on 2 real gloo processes
against ``torch.optim.Adam`` in one process on the whole batch, and the ZeRO formulas
against ``labsim.training_memory`` (Rajbhandari et al. 2020)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from labsim.checks._core import Case, close, run_check
from labsim.checks.data_parallel import (
    INIT_SEED,
    _check_outcomes,
    _guard,
    _launch,
    _spread,
    _stub,
    batches,
)
from labsim.lab.memory import optimizer_state_bytes, tensor_bytes
from labsim.memory import training_memory
from labsim.parallel.data_parallel import (
    TrainingRun,
    TrapNet,
    broadcast_parameters,
    lm_loss,
    parameters_of,
    shard,
)


def sharded_adam(cls: Callable[..., Any], timeout_s: float = 120.0) -> None:
    """``cls(params, lr)`` with ``step()``, ``zero_grad()`` and ``state_tensors()``: trains
    exactly like unsharded Adam on the whole batch and holds about 1/N of Adam's state."""

    title, n = "sharded_adam", 6
    _stub(title, n, lambda: cls([], 0.1))
    ranks = _launch(title, n, zero1_worker, (cls,), timeout_s)
    ref = serial_adam()
    r0, r1 = ranks[0], ranks[1]
    err = next((r for r in (r0, r1) if isinstance(r, Exception)), None)
    # Adam keeps two moments per trainable element (the step counter is left out)
    moments = sum(v.numel() * v.element_size() for k, v in ref.params.items()
                  if "frozen" not in k) * 2
    state: Any = None
    if err is None:
        sizes = [r.state_bytes for r in ranks]
        state = next((s for s in sizes if isinstance(s, Exception)), None)
        if state is None:
            state = (sum(sizes), max(sizes) <= moments / 2 + 16)
    got: list[Any] = [err or r0.losses, err or r0.params, err or r1.spread,
                      err or r0.params["frozen.weight"], err or r1.params["unused.weight"],
                      err or state]
    exp = [ref.losses, ref.params, 0.0, ref.params["frozen.weight"],
           ref.params["unused.weight"], (moments, True)]
    names = ["losses of 3 steps equal Adam in one process on the whole batch",
             "final parameters equal unsharded Adam's",
             "both ranks hold identical parameters (the shards were all-gathered)",
             "the frozen layer is not changed",
             "the layer unused in forward is not changed",
             "Adam moments: the ranks' shares add up to the whole, each holds about half"]
    _check_outcomes(title, names, got, exp)


def zero_memory(fn: Callable[[float, int, int], float]) -> None:
    """``fn(params, dp, stage)``: bytes per GPU of model states (weights, gradients, Adam)
    in mixed precision (2 + 2 + 12 bytes per parameter) under ZeRO ``stage`` over ``dp``."""
    specs = [("ZeRO paper: 7.5B on 64 GPUs, baseline", 7.5e9, 64, 0),
             ("7.5B on 64 GPUs, P_os", 7.5e9, 64, 1),
             ("7.5B on 64 GPUs, P_os+g", 7.5e9, 64, 2),
             ("7.5B on 64 GPUs, P_os+g+p", 7.5e9, 64, 3),
             ("one GPU: no stage saves anything", 1e9, 1, 3),
             ("175B on 1024 GPUs, P_os+g+p", 175e9, 1024, 3),
             ("1.5B on 8 GPUs, P_os+g", 1.5e9, 8, 2)]
    cases = [Case(name, (p, dp, s), expected=training_memory(p, zero_stage=s, dp=dp)
                  .model_states) for name, p, dp, s in specs]
    run_check("zero_memory", fn, cases, compare=close(rtol=1e-9))


def comm_volume(fn: Callable[[float, int, int], float]) -> None:
    """``fn(params, dp, stage)``: elements each GPU sends per step for the gradient and
    parameter traffic of ZeRO ``stage`` with ring collectives over ``dp`` GPUs: all-reduce
    2(N-1)/N Psi for stages 0-2 (reduce-scatter + all-gather), 3(N-1)/N Psi for stage 3
    (parameters all-gathered in forward and again in backward, gradients reduce-scattered)."""
    specs = [("plain DP, 8 GPUs", 1e9, 8, 0), ("ZeRO-1, 8 GPUs", 1e9, 8, 1),
             ("ZeRO-2, 64 GPUs", 7.5e9, 64, 2), ("ZeRO-3, 64 GPUs", 7.5e9, 64, 3),
             ("ZeRO-3, 2 GPUs", 1e6, 2, 3), ("one GPU: nothing to send", 1e9, 1, 3)]

    def reference(p: float, n: int, s: int) -> float:
        return (3 if s == 3 else 2) * (n - 1) / n * p

    cases = [Case(name, (p, n, s), expected=reference(p, n, s)) for name, p, n, s in specs]
    run_check("comm_volume", fn, cases, compare=close(rtol=1e-9))


LR = 0.05


@dataclass(frozen=True)
class AdamRun(TrainingRun):
    """A training run with Adam: also the bytes of optimizer state this rank holds (or the error
    ``state_tensors()`` raised)."""

    state_bytes: int | Exception = 0


def serial_adam(lr: float = LR) -> AdamRun:
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
    return AdamRun(losses, parameters_of(model), state_bytes=optimizer_state_bytes(opt))


def zero1_worker(rank: int, world: int, cls: Callable[..., Any]) -> AdamRun | Exception:
    """Train with ``cls(trainable_params, lr=LR)``: ``step()`` reduces the gradients, updates
    this rank's shard and all-gathers; ``state_tensors()`` lists the Adam state held here."""
    torch.manual_seed(INIT_SEED + rank)
    model = TrapNet().double()
    broadcast_parameters(model)
    opt = _guard(cls, [p for p in model.parameters() if p.requires_grad], LR)
    if isinstance(opt, Exception):
        return opt
    losses = []
    for b in batches():
        loss = lm_loss(model, shard(b, rank, world))
        loss.backward()
        err = _guard(opt.step)
        if isinstance(err, Exception):
            return err
        _guard(opt.zero_grad)
        for p in model.parameters():
            p.grad = None
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
    state = _guard(opt.state_tensors)
    return AdamRun(losses, parameters_of(model), _spread(model),
                   state_bytes=state if isinstance(state, Exception) else tensor_bytes(state))


