"""Simulate one training step from a TOML or JSON config and print a summary.

    labsim simulate configs/gpt3-175b.toml [--trace step.json] [--estimate]

The config has three tables::

    [model]    preset = "gpt3-175b"           (or layers, hidden, heads, seq_len, vocab, ...;
                                               any Transformer field overrides the preset)
    [cluster]  preset = "dgx-a100", nodes = 192  (a name of labsim.cluster.PRESETS, or gpu,
                                               nodes, gpus_per_node, intra_node, inter_node,
                                               nics_per_node, nccl_net_channels)
    [plan]     dp = 16, tp = 8, pp = 12, ...  (any Plan field, software = "megatron-lm-2021")

``--trace`` writes the step's Chrome trace (open it in ui.perfetto.dev or chrome://tracing);
``--estimate`` prints the closed form (``labsim.estimate_step``) instead of simulating.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from labsim.cli._guard import guarded, output_path, write_atomic
from labsim.cluster import Cluster
from labsim.cluster import cluster as cluster_preset
from labsim.plan import Plan
from labsim.sim.step import simulate_step
from labsim.step import StepResult, estimate_step
from labsim.units import fmt_bytes
from labsim.workload import Transformer

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, packaged as tomli (a dependency there)
    import tomli as tomllib

MAX_CONFIG_BYTES = 1_000_000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML (.toml) or JSON (.json) file: model, cluster, plan")
    parser.add_argument("--trace", metavar="OUT", help="write the Chrome trace JSON here")
    parser.add_argument("--estimate", action="store_true",
                        help="the closed form (labsim.estimate_step) instead of the simulation")


def load_config(path: str | Path, tables: tuple[str, ...] = ("model", "cluster", "plan"),
                optional: tuple[str, ...] = ()) -> dict:
    """Read a config file into a dict; ValueError naming the file if it is missing,
    unreadable, too large, not UTF-8, unparsable or incomplete (``tables`` required,
    ``optional`` allowed beside them)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} not found")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES:,} bytes; not a config")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") \
            from None
    try:
        config = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: cannot parse: {exc}") from None
    names = ", ".join(f"[{t}]" for t in tables)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: the top level must be a table of {names}")
    unknown = set(config) - set(tables) - set(optional)
    if unknown or not set(tables) <= set(config):
        raise ValueError(f"{path}: needs the tables {names}"
                         + (f" (optional: {', '.join(f'[{t}]' for t in optional)})"
                            if optional else "")
                         + (f"; unknown: {sorted(unknown)}" if unknown else ""))
    for key in (*tables, *(t for t in optional if t in config)):
        if not isinstance(config[key], dict):
            raise ValueError(f"{path}: [{key}] must be a table of keys, got "
                             f"{type(config[key]).__name__}")
    return config


def _fields(cls: type, table: dict, name: str, extra: tuple[str, ...] = ()) -> dict:
    allowed = {f.name for f in dataclasses.fields(cls)} | set(extra)
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"[{name}] has unknown keys {sorted(unknown)}; allowed: "
                         f"{sorted(allowed)}")
    for key, value in table.items():  # NaN and infinities are never a valid setting
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"[{name}] {key} = {value}: must be a finite number")
    return {k: v for k, v in table.items() if k not in extra}


def _build(what: str, make: object, **kwargs: object) -> object:
    try:
        return make(**kwargs)  # type: ignore[operator]
    except ValueError as exc:
        raise ValueError(f"[{what}] {exc}") from None
    except TypeError as exc:  # a wrongly typed value the dataclass could not take
        raise ValueError(f"[{what}] {exc}") from None


def build(config: dict) -> tuple[Transformer, Cluster, Plan]:
    """The model, cluster and plan a config describes (ValueError naming the table)."""
    model_t = dict(config["model"])
    fields = _fields(Transformer, model_t, "model", ("preset",))
    if "preset" in model_t:
        model = _build("model", Transformer.preset, name=model_t["preset"], **fields)
    else:
        model = _build("model", Transformer, **fields)
    cluster_t = dict(config["cluster"])
    if "preset" in cluster_t:
        preset = cluster_t.pop("preset")
        if set(cluster_t) - {"nodes"}:
            raise ValueError(f"[cluster] preset = {preset!r} takes only 'nodes' beside it; "
                             f"for another cluster give gpu, nodes, gpus_per_node, intra_node, "
                             f"inter_node")
        nodes = cluster_t.get("nodes", 1)
        _fields(Cluster, {"nodes": nodes}, "cluster")
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"[cluster] nodes = {nodes!r}: must be a whole number >= 1")
        cluster = _build("cluster", cluster_preset, name=preset, nodes=nodes)
    else:
        cluster = _build("cluster", Cluster, **_fields(Cluster, cluster_t, "cluster"))
    plan = _build("plan", Plan, **_fields(Plan, dict(config["plan"]), "plan"))
    return model, cluster, plan  # type: ignore[return-value]


def summary(result: StepResult, model: Transformer, cluster: Cluster) -> str:
    """A few lines a person reads: time, throughput, utilisation, memory, where time goes."""
    p = result.plan
    m = result.memory
    lines = [
        f"model    {model!r}",
        f"cluster  {cluster!r}",
        f"plan     dp={p.dp} tp={p.tp} pp={p.pp} (v={p.virtual_stages}, {p.schedule}"
        + (f" in groups of {p.microbatch_group}" if p.microbatch_group is not None else "")
        + "), "
        f"micro-batch {p.micro_batch} x {p.microbatches} per replica, global batch "
        f"{p.global_batch}, ZeRO-{p.zero_stage}, recompute={p.recompute}, "
        f"attention={p.attention}, software={getattr(p.software, 'name', p.software)}"
        + (f", fp8={p.fp8}" if p.fp8 else "")
        + (f", cp={p.cp} ({p.cp_comm})" if p.cp > 1 else "")
        + (f", ep={p.ep}" + (f" (busiest rank x{p.expert_imbalance:g})"
                             if p.expert_imbalance != 1 else "")
           + (f", experts split over etp={p.etp}" if p.etp is not None else "")
           + (f", at most {p.ep_node_limit} nodes a token" if p.ep_node_limit else "")
           + (", all-to-alls overlapped" if p.ep_overlap else "") if p.ep > 1 else "")
        + ("" if p.capacity_factor is None else
           f", capacity factor {p.capacity_factor:g} ("
           f"{'padded' if p.pad_to_capacity else 'dropping'}: busiest rank x{p.expert_load:g})")
        + ("".join(f", {what} counted as a layer" for what, counted in (
            ("embedding", p.account_for_embedding_in_pipeline_split),
            ("loss", p.account_for_loss_in_pipeline_split)) if counted)),
        f"step     {result.step_time_s:.4g} s   {result.tokens_per_s:,.0f} tokens/s   "
        f"{result.model_flops_per_gpu_s / 1e12:.1f} TFLOP/s per GPU",
        f"trust    {result.band.describe()}",
        f"MFU      {result.mfu:.1%}   HFU {result.hfu:.1%}   pipeline bubble "
        f"{result.bubble_fraction:.1%}",
        f"memory   {fmt_bytes(m.total)} per GPU (first stage) of "
        f"{fmt_bytes(result.gpu_memory_bytes)}: params {fmt_bytes(m.params)}, grads "
        f"{fmt_bytes(m.grads)}, optimizer {fmt_bytes(m.optimizer)}, activations "
        f"{fmt_bytes(m.activations)} -> {'fits' if result.fits else 'DOES NOT FIT'}",
    ]
    if result.breakdown:
        lines.append("stage 0  " + ", ".join(f"{k} {v:.3g} s" for k, v in sorted(
            result.breakdown.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


@guarded("simulate")
def run(args: argparse.Namespace) -> int:
    trace_path = output_path(args.trace) if args.trace else None  # fail before simulating
    if trace_path is not None and args.estimate:
        raise ValueError("--trace needs the simulation; drop --estimate")
    model, cluster, plan = build(load_config(args.config))
    step = estimate_step if args.estimate else simulate_step
    result = step(model, cluster, plan)
    print(summary(result, model, cluster))
    if trace_path is not None:
        write_atomic(trace_path, json.dumps(result.trace.to_chrome()))
        print(f"trace    {len(result.trace)} spans written to {trace_path}")
    return 0
