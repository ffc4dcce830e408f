"""The worker process of ``labsim.lab.launcher``, and the same worker under torchrun.

Launched by ``launch()``::  python -m labsim.lab.worker --payload P --result R
(RANK and WORLD_SIZE in the environment; the ranks meet through the payload's file
``init_method``, which a port taken by another process cannot break).

Under torchrun, on a real node::

    torchrun --nproc_per_node=8 -m labsim.lab.worker package.module:function

joins the process group (NCCL when each rank has a GPU, else gloo), calls
``function(rank, world_size)`` and prints each rank's return value.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from labsim.lab.launcher import WorkerOutcome, _alive


def resolve(spec: str) -> Any:
    """'package.module:function' -> the function."""
    module, _, name = spec.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _watch_parent(launcher: int) -> None:
    """Exit if the launching process dies (no orphan workers after a kernel restart): the
    launcher itself, or the zygote that forked this worker (``labsim.lab.zygote``), which
    ends with it."""
    parent = os.getppid()

    def loop() -> None:
        while True:
            if os.getppid() != parent or not _alive(launcher):
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=loop, daemon=True).start()


def _write(path: Path, outcome: WorkerOutcome) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001 - an unpicklable return value is the learner's
        data = pickle.dumps(WorkerOutcome(
            False, exc_type=type(exc).__name__, finished_at=outcome.finished_at,
            traceback=f"the return value could not be pickled: {exc}"))
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("function", nargs="?", help="module:function (torchrun mode)")
    parser.add_argument("--payload", help="cloudpickled call (launcher mode)")
    parser.add_argument("--result", help="where to write this rank's outcome")
    parser.add_argument("--backend", default=None)
    args = parser.parse_args(argv)
    if "LABSIM_PARENT_PID" in os.environ:
        _watch_parent(int(os.environ["LABSIM_PARENT_PID"]))
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.payload:
        call = pickle.loads(Path(args.payload).read_bytes())
    elif args.function:
        call = {"fn": args.function, "args": (), "kwargs": {}, "backend": args.backend,
                "timeout_s": 600.0, "threads": None}
    else:
        parser.error("give module:function (torchrun) or --payload (launcher)")
    backend = call["backend"] or ("nccl" if torch.cuda.is_available() else "gloo")
    if call["threads"]:
        torch.set_num_threads(call["threads"])
    fn = resolve(call["fn"]) if isinstance(call["fn"], str) else call["fn"]
    if backend == "nccl":
        torch.cuda.set_device(local)
    try:
        dist.init_process_group(backend, init_method=call.get("init_method") or "env://",
                                rank=rank, world_size=world,
                                timeout=timedelta(seconds=float(call["timeout_s"])))
        # every rank connected before any runs fn: gloo's connectFullMesh can still be
        # handshaking on one rank when a peer that has finished its side runs a short fn,
        # destroys the group and exits ("Connection closed by peer")
        dist.barrier()
        value = fn(rank, world, *call["args"], **call["kwargs"])
        outcome = WorkerOutcome(True, value, finished_at=time.time())
    except BaseException as exc:  # noqa: BLE001 - report everything to the launcher
        outcome = WorkerOutcome(False, exc_type=type(exc).__name__,
                                traceback=traceback.format_exc(), finished_at=time.time())
    sys.stdout.flush()
    if args.result:
        _write(Path(args.result), outcome)
    else:
        # torchrun mode is a program: its output is each rank's result
        shown = outcome.value if outcome.ok else outcome.traceback
        sys.stdout.write(f"rank {rank}: {shown!r}\n")
        sys.stdout.flush()
    if not outcome.ok:
        os._exit(1)  # do not wait in a collective for ranks that may never come
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
