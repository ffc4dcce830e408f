"""Expert parallelism: the experts of every MoE layer split over ``ep`` GPUs, tokens sent to
their experts and back with two all-to-alls (Lepikhin et al. 2021, GShard, arXiv:2006.16668;
Fedus et al. 2022, Switch Transformers, arXiv:2101.03961).

As Megatron-Core lays it out (``megatron/core/parallel_state.py``, order ``tp-cp-ep-dp-pp``;
``megatron/core/transformer/moe/README.md``, MCore v0.8): the expert-parallel group is ``ep``
neighbouring ranks of the data-parallel group, so ``ep`` divides ``dp``; each rank holds
``experts / ep`` experts of every MoE layer (whole, or split over the tensor-parallel group as
a dense MLP is) and the rest of the layer as data parallelism does.  Each rank routes its own
tokens: the ``MoEAlltoAllTokenDispatcher`` sends every routed copy of a token (``top_k`` per
token) to the rank holding its expert and brings the expert's output back, one all-to-all each
way per layer forward, two more in backward.  With tensor parallelism the README requires
sequence parallelism ("When using MoE with expert parallelism and tensor parallelism,
sequence parallelism must be enabled"): a rank's tokens are then its ``s / tp`` share.

The experts' gradients are reduced over the expert-data-parallel group (``dp / ep`` ranks) and
the distributed optimizer shards their states over it ("EP ... Optimizer states 1/N", the
README's tuning table).

``imbalance``: the routed tokens the busiest rank's experts receive over the mean (1: perfectly
balanced).  A dropless MoE waits for that rank at every all-to-all, so its expert GEMMs and the
bytes it receives set the layer's time; an under-trained router runs far above 1 (the README:
"a severe load imbalance issue when the router is under-trained ... first 100~300 steps").

``capacity_factor``: each expert takes at most ``ceil(cf x T k / E)`` of the routed copies of a
rank's ``T`` tokens (Megatron-Core ``moe_utils.get_capacity``, ``--moe-expert-capacity-factor``;
Fedus et al. 2022 section 2.2) and drops the rest (``--moe-token-drop-policy``: the lowest
router weights, or the latest positions), so a rank whose ``E / ep`` experts each receive
at most that from each of the ``ep`` ranks receives at most ``cf`` times the mean: the busiest
rank's load is at most ``min(imbalance, cf)`` (``expert_load``).  With
``--moe-pad-expert-input-to-capacity`` every expert's input is padded up to its capacity, so
every rank computes and receives exactly ``cf`` times the mean, balanced or not.
"""

from __future__ import annotations

import math
import numbers

from labsim.workload import Transformer


def check_moe_layer(model: Transformer, moe: bool | None) -> None:
    """``moe`` must say, for a mixture-of-experts model, whether a layer is an MoE layer (True)
    or one of its leading dense layers (False); None for a dense model."""
    if bool(moe) and not model.experts or model.experts and moe is None:
        raise ValueError(f"moe={moe!r} for {model.name}: give moe=True (an MoE layer) or False "
                         "(a dense layer) for a mixture-of-experts model, None for a dense one")


def check_imbalance(imbalance: object) -> float:
    """``imbalance`` as a float >= 1, or a ``ValueError`` naming the fix."""
    if isinstance(imbalance, bool) or not isinstance(imbalance, numbers.Real) \
            or not math.isfinite(imbalance) or imbalance < 1:
        raise ValueError(f"expert_imbalance={imbalance!r}: the busiest rank's routed tokens "
                         "over the mean, a number >= 1 (1: balanced)")
    return float(imbalance)


def check_capacity(capacity_factor: object, pad_to_capacity: object) -> float | None:
    """``capacity_factor`` as a float > 0 or None (dropless), or a ``ValueError`` naming the
    fix; ``pad_to_capacity`` needs one."""
    if not isinstance(pad_to_capacity, bool):
        raise ValueError(f"pad_to_capacity={pad_to_capacity!r}: must be True or False")
    if capacity_factor is None:
        if pad_to_capacity:
            raise ValueError("pad_to_capacity=True pads every expert's input to its capacity: "
                             "give capacity_factor (e.g. 1.25) or leave pad_to_capacity False")
        return None
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real) \
            or not math.isfinite(capacity_factor) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor!r}: each expert's capacity over "
                         "its balanced share of the routed tokens, a number > 0 (e.g. 1.0 or "
                         "1.25), or None for a dropless MoE")
    return float(capacity_factor)


def expert_load(imbalance: float, capacity_factor: float | None = None,
                pad_to_capacity: bool = False) -> float:
    """The busiest expert-parallel rank's routed rows over the balanced mean once capacity
    has dropped or padded them (module doc): ``imbalance`` dropless, at most
    ``capacity_factor`` with dropping, exactly ``capacity_factor`` padded."""
    if capacity_factor is None:
        return imbalance
    return capacity_factor if pad_to_capacity else min(imbalance, capacity_factor)


def offnode_copies(experts: int, k: int, nodes: int, limit: int | None = None,
                   dedup: bool = True) -> float:
    """Expected copies of one token sent to other nodes when its ``k`` experts are drawn
    uniformly among ``experts`` spread evenly over ``nodes`` nodes (the token lives on one of
    them).  ``dedup=False``: one copy per routed expert off the node (a plain all-to-all);
    ``dedup=True``: one copy per other node reached, forwarded inside the node over NVLink
    (DeepSeek-V3, arXiv:2412.19437, section 3.2.2); ``limit``: at most that many nodes per
    token (node-limited routing, section 2.1.2): the nodes are then ``limit`` of them, each
    equally likely by symmetry, and the ``k`` experts are drawn among theirs."""
    if experts % nodes:
        raise ValueError(f"{experts} experts do not spread evenly over {nodes} nodes")
    if not 1 <= k <= experts:
        raise ValueError(f"k={k} must be between 1 and the {experts} experts")
    per = experts // nodes
    reach = nodes if limit is None else min(limit, nodes)
    pool = reach * per
    if k > pool:
        raise ValueError(f"k={k} experts cannot fit in {reach} nodes of {per} experts")
    if not dedup:  # a routed expert is on the token's node with probability 1 / nodes,
        return k * (1 - 1 / nodes)  # limited or not (own node chosen w.p. reach / nodes)
    unused = math.comb(pool - per, k) / math.comb(pool, k)  # one given node gets no expert
    return reach * (1 - unused) - reach / nodes * (1 - unused)  # nodes reached, own excluded


def node_limited_loads(model: Transformer, nodes: int, ranks_per_node: float,
                       limit: int) -> tuple[float, float]:
    """How node-limited, deduplicated dispatch (DeepSeek-V3, arXiv:2412.19437, sections 2.1.2
    and 3.2.2; DeepEP's internode kernels) changes an all-to-all over ``nodes`` nodes of
    ``ranks_per_node`` expert-parallel ranks each: (the InfiniBand bytes over a plain
    all-to-all's, the NVLink wire bytes per payload byte).

    A plain all-to-all sends each routed copy off the node on its own (``top_k (1 - 1 /
    nodes)`` copies a token) straight to its GPU; here a token crosses to each node it needs
    once, at most ``limit`` of them (``offnode_copies``), to the GPU of its own local index,
    which forwards each copy over NVLink to the GPU holding its expert (``(ppn - 1) / ppn`` of
    them need that hop), besides the copies for the token's own node, as before."""
    k, ppn, n = model.top_k, ranks_per_node, nodes * ranks_per_node
    try:
        nic = offnode_copies(model.experts, k, nodes, limit) / (k * (1 - 1 / nodes))
    except ValueError as exc:
        raise ValueError(f"ep_node_limit={limit} for {model.name}: {exc}; raise ep_node_limit "
                         f"to at least {math.ceil(k / (model.experts // nodes))}") from None
    intra = (ppn - 1) / n + (n - ppn) / n * (ppn - 1) / ppn
    return nic, intra


def check_ep(model: Transformer, ep: int, tp: int = 1, sequence_parallel: bool = False,
             etp: int | None = None) -> None:
    """Raise ``ValueError`` naming the fix unless ``ep`` expert-parallel ranks, each expert
    split over ``etp`` (default ``tp``), can hold ``model``'s experts (module doc; that the
    grid fits the GPUs, ``labsim.Plan`` checks)."""
    etp = tp if etp is None else etp
    if model.experts and model.expert_ffn_hidden % etp:
        raise ValueError(f"etp={etp} does not divide {model.name}'s expert width "
                         f"{model.expert_ffn_hidden}: choose an etp that divides it")
    if etp != tp and tp > 1 and not sequence_parallel:
        raise ValueError(f"etp={etp} with tp={tp} needs sequence_parallel=True: the experts' "
                         "grid takes each rank's s / tp tokens (Megatron-Core's MoE parallel "
                         "folding); or leave etp None")
    if ep == 1:
        return
    if not model.experts:
        raise ValueError(f"ep={ep} needs a mixture-of-experts model; {model.name} is dense: "
                         "use ep=1")
    if model.experts % ep:
        divisors = [d for d in range(1, model.experts + 1) if model.experts % d == 0]
        raise ValueError(f"ep={ep} does not divide {model.name}'s {model.experts} experts: each "
                         f"rank holds whole experts; choose ep among {divisors}")
    if tp > 1 and not sequence_parallel:
        raise ValueError(f"ep={ep} with tp={tp} needs sequence_parallel=True (Megatron-Core's "
                         "MoE README: with expert and tensor parallelism, sequence "
                         "parallelism must be enabled)")


def local_experts(model: Transformer, ep: int = 1) -> int:
    """Routed experts of one MoE layer held by one expert-parallel rank."""
    return model.experts // ep


def routed_rows(model: Transformer, tokens: float, ep: int = 1) -> float:
    """Rows of each local expert's GEMMs on one rank, tokens spread evenly: every rank of the
    ``ep`` group routes ``tokens`` tokens, ``top_k`` copies each, over all the experts, and a
    rank computes the copies sent to its ``experts / ep``."""
    return tokens * model.top_k * ep / model.experts


def dispatch_bytes(model: Transformer, tokens: float, ep: int, bytes_per_element: float,
                   imbalance: float = 1.0) -> float:
    """One dispatch (or combine) all-to-all's buffer on the busiest rank: its share of the
    ``tokens x top_k`` routed rows of ``h`` elements (``imbalance`` times the mean), ``(ep -
    1) / ep`` of it to other ranks (the collective's cost counts that share).  Zero without
    expert parallelism."""
    if ep == 1:
        return 0.0
    return routed_bytes(model, tokens, bytes_per_element, imbalance)


def routed_bytes(model: Transformer, tokens: float, bytes_per_element: float,
                 imbalance: float = 1.0) -> float:
    """The routed copies of ``tokens`` tokens (``top_k`` rows of ``h`` elements each), on a
    rank that receives ``imbalance`` times the mean."""
    return tokens * model.top_k * model.hidden * bytes_per_element * imbalance


def alltoalls_per_layer(recompute: str) -> tuple[int, int]:
    """(forward, backward) all-to-alls of one MoE layer per micro-batch: dispatch and combine
    forward, their gradients backward, and a recomputed forward's two with ``"full"``
    recomputation (selective recomputation leaves the MoE layer alone)."""
    return 2, 2 + (2 if recompute == "full" else 0)


def mlp_shard_params(model: Transformer, width: int, tp: int = 1) -> int:
    """One MLP of ``width`` on one rank of a ``tp``-way group (column- then row-parallel,
    Shoeybi et al. 2019): its matrices split, the output bias replicated."""
    m, h = model.mlp_matrices, model.hidden
    return m * h * (width // tp) + (((m - 1) * (width // tp) + h) if model.bias else 0)


def routed_expert_params(model: Transformer, tp: int = 1, ep: int = 1) -> int:
    """The routed experts of one MoE layer on one rank: ``experts / ep`` MLPs, each split over
    ``tp`` (the expert tensor-parallel degree; 0 for a dense model)."""
    if not model.experts:
        return 0
    return local_experts(model, ep) * mlp_shard_params(model, model.expert_ffn_hidden, tp)
