"""Check of lab 15's 2-D mesh: a learner's ``parallelize(model, dp, tp)`` (FSDP2 over "dp",
tensor parallelism over "tp", on one ``(dp, tp)`` device mesh; returns the mesh) and
``train_step(model, mesh, optimizer, tokens, targets)`` (one step on the replica's rows),
run on 4 real gloo processes against one process training the whole model on the whole
batch (parallel = serial is the oracle).

One launch runs three mesh shapes of the same 4 ranks: 2 x 2 (both axes), 1 x 4 (tensor
parallel only) and 4 x 1 (FSDP only), each on a fresh float64 ``MeshGPT`` of 2 blocks taking 2
plain SGD steps.  Float64 because the parallel step adds the same numbers in another order
(tensor parallelism's partial sums, FSDP's reduce-scatter): the two agree to about 1e-16
relative, so ``TOL`` (1e-9 relative) passes every honest order and fails any real mistake --
a gradient summed instead of averaged over the replicas, a replica on the wrong rows --
which moves some parameters by up to 1e-2 here (``tests/test_checks_mesh.py`` measures
both).

Besides the values, the rules read what the parameters *are* on every rank after training:

- the mesh: every sharded parameter lives on the ``(dp, tp)`` mesh named ``("dp", "tp")``
  with ranks ``[[0 .. tp - 1], [tp .. 2 tp - 1], ...]`` (tensor-parallel groups of
  consecutive ranks, as PyTorch's 2-D example and Megatron-LM order them), or on one of its 1-D
  sub-meshes;
- tensor parallelism (when tp > 1): each block's Q, K, V and up projections are sharded over
  "tp" by output features (``Shard(0)``, weight and bias), its output and down projections by
  input features (weight ``Shard(1)``, bias replicated);
- FSDP (when dp > 1): every parameter is sharded over "dp";
- each rank's matmul FLOPs in a step (``FlopCounterMode``) are at most 5 % above its share:
  the blocks' over ``dp * tp`` ranks, the output layer's over ``dp`` -- a replica training on
  the whole batch, or a rank computing the whole model, does more;
- and a case compares the bytes of parameters each rank holds with that share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from labsim.checks._core import Case, Outcome, Spec, close, plain_outcome
from labsim.checks._observe import watch
from labsim.parallel.mesh import COLWISE, ROWWISE, MeshGPT, full_parameters, global_batch
from labsim.workload import Transformer

NPROCS = 4
CFG = Transformer(layers=2, hidden=32, heads=4, seq_len=16, vocab=64, dropout=False)
ROWS, STEPS, LR = 4, 2, 0.1
SHAPES = ((2, 2), (1, 4), (4, 1))
TOL = close(rtol=1e-9, atol=1e-12)
FLOPS_SLACK = 1.05
FORBID = ("labsim.parallel.mesh:parallelize_2d", "labsim.parallel.mesh:train_step_2d",
          "labsim.parallel.tensor_parallel:dtensor_block", "labsim.parallel.zero:fsdp_wrap")
WANT_TP = {"colwise": "S0", "row-weight": "S1", "row-bias": "R"}


def split_kind(name: str) -> str:
    """How tensor parallelism splits parameter ``name`` of a ``MeshGPT``: ``"colwise"``,
    ``"row-weight"``, ``"row-bias"`` or ``"other"`` (not split)."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != "blocks":
        return "other"
    path = ".".join(parts[2:4])
    if path in COLWISE:
        return "colwise"
    if path in ROWWISE:
        return "row-weight" if parts[4] == "weight" else "row-bias"
    return "other"


def serial_run() -> dict[str, Any]:
    """One process, the whole batch, plain SGD: each step's loss and every parameter after
    the last step (the oracle)."""
    from labsim.parallel.mesh import serial_step

    model = MeshGPT(CFG).double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, targets = global_batch(CFG, ROWS)
    losses = [serial_step(model, opt, tokens, targets) for _ in range(STEPS)]
    return {"losses": losses,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def expected_bytes(dp: int, tp: int) -> int:
    """Bytes of parameters one rank holds under the 2-D layout: the split linears' 1/(dp tp),
    everything else (row-parallel biases, replicated over tp, included) 1/dp; float64."""
    total = 0
    for name, p in MeshGPT(CFG).named_parameters():
        split = dp * tp if split_kind(name) in ("colwise", "row-weight") else dp
        total += p.numel() * 8 // split
    return total


def flops_budget(dp: int, tp: int) -> float:
    """Matmul FLOPs of one rank in one step under the 2-D layout (forward and backward, 3 x
    the forward): the blocks' linears and attention over ``dp * tp`` ranks, the output layer
    over ``dp``; attention counted whole (s x s scores), so this is an upper bound."""
    c, tokens = CFG, ROWS * CFG.seq_len
    blocks = 3 * 2 * tokens * c.layers * (4 * c.hidden**2 + 2 * c.hidden * c.ffn_hidden)
    attention = 3 * c.layers * 4 * ROWS * c.seq_len**2 * c.hidden
    head = 3 * 2 * tokens * c.hidden * c.vocab
    return (blocks + attention) / (dp * tp) + head / dp


def _at_most(got: Any, expected: Any) -> str | None:
    """Each rank's value is positive and at most the expected one (a layout that shards more,
    such as a split embedding, holds less)."""
    if not isinstance(got, list) or len(got) != len(expected):
        return f"expected one number per rank ({len(expected)}), got {got!r}"
    for rank, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(g, (int, float)) or not 0 < g <= e:
            return (f"rank {rank} holds {g} bytes of parameters; its share of the model is "
                    f"{e} bytes")
    return None


def _shape_cases(i: int, dp: int, tp: int, ref: dict[str, Any]) -> list[Case]:
    """The cases of shape ``i`` (``dp x tp``): both axes get five, one axis two."""
    params = ref["params"]
    share = [expected_bytes(dp, tp)] * NPROCS
    if dp > 1 and tp > 1:
        mesh = f"{dp} x {tp} mesh"
        return [
            Case(f"{mesh}: the losses of {STEPS} SGD steps, averaged over the replicas, "
                 "equal one process on the whole batch", (i, "losses"), expected=ref["losses"]),
            Case(f"{mesh}: Q, K, V, O, up and down after {STEPS} steps equal the serial run",
                 (i, "params", "block"),
                 expected={n: t for n, t in params.items() if split_kind(n) != "other"}),
            Case(f"{mesh}: embeddings, norms and the output layer after {STEPS} steps",
                 (i, "params", "rest"),
                 expected={n: t for n, t in params.items() if split_kind(n) == "other"}),
            Case(f"{mesh}: the ranks of a tensor-parallel group report the same loss",
                 (i, "tp_spread"), expected=[0.0] * STEPS),
            Case(f"{mesh}: each rank holds 1/{dp * tp} of the split linears and 1/{dp} of the "
                 "rest", (i, "bytes"), expected=share, compare=_at_most)]
    axis = "tensor parallel only" if dp == 1 else "FSDP only"
    return [Case(f"{dp} x {tp} mesh ({axis}): losses and every parameter", (i, "all"),
                 expected=[ref["losses"], params]),
            Case(f"{dp} x {tp} mesh: each rank holds its share of the parameters", (i, "bytes"),
                 expected=share, compare=_at_most)]


def _cases_for(shapes: Sequence[tuple[int, int]]) -> Callable[[], list[Case]]:
    def build() -> list[Case]:
        ref = serial_run()
        return [c for i, (dp, tp) in enumerate(shapes) for c in _shape_cases(i, dp, tp, ref)]
    return build


# -- the workers -------------------------------------------------------------------------------


def _placement(pl: Any) -> str:
    """``"S<dim>"`` (a shard, strided or not: FSDP2 shards a tensor-parallel shard of the
    same dimension with ``_StridedShard``), ``"R"`` (replicate) or ``"P"`` (partial)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(pl, (Shard, _StridedShard)):
        return f"S{pl.dim}"
    return "R" if pl.is_replicate() else "P" if pl.is_partial() else str(pl)


def describe(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """What each parameter is on this rank: a DTensor or not, its mesh's dimension names and
    ranks, its placements (``_placement``) and the bytes of its local shard."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            out[name] = {"dtensor": True, "mesh": list(mesh.mesh_dim_names or ()),
                         "grid": mesh.mesh.tolist(),
                         "placements": [_placement(pl) for pl in p.placements],
                         "bytes": p.to_local().numel() * p.element_size()}
        else:
            out[name] = {"dtensor": False, "mesh": [], "grid": [], "placements": [],
                         "bytes": p.numel() * p.element_size()}
    return out


@contextlib.contextmanager
def _unwatched() -> Iterator[None]:
    yield None


def _loss(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _shape_run(rank: int, parallelize: Callable[..., Any], train_step: Callable[..., Any],
               dp: int, tp: int, forbid: Sequence[str]) -> dict[str, Any]:
    """One mesh shape on this rank: the learner's functions watched, then what the
    parameters are and (rank 0) every parameter gathered whole."""
    from labsim.lab.comm import CommRecorder

    tokens, targets = global_batch(CFG, ROWS)
    model = MeshGPT(CFG).double()
    references: set[str] = set()
    # A learner's call that raises ends this rank, and the launch with it: its peers may be
    # waiting in a collective that this rank will never join, so no flag can reach them.
    with watch(forbid, ops=False) as seen:
        mesh = parallelize(model, dp, tp)
    references.update(seen.summary()["references"])
    losses: list[float | None] = []
    flops = 0
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        # the tripwire's profile hook triples the cost of DTensor's Python: it watches the
        # last step, the first one (DTensor's and FSDP's one-time set-up) runs unwatched
        tripwire = watch(forbid, ops=False) if step == STEPS - 1 else _unwatched()
        with tripwire as seen, CommRecorder() as rec:
            losses.append(_loss(train_step(model, mesh, opt, tokens, targets)))
        if seen is not None:
            references.update(seen.summary()["references"])
        flops = rec.flops  # the last step's (the first also counts DTensor's set-up)
    out: dict[str, Any] = {"references": sorted(references),
                           "losses": losses, "params": describe(model), "flops": flops}
    full = full_parameters(model)
    if rank == 0:
        out["full"] = full
    dist.barrier()
    return out


def mesh_worker(rank: int, world: int, parallelize: Callable[..., Any],
                train_step: Callable[..., Any], shapes: Sequence[tuple[int, int]],
                forbid: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every mesh shape of ``shapes`` on this rank (``_shape_run``); a learner's call that
    raises ends the run on every rank (the launcher stops the others)."""
    return [_shape_run(rank, parallelize, train_step, dp, tp, forbid) for dp, tp in shapes]


# -- the driver and the rules ------------------------------------------------------------------


def _value(dp: int, tp: int, what: Sequence[Any], ranks: Sequence[dict[str, Any]]) -> Any:
    """What a case compares of one shape's run on every rank."""
    leaders = [ranks[r * tp]["losses"] for r in range(dp)]
    losses = [sum(lead[s] for lead in leaders) / dp if all(
        lead[s] is not None for lead in leaders) else None for s in range(STEPS)]
    full = ranks[0]["full"]
    kind = what[0]
    if kind == "losses":
        return losses
    if kind == "params":
        keep = (lambda n: split_kind(n) != "other") if what[1] == "block" else (
            lambda n: split_kind(n) == "other")
        return {n: t for n, t in full.items() if keep(n)}
    if kind == "tp_spread":
        return [max(abs((ranks[r]["losses"][s] or 0.0) - (ranks[r - r % tp]["losses"][s]
                                                         or 0.0)) for r in range(NPROCS))
                for s in range(STEPS)]
    if kind == "bytes":
        return [sum(p["bytes"] for p in r["params"].values()) for r in ranks]
    return [losses, full]


def _driver(shapes: Sequence[tuple[int, int]]) -> Callable[..., list[Outcome]]:
    """The driver of a check over ``shapes``: one launch of ``NPROCS`` workers runs them all."""
    def drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
              ) -> list[Outcome]:
        from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

        try:
            ranks = launch(mesh_worker, NPROCS,
                           args=(fns[0], fns[1], list(shapes), spec.forbid),
                           timeout_s=180.0, progress=spec.title).values
        except WorkerError as exc:
            return [_learner_error(exc)] * len(cases)
        except LaunchTimeout as exc:
            return [Outcome.of_error(exc)] * len(cases)
        references = sorted({ref for r in ranks for run in r for ref in run["references"]})
        runs = [{"dp": dp, "tp": tp, "ranks": [{"params": r[i]["params"],
                                                 "flops": r[i]["flops"]} for r in ranks]}
                for i, (dp, tp) in enumerate(shapes)]
        observed = {"runs": runs, "references": references}
        return [plain_outcome(_value(*shapes[int(case.args[0])], case.args[1:],
                                     [r[int(case.args[0])] for r in ranks]), observed)
                for case in cases]
    return drive


def _learner_error(exc: Any) -> Outcome:
    """The error a rank's learner call raised first, named as raised there (``exc`` is the
    launcher's ``WorkerError``): its type and its message, from the last line of the
    rank's traceback."""
    lines = exc.remote_traceback.strip().splitlines()
    last = next((ln for ln in reversed(lines)
                 if ln.partition(":")[0].split(".")[-1] == exc.exc_type), "")
    message = last.partition(": ")[2] or f"(rank {exc.rank}'s traceback has no message)"
    return Outcome(None, exc.exc_type, (exc.exc_type,), f"{message} (on rank {exc.rank})")


def _grid(dp: int, tp: int) -> list[list[int]]:
    return [[r * tp + c for c in range(tp)] for r in range(dp)]


def mesh_rule(case: Case, out: Outcome) -> str | None:
    """Every sharded parameter lives on the (dp, tp) mesh named ("dp", "tp"), tensor-parallel
    groups of consecutive ranks, or on one of its 1-D sub-meshes."""
    for run in out.observed.get("runs", []):
        dp, tp = int(run["dp"]), int(run["tp"])
        grid = _grid(dp, tp)
        for rank, seen in enumerate(run["ranks"]):
            row, col = grid[rank // tp], [g[rank % tp] for g in grid]
            allowed = {("dp", "tp"): grid, ("dp",): col, ("tp",): row}
            for name, p in seen["params"].items():
                if not p["dtensor"]:
                    continue
                names = tuple(p["mesh"])
                if allowed.get(names) != p["grid"]:
                    return (f"for a {dp} x {tp} mesh, {name} lives on a mesh named {names} "
                            f"of ranks {p['grid']}; the mesh is init_device_mesh('cpu', "
                            f"({dp}, {tp}), mesh_dim_names=('dp', 'tp')), ranks {grid}: "
                            "tensor-parallel groups of consecutive ranks")
    return None


def placement_rule(case: Case, out: Outcome) -> str | None:
    """Tensor parallelism splits each block's linears over "tp" as Megatron-LM does; FSDP
    shards every parameter over "dp"."""
    for run in out.observed.get("runs", []):
        dp, tp = int(run["dp"]), int(run["tp"])
        for rank, seen in enumerate(run["ranks"]):
            for name, p in seen["params"].items():
                place = dict(zip(p["mesh"], p["placements"]))
                kind = split_kind(name)
                if tp > 1 and kind != "other":
                    got, want = place.get("tp"), WANT_TP[kind]
                    if got != want:
                        where = f"{got} over 'tp'" if got else "not split over 'tp'"
                        return (f"{dp} x {tp} mesh, rank {rank}: {name} is {where}; tensor "
                                "parallelism splits Q, K, V and up by output features "
                                "(ColwiseParallel: S0), O and down by input features "
                                "(RowwiseParallel: weight S1, bias R)")
                if dp > 1 and not str(place.get("dp", "")).startswith("S"):
                    return (f"{dp} x {tp} mesh, rank {rank}: {name} is not sharded over 'dp' "
                            f"(its placements: {p['placements'] or 'a plain tensor'}); "
                            "fully_shard on the 'dp' sub-mesh shards every parameter")
    return None


def flops_rule(case: Case, out: Outcome) -> str | None:
    """Each rank's matmul FLOPs in a step are at most its share (``flops_budget``)."""
    for run in out.observed.get("runs", []):
        dp, tp = int(run["dp"]), int(run["tp"])
        budget = flops_budget(dp, tp)
        for rank, seen in enumerate(run["ranks"]):
            if int(seen["flops"]) > FLOPS_SLACK * budget:
                return (f"{dp} x {tp} mesh: rank {rank} executed {int(seen['flops']):,} "
                        f"matmul FLOPs in a step, its share is {budget:,.0f}: each "
                        "replica trains on its rows of the batch and each tensor-parallel "
                        "rank computes its part of every block")
    return None


def make_check(shapes: Sequence[tuple[int, int]] = SHAPES,
               title: str = "parallelize_2d") -> Spec:
    """The check over ``shapes`` (the lab's: ``SHAPES``; tests run the 2 x 2 mesh alone)."""
    shapes = tuple(shapes)
    return Spec(title, _cases_for(shapes), drive=_driver(shapes), compare=TOL,
                rules=(mesh_rule, placement_rule, flops_rule), forbid=FORBID, functions=2,
                ops=False)


parallelize_2d = make_check()
"""``parallelize(model, dp, tp)`` shards a ``MeshGPT`` in place over a ``(dp, tp)`` mesh named
("dp", "tp") and returns the mesh; ``train_step(model, mesh, optimizer, tokens, targets)``
takes one step on the replica's rows and returns its loss.  4 processes, one launch, three
mesh shapes (``SHAPES``), 9 cases."""
