"""What the checks see of a learner's function: the dispatcher recorder and the tripwire.

The recorder sees what ``__torch_function__`` hides (SDPA under
``torch._C.DisableTorchFunction()``), a ``ProcessGroup`` called directly, the size of every
tensor created (not views), floats created and matmul operand dtypes.  The tripwire catches a
reference however it is reached (an alias, a wrapper through labsim's own helpers, handed in
directly, a subclass), but not the shell classes calling helpers beside them.
"""

from __future__ import annotations

import os

import pytest
import torch

from labsim.checks._observe import passed_references, reference_codes, trusted, watch
from labsim.lab.profile import OpLog

ROOFLINE = ["labsim.roofline:matmul_flops"]
LEARNER = "<notebook cell>"  # code compiled from a cell is untrusted


def _learner(src: str, name: str, **ns) -> object:  # noqa: ANN003
    exec(compile(src, LEARNER, "exec"), ns)  # noqa: S102
    return ns[name]


def test_sdpa_under_disabled_torch_function_is_seen() -> None:
    q = torch.randn(1, 2, 8, 4)
    with OpLog() as log, torch._C.DisableTorchFunction():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert any("scaled_dot_product" in name for name in log.counts)


def test_created_tensors_not_views_and_dtypes() -> None:
    x = torch.randn(64, 64)
    with OpLog() as log:
        x.T.contiguous()  # a new 4096-element tensor; .T alone is a view
        y = x[:2]  # view
        y.add_(1)  # in place
        (torch.ones(3, dtype=torch.int8) @ torch.ones(3, dtype=torch.int8))
    assert log.largest_new == 4096
    assert "int8" in log.matmul_dtypes or "int8" in str(log.matmul_dtypes)
    assert log.float_dtypes == {"float32"}


def test_held_bytes_counts_only_what_is_still_alive() -> None:
    with OpLog(keep_created=True) as log:
        keep = torch.zeros(100, dtype=torch.float64)
        torch.zeros(1000, dtype=torch.float64)  # dropped at once
    assert log.held_bytes() == 800
    assert log.held_bytes(exclude=[keep]) == 0


def test_tripwire_sees_an_alias_and_a_path_through_labsim_helpers() -> None:
    alias = _learner("from labsim.roofline import matmul_flops as mf\n"
                     "def f(m, n, k):\n    return mf(m, n, k)\n", "f")
    through = _learner("from labsim.lab.device import time_fn\n"
                       "from labsim.roofline import matmul_flops\n"
                       "def f(m, n, k):\n"
                       "    return [matmul_flops(m, n, k) for _ in range(1)][0]\n", "f")
    honest = _learner("def f(m, n, k):\n    return 2 * m * n * k\n", "f")
    for fn, hit in ((alias, True), (through, True), (honest, False)):
        with watch(ROOFLINE, ops=False) as seen:
            assert fn(2, 3, 4) == 48
        assert bool(seen.summary()["references"]) is hit


def test_tripwire_sees_threads_the_learner_starts() -> None:
    fn = _learner("import threading\nfrom labsim.roofline import matmul_flops\n"
                  "def f(m, n, k):\n    out = []\n"
                  "    t = threading.Thread(target=lambda: out.append(matmul_flops(m, n, k)))\n"
                  "    t.start(); t.join()\n    return out[0]\n", "f")
    with watch(ROOFLINE, ops=False) as seen:
        fn(2, 3, 4)
    summary = seen.summary()
    assert summary["references"][0] == "labsim.roofline.matmul_flops"
    assert len(summary["threads_started"]) == 1
    assert summary["references"][1].startswith("outside: it started threads")


def test_a_shell_calling_its_own_helpers_is_not_a_hit() -> None:
    from labsim.checks.quantization import reference as ref

    layer = ref.Int8Linear(torch.ones(2, 3, dtype=torch.int8), torch.tensor(0.1), None, None,
                           None, linear_fn=_learner(
                               "import torch\n"
                               "def lin(x, w_q, w_s, x_s, x_zp, bias=None):\n"
                               "    return x @ w_q.float().T * w_s\n", "lin"))
    with watch(["labsim.checks.quantization.reference:affine_qparams"], ops=False) as seen:
        layer(torch.randn(4, 3))  # dynamic: the shell computes the activation range itself
    assert seen.summary()["references"] == []


def test_the_reference_itself_or_a_subclass_handed_in_is_caught() -> None:
    from labsim.roofline import matmul_flops

    scaler = ["torch.amp.grad_scaler:GradScaler"]

    class Mine(torch.amp.GradScaler):
        pass

    assert passed_references([matmul_flops], ROOFLINE) == ["labsim.roofline.matmul_flops"]
    assert passed_references([Mine], scaler) == ["torch.amp.grad_scaler.GradScaler"]
    assert passed_references([lambda: 0], ROOFLINE) == []


def test_decorators_shared_code_is_not_watched() -> None:
    """contextlib's helper is shared by every @contextmanager: only the wrapped function
    of DDP.no_sync is watched, so another context manager is not a hit."""
    codes = reference_codes(["torch.nn.parallel.distributed:DistributedDataParallel"])
    import contextlib

    @contextlib.contextmanager
    def mine():  # noqa: ANN202
        yield

    assert mine.__code__ not in codes
    assert any(name.endswith("DistributedDataParallel") for name in codes.values())


def test_trusted_code_is_library_code() -> None:
    prefixes = (os.path.join(os.path.dirname(torch.__file__), ""),)
    assert trusted(torch.nn.functional.__file__, prefixes)
    assert not trusted("/tmp/ipykernel_12/3456.py", prefixes)
    assert not trusted("<string>", prefixes)


@pytest.mark.multiprocess
def test_process_group_called_directly_is_seen() -> None:
    from labsim.lab.launcher import launch

    result = launch(_direct_allreduce, 2, timeout_s=60)
    assert all("c10d::allreduce_" in ops for ops in result)


def _direct_allreduce(rank: int, world: int) -> dict:
    import torch.distributed as dist

    pg = dist.distributed_c10d._get_default_group()
    with OpLog() as log, torch._C.DisableTorchFunction():
        pg.allreduce([torch.ones(4)]).wait()
    return dict(log.counts)


def test_trusted_code_an_import_runs_is_not_a_hit(tmp_path) -> None:  # noqa: ANN001
    """A labsim module computing a constant with a reference while it is imported is its own
    business; an untrusted module doing the same is caught."""
    import sys

    from labsim.checks._observe import Tripwire

    (tmp_path / "evil_module.py").write_text(
        "from labsim.roofline import matmul_flops\nTABLE = matmul_flops(2, 3, 4)\n")
    sys.path.insert(0, str(tmp_path))
    wire = Tripwire(reference_codes(ROOFLINE))
    wire.arm(None)
    try:
        import evil_module  # noqa: F401
    finally:
        wire.disarm()
        sys.path.remove(str(tmp_path))
    assert wire.hits == ["labsim.roofline.matmul_flops"]


def test_a_watch_does_not_keep_its_callers_locals_alive() -> None:
    """The tripwire's boundary frame is dropped on exit: a check that keeps the watch (to read
    it later) must not keep the tensors of the frame that opened it, or a "no longer held"
    measurement (lab 09's ZeRO-3 check) would see them alive until a cycle collection."""
    import gc
    import weakref

    def opened() -> tuple[watch, weakref.ref]:
        local = torch.zeros(3)
        with watch(ROOFLINE, ops=False) as seen:
            pass
        return seen, weakref.ref(local)

    enabled = gc.isenabled()
    gc.disable()
    try:
        seen, ref = opened()
        assert ref() is None and seen.summary()["references"] == []
    finally:
        if enabled:
            gc.enable()


def test_work_on_a_python_thread_started_before_the_block_counts_as_elsewhere():
    """A pool thread started before the check, doing the work while the function waits, is
    counted; torch's native OpenMP workers are not (they run no Python code)."""
    import threading
    import time

    from labsim.checks._observe import outside_reason, watch

    go, done = threading.Event(), threading.Event()

    def spin():
        go.wait()
        end = time.thread_time() + 0.15
        while time.thread_time() < end:
            pass
        done.set()

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    with watch() as seen:
        go.set()
        done.wait(10)
    worker.join()
    summary = seen.summary()
    assert summary["elsewhere_cpu_s"] >= 0.1
    assert "ran on other threads" in outside_reason(summary)


def test_an_idle_process_with_torch_threads_shows_no_elsewhere_work():
    import torch

    from labsim.checks._observe import outside_reason, watch

    torch.randn(512, 512) @ torch.randn(512, 512)  # wakes the intra-op pool
    with watch() as seen:
        x = torch.randn(256, 256)
        for _ in range(20):
            x = (x @ x).tanh()
    assert outside_reason(seen.summary()) is None
