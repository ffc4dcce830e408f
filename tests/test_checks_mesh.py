"""Lab 15's 2-D mesh check: the solution and honest variants pass on real processes; every
cheap way to get the right numbers without the layout fails on what the parameters are --
plain DDP, FSDP alone, tensor parallelism alone, no sharding, a mesh of the wrong shape or
order, a replica training on the whole batch -- a wrong gradient fails on the values, the
stub is reported as not done, and the library's own reference is refused.

Most cases run the 2 x 2 mesh alone (``make_check(((2, 2),))``): one launch a test, a third
of the lab's three shapes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsim.checks import CheckFailed, ExerciseNotDone
from labsim.checks import mesh as check
from labsim.checks._core import Case, Outcome
from labsim.parallel.mesh import MeshGPT, full_parameters, global_batch

from .solution_cells import exercises

S = exercises("15_planning")
TWO_BY_TWO = check.make_check(((2, 2),), title="mesh_2x2")
WITH_TP_ONLY = check.make_check(((2, 2), (1, 4)), title="mesh_shapes")


def _run(spec, parallelize, step, capsys: pytest.CaptureFixture) -> str:
    spec(parallelize, step)
    return capsys.readouterr().out


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}


def _mesh(dp: int, tp: int, names: tuple[str, str] = ("dp", "tp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=names)


# -- honest variants ---------------------------------------------------------------------


def root_only(model, dp, tp):
    """FSDP2 once, on the root: every parameter in one group, the same placements."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh(dp, tp)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _tp_plan())
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    return mesh


def one_qkv_all_reduce(model, dp, tp):
    """Megatron's f: the attention's input made a replicated DTensor once, so the three
    gradients of Q, K and V are summed before one all-reduce (pytorch/examples' 2-D plan);
    the whole plan given from the root with wildcards."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

    mesh = _mesh(dp, tp)
    plan = {f"blocks.*.{k}": v for k, v in _tp_plan().items()}
    plan["blocks.*.attn"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                               desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def chunked_step(model, mesh, optimizer, tokens, targets):
    """The replica's rows by ``torch.chunk``; the loss returned as a tensor."""
    replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens.chunk(replicas)[replica], targets.chunk(replicas)[replica])
    loss.backward()
    optimizer.step()
    return loss.detach()


# -- cheats ------------------------------------------------------------------------------


def ddp(model, dp, tp):
    """Plain DDP over the whole world: right numbers, nothing sharded."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def ddp_step(model, wrapper, optimizer, tokens, targets):
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = tokens.shape[0] // world
    optimizer.zero_grad()
    loss = wrapper(tokens[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows])
    loss.backward()
    optimizer.step()
    return float(loss)


def fsdp_only(model, dp, tp):
    """FSDP2 over all ranks on a 1-D mesh named "dp"; no tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dp * tp,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def fsdp_only_step(model, mesh, optimizer, tokens, targets):
    loss = chunked_step(model, mesh, optimizer, tokens, targets)
    value = loss.clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def tp_only(model, dp, tp):
    """Tensor parallelism on the mesh, no FSDP: the gradients averaged by hand over "dp"."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh(dp, tp)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _tp_plan())
    return mesh


def tp_only_step(model, mesh, optimizer, tokens, targets):
    from torch.distributed.tensor import DTensor

    replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = tokens.shape[0] // replicas
    optimizer.zero_grad()
    loss = model(tokens[replica * rows:(replica + 1) * rows],
                 targets[replica * rows:(replica + 1) * rows])
    loss.backward()
    group = mesh["dp"].get_group()
    for p in model.parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        grad /= replicas
    optimizer.step()
    return float(loss)


def nothing(model, dp, tp):
    """No sharding at all: the mesh is built, then ignored."""
    return _mesh(dp, tp)


def whole_batch_step(model, mesh, optimizer, tokens, targets):
    """Every rank trains on the whole batch."""
    optimizer.zero_grad()
    loss = model(tokens, targets)
    loss.backward()
    optimizer.step()
    return float(loss)


def fixed_shape(model, dp, tp):
    """The solution's layout on a 2 x 2 mesh whatever dp and tp are asked."""
    return S["parallelize_2d"](model, 2, 2)


def swapped_names(model, dp, tp):
    """The grid built with "tp" as the outer dimension: tensor-parallel groups {0, 2} and
    {1, 3}, across nodes on a real cluster."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _mesh(tp, dp, names=("tp", "dp"))
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def summed_step(model, mesh, optimizer, tokens, targets):
    """The gradients summed over the replicas instead of averaged."""
    replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
    rows = tokens.shape[0] // replicas
    optimizer.zero_grad()
    loss = model(tokens[replica * rows:(replica + 1) * rows],
                 targets[replica * rows:(replica + 1) * rows])
    (loss * replicas).backward()
    optimizer.step()
    return float(loss)


def stub(*args, **kwargs):
    raise NotImplementedError("write this exercise")


def library(model, dp, tp):
    from labsim.parallel.mesh import parallelize_2d

    return parallelize_2d(model, dp, tp)


def fails_on_rank_1(model, mesh, optimizer, tokens, targets):
    """A learner's bug on one rank only: the others must not wait for it forever."""
    if dist.get_rank() == 1:
        raise ValueError("only rank 1 fails")
    return S["train_step_2d"](model, mesh, optimizer, tokens, targets)


# -- the tests that launch ----------------------------------------------------------------


@pytest.mark.multiprocess
def test_the_solution_passes_the_lab_check(capsys: pytest.CaptureFixture) -> None:
    out = _run(check.parallelize_2d, S["parallelize_2d"], S["train_step_2d"], capsys)
    assert out.strip().endswith("PASS parallelize_2d: 9/9 cases passed")


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallelize, step", [
    (root_only, chunked_step), (one_qkv_all_reduce, S["train_step_2d"])],
    ids=["fsdp-on-root-only-no-reshard-chunked-step", "prepare-module-input-wildcard-plan"])
def test_honest_variants_pass(parallelize, step, capsys: pytest.CaptureFixture) -> None:
    assert "PASS mesh_2x2: 5/5" in _run(TWO_BY_TWO, parallelize, step, capsys)


CHEATS = {
    "plain DDP": (ddp, ddp_step, "(its placements: a plain tensor)"),
    "FSDP alone over the world": (fsdp_only, fsdp_only_step, "lives on a mesh named ('dp',)"),
    "tensor parallelism alone, gradients averaged by hand": (tp_only, tp_only_step,
                                                              "not sharded over 'dp'"),
    "no sharding": (nothing, whole_batch_step, "(its placements: a plain tensor)"),
    "a replica trains on the whole batch": (None, whole_batch_step, "matmul FLOPs"),
    "the mesh with tp outside": (swapped_names, None,
                                 "lives on a mesh named ('dp',) of ranks [0, 1]"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_right_numbers_without_the_layout_fail(name: str) -> None:
    parallelize, step, reason = CHEATS[name]
    with pytest.raises(CheckFailed) as info:
        TWO_BY_TWO(parallelize or S["parallelize_2d"], step or S["train_step_2d"])
    message = str(info.value)
    assert "FAIL mesh_2x2: 0/5" in message and "breaks a rule" in message
    assert reason in message


@pytest.mark.multiprocess
def test_a_mesh_that_ignores_its_shape_fails() -> None:
    with pytest.raises(CheckFailed, match=r"for a 1 x 4 mesh, .* lives on a mesh named "
                                          r"\('dp',\) of ranks \[0, 2\]"):
        WITH_TP_ONLY(fixed_shape, S["train_step_2d"])


@pytest.mark.multiprocess
def test_gradients_summed_over_the_replicas_fail_on_the_values() -> None:
    with pytest.raises(CheckFailed, match="FAIL mesh_2x2: [1-4]/5") as info:
        TWO_BY_TWO(S["parallelize_2d"], summed_step)
    assert "breaks a rule" not in str(info.value)


@pytest.mark.multiprocess
def test_the_stub_is_not_done_and_the_reference_is_refused() -> None:
    with pytest.raises(ExerciseNotDone):
        TWO_BY_TWO(stub, stub)
    with pytest.raises(ExerciseNotDone):
        TWO_BY_TWO(S["parallelize_2d"], stub)
    with pytest.raises(CheckFailed, match="calls labsim's own reference"):
        TWO_BY_TWO(library, S["train_step_2d"])


@pytest.mark.multiprocess
def test_an_error_on_one_rank_ends_the_check() -> None:
    with pytest.raises(CheckFailed, match="raised ValueError: only rank 1 fails"):
        TWO_BY_TWO(S["parallelize_2d"], fails_on_rank_1)


# -- the numbers the rules and the tolerance rest on (one process) -------------------------


def test_the_tolerance_separates_reordering_from_mistakes() -> None:
    """A real mistake moves parameters by far more than the tolerance: the largest element
    moves by more than 1e-3 when the gradient is doubled (summed over 2 replicas) or a
    replica trains on the wrong rows."""
    ref = check.serial_run()["params"]
    tokens, targets = global_batch(check.CFG, check.ROWS)
    for lr, rows in ((2 * check.LR, slice(None)), (check.LR, slice(0, 2))):
        model = MeshGPT(check.CFG).double()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for _ in range(check.STEPS):
            opt.zero_grad()
            model(tokens[rows], targets[rows]).backward()
            opt.step()
        moved = max(float((p.detach() - ref[n]).abs().max())
                    for n, p in model.named_parameters())
        assert moved > 1e-3
        assert check.TOL({n: p.detach() for n, p in model.named_parameters()}, ref)


def test_shares_of_bytes_and_flops() -> None:
    """Bytes: the split linears over dp * tp, the rest over dp; FLOPs: the blocks over
    dp * tp, the output layer over dp (the solution's step counts exactly that, plus nothing
    for attention, which PyTorch's CPU kernel does not report)."""
    model = MeshGPT(check.CFG)
    split = sum(p.numel() for n, p in model.named_parameters()
                if check.split_kind(n) in ("colwise", "row-weight"))
    rest = sum(p.numel() for p in model.parameters()) - split
    assert check.expected_bytes(2, 2) == 8 * (split // 4 + rest // 2)
    assert check.expected_bytes(1, 1) == 8 * (split + rest)
    assert check.flops_budget(4, 1) < check.flops_budget(2, 2) < check.flops_budget(1, 1) / 2
    assert [check.split_kind(n) for n in ("blocks.0.attn.q.bias", "blocks.1.attn.o.weight",
                                          "blocks.1.mlp.down.bias", "blocks.0.ln1.weight",
                                          "head.weight")] == [
        "colwise", "row-weight", "row-bias", "other", "other"]


def _outcome(dp: int, tp: int, params_of, flops: int = 0) -> tuple[Case, Outcome]:
    """A case and an outcome whose observations are ``params_of(rank)`` on every rank."""
    ranks = [{"params": params_of(rank), "flops": flops} for rank in range(dp * tp)]
    runs = [{"dp": dp, "tp": tp, "ranks": ranks}]
    return Case("c", (0, "all")), Outcome(0.0, observed={"runs": runs})


def _param(mesh: list[str], grid: list, placements: list[str]) -> dict:
    return {"dtensor": True, "mesh": mesh, "grid": grid, "placements": placements, "bytes": 8}


GRID = [[0, 1], [2, 3]]


def _layout(rank: int, **changes: dict) -> dict:
    """The 2-D layout of a few parameters on ``rank`` of a 2 x 2 mesh, with ``changes``."""
    column = [rank % 2, rank % 2 + 2]
    good = {"blocks.0.attn.q.weight": _param(["dp", "tp"], GRID, ["S0", "S0"]),
            "blocks.0.attn.o.weight": _param(["dp", "tp"], GRID, ["S0", "S1"]),
            "blocks.0.attn.o.bias": _param(["dp", "tp"], GRID, ["S0", "R"]),
            "wte.weight": _param(["dp"], column, ["S0"])}
    return {**good, **{k.replace("__", "."): v for k, v in changes.items()}}


def test_the_rules_read_meshes_and_placements() -> None:
    """On observations made by hand: the 2-D layout passes; a row-parallel weight split by
    rows, a parameter FSDP did not shard, a "dp" mesh of a row's ranks, a FLOP count of the
    whole model each fail."""
    good = _outcome(2, 2, _layout)
    assert check.placement_rule(*good) is None and check.mesh_rule(*good) is None
    by_rows = _outcome(2, 2, lambda r: _layout(r, blocks__0__attn__o__weight=_param(
        ["dp", "tp"], GRID, ["S0", "S0"])))
    assert "is S0 over 'tp'" in check.placement_rule(*by_rows)
    replicated = _outcome(2, 2, lambda r: _layout(r, wte__weight=_param(
        ["tp"], GRID[r // 2], ["R"])))
    assert "not sharded over 'dp'" in check.placement_rule(*replicated)
    assert check.mesh_rule(*replicated) is None
    row_as_dp = _outcome(2, 2, lambda r: _layout(r, wte__weight=_param(
        ["dp"], GRID[r // 2], ["S0"])))
    assert "lives on a mesh named ('dp',) of ranks [0, 1]" in check.mesh_rule(*row_as_dp)
    assert check.flops_rule(*_outcome(2, 2, _layout, flops=10**9)) is not None
    assert check.flops_rule(*_outcome(2, 2, _layout, flops=1000)) is None


@pytest.mark.multiprocess
def test_full_parameters_gathers_what_the_solution_sharded() -> None:
    """The gathered parameters are whole (the shapes of the unsharded model) on every rank."""
    from labsim.lab.launcher import launch

    shapes = launch(_gathered_shapes, 4, args=(S["parallelize_2d"],), timeout_s=180).values
    want = {n: list(p.shape) for n, p in MeshGPT(check.CFG).named_parameters()}
    assert all(s == want for s in shapes)


def _gathered_shapes(rank: int, world: int, parallelize) -> dict:
    model = MeshGPT(check.CFG).double()
    parallelize(model, 2, 2)
    return {n: list(t.shape) for n, t in full_parameters(model).items()}
