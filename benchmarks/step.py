"""The training-step model against published runs, and how fast it runs.

    python benchmarks/step.py              # calibration and held-out tables
    python benchmarks/step.py --fit        # refit every profile's fitted value
    python benchmarks/step.py --speed      # simulate_step / estimate_step process times
    python benchmarks/step.py --speed --repeat 10 --estimate-repeat 200
    python benchmarks/step.py --budget     # estimate_step on the longest ZeRO-3 steps replayed
    python benchmarks/step.py --agreement  # estimate_step vs simulate_step on a sweep
    python benchmarks/step.py --agreement 1000 --seed 1   # the held-out sweep
    python benchmarks/step.py --formula 60  # the long-pipeline formulas vs evaluation
    python benchmarks/step.py --sweep      # the fsdp profiles on llm-foundry's whole sweep
    python benchmarks/step.py --leave-one-stack-out [--write]   # each stack unseen; the
                                           # error bands StepResult carries
    python benchmarks/step.py --faster     # steps that faster links make slower (property 6)
    python benchmarks/step.py --variants   # models tried against the held-out misses, and
                                           # a bound: ZeRO-3 fitted on every run (~1 min)

Error = predicted / measured - 1 in step time.  ``--fit`` fits, for each (software profile,
GPU generation), the profile's one fitted value (``SoftwareProfile.fitted``: the sustained
fraction, or DeepSpeed 2021's host seconds per rank per ZeRO-3 gather) that minimises the
mean squared log error over that profile's calibration runs only (``labsim.published.runs()``,
role "calibration"); held-out runs are never used.  The values to paste into
``labsim.software`` are printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import numpy as np

import labsim
from labsim import pipeline, software
from labsim.collectives.nccl import clear_cache
from labsim.plan import Plan
from labsim.published import runs, sweep_runs
from labsim.sim.step import simulate_step
from labsim.step import closed_form as labsim_step


def predict(run, prof=None):
    plan = run.plan if prof is None else replace(run.plan, software=prof)
    return simulate_step(run.model, run.cluster, plan)


def table() -> None:
    print(f"{'role':<12} {'run':<46} {'stack':<22} {'GPUs':>5} {'measured':>9} "
          f"{'predicted':>9} {'error':>7} {'memory GB':>10}")
    summary = {}
    for role in ("calibration", "held-out"):
        errors = []
        for run in runs():
            if run.role != role:
                continue
            r = predict(run)
            measured = run.measured_step_s()
            error = r.step_time_s / measured - 1
            errors.append(error)
            mem = f"{r.memory.total / 1e9:.1f}/{r.gpu_memory_bytes / 1e9:.0f}" + (
                "" if r.fits else " NO")
            print(f"{role:<12} {run.id:<46} {run.plan_spec['software']:<22} {run.gpus:>5} "
                  f"{measured:>8.3g}s {r.step_time_s:>8.3g}s {error:>+7.1%} {mem:>10}")
        summary[role] = errors
    for role, errors in summary.items():
        a = [abs(e) for e in errors]
        print(f"{role}: {len(a)} runs, median |error| {statistics.median(a):.1%}, "
              f"max {max(a):.1%}, within 10 %: {sum(x <= 0.10 for x in a)}")


def _with(base, arch: str, x: float):
    """``base`` with its fitted value (``SoftwareProfile.fitted``) set to ``x``."""
    if base.fitted == "sustained":
        return replace(base, sustained=MappingProxyType(dict(base.sustained, **{arch: x})))
    return replace(base, **{base.fitted: x})


# search interval of each fitted value
FIT_RANGE = {"sustained": (0.4, 1.0), "zero3_host_s_per_rank": (0.0, 100e-6)}


def _golden(loss, lo: float, hi: float, rounds: int = 18) -> float:
    """The ``x`` in [lo, hi] of least ``loss(x)`` (golden-section search)."""
    g = (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    for _ in range(rounds):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    return (lo + hi) / 2


def fit() -> None:
    groups: dict[tuple[str, str], list] = {}
    for run in runs():
        if run.role == "calibration":
            arch = labsim.gpu(run.gpu).arch
            groups.setdefault((run.plan_spec["software"], arch), []).append(run)
    for (name, arch), members in sorted(groups.items()):
        base = software.PROFILES[name]

        def loss(x: float, base=base, arch=arch, members=members) -> float:
            prof = _with(base, arch, x)
            return sum(math.log(predict(r, prof).step_time_s / r.measured_step_s()) ** 2
                       for r in members) / len(members)

        x = _golden(loss, *FIT_RANGE[base.fitted])
        was = base.sustained.get(arch) if base.fitted == "sustained" else getattr(
            base, base.fitted)
        print(f"{name:<22} {arch:<8} {base.fitted} {x:.4g} (was {was}), rms "
              f"log error {math.sqrt(loss(x)):.1%} on {len(members)} calibration runs")


# the stacks whose sustained fractions are fitted on their own calibration runs, and the
# profiles that borrow each one's (labsim/software.py: "sustained: Megatron-LM 2021's")
FITTED_STACKS = {
    "megatron-lm-2021": ("megatron-lm-2021", "megatron-deepspeed-2022", "deepspeed-zero3-2021"),
    "megatron-lm-2022": ("megatron-lm-2022",),
    "megatron-core-te": ("megatron-core-te",),
    "fsdp": ("fsdp", "fsdp-torch1.13"),
}
# profiles no run is fitted on: every run of theirs is unseen as it stands
UNFITTED_STACKS = {"torchtitan-2024": ("torchtitan-2024",), "generic": ("generic",)}
# the year each source published its figures (the id's prefix)
_YEARS = {"narayanan2021": 2021, "megatronlm": 2021, "korthikanti2022": 2022,
          "bigscience2022": 2022, "smith2022": 2022, "llmfoundry": 2023, "dgxc2411": 2024,
          "meta2024": 2024, "torchtitan2024": 2024, "mcore09": 2024, "dgxc2504": 2025}


def run_feature(run) -> str:
    """What a run uses beyond dense 16-bit training: "FP8", "MoE + EP", "CP" or
    "BF16/FP16"."""
    if run.plan_spec.get("fp8"):
        return "FP8"
    if run.model_spec.get("experts"):
        return "MoE + EP"
    return "CP" if run.plan_spec.get("cp", 1) > 1 else "BF16/FP16"


def run_year(run) -> int:
    """The year ``run``'s figures were published (``_YEARS``, by the id's prefix)."""
    return next(y for prefix, y in _YEARS.items() if run.id.startswith(prefix))


def left_out_profile(name: str, stack: str):
    """Profile ``name`` (one of ``stack``'s family) with every sustained fraction replaced by
    the mean of the other fitted stacks' on the same GPU generation: what labsim would say of
    a stack none of whose runs it had seen."""
    base = software.PROFILES[name]
    others = [software.PROFILES[s] for s in FITTED_STACKS if s != stack]
    sustained = {}
    for arch in base.sustained:
        values = [o.sustained[arch] for o in others if arch in o.sustained]
        sustained[arch] = statistics.mean(values) if values else base.sustained[arch]
    return replace(base, sustained=MappingProxyType(sustained))


def stack_errors() -> list[tuple[str, str, str, float, float]]:
    """(stack left out, run id, profile, error with the calibrated profile, error with the
    stack left out) for every run of each fitted stack's family, and of each stack no run is
    fitted on (both errors the same: it is unseen as it stands)."""
    rows = []
    for stack, family in {**FITTED_STACKS, **UNFITTED_STACKS}.items():
        for run in runs():
            name = run.plan_spec["software"]
            if name in family:
                measured = run.measured_step_s()
                own = predict(run).step_time_s / measured - 1
                out = own if stack in UNFITTED_STACKS else predict(
                    run, left_out_profile(name, stack)).step_time_s / measured - 1
                rows.append((stack, run.id, name, own, out))
    return rows


def _summary(label: str, errors: list[float]) -> str:
    a = [abs(e) for e in errors]
    return (f"{label:<24} {len(a):>3} runs  median |error| {statistics.median(a):>5.1%}  "
            f"max {max(a):>5.1%}  within 10 %: {sum(x <= 0.10 for x in a)}")


def scaling_pairs() -> list[tuple[str, str, float, float]]:
    """(smaller run, larger run, measured speed-up, predicted speed-up) for every pair of
    published runs of the same model, layout per replica and software on more GPUs (the
    same global batch, so the step time itself scales)."""
    def key(run) -> tuple:
        per_replica = {k: v for k, v in run.plan_spec.items() if k != "dp"}
        return run.model_spec.get("name"), run.gpu, json.dumps(per_replica, sort_keys=True)

    groups: dict[tuple, list] = {}
    for run in runs():
        groups.setdefault(key(run), []).append(run)
    pairs = []
    for members in groups.values():
        members.sort(key=lambda r: r.gpus)
        for small, large in itertools.combinations(members, 2):
            if small.gpus == large.gpus:
                continue
            measured = small.measured_step_s() / large.measured_step_s()
            predicted = predict(small).step_time_s / predict(large).step_time_s
            pairs.append((small.id, large.id, measured, predicted))
    return pairs


def error_bands(rows: list[tuple[str, str, str, float, float]]) -> dict:
    """``labsim/data/step_bands.json``: each profile's typical (median) and worst |error| on
    its stack's runs with the stack left out; every other profile (``generic``, a profile of
    one's own) gets every stack's runs left out in turn."""
    def band(errors: list[float], basis: str) -> dict:
        a = [abs(e) for e in errors]
        return {"typical": round(statistics.median(a), 3), "worst": round(max(a), 3),
                "runs": len(a), "basis": basis}

    bands = {"*": band([r[4] for r in rows], "each stack unseen (fitted ones left out in turn)")}
    for stack, family in FITTED_STACKS.items():
        b = band([r[4] for r in rows if r[0] == stack], f"{stack}'s stack, fitted without its runs")
        bands.update({name: b for name in family})
    for stack, family in UNFITTED_STACKS.items():
        if stack != "generic":  # generic: every stack's band
            b = band([r[4] for r in rows if r[0] == stack], f"{stack}'s stack, never fitted")
            bands.update({name: b for name in family})
    return {"about": "Step-time error bands from `python benchmarks/step.py "
                     "--leave-one-stack-out --write` (docs/step.md section 3): |predicted / "
                     "measured - 1| on published runs whose stack the model was not fitted "
                     "on; typical = median, worst = max.", "profiles": bands}


def leave_one_stack_out(write: bool = False) -> None:
    """Every run of each fitted stack's family predicted with the other stacks' fractions,
    beside the calibrated profile's error on the same runs (held-out runs from a calibrated
    stack are not unseen); ``write``: the bands into labsim/data/step_bands.json."""
    rows = stack_errors()
    print(f"{'left out':<18} {'run':<46} {'profile':<22} {'calibrated':>10} {'left out':>9}")
    for stack in {**FITTED_STACKS, **UNFITTED_STACKS}:
        mine = [r for r in rows if r[0] == stack]
        for _, run_id, name, own, out in mine:
            print(f"{stack:<18} {run_id:<46} {name:<22} {own:>+10.1%} {out:>+9.1%}")
        a, b = [abs(r[4]) for r in mine], [abs(r[3]) for r in mine]
        print(f"{stack}: {len(a)} runs; calibrated median {statistics.median(b):.1%} max "
              f"{max(b):.1%}; left out median {statistics.median(a):.1%} max {max(a):.1%}\n")
    every = [abs(r[4]) for r in rows]
    print(f"every stack left out in turn: {len(every)} runs, median |error| "
          f"{statistics.median(every):.1%}, max {max(every):.1%}\n")
    by_id = {r.id: r for r in runs()}
    for title, of in (("by year", lambda r: str(run_year(r))), ("by GPU", lambda r: r.gpu),
                      ("by feature", run_feature)):
        print(title + ", every stack left out in turn:")
        groups: dict[str, list[float]] = {}
        for row in rows:
            groups.setdefault(of(by_id[row[1]]), []).append(row[4])
        for label in sorted(groups):
            print("  " + _summary(label, groups[label]))
    print("\nscaling: the same model and layout on more GPUs (speed-up of the step)")
    for small, large, measured, predicted in scaling_pairs():
        print(f"  {small:<40} -> {large:<40} measured {measured:.3f} predicted "
              f"{predicted:.3f} ({predicted / measured - 1:+.1%})")
    if write:
        path = Path(labsim.__file__).parent / "data" / "step_bands.json"
        path.write_text(json.dumps(error_bands(rows), indent=1) + "\n", encoding="utf-8")
        print(f"wrote {path}")


def speed_cases() -> list[tuple]:
    """(name, model, cluster, plan) of the cases ``--speed`` times."""
    one_t = labsim.Transformer.preset("megatron-1t")
    gpt3 = labsim.Transformer.preset("gpt3-175b")
    return [
        ("1T, 3072 A100, TP8 PP64 DP6, batch 3072", one_t, labsim.dgx_a100(384),
         Plan(dp=6, tp=8, pp=64, global_batch=3072, recompute="full",
              software="megatron-lm-2021", precision="fp16")),
        ("GPT-3 175B, 1536 A100, TP8 PP12 DP16", gpt3, labsim.dgx_a100(192),
         Plan(dp=16, tp=8, pp=12, global_batch=1536, recompute="full",
              software="megatron-lm-2021", precision="fp16")),
        ("GPT-3 175B, 128 H100, TP4 PP8 v12 DP4 (MCore)", gpt3, labsim.dgx_h100(16),
         Plan(dp=4, tp=4, pp=8, schedule="interleaved", virtual_stages=12, global_batch=256,
              sequence_parallel=True, software="megatron-core-te", zero_stage=1)),
    ]


def speed(repeat: int, estimate_repeat: int) -> None:
    def best(fn, n: int = repeat) -> float:
        times = []
        for _ in range(n):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times)

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"process time, best of {repeat} (estimate_step: {estimate_repeat}); load average "
          f"before {load} on {os.cpu_count()} cores")
    print(f"{'case':<48} {'simulate_step s':>16} {'estimate_step ms':>17}")
    for name, model, cluster, plan in speed_cases():
        sim = best(lambda m=model, c=cluster, p=plan: simulate_step(m, c, p, memory=False))
        est = best(lambda m=model, c=cluster, p=plan: labsim.estimate_step(m, c, p),
                   estimate_repeat)
        print(f"{name:<48} {sim:>16.3f} {est * 1e3:>17.3f}")
    print("goals: simulate_step of the 1T case <= 0.2 s, estimate_step <= 1 ms a plan; reference "
          "point: Calculon (Isaev et al. 2023), about 2 ms an estimate on the same inputs on a "
          "machine like this one (not run here)")
    def line(what: str, ms: list[float]) -> None:
        ms = sorted(ms)
        print(f"estimate_step on 200 sampled plans ({what}): median {statistics.median(ms):.3f} "
              f"ms, 90th percentile {ms[int(0.9 * (len(ms) - 1))]:.3f} ms, max {ms[-1]:.3f} ms")

    for pcie in (False, True):
        plans = sample_plans(200, seed=0, pcie=pcie)
        name = "PCIe boxes" if pcie else "DGX nodes"
        # a planner's sweep: each plan once, in turn, from a fresh process's empty caches
        # (what one plan's collectives and schedules teach the model is kept for the next)
        clear_cache()
        pipeline.clear_cache()
        first = []
        for model, cluster, plan in plans:
            t0 = time.process_time()
            labsim.estimate_step(model, cluster, plan)
            first.append((time.process_time() - t0) * 1e3)
        line(f"{name}, each once from empty caches", first)
        line(f"{name}, best of {estimate_repeat}",
             [best(lambda m=model, c=cluster, p=plan: labsim.estimate_step(m, c, p),
                   estimate_repeat) * 1e3 for model, cluster, plan in plans])
    print(f"load average after {', '.join(f'{x:.2f}' for x in os.getloadavg())}")


SOFTWARE = ("generic", "megatron-lm-2021", "megatron-core-te", "fsdp", "deepspeed-zero3-2021")


def budget_plans():
    """(name, model, cluster, plan): for each ZeRO-3 step shape of a grid (three clusters,
    four ZeRO-3 profiles, TP 1 / 2 / 4, 1F1B at 1 and 8 micro-batches, GPipe at 2, 3 and 8,
    recompute off and full, prefetch 1 and 2), the most layers (of a 2048-wide model) that
    ``estimate_step`` still replays (``step._evaluated_zero3``): its most expensive plans."""
    clusters = {"2 PCIe boxes": labsim.pcie_box(2, nics_per_node=2),
                "1 DGX A100": labsim.dgx_a100(1), "2 DGX H100": labsim.dgx_h100(2)}
    out = []
    for (where, cluster), soft, tp, (schedule, m), recompute, prefetch in itertools.product(
            clusters.items(), ("fsdp", "generic", "megatron-core-te", "deepspeed-zero3-2021"),
            (1, 2, 4), (("1f1b", 1), ("1f1b", 8), ("gpipe", 2), ("gpipe", 3), ("gpipe", 8)),
            ("none", "full"), (1, 2)):
        dp = cluster.world_size // tp

        def shape(layers: int, soft=soft, tp=tp, schedule=schedule, m=m, recompute=recompute,
                  prefetch=prefetch, dp=dp, cluster=cluster):
            model = labsim.Transformer(layers=layers, hidden=2048, heads=16, seq_len=2048,
                                       vocab=32000)
            plan = Plan(dp=dp, tp=tp, zero_stage=3, schedule=schedule, micro_batch=1,
                        global_batch=dp * m, software=soft, recompute=recompute,
                        zero3_prefetch=prefetch, tp_comm_overlap=soft == "megatron-core-te")
            replayed = labsim_step._evaluated_zero3(labsim_step.step_costs(
                model, cluster, plan)) is not None
            return replayed, model, plan

        lo, hi = 1, 512  # bisect: the most layers replayed
        if dp < 2 or not shape(lo)[0]:
            continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if shape(mid)[0] else (lo, mid)
        _, model, plan = shape(lo)
        out.append((f"{where}, {soft}, TP {tp}, {schedule} m={m}, recompute {recompute}, "
                    f"prefetch {prefetch}: {lo} layers", model, cluster, plan))
    return out


def budget(repeat: int, rounds: int = 3) -> None:
    """Process time of ``estimate_step`` on ``budget_plans``: best of ``repeat`` calls, in
    each of ``rounds`` passes over all of them (a pause of the machine spoils one pass)."""
    cases = budget_plans()
    best = [math.inf] * len(cases)
    for _ in range(rounds):
        for i, (_, model, cluster, plan) in enumerate(cases):
            for _ in range(repeat):
                t0 = time.process_time()
                labsim.estimate_step(model, cluster, plan)
                best[i] = min(best[i], time.process_time() - t0)
    times = sorted(zip(best, (name for name, *_ in cases)), reverse=True)
    print(f"estimate_step on the {len(times)} longest ZeRO-3 steps replayed (best of {repeat} "
          f"in each of {rounds} passes, process time): median "
          f"{statistics.median(t for t, _ in times) * 1e3:.3f} ms; the slowest:")
    for t, name in times[:8]:
        print(f"  {t * 1e3:.3f} ms  {name}")


def sample_plans(n: int, seed: int = 0, pcie: bool = False, zero_tp: int = 0):
    """``n`` random (model, cluster, plan) on DGX A100 / H100 nodes (``pcie``: PCIe boxes with
    two NICs per node instead), drawn like ``tests/test_step.py``'s property test;
    ``zero_tp`` 2 or 3: that ZeRO stage with tensor parallelism 2-8 only (one stage), where
    TP collectives meet ZeRO-2's buckets or ZeRO-3's gathers and reductions."""
    rng = np.random.default_rng(seed)
    models = [labsim.Transformer(layers=16, hidden=2048, heads=16, seq_len=2048, vocab=32000),
              labsim.Transformer.preset("gpt2-1.5b"), labsim.Transformer.preset("llama2-7b")]

    def pick(options):
        return options[int(rng.integers(len(options)))]

    out = []
    while len(out) < n:
        nodes = pick([1, 2, 4])
        cluster = (labsim.pcie_box(nodes, nics_per_node=2) if pcie else
                   pick([labsim.dgx_a100, labsim.dgx_h100])(nodes))
        g = cluster.world_size
        tp = pick([t for t in ((2, 4, 8) if zero_tp else (1, 2, 4, 8)) if t <= g])
        pp = 1 if zero_tp else pick([p for p in (1, 2, 4, 8) if tp * p <= g])
        schedule = pick(["1f1b", "gpipe", "interleaved"]) if pp > 1 else "1f1b"
        v = 2 if schedule == "interleaved" else 1
        m = pick([1, 2, 4, 8]) * (pp if v > 1 else 1)
        mb = pick([1, 2, 4])
        model = pick(models)
        if model.layers < pp * v or model.heads % tp or (zero_tp and g == tp):
            continue
        plan = Plan(dp=g // (tp * pp), tp=tp, pp=pp, micro_batch=mb,
                    global_batch=g // (tp * pp) * mb * m, schedule=schedule, virtual_stages=v,
                    zero_stage=(zero_tp or
                                pick([0, 1, 2, 3] if pp == 1 and tp == 1 else [0, 1])),
                    recompute=pick(["none", "selective", "full"]),
                    sequence_parallel=tp > 1 and bool(rng.integers(2)),
                    software=pick(SOFTWARE))
        out.append((model, cluster, plan))
    return out


def grouped(plan: Plan) -> list[Plan]:
    """An interleaved plan with each micro-batch group Megatron-Core accepts of p, (p + m) / 2
    and m (``Plan.microbatch_group``; none for other schedules)."""
    if plan.schedule != "interleaved":
        return []
    p, m = plan.pp, plan.microbatches
    return [replace(plan, microbatch_group=n) for n in sorted({p, (p + m) // 2, m})
            if not pipeline.group_problems(p, m, n)]


def _errors_line(what: str, errors: list[float]) -> None:
    a = sorted(errors)
    within = sum(x <= 0.02 for x in a) / len(a)
    print(f"{what}: median {statistics.median(a):.2%}, 95th percentile "
          f"{a[int(0.95 * (len(a) - 1))]:.2%}, max {a[-1]:.2%}, within 2 %: {within:.1%}")


def agreement(n: int, seed: int, zero_tp: int = 0) -> None:
    """|estimate_step / simulate_step - 1| on ``n`` sampled plans per cluster family, then on
    their interleaved plans again with Megatron-Core's micro-batch groups (``grouped``)."""
    for pcie in (False, True):
        errors, group_errors = [], []
        for model, cluster, plan in sample_plans(n, seed=seed, pcie=pcie, zero_tp=zero_tp):
            for x in [plan, *grouped(plan)]:
                s = simulate_step(model, cluster, x, memory=False).step_time_s
                e = labsim.estimate_step(model, cluster, x, memory=False).step_time_s
                (errors if x is plan else group_errors).append(abs(e / s - 1))
        family = "PCIe boxes, 2 NICs" if pcie else "DGX A100/H100"
        _errors_line(f"{family:<20} {n} plans: |estimate/simulate - 1|", errors)
        if group_errors:
            _errors_line(f"{'':<20} {len(group_errors)} of them grouped", group_errors)


def long_pipelines(n: int, seed: int = 0):
    """``n`` random interleaved pipelines too long for ``estimate_step`` to evaluate (4-16
    stages, 2-12 virtual stages, more than ``SCHEDULE_OPS`` ops), on DGX A100 / H100 nodes
    and PCIe boxes."""
    rng = np.random.default_rng(seed)
    models = [labsim.Transformer(layers=48, hidden=4096, heads=32, seq_len=2048, vocab=32000),
              labsim.Transformer.preset("llama2-7b"),
              labsim.Transformer(layers=96, hidden=2048, heads=16, seq_len=2048, vocab=32000)]

    def pick(options):
        return options[int(rng.integers(len(options)))]

    out = []
    while len(out) < n:
        model, p, v, tp = pick(models), pick([4, 8, 16]), pick([2, 3, 4, 6, 12]), pick([1, 2, 4, 8])
        make = pick([labsim.dgx_a100, labsim.dgx_h100,
                     lambda nodes: labsim.pcie_box(nodes, nics_per_node=2)])
        cluster = make(max(1, p * tp // 8) * pick([1, 2]))
        m, mb = p * pick([1, 2, 4]), pick([1, 2])
        if model.layers % (p * v) or model.heads % tp or cluster.world_size % (tp * p):
            continue
        dp = cluster.world_size // (tp * p)
        if 2 * p * v * m <= labsim_step.SCHEDULE_OPS:
            continue
        out.append((model, cluster, Plan(
            dp=dp, tp=tp, pp=p, micro_batch=mb, global_batch=dp * m * mb,
            schedule="interleaved", virtual_stages=v, recompute=pick(["none", "selective", "full"]),
            software=pick(["megatron-core-te", "generic", "megatron-lm-2021"]))))
    return out


def formula(n: int, seed: int) -> None:
    """The formulas ``estimate_step`` falls back on, against its own op-by-op evaluation of
    the same schedules (every flow alone in both, so only the formula differs)."""
    errors, group_errors = [], []
    for model, cluster, plan in long_pipelines(n, seed):
        for x in [plan, *grouped(plan)]:
            est = labsim.estimate_step(model, cluster, x, memory=False).step_time_s
            budget = labsim_step.SCHEDULE_OPS
            labsim_step.SCHEDULE_OPS = 10 ** 9
            try:
                exact = labsim.estimate_step(model, cluster, x, memory=False).step_time_s
            finally:
                labsim_step.SCHEDULE_OPS = budget
            (errors if x is plan else group_errors).append(abs(est / exact - 1))
    _errors_line(f"{n} long interleaved pipelines (seed {seed}): |formula/evaluated - 1|",
                 errors)
    _errors_line(f"the same with Megatron-Core's groups of p, (p + m) / 2, m "
                 f"({len(group_errors)} plans)", group_errors)


def _key(run) -> tuple:
    return run.gpu, run.model.hidden, run.model.seq_len, run.gpus, run.plan.micro_batch


def sweep_errors() -> list[tuple]:
    """(run, error, in the calibration set) for every run of llm-foundry's sweep."""
    fitted = {_key(r) for r in runs() if r.role == "calibration"}
    return [(r, simulate_step(r.model, r.cluster, r.plan, memory=False).step_time_s
             / r.measured_step_s() - 1, _key(r) in fitted) for r in sweep_runs()]


def sweep(verbose: bool) -> None:
    rows = sweep_errors()
    if verbose:
        for r, e, fitted in rows:
            print(f"{r.id:<58} {r.plan.recompute:<5} {e:+7.1%}{' calibration' if fitted else ''}")

    def line(name: str, errors: list[float]) -> None:
        a = [abs(x) for x in errors]
        print(f"{name:<34} {len(a):>4} {statistics.median(errors):>+8.1%} "
              f"{statistics.median(a):>8.1%} {sum(x <= 0.1 for x in a) / len(a):>7.0%} "
              f"{sum(x <= 0.2 for x in a) / len(a):>7.0%} {max(a):>7.1%}")

    print(f"{'llm-foundry sweep, fsdp profiles':<34} {'runs':>4} {'median':>8} {'|median|':>8} "
          f"{'<=10%':>7} {'<=20%':>7} {'max':>7}")
    for gpu in ("A100-40GB", "A100-80GB", "H100-SXM"):
        for rec in ("full", "none"):
            errors = [e for r, e, _ in rows if r.gpu == gpu and r.plan.recompute == rec]
            if errors:
                line(f"{gpu}, recompute {rec}", errors)
    line("all", [e for _, e, _ in rows])
    line("all but the calibration runs", [e for _, e, fitted in rows if not fitted])
    print(f"\n{'by sequence length (tokens)':<34} {'runs':>4} {'median':>8} {'|median|':>8} "
          f"{'<=10%':>7} {'<=20%':>7} {'max':>7}")
    for gpu in ("A100-40GB", "A100-80GB", "H100-SXM"):
        for lo, hi in ((512, 2048), (4096, 8192), (16384, 65536)):
            errors = [e for r, e, _ in rows if r.gpu == gpu and lo <= r.model.seq_len <= hi]
            if errors:
                line(f"{gpu}, {lo}-{hi}", errors)


def faster(n: int, seed: int) -> None:
    """``n`` sampled plans on DGX nodes and ``n`` on PCIe boxes, every link 1.25, 2 and 4 times
    as fast: how many steps come out slower (``estimate_step``; ``simulate_step`` checks
    each one that does), and which collective NCCL's choice moved."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "benchmark_collectives", os.path.join(os.path.dirname(__file__), "collectives.py"))
    collectives = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(collectives)
    slower, pairs = [], 0
    for pcie in (False, True):
        for model, cluster, plan in sample_plans(n, seed, pcie):
            base = labsim.estimate_step(model, cluster, plan, memory=False).step_time_s
            for factor in (1.25, 2.0, 4.0):
                fast_cluster = collectives.links_times(cluster, factor)
                fast = labsim.estimate_step(model, fast_cluster, plan, memory=False).step_time_s
                pairs += 1
                if fast > base * (1 + 1e-9):
                    sim = (simulate_step(model, fast_cluster, plan, memory=False).step_time_s
                           / simulate_step(model, cluster, plan, memory=False).step_time_s)
                    slower.append((fast / base - 1, sim - 1, cluster.name, factor, plan))
    print(f"{pairs} (plan, factor) pairs: {len(slower)} steps slower")
    for est, sim, name, factor, plan in sorted(slower, key=lambda x: -x[0]):
        print(f"  estimate {est:+.2%}, simulate {sim:+.2%}: {name}, links x{factor}, "
              f"dp {plan.dp} tp {plan.tp} pp {plan.pp} ZeRO-{plan.zero_stage} {plan.software}")


def _inter_node_times(cluster, factor: float):
    """``cluster`` with its NICs' line rate ``factor`` times what it is (NCCL's view of them
    unchanged: the tuner chooses as before)."""
    link = cluster.inter_node
    return replace(cluster, inter_node=replace(link, bandwidth_Bps=link.bandwidth_Bps * factor))


ZERO3_VARIANTS = (
    ("kept", {}, 1.0),
    ("v0.3.12-v0.3.14: 3 HBM passes a gather", {"zero3_gather_hbm_passes": 3}, 1.0),
    ("gathers beside the reductions", {"zero3_gather_syncs": False}, 1.0),
    ("NICs at 0.7 of their rate", {}, 0.7),
    ("NICs at 0.5 of their rate", {}, 0.5),
)


def zero3_variants() -> None:
    """DeepSpeed 2021's ZeRO-3: each variant with its host seconds per rank refitted on the
    three 175B calibration runs, then the three held-out 529.6B runs."""
    members = [r for r in runs() if r.plan_spec["software"] == "deepspeed-zero3-2021"]
    cal = [r for r in members if r.role == "calibration"]
    held = [r for r in members if r.role == "held-out"]
    print(f"{'DeepSpeed 2021 ZeRO-3 variant':<40} {'host us':>7} {'rms':>5}  "
          f"{'175B: 384 / 768 / 1536 GPUs':<28} 529.6B: 640 / 1120 / 2240 GPUs")
    for name, fields, nic in ZERO3_VARIANTS:
        base = replace(software.PROFILES["deepspeed-zero3-2021"], **fields)

        def error(run, host: float, base=base, nic=nic) -> float:
            return zero3_errors([run], host, nic, base)[0]

        def loss(host: float, error=error) -> float:
            return sum(math.log1p(error(r, host)) ** 2 for r in cal) / len(cal)

        host = _golden(loss, *FIT_RANGE["zero3_host_s_per_rank"])
        print(f"{name:<40} {host * 1e6:>7.1f} {math.sqrt(loss(host)):>5.1%}  "
              f"{' / '.join(f'{error(r, host):+.1%}' for r in cal):<28} "
              f"{' / '.join(f'{error(r, host):+.1%}' for r in held)}")
    worst, host, nic = zero3_ceiling(cal + held)
    e = [f"{x:+.1%}" for x in zero3_errors(cal + held, host, nic)]
    print(f"{f'NICs at {nic:.2f}, fitted on all six':<40} {host * 1e6:>7.1f} {'':>5}  "
          f"{' / '.join(e[:3]):<28} {' / '.join(e[3:])}  (a bound: the least largest "
          f"|error| of any host work and NIC rate, {worst:.1%})")


def zero3_errors(members: list, host_s: float, nic: float, base=None) -> list[float]:
    """Each run's error with the ZeRO-3 profile ``base`` (the kept one when None) at host
    seconds per rank ``host_s``, every byte across nodes at ``nic`` of the NICs' modelled
    rate."""
    base = base or software.PROFILES["deepspeed-zero3-2021"]
    out = []
    for r in members:
        plan = replace(r.plan, software=replace(base, zero3_host_s_per_rank=host_s))
        step = simulate_step(r.model, _inter_node_times(r.cluster, nic), plan, memory=False)
        out.append(step.step_time_s / r.measured_step_s() - 1)
    return out


def zero3_ceiling(members: list, nics: tuple[float, ...] | None = None, rounds: int = 14,
                  refine: bool = True) -> tuple[float, float, float]:
    """A bound, not a fit: (the least largest |error|, host seconds per rank, NIC rate) of the
    host work and the NICs' rate chosen on all of ``members``, held-out runs included; the
    rates ``nics`` (by default 1 to 0.3 of the modelled by 0.05), then with ``refine`` every
    0.01 within 0.05 of the best.  Each run's error grows with the host work, so at one rate
    the largest |error| has a single minimum (golden-section search)."""
    if nics is None:
        nics = tuple(round(1.0 - k / 20, 2) for k in range(15))

    def at(nic: float) -> tuple[float, float, float]:
        host = _golden(lambda x: max(map(abs, zero3_errors(members, x, nic))),
                       *FIT_RANGE["zero3_host_s_per_rank"], rounds=rounds)
        return max(map(abs, zero3_errors(members, host, nic))), host, float(nic)

    best = min(at(nic) for nic in nics)
    if refine:
        best = min([best] + [at(round(best[2] + k / 100, 2)) for k in range(-4, 5) if k])
    return best


def _gradient_lifetimes_gb(run, prof) -> float:
    """The first stage's peak (GB) if each chunk's fp32 gradient lived only from the chunk's
    first backward to its last (reduce-scattered then into a sharded accumulator), walking
    the stage's schedule op by op; everything else as ``step_memory`` counts it (a run
    without recomputation: its activations are then a layer's times the layers held)."""
    from labsim.memory import stage_params, step_memory
    from labsim.pipeline import in_flight_peak, make_schedule

    model, plan = run.model, run.plan
    if plan.recompute != "none":
        raise ValueError(f"{run.id}: recompute={plan.recompute!r}; the walk counts a run "
                         "without recomputation")
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    whole = step_memory(model, plan, in_flight_peak(plan.schedule, p, m, v),
                        swiglu_fused=prof.swiglu_fused)
    split = plan.chunk_layers(model.layers)
    layers = split[0::p]  # stage 0's chunks, in local order
    per_layer = whole.activations / in_flight_peak(plan.schedule, p, m, v, layers)
    params = [stage_params(model, tp=plan.tp, pp=p * v, stage=g, layers=split[g])
              for g in range(0, p * v, p)]
    grad = [whole.grads * n / sum(params) for n in params]  # each chunk's share
    ops = make_schedule(plan.schedule, p, m, v)[0]
    backwards = [(local, i) for i, (kind, _, local) in enumerate(ops) if kind == "B"]
    first, last = dict(reversed(backwards)), dict(backwards)  # each chunk's op index
    held = alive = peak = 0.0
    for i, (kind, _, local) in enumerate(ops):
        if kind == "F":
            held += layers[local] * per_layer
        elif first[local] == i:
            alive += grad[local]
        peak = max(peak, held + alive)
        if kind == "B":
            held -= layers[local] * per_layer
            if last[local] == i:
                alive -= grad[local]
    return (whole.params + whole.grads / plan.dp + whole.optimizer + peak) / 1e9


def _norm_outputs_only_gb(run, prof) -> float:
    """The first stage's memory (GB) if each layer's two RMSNorms kept their outputs for
    backward, not their inputs (an RMSNorm's input gradient can be computed from its output
    and 1 / rms, as Apex's ``FusedRMSNorm(memory_efficient=True)`` does), so that nothing
    keeps the residual stream: what "we proactively deallocate ... the input and output
    tensors of each pipeline stage" (Llama 3, section 3.3.2) needs of the stage's input, which
    is its first norm's.  Everything else as ``step_memory`` counts it."""
    from labsim.pipeline import in_flight_peak
    from labsim.precision import training_precision

    model, plan = run.model, run.plan
    if plan.recompute != "none":
        raise ValueError(f"{run.id}: recompute={plan.recompute!r}; the count is of a run "
                         "without recomputation")
    kept = labsim.estimate_step(model, run.cluster, replace(plan, software=prof)).memory
    p, m, v = plan.pp, plan.microbatches, plan.virtual_stages
    held = in_flight_peak(plan.schedule, p, m, v, plan.chunk_layers(model.layers)[0::p],
                          group=plan.microbatch_group)  # layers' worth at the peak
    shard = plan.tp if plan.sequence_parallel else 1
    norm_inputs = (2 * training_precision(plan.numerics).activation_bytes
                   * model.seq_len * plan.micro_batch * model.hidden / shard)
    return (kept.total - held * norm_inputs) / 1e9


def llama3_variants() -> None:
    """Llama 3 405B's two layouts: the first stage's memory (GB of 80) and the step error as
    the model counts them, and under what the paper may have done that the model does not
    (ZeRO-2 is forced past ``Plan``'s check and only ``simulate_step`` is asked: the closed
    form has no path for a combination ``Plan`` refuses)."""
    members = [r for r in runs() if r.id.startswith("meta2024_llama3")]
    generic = software.PROFILES["generic"]
    print(f"{'Llama 3 405B variant':<58} "
          + "  ".join(f"{r.gpus:>6} GPUs: GB, error" for r in members))

    def row(name: str, cells) -> None:
        print(f"{name:<58} " + "  ".join(f"{gb:>11.1f}, {e:>+6.1%}" for gb, e in cells))

    def cells(prof, force_zero2: bool = False):
        out = []
        for r in members:
            plan = replace(r.plan, software=prof)
            if force_zero2:  # past Plan's check, which refuses ZeRO-2 with pipelines
                object.__setattr__(plan, "zero_stage", 2)
            res = simulate_step(r.model, r.cluster, plan)
            out.append((res.memory.total / 1e9, res.step_time_s / r.measured_step_s() - 1))
        return out

    kept = cells(generic)
    row("kept (SwiGLU's four f-wide tensors, whole fp32 gradient)", kept)
    row("fused SwiGLU (three f-wide tensors)", cells(replace(generic, swiglu_fused=True)))
    row("gradients reduce-scattered every micro-batch (ZeRO-2)", cells(generic, True))
    row("each chunk's gradient from its first backward to its last",
        [(_gradient_lifetimes_gb(r, generic), e) for r, (_, e) in zip(members, kept)])
    row("norms keep their outputs, not their inputs",
        [(_norm_outputs_only_gb(r, generic), e) for r, (_, e) in zip(members, kept)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--budget", action="store_true")
    parser.add_argument("--agreement", type=int, nargs="?", const=200, default=None)
    parser.add_argument("--formula", type=int, nargs="?", const=60, default=None)
    parser.add_argument("--seed", type=int, default=0,
                        help="--agreement, --formula: the plans' seed")
    parser.add_argument("--zero-tp", type=int, choices=(2, 3), default=0,
                        help="--agreement: plans of this ZeRO stage with tensor parallelism")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--leave-one-stack-out", action="store_true",
                        help="each fitted stack's runs with the other stacks' fractions")
    parser.add_argument("--write", action="store_true",
                        help="--leave-one-stack-out: write labsim/data/step_bands.json")
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--faster", type=int, nargs="?", const=300, default=None,
                        help="plans per cluster family whose links get faster")
    parser.add_argument("-v", "--verbose", action="store_true", help="--sweep: every run")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--estimate-repeat", type=int, default=None,
                        help="--speed, --budget: best of this many for estimate_step (default "
                             "--repeat; --budget 20)")
    args = parser.parse_args()
    if args.fit:
        fit()
    elif args.speed:
        speed(args.repeat, args.estimate_repeat or args.repeat)
    elif args.budget:
        budget(args.estimate_repeat or 20)
    elif args.agreement:
        agreement(args.agreement, args.seed, args.zero_tp)
    elif args.formula:
        formula(args.formula, args.seed)
    elif args.sweep:
        sweep(args.verbose)
    elif args.leave_one_stack_out:
        leave_one_stack_out(args.write)
    elif args.faster:
        faster(args.faster, args.seed)
    elif args.variants:
        zero3_variants()
        print()
        llama3_variants()
    else:
        table()


if __name__ == "__main__":
    main()
