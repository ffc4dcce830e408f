"""Checks for the mixture-of-experts lab's single-process exercises: the top-k router, the
Switch Transformer's load-balancing loss, the MoE layer and capacity-factor token dropping.

The oracle is ``labsim.parallel.expert_parallel`` run in the grader's process, in float64.
Values and gradients are compared (the router's weights are differentiable, the balancing
loss differentiable through the probabilities only); the MoE layer is held to its method: a
rank executes the router's matmul FLOPs and only the routed rows' expert FLOPs (forward and
backward, 5 % slack), so computing every expert on every token and masking -- ``E / k`` times
the work -- fails even though its output is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from labsim.checks._core import Case, Outcome, Spec, close, equal, plain_outcome
from labsim.checks._observe import watch
from labsim.lab.comm import CommRecorder
from labsim.parallel import expert_parallel as ref

FORBID = ("labsim.parallel.expert_parallel:*",)
TOL = close(rtol=1e-9, atol=1e-12)
LOSS_TOL = close(rtol=1e-6, atol=1e-9)  # f_i counted in float32 (an int tensor / an int)
FLOPS_SLACK = 1.05


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(tokens: int, experts: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=_gen(seed), dtype=torch.float64) * scale


def _upstream(shape: Sequence[int], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed + 1000), dtype=torch.float64)


def _grad_of(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], upstream: Any,
             *rest: Any) -> tuple[Any, list[torch.Tensor | None], int]:
    """``fn(*inputs, *rest)``, back-propagated with ``upstream`` (a tensor weighting the
    first output, or 1 for a scalar), under the FLOP counter: (output, input gradients,
    matmul FLOPs)."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with CommRecorder() as rec:
        out = fn(*leaves, *rest)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(first, torch.Tensor):
            raise TypeError(f"returned {type(first).__name__}; return torch tensors")
        if first.requires_grad:
            (first * upstream).sum().backward()
    return out, [t.grad for t in leaves], rec.flops


def _drive(kind: str) -> Callable[..., list[Outcome]]:
    def drive(fns: Sequence[Callable[..., Any]], cases: Sequence[Case], spec: Spec
              ) -> list[Outcome]:
        outcomes = []
        for case in cases:
            with watch(spec.forbid, ops=False) as seen:
                try:
                    value, flops = _run(kind, fns[0], case.args)
                except Exception as exc:  # noqa: BLE001 - a learner's bug is a failed case
                    outcomes.append(Outcome.of_error(exc, seen.summary()))
                    continue
            outcomes.append(plain_outcome(value, {**seen.summary(), "flops": flops}))
        return outcomes
    return drive


def _run(kind: str, fn: Callable[..., Any], args: tuple) -> tuple[Any, int]:
    if kind == "router":
        logits, k, seed = args
        out, grads, flops = _grad_of(fn, [logits], _upstream((logits.shape[0], k), seed), k)
        weights, experts = out
        return [weights.detach(), experts, grads[0]], flops
    if kind == "loss":
        logits, experts, num_experts = args
        out, grads, flops = _grad_of(fn, [logits], 1.0, experts, num_experts)
        return [out.detach(), grads[0]], flops
    x, w_router, w_in, w_out, k, seed = args
    out, grads, flops = _grad_of(fn, [x, w_router, w_in, w_out], _upstream(x.shape, seed), k)
    return [out.detach(), *grads], flops


# -- the router ---------------------------------------------------------------------------------


def _router_case(name: str, logits: torch.Tensor, k: int, seed: int = 0) -> Case:
    out, grads, _ = _grad_of(ref.top_k_route, [logits], _upstream((logits.shape[0], k), seed), k)
    return Case(name, (logits, k, seed), expected=[out[0].detach(), out[1], grads[0]],
                compare=_router_compare)


def _router_compare(got: Any, expected: Any) -> str | None:
    if not isinstance(got, list) or len(got) != 3:
        return "return (weights, experts): two (T, k) tensors"
    weights, experts, grad = got
    if not isinstance(experts, torch.Tensor) or tuple(experts.shape) != tuple(expected[1].shape):
        return f"experts must be a ({expected[1].shape[0]}, k) tensor of expert indices"
    if not torch.equal(experts.long(), expected[1]):
        return (f"experts {experts.tolist()[:3]}..., expected {expected[1].tolist()[:3]}...: "
                "each token's k largest logits, largest first")
    wrong = TOL(weights, expected[0])
    if wrong is not None:
        return f"weights: {wrong} (the softmax of the k chosen logits)"
    if grad is None:
        return ("no gradient reached the logits: the weights must be computed from them with "
                "torch operations (the router learns through them)")
    wrong = TOL(grad, expected[2])
    return None if wrong is None else f"gradient of the logits: {wrong}"


def _router_cases() -> list[Case]:
    by_hand = torch.tensor([[2.0, 0.5, -1.0, 3.0], [0.0, 0.1, 0.2, -0.3]], dtype=torch.float64)
    return [
        _router_case("8 tokens, 4 experts, top-2", _logits(8, 4, 1), 2, 1),
        _router_case("16 tokens, 8 experts, top-2 (Mixtral's k)", _logits(16, 8, 2), 2, 2),
        _router_case("5 tokens, 6 experts, top-1 (Switch: weight 1, no gradient)",
                     _logits(5, 6, 3), 1, 3),
        _router_case("4 tokens, 4 experts, k = E (every expert)", _logits(4, 4, 4), 4, 4),
        _router_case("logits near +-1000 (exp overflows unless shifted)",
                     _logits(6, 8, 5, scale=1000.0), 3, 5),
        _router_case("2 tokens, logits written by hand", by_hand, 2, 6),
    ]


router = Spec("router", _router_cases, drive=_drive("router"), forbid=FORBID, ops=False)
"""``top_k_router(logits, k) -> (weights, experts)``: each token's k largest logits' experts
(largest first) and the softmax of those k logits, differentiable."""


# -- the balancing loss -------------------------------------------------------------------------


def _loss_case(name: str, logits: torch.Tensor, experts: torch.Tensor, num_experts: int
               ) -> Case:
    out, grads, _ = _grad_of(ref.balancing_loss, [logits], 1.0, experts, num_experts)
    return Case(name, (logits, experts, num_experts), expected=[out.detach(), grads[0]],
                compare=_loss_compare)


def _loss_compare(got: Any, expected: Any) -> str | None:
    value, grad = got
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        return "return the loss as a one-element tensor"
    wrong = LOSS_TOL(value.reshape(()), expected[0])
    if wrong is not None:
        return f"loss {float(value):.6g}, expected {float(expected[0]):.6g}"
    if grad is None:
        return ("no gradient reached the logits: P_i (the mean router probability) must be "
                "computed from them")
    wrong = LOSS_TOL(grad, expected[1])
    return None if wrong is None else (
        f"gradient of the logits: {wrong} (f_i is a count: no gradient flows through it)")


def _loss_cases() -> list[Case]:
    uniform = torch.zeros(8, 4, dtype=torch.float64)
    balanced = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2], [1, 3], [2, 0], [3, 1]])
    lg = _logits(12, 6, 11)
    skew = _logits(10, 4, 12)
    skew[:, 0] += 4.0
    return [
        _loss_case("uniform probabilities, balanced top-2 routing: loss 1", uniform, balanced,
                   4),
        _loss_case("12 tokens, 6 experts, top-2 routing of the logits", lg,
                   torch.topk(lg, 2).indices, 6),
        _loss_case("10 tokens, every one routed to expert 0 (k = 1)", skew,
                   torch.zeros(10, 1, dtype=torch.long), 4),
        _loss_case("routing that ignores the logits (f is counted from `experts`)", lg,
                   torch.arange(12 * 2).remainder(6).view(12, 2), 6),
        _loss_case("an expert nobody chose (E = 8, experts 0-3 only)", _logits(6, 8, 13),
                   torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3], [0, 3], [1, 2]]), 8),
    ]


balancing_loss = Spec("balancing_loss", _loss_cases, drive=_drive("loss"), forbid=FORBID,
                      ops=False)
"""``load_balancing_loss(logits, experts, num_experts)``: the Switch Transformer's
``E * sum_i f_i P_i`` with ``f_i`` the fraction of routed slots (of ``T k``) on expert ``i``
and ``P_i`` the mean softmax probability of expert ``i``."""


# -- the MoE layer ------------------------------------------------------------------------------


def layer_inputs(tokens: int, hidden: int, ffn: int, experts: int, seed: int,
                 skew: float = 0.0) -> list[torch.Tensor]:
    """``x, w_router, w_in, w_out`` of a case (float64); ``skew`` > 0 favours expert 0."""
    g = _gen(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w_router = torch.randn(experts, hidden, generator=g, dtype=torch.float64)
    w_router[0] += skew * x.mean(0) / x.mean(0).norm() ** 2
    w_in = torch.randn(experts, ffn, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5
    w_out = torch.randn(experts, hidden, ffn, generator=g, dtype=torch.float64) / ffn ** 0.5
    return [x, w_router, w_in, w_out]


def routed_flops(x: torch.Tensor, w_router: torch.Tensor, w_in: torch.Tensor, k: int) -> int:
    """Matmul FLOPs of the layer done sparsely, forward and backward (3x forward): the router
    on every token, each expert's two GEMMs on its routed rows."""
    tokens, hidden = x.shape
    experts, ffn, _ = w_in.shape
    return 3 * (2 * tokens * hidden * experts + 4 * hidden * ffn * tokens * k)


def _layer_case(name: str, tokens: int, hidden: int, ffn: int, experts: int, k: int, seed: int,
                skew: float = 0.0) -> Case:
    inputs = layer_inputs(tokens, hidden, ffn, experts, seed, skew)
    out, grads, _ = _grad_of(ref.moe_forward, inputs, _upstream((tokens, hidden), seed), k)
    return Case(name, (*inputs, k, seed),
                expected={"values": [out.detach(), *grads],
                          "flops": routed_flops(inputs[0], inputs[1], inputs[2], k),
                          "dense_flops": routed_flops(inputs[0], inputs[1], inputs[2],
                                                      experts)},
                compare=_layer_compare)


NAMES = ("output", "gradient of x", "gradient of w_router", "gradient of w_in",
         "gradient of w_out")


def _layer_compare(got: Any, expected: Any) -> str | None:
    for name, g, e in zip(NAMES, got, expected["values"]):
        if g is None:
            return f"{name}: missing (None); it must flow through the routing weights"
        wrong = TOL(g, e)
        if wrong is not None:
            return f"{name}: {wrong}"
    return None


def _sparse_rule(case: Case, out: Outcome) -> str | None:
    budget = case.expected["flops"]
    flops = int(out.observed.get("flops", 0))
    if flops > FLOPS_SLACK * budget:
        return (f"each expert runs only on the rows routed to it: the layer executed {flops} "
                f"matmul FLOPs (forward + backward), the router plus the routed rows need "
                f"{budget}, every expert on every token {case.expected['dense_flops']}")
    return None


def _layer_cases() -> list[Case]:
    return [
        _layer_case("12 tokens, h=8, ffn=16, 4 experts, top-1", 12, 8, 16, 4, 1, 21),
        _layer_case("16 tokens, h=8, ffn=16, 8 experts, top-2", 16, 8, 16, 8, 2, 22),
        _layer_case("a router favouring expert 0: expert 3 gets no token",
                    10, 6, 12, 8, 2, 23, skew=6.0),
        _layer_case("1 token, 4 experts, top-2", 1, 8, 8, 4, 2, 24),
        _layer_case("9 tokens, 6 experts, top-3", 9, 10, 12, 6, 3, 25),
    ]


layer = Spec("moe_layer", _layer_cases, drive=_drive("layer"), rules=(_sparse_rule,),
             forbid=FORBID, ops=False)
"""``moe_layer(x, w_router, w_in, w_out, k)``: the mixture-of-experts layer, equal in output
and every gradient to the whole layer, each expert computing only its routed rows."""


# -- capacity -----------------------------------------------------------------------------------


def _capacity_case(name: str, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
                   factor: float) -> Case:
    return Case(name, (weights, experts, num_experts, factor),
                expected=ref.capacity_keep(weights, experts, num_experts, factor),
                compare=_capacity_compare)


def _capacity_compare(got: Any, expected: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(expected.shape):
        return f"return a {tuple(expected.shape)} tensor of booleans (True: kept)"
    if got.dtype != torch.bool:
        got = got != 0
    if torch.equal(got, expected):
        return None
    wrong = (got != expected).nonzero().tolist()[:3]
    return (f"kept {int(got.sum())} slots, expected {int(expected.sum())}; first differences "
            f"at (token, slot) {wrong}")


def _capacity_cases() -> list[Case]:
    g = _gen(31)

    def routed(tokens: int, experts: int, k: int, skew: float = 0.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
        logits[:, 0] += skew
        return ref.top_k_route(logits, k)

    w1, e1 = routed(16, 4, 1, skew=2.0)
    w2, e2 = routed(24, 8, 2, skew=1.5)
    w3, e3 = routed(10, 4, 2)
    w4, e4 = routed(5, 4, 1)
    return [
        _capacity_case("capacity factor 4: nothing dropped", w2, e2, 8, 4.0),
        _capacity_case("16 tokens, 4 experts, top-1, factor 1.0, expert 0 favoured", w1, e1, 4,
                       1.0),
        _capacity_case("24 tokens, 8 experts, top-2, factor 1.25", w2, e2, 8, 1.25),
        _capacity_case("10 tokens, 4 experts, top-2, factor 0.5", w3, e3, 4, 0.5),
        _capacity_case("5 tokens, 4 experts, top-1, factor 1.0: capacity ceil(1.25) = 2", w4,
                       e4, 4, 1.0),
        _capacity_case("every token on expert 0, factor 1.0", torch.ones(8, 1,
                       dtype=torch.float64) * torch.linspace(0.2, 0.9, 8,
                       dtype=torch.float64)[:, None], torch.zeros(8, 1, dtype=torch.long), 4,
                       1.0),
    ]


capacity = Spec("capacity_keep", _capacity_cases, compare=equal, forbid=FORBID)
"""``capacity_keep(weights, experts, num_experts, capacity_factor)``: which routed slots
their expert keeps, at most ``ceil(T k / E * capacity_factor)`` per expert, the largest
weights first (Megatron-Core's ``drop_policy="probs"``)."""
