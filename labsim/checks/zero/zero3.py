"""Check of lab 09's ZeRO-3 layer: a learner's ``cls(linear)`` -- a module keeping only this
rank's flat shard of an ``nn.Linear``'s weight and bias -- trained on 2 real gloo processes
against the unsharded model in one process on the whole batch (Rajbhandari et al. 2020,
P_os+g+p).

The contract fixes the layout so the check can read the shards back: the layer's only
parameter is rank r's slice ``[r s, (r + 1) s)`` of ``cat(weight.flatten(), bias)``
zero-padded to ``N s`` elements, ``s = ceil(numel / N)``; after backward its ``.grad`` is that
slice of the gradient averaged over the ranks (as data parallelism averages).  A 3-layer
float64 MLP (one layer with an odd element count, so padding matters) takes 3 plain SGD steps
on half of each batch per rank.

Besides the values, the rules hold the layer to ZeRO-3's memory and traffic, measured rather
than declared:

- between steps each rank keeps only its shards: the parameters' storage is the shards' size,
  the tensors its code created are freed (parameters aside), and the ``nn.Linear`` it was given
  is not kept alive;
- from forward to backward no gathered weight stays alive (tensors created in the layer's
  forward, its output aside): the weight is gathered again in backward, not saved;
- its collectives are all-gathers and reduce-scatters only (no all-reduce): a gather in
  forward, another in backward, a reduce-scatter of the gradient in backward -- 3 Psi elements
  of whole tensors per step, (N-1)/N of which a ring sends per rank.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from labsim.checks._core import Case, Outcome, Spec, close
from labsim.checks._observe import watch
from labsim.checks.data_parallel import NPROCS, _guard, _launch, _not_done, _outcomes
from labsim.lab.profile import OpLog

SIZES = ((15, 32), (32, 31), (31, 5))  # (in, out) of each Linear; 32 * 31 + 31 is odd
BATCH, STEPS, LR, SEED = 8, 3, 0.1, 2024
SLACK_BYTES = 1024  # below the smallest layer's full weight and bias (1280 bytes)
ALL_GATHER = ("c10d::_allgather_base_", "c10d::allgather_",
              "c10d::allgather_into_tensor_coalesced_")
REDUCE_SCATTER = ("c10d::reduce_scatter_", "c10d::_reduce_scatter_base_",
                  "c10d::reduce_scatter_tensor_coalesced_")
FORBID_ZERO3 = tuple(f"labsim.parallel.zero:{n}" for n in (
    "Zero3Linear", "_GatheredLinear", "_gather_layer", "zero3_wrap", "fsdp_wrap",
    "ShardedOptimizer")) + ("torch.distributed.fsdp:fully_shard",)


def layer_numels() -> list[int]:
    """Elements of each layer's weight and bias."""
    return [i * o + o for i, o in SIZES]


def shard_numel(numel: int, world: int = NPROCS) -> int:
    """Elements of one rank's shard: ``ceil(numel / world)`` (the last one zero-padded)."""
    return -(-numel // world)


def step_traffic_bytes(world: int = NPROCS) -> float:
    """Bytes a ring sends per rank in one ZeRO-3 step of the check's model: (N-1)/N of each
    whole tensor, for a gather in forward, a gather in backward and a reduce-scatter."""
    padded = sum(world * shard_numel(n, world) for n in layer_numels()) * 8  # float64
    return 3 * (world - 1) / world * padded


@dataclass(frozen=True)
class Zero3Run:
    """One rank's run: each step's loss (averaged over ranks); every layer's flat weight and
    bias gathered from the shards after the last step (``flats``) and its gradient after the
    first backward (``grads0``); the parameter sizes of each layer; and what was measured
    (``observed``: held bytes, collectives per step, references the tripwire caught)."""

    losses: list[float]
    flats: list[torch.Tensor]
    grads0: list[torch.Tensor]
    shards: list[list[int]]
    observed: dict[str, Any] = field(default_factory=dict)


def _full_model() -> nn.Sequential:
    torch.manual_seed(SEED)
    mods: list[nn.Module] = []
    for i, (a, b) in enumerate(SIZES):
        mods += [nn.Linear(a, b)] + ([nn.Tanh()] if i < len(SIZES) - 1 else [])
    return nn.Sequential(*mods).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (inputs, targets) global batches of every step."""
    g = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(BATCH, SIZES[0][0], generator=g, dtype=torch.float64),
             torch.randn(BATCH, SIZES[-1][1], generator=g, dtype=torch.float64))
            for _ in range(STEPS)]


def _flat(linear: nn.Linear, grad: bool = False) -> torch.Tensor:
    w, b = (linear.weight.grad, linear.bias.grad) if grad else (linear.weight, linear.bias)
    assert w is not None and b is not None
    return torch.cat([w.detach().reshape(-1), b.detach()])


def serial_run() -> dict[str, Any]:
    """One process, whole batches, plain SGD on the unsharded model: the oracle."""
    model = _full_model()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads0 = [], []
    for i, (x, y) in enumerate(batches()):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if i == 0:
            grads0 = [_flat(m, grad=True) for m in linears]
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "flats": [_flat(m) for m in linears], "grads0": grads0}


def _cases() -> list[Case]:
    ref = serial_run()
    cases = [Case("losses of 3 SGD steps equal one process on the whole batch", ("losses",),
                  expected=ref["losses"])]
    for i, (a, b) in enumerate(SIZES):
        cases.append(Case(f"layer {i + 1} ({a} -> {b}): weight and bias gathered from the "
                          "shards equal the unsharded run", ("flat", i), expected=ref["flats"][i]))
    cases += [Case("after the first backward, the shards' gradients make the whole batch's",
                   ("grads0",), expected=ref["grads0"]),
              Case("each rank's parameters are its 1/N flat shards (padded)", ("shards",),
                   expected=[[shard_numel(n)] for n in layer_numels()]),
              Case("bytes sent per rank per step: gathers forward and backward, a "
                   "reduce-scatter (3 Psi)", ("sent",),
                   expected=[step_traffic_bytes()] * STEPS)]
    return cases


def sent_per_step(steps: Sequence[dict]) -> list[float]:
    """Bytes a ring sends per rank in each step of ``steps`` (recorded messages)."""
    out = []
    for seen in steps:
        total = 0
        for m in [*seen["forward"], *seen["backward"]]:
            total += m[1] if m[0] in ALL_GATHER else m[2] if m[0] in REDUCE_SCATTER else 0
        out.append((NPROCS - 1) / NPROCS * total)
    return out


def _drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
           ) -> list[Outcome]:
    cls = fns[0]
    stub = _not_done([lambda: cls(nn.Linear(2, 2))])
    ranks = stub or _launch(zero3_worker, (cls, spec.forbid), spec.title)
    if isinstance(ranks, Outcome):
        return [ranks] * len(cases)
    bad = next((r for r in ranks if isinstance(r, Outcome)), None)
    if bad is not None:
        return _outcomes([bad] * len(cases), {})
    r0, r1 = ranks
    observed = {"runs": [r0.observed, r1.observed],
                "references": sorted({*r0.observed["references"],
                                      *r1.observed["references"]})}
    shards = r0.shards if r0.shards == r1.shards else [r0.shards, r1.shards]
    by_what = {"losses": r0.losses, "grads0": r0.grads0, "shards": shards,
               "sent": sent_per_step(r0.observed["steps"])}
    return _outcomes([r0.flats[int(c.args[1])] if c.args[0] == "flat" else by_what[c.args[0]]
                      for c in cases], observed)


def _memory_reason(run: dict, rank: int) -> str | None:
    limit = sum(shard_numel(n) for n in layer_numels()) * 8
    if run["originals_alive"]:
        return (f"rank {rank} keeps the nn.Linear it was given (its full weight) alive; keep "
                "only this rank's shard")
    if run["param_storage"] > limit:
        return (f"rank {rank}: the parameters' storage holds {run['param_storage']} bytes, "
                f"the shards {limit}: keep only the shard (a slice of a full tensor keeps "
                "the whole storage alive: clone it)")
    if run["held_between"] > SLACK_BYTES:
        return (f"rank {rank} keeps {run['held_between']} bytes of tensors it created between "
                "steps; ZeRO-3 keeps only its shards there (free the gathered weights)")
    if max(run["held_forward"]) > SLACK_BYTES:
        return (f"rank {rank} keeps {max(run['held_forward'])} bytes from forward to "
                "backward: ZeRO-3 frees each gathered weight after forward and gathers it "
                "again in backward, it does not save it")
    return None


def _traffic_reason(run: dict, rank: int) -> str | None:
    for i, seen in enumerate(run["steps"]):
        where = f"rank {rank}, step {i + 1}"
        for phase in ("forward", "backward"):
            other = [m for m in seen[phase] if m[0] not in (*ALL_GATHER, *REDUCE_SCATTER)]
            if other:
                op, nbytes = other[0][0], max(other[0][1], other[0][2])
                also = (" ZeRO-3 reduce-scatters each layer's gradient, each rank receiving "
                        "only its shard" if op == "c10d::allreduce_" else "")
                return (f"{where}: {op.removeprefix('c10d::')} of {nbytes} bytes in {phase}; "
                        "only all-gathers and reduce-scatters are ZeRO-3's." + also)
        if not any(m[0] in ALL_GATHER for m in seen["forward"]):
            return f"{where}: no all-gather in forward (each layer gathers its weight)"
        if not any(m[0] in ALL_GATHER for m in seen["backward"]):
            return (f"{where}: no all-gather in backward; ZeRO-3 gathers each layer again for "
                    "its backward")
        if not any(m[0] in REDUCE_SCATTER for m in seen["backward"]):
            return (f"{where}: no reduce-scatter in backward (dist.reduce_scatter_tensor of "
                    "each layer's gradient)")
    return None


def zero3_rule(case: Case, out: Outcome) -> str | None:
    """Memory first (shards only between steps, nothing gathered kept for backward), then
    traffic (gathers forward and backward, a reduce-scatter, no all-reduce)."""
    runs = out.observed.get("runs", [])
    for why in (_memory_reason, _traffic_reason):
        for rank, run in enumerate(runs):
            reason = why(run, rank)
            if reason is not None:
                return reason
    return None


zero3_linear = Spec("zero3_linear", _cases, drive=_drive, compare=close(rtol=1e-9, atol=1e-12),
                    rules=(zero3_rule,), forbid=FORBID_ZERO3)
"""``cls(linear)``: a module holding this rank's flat shard of ``linear``'s weight and bias
(see the module doc); its forward all-gathers the layer, frees it, gathers it again in
backward and reduce-scatters the gradient, so N ranks on N shards of a batch train like the
unsharded model in one process on the whole batch."""


# --------------------------------------------------------------------------------------
# The worker: runs in ``labsim.lab.launch`` processes with the learner's class by value.


def _gather_flat(tensors: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
    """Every rank's ``tensors`` flattened, concatenated in rank order, cut to ``numel``."""
    mine = torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return torch.cat(parts)[:numel].to(torch.float64)


def settled_held(log: OpLog, exclude: Sequence[torch.Tensor], polls: int = 50,
                 wait_s: float = 0.01) -> int:
    """``log.held_bytes(exclude)`` once what is only briefly alive has died
    (``OpLog.settled_held_bytes``), polled until it is within ``SLACK_BYTES``: what a layer
    really keeps stays."""
    return log.settled_held_bytes(exclude, polls=polls, wait_s=wait_s, enough=SLACK_BYTES)


def _build(cls: Callable[..., Any], forbid: Sequence[str]
           ) -> tuple[Any, list[Any], OpLog, list[str]]:
    """The learner's layers around the full model's Linears (equal on every rank), Tanh
    between them; weak references to the Linears' storages (which must die)."""
    full = _full_model()
    linears = [m for m in full if isinstance(m, nn.Linear)]
    originals = [StorageWeakRef(t.untyped_storage()) for m in linears
                 for t in (m.weight, m.bias)]
    with watch(forbid, keep_created=True) as seen:
        layers = [_guard(cls, m) for m in linears]
    refs = seen.summary()["references"]
    bad = next((x for x in layers if isinstance(x, Outcome)), None)
    if bad is not None:
        return bad, originals, seen.log, refs
    mods: list[Any] = []
    for i, layer in enumerate(layers):
        mods += [layer] + ([nn.Tanh()] if i < len(layers) - 1 else [])
    return _guard(nn.Sequential, *mods), originals, seen.log, refs


def zero3_worker(rank: int, world: int, cls: Callable[..., Any],
                 forbid: Sequence[str] = ()) -> Zero3Run | Outcome:
    """3 SGD steps with the learner's layers on this rank's half of each batch; every call of
    the learner's code watched (see the module doc)."""
    model, originals, log, refs = _build(cls, forbid)
    if isinstance(model, Outcome):
        return model
    layers = [m for m in model if not isinstance(m, nn.Tanh)]
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    logs, steps, held_forward, losses = [log], [], [], []
    grads0: list[torch.Tensor] = []
    half = BATCH // world
    for i, (x, y) in enumerate(batches()):
        h, ys = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        outs, forward, fwd_log = [], [], OpLog(keep_created=True)
        for m in model:
            if isinstance(m, nn.Tanh):
                h = m(h)
                continue
            with watch(forbid, keep_created=True) as seen:
                h = _guard(m, h)
            refs += seen.summary()["references"]
            if isinstance(h, Outcome):
                return h
            forward += seen.summary()["messages"]
            assert fwd_log.created is not None and seen.log.created is not None
            fwd_log.created.extend(seen.log.created)
            outs.append(h)
        loss = F.mse_loss(h, ys)
        held_forward.append(settled_held(fwd_log, [*params, *outs]))
        del outs
        with watch(forbid, keep_created=True) as seen:
            err = _guard(loss.backward)
        refs += seen.summary()["references"]
        if isinstance(err, Outcome):
            return err
        steps.append({"forward": forward, "backward": seen.summary()["messages"]})
        logs += [fwd_log, seen.log]
        if i == 0:
            grads0 = [_gather_flat([p.grad for p in m.parameters() if p.grad is not None], n)
                      for m, n in zip(layers, layer_numels())]
        opt.step()
        opt.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1).clone()
        dist.all_reduce(t)
        losses.append(float(t) / world)
        del h, loss
    gc.collect()  # module objects of the given Linears may sit in reference cycles
    merged = OpLog(keep_created=True)
    for lg in logs:
        assert merged.created is not None and lg.created is not None
        merged.created.extend(lg.created)
    observed = {"held_between": settled_held(merged, params), "held_forward": held_forward,
                "param_storage": sum(p.untyped_storage().nbytes() for p in params),
                "originals_alive": sum(not r.expired() for r in originals),
                "steps": steps, "references": sorted(set(refs))}
    flats = [_gather_flat(list(m.parameters()), n) for m, n in zip(layers, layer_numels())]
    shards = [[p.numel() for p in m.parameters()] for m in layers]
    return Zero3Run(losses, flats, grads0, shards, observed)

