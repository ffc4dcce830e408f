"""Simulate one training step from a TOML or JSON config and print a summary.

    labsim simulate configs/gpt3-175b.toml [--trace step.json]

The config has three tables::

    [model]    preset = "gpt3-175b"           (or layers, hidden, heads, seq_len, vocab, ...;
                                               any Transformer field overrides the preset)
    [cluster]  preset = "dgx-a100", nodes = 192  (a name of labsim.cluster.PRESETS, or gpu,
                                               nodes, gpus_per_node, intra_node, inter_node,
                                               nics_per_node)
    [plan]     dp = 16, tp = 8, pp = 12, ...  (any Plan field)

``--trace`` writes the step's Chrome trace (open it in ui.perfetto.dev or chrome://tracing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from labsim.cluster import Cluster
from labsim.cluster import cluster as cluster_preset
from labsim.plan import Plan
from labsim.sim.step import StepResult, simulate_step
from labsim.units import fmt_bytes
from labsim.workload import Transformer

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli (a dependency there)
    import tomli as tomllib

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML (.toml) or JSON (.json) file: model, cluster, plan")
    parser.add_argument("--trace", metavar="OUT", help="write the Chrome trace JSON here")


def load_config(path: str | Path) -> dict:
    """Read a config file into a dict; ValueError if missing, unparsable or incomplete."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} not found")
    text = path.read_text(encoding="utf-8")
    try:
        config = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot parse: {exc}") from None
    unknown = set(config) - {"model", "cluster", "plan"}
    if unknown or not {"model", "cluster", "plan"} <= set(config):
        raise ValueError(f"{path}: needs exactly the tables [model], [cluster] and [plan]"
                         + (f"; unknown: {sorted(unknown)}" if unknown else ""))
    return config


def _fields(cls: type, table: dict, name: str, extra: tuple[str, ...] = ()) -> dict:
    allowed = {f.name for f in dataclasses.fields(cls)} | set(extra)
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"[{name}] has unknown keys {sorted(unknown)}; allowed: "
                         f"{sorted(allowed)}")
    return {k: v for k, v in table.items() if k not in extra}


def build(config: dict) -> tuple[Transformer, Cluster, Plan]:
    """The model, cluster and plan a config describes."""
    model_t = dict(config["model"])
    fields = _fields(Transformer, model_t, "model", ("preset",))
    model = (Transformer.preset(model_t["preset"], **fields) if "preset" in model_t
             else Transformer(**fields))
    cluster_t = dict(config["cluster"])
    if "preset" in cluster_t:
        preset = cluster_t.pop("preset")
        if set(cluster_t) - {"nodes"}:
            raise ValueError(f"[cluster] preset = {preset!r} takes only 'nodes' beside it; "
                             f"for another cluster give gpu, nodes, gpus_per_node, intra_node, "
                             f"inter_node")
        cluster = cluster_preset(str(preset), int(cluster_t.get("nodes", 1)))
    else:
        cluster = Cluster(**_fields(Cluster, cluster_t, "cluster"))
    plan = Plan(**_fields(Plan, dict(config["plan"]), "plan"))
    return model, cluster, plan


def summary(result: StepResult, model: Transformer, cluster: Cluster) -> str:
    """A few lines a person reads: time, throughput, utilisation, memory, where time goes."""
    p = result.plan
    m = result.memory
    lines = [
        f"model    {model!r}",
        f"cluster  {cluster!r}",
        f"plan     dp={p.dp} tp={p.tp} pp={p.pp} (v={p.virtual_stages}, {p.schedule}), "
        f"micro-batch {p.micro_batch} x {p.microbatches} per replica, global batch "
        f"{p.global_batch}, ZeRO-{p.zero_stage}, recompute={p.recompute}, "
        f"attention={p.attention}",
        f"step     {result.step_time_s:.4g} s   {result.tokens_per_s:,.0f} tokens/s   "
        f"{result.model_flops_per_gpu_s / 1e12:.1f} TFLOP/s per GPU",
        f"MFU      {result.mfu:.1%}   HFU {result.hfu:.1%}   pipeline bubble "
        f"{result.bubble_fraction:.1%}",
        f"memory   {fmt_bytes(m.total)} per GPU (first stage) of "
        f"{fmt_bytes(result.gpu_memory_bytes)}: params {fmt_bytes(m.params)}, grads "
        f"{fmt_bytes(m.grads)}, optimizer {fmt_bytes(m.optimizer)}, activations "
        f"{fmt_bytes(m.activations)} -> {'fits' if result.fits else 'DOES NOT FIT'}",
        "stage 0  " + ", ".join(f"{k} {v:.3g} s" for k, v in sorted(
            result.breakdown.items(), key=lambda kv: -kv[1])),
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    model, cluster, plan = build(load_config(args.config))
    result = simulate_step(model, cluster, plan)
    print(summary(result, model, cluster))
    if args.trace:
        result.trace.to_chrome(args.trace)
        print(f"trace    {len(result.trace)} spans written to {args.trace}")
    return 0
