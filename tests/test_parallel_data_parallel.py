"""Data parallel by hand (labsim.parallel.data_parallel) and ZeRO-1 (labsim.parallel.zero):
structure in one process, and the torchrun demos on 2 real processes (ranks agree)."""

from __future__ import annotations

import pytest
import torch

from labsim.lab import launch
from labsim.parallel import data_parallel as dp
from labsim.parallel.zero import shard_bounds

pytestmark = pytest.mark.multiprocess


def _both_demos(rank: int, world: int) -> tuple[float, float]:
    from labsim.parallel import data_parallel, zero

    return data_parallel.demo(rank, world), zero.demo(rank, world)


def test_demos_leave_ranks_identical() -> None:
    result = launch(_both_demos, 2, timeout_s=120)
    assert [v for r in result for v in r] == [0.0] * 4


def test_trapnet_traps() -> None:
    m = dp.TrapNet()
    assert m.head.weight is m.embed.weight
    assert not m.frozen.weight.requires_grad
    dp.lm_loss(m, dp.make_tokens(0, 2)).backward()
    assert m.unused.weight.grad is None and m.frozen.weight.grad is None
    assert m.embed.weight.grad is not None


def test_shard_splits_rows_and_rejects_uneven() -> None:
    b = torch.arange(12).reshape(6, 2)
    assert torch.equal(torch.cat([dp.shard(b, r, 3) for r in range(3)]), b)
    with pytest.raises(ValueError, match="does not split"):
        dp.shard(b, 0, 4)


def test_serial_reference_accumulation_equals_big_batch() -> None:
    batches = [dp.make_tokens(s, 8) for s in range(2)]
    one = dp.serial_reference(3, batches)
    four = dp.serial_reference(3, batches, accumulate=4)
    for k, v in one.params.items():
        assert torch.allclose(v, four.params[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("numel,world", [(10, 3), (2, 4), (0, 2), (7, 1), (1000, 7)])
def test_shard_bounds_match_tensor_split(numel: int, world: int) -> None:
    sizes = [len(c) for c in torch.tensor_split(torch.arange(numel), world)]
    got = [shard_bounds(numel, world, r) for r in range(world)]
    assert [e - s for s, e in got] == sizes
    assert got[0][0] == 0 and got[-1][1] == numel
    with pytest.raises(ValueError):
        shard_bounds(numel, world, world)


def _accumulate(rank: int, world: int, k: int, no_sync: bool) -> tuple[float, int, int]:
    """k micro-batches per step with DataParallelBucket, with or without ``no_sync`` on all
    but the last; returns (largest difference from one process on the whole batch,
    all-reduces launched, buckets)."""
    import contextlib

    init, cap = 7, 600.0
    batches = [dp.make_tokens(50 + s, 4 * world) for s in range(3)]
    ref = dp.serial_reference(init, batches, accumulate=k)
    torch.manual_seed(init + rank)  # replicas start different: only the broadcast fixes it
    model = dp.DataParallelBucket(dp.TrapNet().double(), bucket_cap_bytes=cap)
    torch.manual_seed(init)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for b in batches:
        parts = dp.shard(b, rank, world).chunk(k)
        for i, mb in enumerate(parts):
            quiet = no_sync and i < k - 1
            with model.no_sync() if quiet else contextlib.nullcontext():
                (dp.lm_loss(model, mb) / k).backward()
        model.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad()
    got = dp.parameters_of(model.module)
    err = max(float((got[n] - v).abs().max()) for n, v in ref.params.items())
    return err, model.n_allreduce, len(model.buckets)


@pytest.mark.slow
def test_bucket_accumulation_is_right_with_and_without_no_sync() -> None:
    """Four backward passes before one synchronization: with ``no_sync`` one all-reduce per
    bucket per step, without it one per bucket per backward (each waited for), and both
    equal one process on the whole batch."""
    from labsim.checks.data_parallel import expected_buckets

    k, steps = 4, 3
    buckets = expected_buckets(600.0)  # the one holding the unused layer fills only at the end
    per_step = {True: len(buckets),
                False: sum(k if complete else 1 for _, complete in buckets)}
    for no_sync in (True, False):
        ranks = launch(_accumulate, 2, args=(k, no_sync), timeout_s=120)
        for err, n_allreduce, n_buckets in ranks:
            assert n_buckets == len(buckets)
            assert err < 1e-12, (no_sync, err)
            assert n_allreduce == steps * per_step[no_sync], (no_sync, n_allreduce)


def _sharded_vs_unsharded(rank: int, world: int, config: str) -> tuple[float, int, int]:
    """ShardedOptimizer on this rank's shard against ``optimizer_cls`` in one process on the
    whole batch; the second block's parameters get no gradient in step 2 (unused that step).
    Returns (largest parameter difference, state elements held here, elements of the
    parameters that ever get a gradient)."""
    import torch.distributed as dist

    from labsim.parallel.zero import ShardedOptimizer

    def groups(model: torch.nn.Module) -> list[dict]:
        blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
        rest = [p for n, p in model.named_parameters()
                if p.requires_grad and not n.startswith("blocks.")]
        return [{"params": blocks, "lr": 0.02}, {"params": rest}]

    cls, kwargs = {"adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
                   "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}[config]
    torch.manual_seed(5)
    serial, local = dp.TrapNet().double(), dp.TrapNet().double()
    local.load_state_dict(serial.state_dict())
    ref, opt = cls(groups(serial), **kwargs), ShardedOptimizer(groups(local), cls, **kwargs)
    for step in range(3):
        batch = dp.make_tokens(70 + step, 4 * world)
        for model, o, tokens in ((serial, ref, batch), (local, opt, dp.shard(batch, rank, world))):
            dp.lm_loss(model, tokens).backward()
            if step == 1:
                for p in model.blocks[1].parameters():
                    p.grad = None
            o.step()
            o.zero_grad()
    err = max(float((a - b).abs().max()) for a, b in zip(serial.parameters(), local.parameters()))
    held = sum(t.numel() for t in opt.state_tensors() if t.ndim)
    total = sum(p.numel() for n, p in local.named_parameters()  # the unused layer: no state
                if p.requires_grad and not n.startswith("unused."))
    dist.barrier()
    return err, held, total


@pytest.mark.slow
@pytest.mark.parametrize("config", ["adamw", "sgd"])
def test_sharded_optimizer_equals_the_unsharded_one(config: str) -> None:
    """AdamW with weight decay and two parameter groups, SGD with momentum: 2 ranks on
    different halves of each batch equal one process on the whole batch, a parameter with no
    gradient in one step included; together the ranks hold the state once, and none for a
    parameter that never had a gradient (torch.optim's lazy state)."""
    ranks = launch(_sharded_vs_unsharded, 2, args=(config,), timeout_s=120)
    per_param = {"adamw": 2, "sgd": 1}[config]
    for err, _, _ in ranks:
        assert err < 1e-12
    total = ranks[0][2]
    assert sum(h for _, h, _ in ranks) == per_param * total
    assert max(h for _, h, _ in ranks) <= 0.6 * per_param * total


def _zero3_vs_whole_batch(rank: int, world: int) -> float:
    """Two Adam steps of an MLP with ``Zero3Linear`` layers on this rank's half of each batch
    against the plain MLP on the whole batch; the largest difference of the gathered
    parameters."""
    import torch.distributed as dist

    from labsim.parallel.zero import zero3_wrap

    def mlp() -> torch.nn.Module:
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(),
                                   torch.nn.Linear(7, 5)).double()

    plain, sharded = mlp(), zero3_wrap(mlp())
    ref, opt = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (plain, sharded))
    for step in range(2):
        x = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(step)).double()
        for model, o, batch in ((plain, ref, x), (sharded, opt, dp.shard(x, rank, world))):
            model(batch).square().mean().backward()
            o.step()
            o.zero_grad()
    err = 0.0
    for layer, full in ((sharded[0], plain[0]), (sharded[2], plain[2])):
        gathered = layer.shard.new_empty(world * layer.shard.numel())
        dist.all_gather_into_tensor(gathered, layer.shard.detach())
        flat = torch.cat([full.weight.detach().reshape(-1), full.bias.detach()])
        err = max(err, float((gathered[:flat.numel()] - flat).abs().max()))
    return err


@pytest.mark.slow
def test_zero3_by_hand_equals_one_process_on_the_whole_batch() -> None:
    """Uneven layers (6 x 7 + 7 = 49 elements: padded shards) included."""
    assert max(launch(_zero3_vs_whole_batch, 2, timeout_s=120)) < 1e-12
