"""Time each lab's cell of the running table (``labsim.experiments.my_step``) as a learner runs
it: one fresh interpreter per lab, in lab order, all writing one table in a scratch folder.

    python benchmarks/my_step.py [--labs 00 02 ...] [--cold] [--busy N] [--repeat K]

For every lab it prints the wall time and CPU time of the cell (``record`` and printing the
table, imports apart), the interpreter's peak RSS, and each row's verdict against fp32.  Lab
04 plugs in the FlashAttention-2 of ``solutions/04_flash_attention.ipynb``.  ``--cold`` gives
lab 05 an empty Inductor cache (what a first run pays); ``--busy N`` keeps N processes
spinning meanwhile (a machine someone else uses); ``--repeat K`` runs the whole set K times,
so that a verdict that flips from run to run shows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABS = ("00", "02", "03", "04", "05")

CELL = r"""
import json, resource, sys, time
from labsim.experiments import my_step
kwargs = {}
if LAB == "04":
    nb = json.loads(open(NOTEBOOK, encoding="utf-8").read())
    src = next("".join(c["source"]) for c in nb["cells"]
               if "class FlashAttention2" in "".join(c["source"]))
    ns = {}
    exec(compile("import math\nimport torch\n" + src, "<FlashAttention2>", "exec"), ns)
    kwargs["attention"] = lambda q, k, v: ns["FlashAttention2"].apply(q, k, v, True)
wall, cpu = time.perf_counter(), time.process_time()
table = my_step.record(LAB, **kwargs)
text = str(table) + ("\n" + table.summary() if LAB == "05" else "")
out = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
       "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
       "rows": {k: my_step._versus(r) for k, r in table.rows.items() if r.lab == LAB},
       "text": text}
print("RESULT" + json.dumps(out))
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_lab(lab: str, folder: Path, env: dict[str, str]) -> dict:
    """One lab's cell in a fresh interpreter started in ``folder``; ``process_cpu_s`` is the
    interpreter's whole CPU time (imports, and the compiler processes it waited for)."""
    code = f"LAB = {lab!r}\nNOTEBOOK = {str(ROOT / 'solutions' / '04_flash_attention.ipynb')!r}"
    before = _children_cpu_s()
    proc = subprocess.run([sys.executable, "-c", code + CELL], cwd=folder, env=env,
                          capture_output=True, text=True, check=False)
    line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT")), None)
    if line is None:
        raise RuntimeError(f"lab {lab} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(line[len("RESULT"):])
    result["stderr"] = proc.stderr.strip()
    result["process_cpu_s"] = _children_cpu_s() - before
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--labs", nargs="*", default=list(LABS))
    parser.add_argument("--cold", action="store_true", help="empty Inductor cache for lab 05")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes meanwhile")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    try:
        for k in range(args.repeat):
            with tempfile.TemporaryDirectory() as tmp:
                env = dict(os.environ, PYTHONPATH=str(ROOT))
                if args.cold:
                    env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
                print(f"run {k + 1} of {args.repeat} ({args.busy} busy processes"
                      f"{', cold Inductor cache' if args.cold else ''})")
                for lab in args.labs:
                    start = time.perf_counter()
                    r = run_lab(lab, Path(tmp), env)
                    print(f"  lab {lab}: cell {r['wall_s']:5.1f} s wall, {r['cpu_s']:5.1f} s CPU"
                          f"; interpreter {time.perf_counter() - start:5.1f} s wall, "
                          f"{r['process_cpu_s']:5.1f} s CPU, peak RSS "
                          f"{r['rss_bytes'] / 1e6:.0f} MB; {r['rows']}")
                    if r["stderr"]:
                        print(f"    stderr: {r['stderr'][-500:]}")
                print(r["text"])
    finally:
        for p in spinners:
            p.kill()


if __name__ == "__main__":
    main()
