"""The cases and the serial oracle of lab 10's checks (tensor parallelism): sizes and seeds,
the whole tensors every case starts from, how a rank's share is cut from them, and the serial
block each split is compared with, in float64 in one process.

``record`` runs a function and back-propagates a fixed upstream gradient under
``labsim.lab.comm.CommRecorder`` and the reference tripwire (``labsim.checks._observe.watch``):
on a worker it sees the learner's collectives, FLOPs and calls into labsim's reference; on the
whole tensors in the checking process it is the oracle (``serial``).  A *job* is one kind of
exercise (``KINDS``) on one ``Spec`` of sizes: ``job_inputs`` cuts a rank's inputs,
``job_call`` adapts the learner's function, ``serial_job`` is what each rank must return.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from labsim.checks._observe import watch
from labsim.lab.comm import CommRecorder
from labsim.parallel.tensor_parallel import causal_attention

Comms = tuple[tuple[str, int], ...]
KINDS = ("f", "g", "mlp", "attention", "gather", "scatter", "sp", "ce")


@dataclass(frozen=True)
class TPRun:
    """One case on one rank: the output, the gradients of the named inputs, the
    communication of forward and backward as (kind, elements) in issue order, and the matmul
    FLOPs the rank executed (forward and backward), and the functions of labsim's own
    tensor-parallel reference it called (``REFERENCE``)."""

    out: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    forward: Comms
    backward: Comms
    flops: int
    references: tuple[str, ...] = ()


@dataclass(frozen=True)
class Spec:
    """Sizes of one case: sequence, batch, hidden, MLP features (or vocabulary), heads."""

    seq: int
    batch: int
    hidden: int
    ffn: int = 0
    heads: int = 1
    seed: int = 0
    scale: float = 1.0


def randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def record(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
           upstream: torch.Tensor, forbid: tuple[str, ...] = ()) -> TPRun:
    """Run ``fn(*inputs)`` and back-propagate ``upstream`` under a ``CommRecorder``, noting
    any call of the ``forbid`` references (``"module:qualname"``) made from the learner's
    code."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point())
              for k, v in inputs.items()}
    with CommRecorder() as rec, watch(forbid, ops=False) as seen:
        out = fn(*leaves.values())
        rec.phase = "backward"
        (out * upstream).sum().backward()
    return TPRun(out.detach(), {k: v.grad for k, v in leaves.items() if v.requires_grad},
                 tuple((c.kind, c.numel) for c in rec.comms if c.phase == "forward"),
                 tuple((c.kind, c.numel) for c in rec.comms if c.phase == "backward"),
                 rec.flops, tuple(seen.summary()["references"]))


def serial(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor],
           upstream: torch.Tensor) -> TPRun:
    """The oracle: ``fn`` on whole tensors in this process (no communication)."""
    return record(fn, inputs, upstream)


# -- comparisons -------------------------------------------------------------------------------


MLP_SPECS = (Spec(4, 2, 8, ffn=32, seed=1), Spec(3, 1, 6, ffn=12, seed=2))


def mlp_whole(spec: Spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    s, b, h, f = spec.seq, spec.batch, spec.hidden, spec.ffn
    return {"x": randn(g, s, b, h), "w_up": randn(g, f, h, scale=h ** -0.5),
            "b_up": randn(g, f, scale=0.1), "w_down": randn(g, h, f, scale=f ** -0.5),
            "b_down": randn(g, h, scale=0.1), "upstream": randn(g, s, b, h)}


def mlp_part(whole: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    f = whole["w_up"].shape[0]
    part = slice(rank * f // world, (rank + 1) * f // world)
    return {"x": whole["x"], "w_up": whole["w_up"][part], "b_up": whole["b_up"][part],
            "w_down": whole["w_down"][:, part], "b_down": whole["b_down"]}


def serial_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor, w_down: torch.Tensor,
         b_down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w_up, b_up)), w_down, b_down)


def shard_grads(run: TPRun, rank: int, world: int, sharded: dict[str, int]) -> TPRun:
    """The serial run's gradients cut as rank ``rank`` holds them (``sharded``: name ->
    dimension split over the ranks; others whole)."""
    grads = {}
    for name, grad in run.grads.items():
        if name in sharded:
            n = grad.shape[sharded[name]] // world
            grad = grad.narrow(sharded[name], rank * n, n)
        grads[name] = grad
    return TPRun(run.out, grads, run.forward, run.backward, run.flops)


def operator_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An input and an upstream gradient different on every rank."""
    gen = torch.Generator().manual_seed(7 + rank)
    return randn(gen, 3, 2, 4), randn(gen, 3, 2, 4)


ATTENTION_SPECS = (Spec(5, 2, 16, heads=4, seed=3), Spec(3, 1, 8, heads=2, seed=4))


def attention_whole(spec: Spec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    s, b, h = spec.seq, spec.batch, spec.hidden
    return {"x": randn(g, s, b, h), "w_qkv": randn(g, 3 * h, h, scale=h ** -0.5),
            "b_qkv": randn(g, 3 * h, scale=0.1), "w_o": randn(g, h, h, scale=h ** -0.5),
            "b_o": randn(g, h, scale=0.1), "upstream": randn(g, s, b, h)}


def attention_part(whole: dict[str, torch.Tensor], rank: int,
                    world: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s heads: a contiguous block of the head-major QKV rows and the matching
    columns of the output projection."""
    h = whole["w_o"].shape[0]
    rows = slice(rank * 3 * h // world, (rank + 1) * 3 * h // world)
    cols = slice(rank * h // world, (rank + 1) * h // world)
    return {"x": whole["x"], "w_qkv": whole["w_qkv"][rows], "b_qkv": whole["b_qkv"][rows],
            "w_o": whole["w_o"][:, cols], "b_o": whole["b_o"]}


def serial_attention(head_dim: int) -> Callable[..., torch.Tensor]:
    def attention(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor,
                  w_o: torch.Tensor, b_o: torch.Tensor) -> torch.Tensor:
        return F.linear(causal_attention(F.linear(x, w_qkv, b_qkv), head_dim), w_o, b_o)
    return attention


SP_SPECS = (Spec(4, 2, 8, ffn=16, seed=5), Spec(6, 1, 4, ffn=8, seed=6))


def sp_whole(spec: Spec) -> dict[str, torch.Tensor]:
    whole = mlp_whole(spec)
    g = torch.Generator().manual_seed(100 + spec.seed)
    h = spec.hidden
    return {"x": whole["x"], "ln_w": 1 + randn(g, h, scale=0.1), "ln_b": randn(g, h, scale=0.1),
            **{k: whole[k] for k in ("w_up", "b_up", "w_down", "b_down", "upstream")}}


def sp_part(whole: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, torch.Tensor]:
    s = whole["x"].shape[0]
    rows = slice(rank * s // world, (rank + 1) * s // world)
    mlp = mlp_part(whole, rank, world)
    return {"x": whole["x"][rows], "ln_w": whole["ln_w"], "ln_b": whole["ln_b"],
            **{k: mlp[k] for k in ("w_up", "b_up", "w_down", "b_down")}}


def serial_sp_block(x: torch.Tensor, ln_w: torch.Tensor, ln_b: torch.Tensor, w_up: torch.Tensor,
              b_up: torch.Tensor, w_down: torch.Tensor, b_down: torch.Tensor) -> torch.Tensor:
    return x + serial_mlp(F.layer_norm(x, x.shape[-1:], ln_w, ln_b), w_up, b_up, w_down, b_down)


CE_SPECS = (Spec(6, 1, 0, ffn=10, seed=8), Spec(5, 1, 0, ffn=8, seed=9, scale=1000.0),
            Spec(4, 1, 0, ffn=6, seed=10), Spec(1, 1, 0, ffn=4, seed=11))


def ce_whole(spec: Spec, world: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    tokens, vocab = spec.seq, spec.ffn
    target = torch.randint(0, vocab, (tokens,), generator=g)
    if spec.seed == 10:  # every target in the last rank's slice of the vocabulary
        target = vocab - 1 - torch.randint(0, vocab // world, (tokens,), generator=g)
    return {"logits": randn(g, tokens, vocab, scale=spec.scale), "target": target,
            "upstream": torch.rand(tokens, generator=g, dtype=torch.float64)}


# -- jobs: one kind of exercise on one Spec, as every rank runs it ------------------------------


def sp_operator_inputs(rank: int, world: int) -> list[torch.Tensor]:
    """For the sequence-parallel operators: a (2, 3, 4) shard and a (2 world, 3, 4) whole
    tensor, and their upstream gradients, different on every rank."""
    gen = torch.Generator().manual_seed(11 + rank)
    return [randn(gen, 2, 3, 4), randn(gen, 2 * world, 3, 4), randn(gen, 2 * world, 3, 4),
            randn(gen, 2, 3, 4)]


def job_inputs(kind: str, spec: Spec | None, rank: int, world: int
               ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rank ``rank``'s inputs of a job (named, in the order the exercise takes them) and the
    upstream gradient of its output."""
    if kind in ("f", "g"):
        x, grad = operator_inputs(rank)
        return {"x": x}, grad
    if kind in ("gather", "scatter"):
        shard, whole_x, up_gather, up_scatter = sp_operator_inputs(rank, world)
        return ({"x": shard}, up_gather) if kind == "gather" else ({"x": whole_x}, up_scatter)
    if spec is None:
        raise ValueError(f"a {kind} job needs a Spec of sizes")
    if kind == "mlp":
        whole = mlp_whole(spec)
        return mlp_part(whole, rank, world), whole["upstream"]
    if kind == "attention":
        whole = attention_whole(spec)
        return attention_part(whole, rank, world), whole["upstream"]
    if kind == "sp":
        whole, s = sp_whole(spec), spec.seq
        return sp_part(whole, rank, world), whole["upstream"][rank * s // world:
                                                              (rank + 1) * s // world]
    if kind == "ce":
        whole, v = ce_whole(spec, world), spec.ffn // world
        return ({"logits": whole["logits"][:, rank * v:(rank + 1) * v],
                 "target": whole["target"]}, whole["upstream"])
    raise ValueError(f"unknown job kind {kind!r}; one of {', '.join(KINDS)}")


def job_call(kind: str, spec: Spec | None, rank: int, world: int,
             fn: Any) -> Callable[..., torch.Tensor]:
    """The learner's exercise as a function of the job's inputs."""
    if kind in ("f", "g", "gather", "scatter"):
        return lambda t: fn.apply(t)
    if kind == "attention" and spec is not None:
        return lambda *a, d=spec.hidden // spec.heads: fn(*a, d)
    if kind == "ce" and spec is not None:
        return lambda lg, tg, start=rank * (spec.ffn // world): fn.apply(lg, tg, start)
    return fn


def serial_job(kind: str, spec: Spec | None, world: int) -> list[TPRun]:
    """What each rank must return for a job: its output and its inputs' gradients, from the
    whole computation in one process (float64), cut as the rank holds them."""
    if kind in ("f", "g"):
        xs = [operator_inputs(r) for r in range(world)]
        total_x, total_grad = sum(x for x, _ in xs), sum(g for _, g in xs)
        if kind == "f":
            return [TPRun(x, {"x": total_grad}, (), (), 0) for x, _ in xs]
        return [TPRun(total_x, {"x": g}, (), (), 0) for _, g in xs]
    if kind in ("gather", "scatter"):
        data = [sp_operator_inputs(r, world) for r in range(world)]
        if kind == "gather":
            full, up = torch.cat([d[0] for d in data]), sum(d[2] for d in data)
            return [TPRun(full, {"x": up[2 * r:2 * r + 2]}, (), (), 0) for r in range(world)]
        summed, grads = sum(d[1] for d in data), torch.cat([d[3] for d in data])
        return [TPRun(summed[2 * r:2 * r + 2], {"x": grads}, (), (), 0) for r in range(world)]
    if spec is None:
        raise ValueError(f"a {kind} job needs a Spec of sizes")
    if kind == "mlp":
        whole = mlp_whole(spec)
        ref = serial(serial_mlp, _without_upstream(whole), whole["upstream"])
        return [shard_grads(ref, r, world, {"w_up": 0, "b_up": 0, "w_down": 1})
                for r in range(world)]
    if kind == "attention":
        whole = attention_whole(spec)
        ref = serial(serial_attention(spec.hidden // spec.heads), _without_upstream(whole),
                     whole["upstream"])
        return [shard_grads(ref, r, world, {"w_qkv": 0, "b_qkv": 0, "w_o": 1})
                for r in range(world)]
    if kind == "sp":
        whole, s = sp_whole(spec), spec.seq
        ref = serial(serial_sp_block, _without_upstream(whole), whole["upstream"])
        cut = [shard_grads(ref, r, world, {"x": 0, "w_up": 0, "b_up": 0, "w_down": 1})
               for r in range(world)]
        return [TPRun(ref.out[r * s // world:(r + 1) * s // world], c.grads, (), (), ref.flops)
                for r, c in enumerate(cut)]
    if kind == "ce":
        whole, v = ce_whole(spec, world), spec.ffn // world
        ref = serial(lambda lg, tg: F.cross_entropy(lg, tg, reduction="none"),
                     {"logits": whole["logits"], "target": whole["target"]}, whole["upstream"])
        return [TPRun(ref.out, {"logits": ref.grads["logits"][:, r * v:(r + 1) * v]}, (), (),
                      ref.flops) for r in range(world)]
    raise ValueError(f"unknown job kind {kind!r}; one of {', '.join(KINDS)}")


def serial_flops(kind: str, spec: Spec) -> int:
    """Matmul FLOPs (forward and backward) of the whole block of a job, in one process."""
    if kind == "mlp":
        whole, fn = mlp_whole(spec), serial_mlp
    elif kind == "attention":
        whole, fn = attention_whole(spec), serial_attention(spec.hidden // spec.heads)
    elif kind == "sp":
        whole, fn = sp_whole(spec), serial_sp_block
    else:
        raise ValueError(f"no FLOP budget for a {kind} job")
    return serial(fn, _without_upstream(whole), whole["upstream"]).flops


def _without_upstream(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in whole.items() if k != "upstream"}
