"""A bucketed DDP on an emulated wire (labsim.experiments.data_parallel.wire_steps): the
wire's schedule is the one its contract states, and torch.distributed is restored after."""

from __future__ import annotations

import torch.distributed as dist

from labsim.experiments.data_parallel import wire_steps
from labsim.parallel.data_parallel import DataParallelBucket


def test_the_wire_carries_one_message_per_bucket_at_its_speed() -> None:
    saved = (dist.all_reduce, dist.broadcast, dist.get_world_size, dist.get_rank)
    alpha, bandwidth = 1e-4, 2e8
    (step,) = wire_steps(DataParallelBucket, bandwidths_Bps=(bandwidth,), alpha_s=alpha,
                         cap_bytes=20e3, width=64, depth=4, batch=4, repeat=1,
                         progress=False)
    assert (dist.all_reduce, dist.broadcast, dist.get_world_size, dist.get_rank) == saved
    assert sum(step.nbytes) == 4 * 4 * (64 * 64 + 64)  # 4 layers of 64 x 64 + 64, fp32
    assert len(step.launches_s) == len(step.arrivals_s) == len(step.nbytes) >= 2
    free = 0.0
    for launch, arrival, nbytes in zip(step.launches_s, step.arrivals_s, step.nbytes):
        start = max(launch, free)  # one message at a time
        assert abs(arrival - (start + alpha + nbytes / bandwidth)) < 1e-9
        free = arrival
    assert step.wire_s == sum(alpha + n / bandwidth for n in step.nbytes)
    assert max(step.launches_s) <= step.backward_s  # every bucket is launched by the hooks
    assert step.exposed_s == max(0.0, step.arrivals_s[-1] - step.backward_s)
    assert step.hidden_s <= step.wire_s
