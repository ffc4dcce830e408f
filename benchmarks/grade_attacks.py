"""The attack table of ``labsim grade``: every attack of the grading red-team, graded by the
checkout on ``PYTHONPATH``, beside a correct submission; prints attack -> points / status /
whether the review column names it.

    PYTHONPATH=$PWD python benchmarks/grade_attacks.py              # this checkout
    PYTHONPATH=$OTHER python benchmarks/grade_attacks.py --fixtures $OTHER/tests/fixtures

It uses only what every version of the grader has (``labsim.course.release.release``, the
``labsim grade`` command and the tests' tiny lab ``gradelab``), so it measures a checkout
before and after a change the same way.  Takes a few minutes on 2 cores (real labs are cut to
the attacked exercise).
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECRET = "hunter2-grader-secret"


def _src(cell: dict) -> str:
    return "".join(cell["source"])


def _defines(cell: dict) -> list[str]:
    return re.findall(r"^(?:def|class)\s+(\w+)", _src(cell), flags=re.M)


def mini_lab(root: Path, solutions: Path, stem: str, names: list[str]) -> Path:
    """The lab ``stem`` cut to its setup cells and the exercises ``names``, released."""
    from labsim.course.release import release

    nb = json.loads((solutions / f"{stem}.ipynb").read_text())
    cells = nb["cells"]
    first = next(i for i, c in enumerate(cells) if "### BEGIN SOLUTION" in _src(c))
    kept = [c for c in cells[:first] if c["cell_type"] == "markdown"][:1]
    kept += [c for c in cells[:first] if c["cell_type"] == "code" and "import " in _src(c)]
    for i, cell in enumerate(cells):
        if "### BEGIN SOLUTION" in _src(cell) and set(_defines(cell)) & set(names):
            kept += [cell, next(c for c in cells[i + 1:]
                                if _src(c).startswith("# NBVAL_CHECK_OUTPUT"))]
    out = copy.deepcopy(nb)
    out["cells"] = copy.deepcopy(kept)
    for cell in out["cells"]:
        cell.pop("id", None)
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    number = stem.split("_", 1)[0]
    (root / "solutions").mkdir(parents=True, exist_ok=True)
    (root / "solutions" / f"{number}_mini.ipynb").write_text(json.dumps(out))
    release(root / "solutions", root / "labs", [f"{number}_mini"])
    return root / "labs" / f"{number}_mini.ipynb"


def answer(lab: Path, path: Path, answers: dict[str, str]) -> Path:
    nb = json.loads(lab.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "NotImplementedError" in _src(cell):
            for name, source in answers.items():
                if name in _defines(cell):
                    cell["source"] = source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))
    return path


def solution_of(solutions: Path, stem: str, name: str) -> str:
    nb = json.loads((solutions / f"{stem}.ipynb").read_text())
    return next(_src(c) for c in nb["cells"]
                if name in _defines(c) and "### BEGIN SOLUTION" in _src(c))


def grade(lab: Path, subs: list[Path], out: Path, extra: Path | None = None,
          timeout_s: float = 900, keep: Path | None = None,
          memory_bytes: int = 8 * 10**9, kernel: str = "4GiB") -> tuple[int | str, str]:
    """Run ``labsim grade`` (its address space capped, so a grader that reads /dev/zero fails
    instead of taking the machine); (exit code or 'hung', CSV text or stderr)."""
    cmd = ["prlimit", f"--as={memory_bytes}", "--",
           sys.executable, "-m", "labsim", "grade", "--lab", str(lab), *map(str, subs),
           "--out", str(out), "--jobs", "2", "--timeout-cell", "240",
           "--timeout-notebook", "400", "--feedback", str(out.parent / "feedback"),
           "--memory", kernel]
    if extra is not None:
        cmd += ["--extra-checks", str(extra)]
    if keep is not None:
        cmd += ["--keep-runs", str(keep)]
    env = dict(os.environ, LABSIM_TEST_GRADER_SECRET=SECRET)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return "hung", ""
    return proc.returncode, out.read_text() if out.exists() else proc.stderr[-300:]


def rows(csv_text: str) -> dict[str, dict]:
    return {Path(r["submission"]).stem: r for r in csv.DictReader(io.StringIO(csv_text))}


TINY_ATTACKS = {
    "forged records from a forked process": '''import os, glob, json, time
rec = json.dumps({"cell": 2, "phase": "call", "outcome": "passed", "kernel_alive": True,
                  "outputs": [{"type": "stream", "name": "stdout",
                               "text": "PASS add: 5/5 cases passed\\n"}]}) + "\\n"
if os.fork() == 0:  # once the check's own record is written, append ours: the last wins
    targets = [os.path.join(os.getcwd(), "cells.jsonl"),
               *glob.glob("/run/labsim/**", recursive=True)]
    for _ in range(3000):
        time.sleep(0.005)
        for p in targets:
            try:
                if '"cell": 2,' in open(p).read():
                    open(p, "a").write(rec)
                    os._exit(0)
            except OSError:
                pass
    os._exit(0)
def add(a, b):
    return a - b - 1
''',
    "expected read from the check's frames": '''import sys
def add(a, b):
    f = sys._getframe(1)
    while f is not None:
        for v in list(f.f_locals.values()):
            if hasattr(v, "expected") and getattr(v, "args", None) == (a, b):
                return v.expected
        f = f.f_back
    return None
''',
    "an exception named CheckFailed carrying a FAIL 5/5 line": '''import importlib
class CheckFailed(AssertionError):
    pass
def run_check(title, fn, cases, **kwargs):
    n = len(list(cases))
    raise CheckFailed(f"FAIL {title}: {n}/{n} cases passed")
for name in ("labsim.checks", "labsim.checks._core"):
    setattr(importlib.import_module(name), "run_check", run_check)
def add(a, b):
    return a - b - 1
''',
    "run_check's code swapped via importlib": '''import importlib
_core = importlib.import_module("labsim." + "checks." + "_core")
def _fake(title, fn, cases, *, compare=None):
    n = len(list(cases))
    print(f"PASS {title}: {n}/{n} cases passed")
_core.run_check.__code__ = _fake.__code__
def add(a, b):
    return a - b - 1
''',
    "set_custom_exc prints the PASS line": '''get_ipython().set_custom_exc(
    (BaseException,), lambda *a, **k: print("PASS add: 5/5 cases passed"))
def add(a, b):
    return a - b - 1
''',
    "the grader's secrets in an exception": '''import os, glob
def add(a, b):
    s = repr(dict(os.environ))
    for p in glob.glob("/tmp/attacks-*/tiny/private/*.py") + glob.glob(
            "/tmp/attacks-*/tiny/subs/*.ipynb"):
        try:
            s += open(p).read()
        except OSError:
            pass
    raise ValueError("LEAK " + s)
''',
    "writes to /dev/shm, the cgroup fs, a classmate's feedback (add 1 = blocked)": '''import os
import glob
hits = []
for p in ["/dev/shm/labsim-probe"] + glob.glob("/sys/fs/cgroup/*/tasks")[:1] + glob.glob(
        "/tmp/**/feedback/*.txt", recursive=True):
    try:
        open(p, "a").write("x")
        hits.append(p)
    except OSError:
        pass
def add(a, b):
    return a + b if not hits else None
''',
    "a raw write to a loop device (add 1 = blocked)": '''import glob
hits = []
for p in glob.glob("/dev/loop*")[:1]:
    try:
        open(p, "r+b").write(b"")
        hits.append(p)
    except OSError:
        pass
def add(a, b):
    return a + b if not hits else None
''',
    "300 processes (add 1 = limited)": '''import os, time
kids = 0
try:
    for _ in range(300):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        kids += 1
except OSError:
    pass
def add(a, b):
    return a + b if kids < 300 else None
''',
    "the solutions read from the checkout": '''import glob, json
src = None
for p in glob.glob("/work/**/solutions/90_tiny.ipynb", recursive=True) + glob.glob(
        "/tmp/**/solutions/90_tiny.ipynb", recursive=True):
    try:
        cells = json.load(open(p))["cells"]
        src = next("".join(c["source"]) for c in cells if "def add" in "".join(c["source"]))
        break
    except (OSError, StopIteration, ValueError):
        pass
exec(src or "def add(a, b):\\n    return None")
''',
}


REAL = [  # (lab, exercise, check column, attack, source)
    ("07_collectives", "ring_allreduce", "ring_allreduce", "ring as dist.all_reduce",
     "def ring_allreduce(tensor):\n    dist.all_reduce(tensor)\n    return tensor\n"),
    ("04_flash_attention", "tiled_attention", "tiled_attention", "tiled as full-row softmax",
     "def tiled_attention(q, k, v, causal=False, block_q=64, block_kv=64):\n"
     "    out = torch.empty_like(q)\n    for i in range(0, q.shape[-2], block_q):\n"
     "        s = q[..., i:i + block_q, :] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])\n"
     "        if causal:\n            rows = torch.arange(i, i + s.shape[-2]).unsqueeze(-1)\n"
     "            s = s.masked_fill(torch.arange(s.shape[-1]) > rows, float('-inf'))\n"
     "        out[..., i:i + block_q, :] = torch.softmax(s, -1) @ v\n    return out\n"),
    ("04_flash_attention", "tiled_attention", "tiled_attention",
     "SDPA under DisableTorchFunction",
     "def tiled_attention(q, k, v, causal=False, block_q=64, block_kv=64):\n"
     "    with torch._C.DisableTorchFunction():\n"
     "        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)\n"),
    ("05_kernel_fusion", "fused_chain", "fused_chain", "fused chain calls the reference",
     "def fused_chain(x, bias, residual, keep, p, chunk_rows=256):\n"
     "    return bias_gelu_dropout_residual(x, bias, residual, keep, p)\n"),
    ("02_mixed_precision", "DynamicLossScaler", "loss_scaler", "scaler as a GradScaler subclass",
     "class DynamicLossScaler(torch.amp.GradScaler):\n"
     "    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,\n"
     "                 growth_interval=2000):\n"
     "        super().__init__('cpu', init_scale=init_scale, growth_factor=growth_factor,\n"
     "                         backoff_factor=backoff_factor, growth_interval=growth_interval)\n"),
    ("03_checkpointing", "checkpointed_forward", "checkpointed_forward",
     "checkpointing by labsim's own forward",
     "from labsim.checks.checkpointing import forward_segments\n"
     "def checkpointed_forward(blocks, x, starts):\n"
     "    return forward_segments(blocks, x, starts)\n"),
    ("08_data_parallel", "BucketDDP", "bucketed_ddp",
     "bucketed DDP as a blocking all-reduce per parameter",
     "class BucketDDP(nn.Module):\n    def __init__(self, module, bucket_cap_bytes):\n"
     "        super().__init__()\n        self.module = module\n"
     "        for p in module.parameters():\n            dist.broadcast(p.data, src=0)\n"
     "            if p.requires_grad:\n"
     "                p.register_post_accumulate_grad_hook(self._hook)\n"
     "    def _hook(self, p):\n        dist.all_reduce(p.grad, async_op=True).wait()\n"
     "        p.grad /= dist.get_world_size()\n"
     "    def forward(self, *args, **kwargs):\n        return self.module(*args, **kwargs)\n"
     "    def finish_gradient_synchronization(self):\n        pass\n"),
    ("09_zero_fsdp", "ShardedOptimizer", "sharded_optimizer",
     "ZeRO-1 as the replicated optimizer",
     "class ShardedOptimizer:\n    def __init__(self, params, optimizer_cls, **kwargs):\n"
     "        self.opt = optimizer_cls(params, **kwargs)\n"
     "    def zero_grad(self):\n        self.opt.zero_grad()\n"
     "    @torch.no_grad()\n    def step(self):\n"
     "        for g in self.opt.param_groups:\n            for p in g['params']:\n"
     "                if p.grad is not None:\n                    dist.all_reduce(p.grad)\n"
     "                    p.grad /= dist.get_world_size()\n"
     "        self.opt.step()\n"),
    ("12_int8_quantization", "int8_matmul", "int8_matmul", "int8 matmul in float64",
     "def int8_matmul(x_q, w_q, x_zero_point):\n"
     "    x = x_q.double() - float(x_zero_point)\n"
     "    return (x @ w_q.double().T).round().to(torch.int32)\n"),
    ("12_int8_quantization", "int8_matmul", "int8_matmul", "lab 12's `ref` in the namespace",
     "def int8_matmul(x_q, w_q, x_zero_point):\n"
     "    return ref.int8_matmul(x_q, w_q, x_zero_point)\n"),
    ("00_why_gpus", "matmul_cost", "matmul_cost", "a reference importable from labsim",
     "from labsim.roofline import matmul_bytes as _b, matmul_flops as _f\n"
     "def matmul_cost(m, n, k, dtype_bytes):\n"
     "    return _f(m, n, k), _b(m, n, k, dtype_bytes)\n"),
]


def _cell(r: dict | None, column: str) -> str:
    if r is None:
        return "no row"
    flagged = "flagged" if r.get("review") else "not flagged"
    return f"{column} {r[column]} (total {r['total']}/{r['max']}, {r['status']}, {flagged})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=ROOT / "tests" / "fixtures",
                        help="the tests/fixtures folder of the checkout graded")
    parser.add_argument("--solutions", type=Path, default=None,
                        help="its solutions/ (default: beside the fixtures)")
    parser.add_argument("--only", choices=("tiny", "real", "files"), default=None)
    args = parser.parse_args()
    sys.path.insert(0, str(args.fixtures))
    import gradelab

    solutions = args.solutions or args.fixtures.parent.parent / "solutions"
    tmp = Path(tempfile.mkdtemp(prefix="attacks-", dir="/tmp"))
    table: list[tuple[str, str]] = []
    if args.only in (None, "tiny"):
        lab = gradelab.release_lab(tmp / "tiny")
        subs = [gradelab.submission(lab, tmp / "tiny" / "subs" / "correct.ipynb",
                                    **gradelab.SOLUTIONS)]
        for i, src in enumerate(TINY_ATTACKS.values()):
            subs.append(gradelab.submission(lab, tmp / "tiny" / "subs" / f"a{i}.ipynb",
                                            add=src, scale=gradelab.SOLUTIONS["scale"],
                                            mean=gradelab.SOLUTIONS["mean"]))
        extra = tmp / "tiny" / "private" / "extra_checks.py"
        extra.parent.mkdir(parents=True)
        try:
            from labsim.checks import Hidden  # noqa: F401
            extra.write_text(
                "from labsim.checks import Case, Hidden, equal\nCHECKS = [Hidden('add_big', "
                "'add', [Case(f'big{i}', (10**12 * i, 7), expected=10**12 * i + 7) "
                "for i in range(1, 6)], points=3, compare=equal)]\n")
        except ImportError:
            extra.write_text(
                "# %%\nfrom labsim.checks import Case, equal, run_check\n\n# %% extra-check "
                "add_big points=3\nrun_check('add_big', add, [Case(f'big{i}', (10**12 * i, 7), "
                "expected=10**12 * i + 7) for i in range(1, 6)], compare=equal)\n")
        rc, text = grade(lab, subs, tmp / "tiny" / "grades.csv", extra)
        got = rows(text) if rc == 0 else {}
        table.append(("correct tiny submission (add)", _cell(got.get("correct"), "add")))
        for i, name in enumerate(TINY_ATTACKS):
            r = got.get(f"a{i}")
            cell = _cell(r, "add")
            if name.startswith("the grader's secrets") and r is not None:
                fb = (tmp / "tiny" / "feedback" / f"a{i}.txt").read_text()
                leaked = [w for w, k in (("the grader's environment", SECRET),
                                         ("the private extra checks", "10**12"),
                                         ("classmates' notebooks", "nbformat")) if k in fb]
                cell += "; leaked: " + (", ".join(leaked) or "nothing")
            table.append((name, cell))
    if args.only in (None, "real"):
        for stem, name, column, attack, src in REAL:
            root = tmp / f"{stem}-{name}-{len(table)}"
            lab = mini_lab(root, solutions, stem, [name])
            good = answer(lab, root / "subs" / "correct.ipynb",
                          {name: solution_of(solutions, stem, name)})
            bad = answer(lab, root / "subs" / "attack.ipynb", {name: src})
            rc, text = grade(lab, [good, bad], root / "grades.csv")
            got = rows(text) if rc == 0 else {}
            table.append((f"{attack} (correct beside it: "
                          f"{_cell(got.get('correct'), column)})", _cell(got.get("attack"),
                                                                          column)))
    if args.only in (None, "files"):
        lab = gradelab.release_lab(tmp / "files")
        d = tmp / "files" / "subs"
        good = gradelab.submission(lab, d / "correct.ipynb", **gradelab.SOLUTIONS)
        cases = {
            "a UTF-16 file": lambda p: p.write_bytes(good.read_text().encode("utf-16")),
            "a zip renamed .ipynb": lambda p: p.write_bytes(b"PK\x03\x04" + b"\0" * 64),
            "deeply nested JSON": lambda p: p.write_bytes(b"[" * 300_000 + b"]" * 300_000),
            "a FIFO named .ipynb": lambda p: os.mkfifo(p),
            "a symlink to /dev/zero": lambda p: p.symlink_to("/dev/zero"),
            "a symlink to the solution": lambda p: p.symlink_to(
                tmp / "files" / "solutions" / "90_tiny.ipynb"),
        }
        for name, make in cases.items():
            path = d / f"{len(table)}.ipynb"
            make(path)
            start = time.monotonic()
            rc, text = grade(lab, [good, path], tmp / "files" / f"{len(table)}.csv",
                             timeout_s=120, memory_bytes=4 * 10**9, kernel="1536MiB")
            wall = time.monotonic() - start
            if rc == 0:
                r = rows(text)
                bad = r.get(path.stem, {})
                good_row = r.get("correct", {})
                outcome = (f"exit 0, {bad.get('status')} {bad.get('total')}/"
                           f"{bad.get('max')} ({bad.get('reason', '')[:60]}); correct "
                           f"{good_row.get('total')}/{good_row.get('max')}; {wall:.0f} s")
            else:
                outcome = f"exit {rc}, no CSV ({text.strip()[-80:]}); {wall:.0f} s"
            table.append((name, outcome))
        big = json.loads(good.read_text())
        code = next(c for c in big["cells"] if c["cell_type"] == "code")
        code["outputs"].append({"output_type": "stream", "name": "stdout",
                                "text": "x" * 39_000_000})
        path = d / "big.ipynb"
        path.write_text(json.dumps(big))
        start = time.monotonic()
        out = tmp / "files" / "big.csv"
        proc = subprocess.Popen([sys.executable, "-m", "labsim", "grade", "--lab", str(lab),
                                 str(path), "--out", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        peak_kb = 0
        while proc.poll() is None:  # the grader's own peak resident memory
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.1)
        r = rows(out.read_text()).get("big", {}) if out.exists() else {}
        table.append(("a 39 MB notebook", f"{r.get('status')} {r.get('total')}/{r.get('max')} "
                      f"in {time.monotonic() - start:.0f} s, grader's peak RSS "
                      f"{peak_kb / 1024:.0f} MiB"))
        link = gradelab.submission(lab, d / "keeplink.ipynb", add="import os\nos.symlink("
                                   "'/usr/share', os.path.join(os.getcwd(), 'usr-share'))\n"
                                   + gradelab.SOLUTIONS["add"], scale=gradelab.SOLUTIONS[
                                       "scale"], mean=gradelab.SOLUTIONS["mean"])
        keep = tmp / "files" / "keep"
        rc, _ = grade(lab, [link], tmp / "files" / "keep.csv", keep=keep)
        size = sum(f.stat().st_size for f in keep.rglob("*") if f.is_file()
                   and not f.is_symlink()) if keep.exists() else 0
        table.append(("--keep-runs and a symlink to /usr/share",
                      f"exit {rc}; kept {size / 1e6:.1f} MB"))
    width = max(len(a) for a, _ in table)
    for attack, outcome in table:
        print(f"{attack:{width}}  {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
