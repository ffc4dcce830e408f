"""The mixture-of-experts lab's single-process checks: the solution and honest variants pass;
the cheapest wrong routers, losses, layers and capacity rules fail, naming what is wrong."""

from __future__ import annotations

import math
import threading

import pytest
import torch
import torch.nn.functional as F

from labsim.checks import CheckFailed
from labsim.checks import moe as c
from labsim.parallel import expert_parallel as ref

from .solution_cells import exercises

S = exercises("13_mixture_of_experts")


def _fails(spec, fn, *words: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckFailed) as err:
        spec(fn)
    text = str(err.value)
    for w in words:
        assert w in text, text
    return text


def test_the_solution_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    c.router(S["top_k_router"])
    c.balancing_loss(S["load_balancing_loss"])
    c.layer(S["moe_layer"])
    c.capacity(S["capacity_keep"])
    out = capsys.readouterr().out
    for name in ("router", "balancing_loss", "moe_layer", "capacity_keep"):
        assert f"PASS {name}:" in out


# -- the router ---------------------------------------------------------------------------------


def test_a_softmax_over_every_expert_without_renormalising_fails() -> None:
    def switch_weights(logits, k):  # type: ignore[no-untyped-def]
        probs, experts = torch.topk(torch.softmax(logits, -1), k)
        return probs, experts
    _fails(c.router, switch_weights, "weights")


def test_detached_weights_fail_on_the_gradient() -> None:
    def detached(logits, k):  # type: ignore[no-untyped-def]
        top, experts = torch.topk(logits.detach(), k)
        return torch.softmax(top, -1), experts
    _fails(c.router, detached, "no gradient reached the logits")


def test_experts_smallest_first_fail() -> None:
    def ascending(logits, k):  # type: ignore[no-untyped-def]
        top, experts = torch.topk(logits, k, largest=True, sorted=True)
        return torch.softmax(top, -1).flip(-1), experts.flip(-1)
    _fails(c.router, ascending, "largest first")


def test_an_overflowing_softmax_fails() -> None:
    def naive(logits, k):  # type: ignore[no-untyped-def]
        top, experts = torch.topk(logits, k)
        e = top.exp()
        return e / e.sum(-1, keepdim=True), experts
    _fails(c.router, naive, "+-1000")


# -- the balancing loss -------------------------------------------------------------------------


def test_a_float32_count_passes() -> None:
    def float32_f(logits, experts, n):  # type: ignore[no-untyped-def]
        f = torch.bincount(experts.flatten(), minlength=n) / experts.numel()
        return n * (f * torch.softmax(logits, -1).mean(0)).sum()
    c.balancing_loss(float32_f)


def test_f_not_divided_by_k_fails() -> None:
    def per_token(logits, experts, n):  # type: ignore[no-untyped-def]
        f = torch.bincount(experts.flatten(), minlength=n).double() / experts.shape[0]
        return n * (f * torch.softmax(logits, -1).mean(0)).sum()
    _fails(c.balancing_loss, per_token, "loss 2, expected 1")


def test_probabilities_of_the_chosen_experts_only_fail() -> None:
    def topk_probs(logits, experts, n):  # type: ignore[no-untyped-def]
        f = torch.bincount(experts.flatten(), minlength=n).double() / experts.numel()
        p = torch.zeros_like(logits).scatter(1, experts, torch.softmax(
            logits.gather(1, experts), -1)).mean(0)
        return n * (f * p).sum()
    _fails(c.balancing_loss, topk_probs)


def test_a_detached_loss_fails() -> None:
    def detached(logits, experts, n):  # type: ignore[no-untyped-def]
        f = torch.bincount(experts.flatten(), minlength=n).double() / experts.numel()
        return n * (f * torch.softmax(logits.detach(), -1).mean(0)).sum()
    _fails(c.balancing_loss, detached, "no gradient")


# -- the layer ----------------------------------------------------------------------------------


def _router(logits, k):  # type: ignore[no-untyped-def]
    top, experts = torch.topk(logits, k)
    return torch.softmax(top, -1), experts


def gathered_weights(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    """Honest: each routed slot gathers its expert's matrices and runs a batched product."""
    weights, experts = _router(x @ w_router.T, k)
    h = F.gelu(torch.einsum("th,tkfh->tkf", x, w_in[experts]))
    y = torch.einsum("tkf,tkhf->tkh", h, w_out[experts])
    return (y * weights[..., None]).sum(1)


def test_a_batched_gather_of_each_slots_expert_passes() -> None:
    c.layer(gathered_weights)


def every_expert_masked(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
    weights, experts = _router(x @ w_router.T, k)
    gate = torch.zeros(x.shape[0], w_in.shape[0], dtype=x.dtype).scatter(1, experts, weights)
    return sum(F.linear(F.gelu(F.linear(x, w_in[e])), w_out[e]) * gate[:, e:e + 1]
               for e in range(w_in.shape[0]))


def test_every_expert_on_every_token_fails_on_the_flops() -> None:
    _fails(c.layer, every_expert_masked, "each expert runs only on the rows routed to it")


def test_the_reference_layer_fails() -> None:
    _fails(c.layer, ref.moe_forward, "labsim.parallel.expert_parallel.moe_forward")
    _fails(c.layer, lambda *a: ref.dense_moe(*a), "labsim.parallel.expert_parallel")


def test_the_layer_run_on_another_thread_fails() -> None:
    def threaded(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
        box = {}
        t = threading.Thread(target=lambda: box.update(y=S["moe_layer"](x, w_router, w_in,
                                                                         w_out, k)))
        t.start()
        t.join()
        return box["y"]
    _fails(c.layer, threaded, "thread")


def test_ignoring_the_routing_weights_fails() -> None:
    def unweighted(x, w_router, w_in, w_out, k):  # type: ignore[no-untyped-def]
        _, experts = _router(x @ w_router.T, k)
        out = torch.zeros_like(x)
        for e in range(w_in.shape[0]):
            token, _slot = torch.nonzero(experts == e, as_tuple=True)
            out = out.index_add(0, token, F.linear(F.gelu(F.linear(x[token], w_in[e])),
                                                   w_out[e]))
        return out
    _fails(c.layer, unweighted, "routing weights")


# -- capacity -----------------------------------------------------------------------------------


def _keep(weights, experts, n, factor, *, cap_of, by_weight=True):  # type: ignore
    cap = cap_of(experts.shape[0], experts.shape[1], n, factor)
    keep = torch.zeros_like(experts, dtype=torch.bool)
    for e in range(n):
        token, slot = torch.nonzero(experts == e, as_tuple=True)
        order = (torch.argsort(weights[token, slot], descending=True) if by_weight
                 else torch.arange(token.numel()))
        keep[token[order[:cap]], slot[order[:cap]]] = True
    return keep


def test_first_come_first_kept_fails() -> None:
    def position(w, e, n, f):  # type: ignore[no-untyped-def]
        return _keep(w, e, n, f, cap_of=lambda t, k, n, f: math.ceil(t * k / n * f),
                     by_weight=False)
    _fails(c.capacity, position, "kept")


def test_a_capacity_rounded_down_fails() -> None:
    def floor(w, e, n, f):  # type: ignore[no-untyped-def]
        return _keep(w, e, n, f, cap_of=lambda t, k, n, f: math.floor(t * k / n * f))
    _fails(c.capacity, floor, "kept")


def test_a_capacity_without_k_fails() -> None:
    def per_token(w, e, n, f):  # type: ignore[no-untyped-def]
        return _keep(w, e, n, f, cap_of=lambda t, k, n, f: math.ceil(t / n * f))
    _fails(c.capacity, per_token, "kept")


def test_a_zero_one_integer_mask_passes() -> None:
    def as_int(w, e, n, f):  # type: ignore[no-untyped-def]
        return S["capacity_keep"](w, e, n, f).int()
    c.capacity(as_int)
