"""The communication recorder (labsim.lab.comm): every collective and point-to-point op the
code dispatches, with its payload and phase, whatever API issued it; matmul FLOPs too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsim.lab import launch
from labsim.lab.comm import CommOp, CommRecorder, comm_kind, count_by_kind


def _everything(rank: int, world: int) -> tuple[list[CommOp], int, dict[str, int]]:
    import torch.distributed._functional_collectives as funcol

    x = torch.arange(8, dtype=torch.float64) + rank
    a = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    with CommRecorder() as rec:
        dist.all_reduce(x.clone())
        out = torch.empty(8 * world, dtype=torch.float64)
        dist.all_gather_into_tensor(out, x)
        dist.all_gather([torch.empty_like(x) for _ in range(world)], x)
        dist.reduce_scatter_tensor(torch.empty(8 // world, dtype=torch.float64), x)
        funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait()
        rec.phase = "backward"
        peer = 1 - rank
        if rank == 0:
            dist.isend(x, peer).wait()
        else:
            dist.irecv(x, peer).wait()
        (a @ a.T).sum().backward()
    return rec.comms, rec.flops, rec.count("backward")


@pytest.mark.multiprocess
def test_every_api_is_seen_with_its_whole_payload_and_phase() -> None:
    comms, flops, backward = launch(_everything, 2, timeout_s=120)[1]
    assert [(c.kind, c.numel, c.phase) for c in comms] == [
        ("all_reduce", 8, "forward"), ("all_gather", 16, "forward"),
        ("all_gather", 16, "forward"), ("reduce_scatter", 8, "forward"),
        ("all_gather", 16, "forward"), ("recv", 8, "backward")]
    assert comms[0].nbytes == 64 and backward == {"recv": 1}
    assert flops == 3 * 2 * 4 * 4 * 6  # forward a @ a.T and the two backward GEMMs


def test_kinds_and_counts_without_a_process_group() -> None:
    assert comm_kind(torch.ops.c10d.allreduce_.default) == "all_reduce"
    assert comm_kind(torch.ops._c10d_functional.wait_tensor.default) is None
    assert comm_kind(torch.ops.aten.mm.default) is None
    ops = [CommOp("send", 1, 4, "forward", "c10d::send")] * 2 + [
        CommOp("all_reduce", 1, 4, "backward", "c10d::allreduce_")]
    assert count_by_kind(ops) == {"all_reduce": 1, "send": 2}
    with CommRecorder() as rec:
        torch.ones(3, 5) @ torch.ones(5, 2)
    assert rec.comms == [] and rec.flops == 2 * 3 * 5 * 2


def test_importing_the_recorder_leaves_triton_unimported() -> None:
    """Triton's interpreter is chosen at its first import (lab 05 sets TRITON_INTERPRET before
    it), so the checks that import the recorder must not import Triton on the way."""
    import subprocess
    import sys

    code = ("import sys, labsim.lab.comm, labsim.checks.moe, labsim.checks.expert_parallel, "
            "labsim.checks.tensor_parallel, labsim.checks.context_parallel; "
            "print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
