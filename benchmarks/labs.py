"""Execute every solution notebook and print its wall time and peak memory.

    python benchmarks/labs.py [NAME ...]

Each notebook runs in a fresh kernel, one at a time. Peak memory is the largest total
proportional set size (PSS) of the kernel and all its descendant processes (DataLoader
workers, distributed workers), sampled every 50 ms from /proc (Linux). PSS splits each page
shared by several processes among them, so forked workers that share the kernel's pages
copy-on-write are not counted twice, as a sum of RSS would. Elsewhere it falls back to the
kernel's own peak RSS from getrusage. Budget per lab: about 60 s and under 1.5 GB on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S, BUDGET_BYTES = 60.0, 1.5e9


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss_bytes(root: int) -> int:
    """Total PSS of ``root``'s descendants (not ``root`` itself), from /proc."""
    tree = _children()
    total, todo = 0, list(tree.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        total += _pss_bytes(pid)
    return total


def run_one(path: Path) -> tuple[float, float, str]:
    """(wall seconds, peak bytes, error or '') for one notebook."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    peak = [0]
    done = threading.Event()
    have_proc = Path("/proc/self/smaps_rollup").exists()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_pss_bytes(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    if have_proc:
        sampler.start()
    error = ""
    start = time.perf_counter()
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
    except Exception as exc:  # report and go on to the next lab
        error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:120]}"
    wall = time.perf_counter() - start
    done.set()
    if have_proc:
        sampler.join()
    else:
        peak[0] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return wall, float(peak[0]), error


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="labs to run, e.g. 00 03 (default: all)")
    parser.add_argument("--folder", type=Path, default=ROOT / "solutions")
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("MPLBACKEND", "Agg")
    paths = sorted(args.folder.glob("[0-9][0-9]_*.ipynb"))
    if args.names:
        paths = [p for p in paths if any(p.stem.startswith(n) for n in args.names)]
    print(f"{'lab':<28} {'wall s':>7} {'peak MB':>8}  budget ({BUDGET_S:.0f} s, "
          f"{BUDGET_BYTES / 1e6:.0f} MB)", flush=True)
    worst = 0
    for path in paths:
        wall, peak, error = run_one(path)
        over = wall > BUDGET_S or peak > BUDGET_BYTES
        worst = max(worst, 1 if (over or error) else 0)
        flag = "ERROR " + error if error else ("OVER" if over else "ok")
        print(f"{path.stem:<28} {wall:>7.1f} {peak / 1e6:>8.0f}  {flag}", flush=True)
    print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    return worst


if __name__ == "__main__":
    sys.exit(main())
