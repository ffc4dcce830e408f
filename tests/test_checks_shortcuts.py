"""Shortcuts through the checks of labs 00-06, 10 and 11 fail, naming the rule; each lab's own
solution (from ``solutions/``) passes beside them.  (Labs 07-09 and 12: their own check tests;
lab 00's measured roofline, step count and MFU in ``test_checks_roofline``;
more shortcuts of labs 10 and 11 in ``test_checks_tensor_parallel`` and
``test_checks_pipeline``.)"""

from __future__ import annotations

import math

import pytest
import torch

from labsim import checks as check
from labsim.checks import CheckFailed
from labsim.course.notebook import as_shown

from .solution_cells import exercises

REFERENCE = "calls labsim's own reference"


def test_labs_00_01_solutions_pass_and_library_answers_do_not(capsys) -> None:  # noqa: ANN001
    s0, s1 = exercises("00_why_gpus"), exercises("01_memory")
    check.roofline.matmul_cost(s0["matmul_cost"])
    check.memory.param_breakdown(s1["param_breakdown"])
    assert as_shown(capsys.readouterr().out).count("PASS") == 2
    import labsim

    with pytest.raises(CheckFailed, match=REFERENCE):
        check.roofline.matmul_cost(lambda m, n, k, d: (labsim.roofline.matmul_flops(m, n, k),
                                                      labsim.roofline.matmul_bytes(m, n, k, d)))
    with pytest.raises(CheckFailed, match=REFERENCE):
        check.memory.param_breakdown(lambda model: {"Linear.weight": model.cfg.params})
    with pytest.raises(CheckFailed, match=REFERENCE):
        check.memory.layer_activation_bytes(
            lambda s, b, h, a, d=2, m=1: labsim.memory.activation_per_layer(
                labsim.Transformer(1, h, a, s, 8, dropout=m > 0), micro_batch=b, dtype_bytes=d,
                mask_bytes=m))


def test_the_dropout_formula_without_dropout_fails() -> None:
    # The cheapest answer: Korthikanti's sbh(16d + 2m) + as^2b(2d + m) for every m.  Without
    # dropout it counts the softmax output twice (the dropout output *is* the softmax output).
    def with_dropout_always(s, b, h, a, d=2, m=1):  # noqa: ANN001, ANN202
        return s * b * h * (16 * d + 2 * m) + a * s * s * b * (2 * d + m)

    with pytest.raises(CheckFailed, match="m=0"):
        check.memory.layer_activation_bytes(with_dropout_always)


# -- lab 02: the loss scaler must not be, wrap or run a GradScaler ----------------------------

S2 = exercises("02_mixed_precision")


class Subclass(torch.amp.GradScaler):
    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        super().__init__("cpu", **kwargs)


class Wrapper:
    """Delegates everything to a GradScaler it holds (composition)."""

    def __init__(self, **kwargs) -> None:  # noqa: ANN003
        self.inner = torch.amp.GradScaler("cpu", **kwargs)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


class Kernels(S2["DynamicLossScaler"]):
    """The solution, but the update is GradScaler's own kernel called directly."""

    def update(self) -> None:
        found = torch.tensor(float(any(self._found_inf.values())))
        scale, tracker = torch.tensor([self._scale]), torch.tensor([self._good_steps],
                                                                    dtype=torch.int32)
        with torch._C.DisableTorchFunction():
            torch._amp_update_scale_(scale, tracker, found, self.growth_factor,
                                     self.backoff_factor, self.growth_interval)
        self._scale, self._good_steps = float(scale), int(tracker)
        self._found_inf = {}


def test_the_loss_scaler_solution_passes_every_scenario(capsys) -> None:  # noqa: ANN001
    check.precision.loss_scaler(S2["DynamicLossScaler"])
    assert "PASS loss_scaler: 10/10 cases passed" in as_shown(capsys.readouterr().out)


@pytest.mark.parametrize(("cls", "why"), [
    (Subclass, "GradScaler"), (Wrapper, REFERENCE), (Kernels, "GradScaler's own kernels"),
], ids=["subclass", "composition", "kernels"])
def test_a_grad_scaler_in_disguise_scores_zero(cls, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why) as info:
        check.precision.loss_scaler(cls)
    assert "0/10 cases passed" in str(info.value)


def test_one_flag_for_every_optimizer_fails_the_edge_cases() -> None:
    class OneFlag(S2["DynamicLossScaler"]):
        """The single-flag design: a second optimizer is never unscaled."""

        def unscale_(self, optimizer) -> None:  # noqa: ANN001
            if self._found_inf:
                return
            super().unscale_(optimizer)

    with pytest.raises(CheckFailed, match="unscale_ twice|two optimizers"):
        check.precision.loss_scaler(OneFlag)


# -- lab 03: checkpointing by calling labsim's own forward ------------------------------------

def test_checkpointing_with_labsims_forward_fails(capsys) -> None:  # noqa: ANN001
    s3 = exercises("03_checkpointing")
    check.checkpointing.checkpointed_forward(s3["checkpointed_forward"])
    check.checkpointing.segment_plan(s3["plan_segments"])
    assert as_shown(capsys.readouterr().out).count("PASS") == 2
    from labsim.checks.checkpointing import forward_segments, plan_segments

    for spec, ref in ((check.checkpointing.checkpointed_forward, forward_segments),
                      (check.checkpointing.segment_plan, plan_segments)):
        with pytest.raises(CheckFailed, match=REFERENCE):
            spec(lambda *a, ref=ref: ref(*a))


def brute_force_plan(layer_bytes, boundary_bytes, budget_bytes):  # noqa: ANN001, ANN201
    """Every segmentation tried (2**(n-1) of them): right, but not the dynamic programme."""
    import itertools

    from labsim.checkpointing import recomputed_layers, segment_peak_bytes

    n, best = len(layer_bytes), None
    for cuts in itertools.product((False, True), repeat=n - 1):
        starts = [0] + [i + 1 for i, c in enumerate(cuts) if c]
        if segment_peak_bytes(layer_bytes, boundary_bytes, starts) <= budget_bytes:
            if best is None or recomputed_layers(n, starts) < recomputed_layers(n, best):
                best = starts
    if best is None:
        raise ValueError("nothing fits")
    return best


def test_trying_every_segmentation_is_not_the_dynamic_programme() -> None:
    from labsim.checks import checkpointing

    spec = checkpointing.segment_plan
    quick = type(spec)(spec.title, spec.build, forbid=spec.forbid, ops=False, case_seconds=2.0)
    with pytest.raises(CheckFailed, match="9/10 cases passed") as info:
        quick(brute_force_plan)
    assert "80 layers" in str(info.value) and "ran over 2 s" in str(info.value)


@pytest.mark.parametrize("seed", range(20))
def test_the_reference_plan_is_the_best_of_every_segmentation(seed: int) -> None:
    """The dynamic programme that sets the 80-layer case agrees with trying every plan."""
    import random

    from labsim.checks.checkpointing import _best_recompute, _dp_recompute

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    layers = [float(rng.randint(1, 15)) for _ in range(n)]
    inputs = [float(rng.randint(1, 5)) for _ in range(n)]
    budget = float(rng.randint(5, 60))
    assert _dp_recompute(layers, inputs, budget) == _best_recompute(layers, inputs, budget)


# -- lab 05: the launch-overhead fit -----------------------------------------------------------

def _polyfit_fit(nbytes, times):  # noqa: ANN001, ANN202
    import numpy as np

    if len(set(nbytes)) < 2:
        raise ValueError("one size")
    per_byte, launch = np.polyfit(nbytes, times, 1)
    return float(launch), 1 / float(per_byte)


def _lstsq_fit(nbytes, times):  # noqa: ANN001, ANN202
    a = torch.tensor([[1.0, float(x)] for x in nbytes], dtype=torch.float64)
    if len(set(nbytes)) < 2:
        raise ValueError("one size")
    launch, per_byte = torch.linalg.lstsq(a, torch.tensor(times, dtype=torch.float64)
                                          ).solution.tolist()
    return launch, 1 / per_byte


@pytest.mark.parametrize("fit", [_polyfit_fit, _lstsq_fit], ids=["numpy-polyfit", "torch-lstsq"])
def test_a_library_least_squares_is_not_the_fit(fit) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match="polyfit|linalg_lstsq"):
        check.fusion.launch_model(fit)


def test_the_fit_solution_passes(capsys) -> None:  # noqa: ANN001
    check.fusion.launch_model(exercises("05_kernel_fusion")["fit_launch_model"])
    assert as_shown(capsys.readouterr().out).strip() == "PASS launch_model: 7/7 cases passed"


# -- lab 04: attention without SDPA, tile by tile ---------------------------------------------

S4 = exercises("04_flash_attention")


def full_rows(q, k, v, causal=False, block_q=64, block_kv=64):  # noqa: ANN001, ANN201
    """Blocks of queries against *all* keys: exact, but a full row of scores per query."""
    out = torch.empty_like(q)
    for i in range(0, q.shape[-2], block_q):
        s = q[..., i:i + block_q, :] @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if causal:
            rows = torch.arange(i, i + s.shape[-2]).unsqueeze(-1)
            s = s.masked_fill(torch.arange(s.shape[-1]) > rows, -math.inf)
        out[..., i:i + block_q, :] = torch.softmax(s, -1) @ v
    return out


def hidden_sdpa(q, k, v, causal=False, **_):  # noqa: ANN001, ANN003, ANN201
    with torch._C.DisableTorchFunction():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def test_attention_solutions_pass_on_bf16_cross_and_odd_heads(capsys) -> None:  # noqa: ANN001
    check.attention.naive_attention(S4["naive_attention"])
    check.attention.tiled_attention(S4["tiled_attention"])
    assert as_shown(capsys.readouterr().out).splitlines() == [
        "PASS naive_attention: 8/8 cases passed", "PASS tiled_attention: 12/12 cases passed"]


def head_rows(q, k, v, causal=False, block_q=64, block_kv=64):  # noqa: ANN001, ANN201
    """A plain softmax over chunks of d query rows against every key: no online softmax,
    and each chunk (d x M) no bigger than an input."""
    out = torch.empty_like(q)
    d = q.shape[-1]
    for i in range(0, q.shape[-2], d):
        s = q[..., i:i + d, :] @ k.transpose(-1, -2) / math.sqrt(d)
        if causal:
            rows = torch.arange(i, i + s.shape[-2]).unsqueeze(-1)
            s = s.masked_fill(torch.arange(s.shape[-1]) > rows, -math.inf)
        out[..., i:i + d, :] = torch.softmax(s, -1) @ v
    return out


@pytest.mark.parametrize("cheat", [full_rows, head_rows], ids=["block-rows", "head-rows"])
def test_a_full_row_softmax_is_not_tiled(cheat) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match="no full rows of scores|whole softmax row") as info:
        check.attention.tiled_attention(cheat)
    assert "0/12 cases passed" in str(info.value)


@pytest.mark.parametrize("name", ["naive_attention", "tiled_attention"])
def test_sdpa_hidden_from_torch_function_is_still_sdpa(name: str) -> None:
    with pytest.raises(CheckFailed, match="write the attention yourself") as info:
        getattr(check.attention, name)(hidden_sdpa)
    assert " 0/" in str(info.value)


# -- lab 10: every head on every rank is not head-parallel -----------------------------------


def every_head_everywhere(x, w_qkv, b_qkv, w_o, b_o, head_dim):  # noqa: ANN001, ANN201
    """Right output, the wrong way: gather every head's weights and run the whole layer."""
    def whole(t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim)

    s, b, h = x.shape
    qkv = torch.nn.functional.linear(x, whole(w_qkv, 0), whole(b_qkv, 0))
    q, k, v = (t.permute(1, 2, 0, 3)
               for t in qkv.reshape(s, b, h // head_dim, 3, head_dim).unbind(3))
    heads = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return torch.nn.functional.linear(heads.permute(2, 0, 1, 3).reshape(s, b, h),
                                      whole(w_o, 1), b_o)


@pytest.mark.multiprocess
def test_lab_10_solutions_pass_and_every_head_everywhere_does_not(capsys) -> None:  # noqa: ANN001
    s10 = exercises("10_tensor_parallel")
    tp = check.tensor_parallel
    tp.parallel_mlp(s10["CopyToTP"], s10["ReduceFromTP"], s10["tp_mlp"])
    tp.head_parallel_attention(s10["tp_attention"])
    tp.sequence_parallel(s10["GatherSequence"], s10["ScatterSequence"], s10["sp_mlp"])
    tp.vocab_parallel_cross_entropy(s10["VocabParallelCE"])
    assert as_shown(capsys.readouterr().out).splitlines() == [
        "PASS parallel_mlp: 8/8 cases passed", "PASS head_parallel_attention: 5/5 cases passed",
        "PASS sequence_parallel: 10/10 cases passed",
        "PASS vocab_parallel_cross_entropy: 6/6 cases passed"]
    with pytest.raises(CheckFailed, match="(?s)0/5.*breaks a rule of this exercise") as info:
        tp.head_parallel_attention(every_head_everywhere)
    assert "all_gather" in str(info.value)


# -- lab 11: GPipe over the chunks is not interleaved 1F1B ------------------------------------


def gpipe_over_chunks(p, m, v):  # noqa: ANN001, ANN201
    """Valid, and as fast on paper, but every (micro-batch, chunk) held at once."""
    from labsim.pipeline import Op

    fwd = [Op("F", i, c) for c in range(v) for i in range(m)]
    bwd = [Op("B", i, c) for c in reversed(range(v)) for i in range(m)]
    return tuple(tuple(fwd + bwd) for _ in range(p))


@pytest.mark.multiprocess
def test_lab_11_solutions_pass_and_gpipe_over_chunks_does_not(capsys) -> None:  # noqa: ANN001
    s11 = exercises("11_pipeline_parallel")
    pp = check.pipeline
    pp.gpipe(s11["gpipe"])
    pp.one_f_one_b(s11["one_f_one_b"])
    pp.interleaved(s11["interleaved"])
    pp.pipeline_step(s11["pipeline_step"])
    assert as_shown(capsys.readouterr().out).splitlines() == [
        "PASS gpipe: 8/8 cases passed", "PASS one_f_one_b: 8/8 cases passed",
        "PASS interleaved: 7/7 cases passed", "PASS pipeline_step: 9/9 cases passed"]
    with pytest.raises(CheckFailed, match="(?s)0/7.*breaks a rule of this exercise: "
                       "interleaved 1F1B holds no more"):
        pp.interleaved(gpipe_over_chunks)


# -- lab 04: FlashAttention-2 as an autograd.Function ------------------------------------------

def _naive(q, k, v, causal):  # noqa: ANN001, ANN202
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


class AutogradNaive:
    """No Function at all: autograd through the naive code keeps the N x N matrices."""

    @staticmethod
    def apply(q, k, v, is_causal=False):  # noqa: ANN001, ANN205
        return _naive(q, k, v, is_causal)


class RecomputeEverything(torch.autograd.Function):
    """Saves only Q, K, V, and backward re-runs the naive code under autograd: no L, and a
    full N x N matrix in backward."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v)
        ctx.is_causal = is_causal
        return _naive(q, k, v, is_causal)

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _naive(q, k, v, ctx.is_causal)
        return (*torch.autograd.grad(out, (q, k, v), do), None)


class FullMatrixBackward(S4["FlashAttention2"]):
    """The solution's forward (saves L), but a backward that builds the whole P at once."""

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        q, k, v, o, lse = ctx.saved_tensors
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if ctx.is_causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), -math.inf)
        p = torch.exp(s - lse.unsqueeze(-1))
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
        scale = 1 / math.sqrt(q.shape[-1])
        return ds @ k * scale, ds.transpose(-1, -2) @ q * scale, dv, None


class TiledForwardAutogradBackward(S4["FlashAttention2"]):
    """The solution's tiled forward (saves L), and a backward that runs that forward again
    under autograd: tiles everywhere, but no backward written by hand."""

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        q, k, v, _, _ = ctx.saved_tensors
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with torch.enable_grad():
            out = TiledForwardAutogradBackward._tiled(q, k, v, ctx.is_causal)
        return (*torch.autograd.grad(out, (q, k, v), do), None)

    @staticmethod
    def _tiled(q, k, v, causal):  # noqa: ANN001, ANN205
        return S4["tiled_attention"](q, k, v, causal=causal, block_q=64, block_kv=64)


class SdpaFunction(torch.autograd.Function):
    """SDPA hidden from the torch-function log, forward and (recomputed) backward."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):  # noqa: ANN001, ANN205
        ctx.save_for_backward(q, k, v)
        ctx.is_causal = is_causal
        return hidden_sdpa(q, k, v, is_causal)

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = hidden_sdpa(q, k, v, ctx.is_causal)
        return (*torch.autograd.grad(out, (q, k, v), do), None)


def test_the_flash_attention2_solution_passes(capsys) -> None:  # noqa: ANN001
    check.attention.flash_attention2(S4["FlashAttention2"])
    assert as_shown(capsys.readouterr().out).strip() == "PASS flash_attention2: 8/8 cases passed"


@pytest.mark.parametrize(("cls", "why"), [
    (AutogradNaive, "its forward saved"),
    (RecomputeEverything, "logsumexp|tile"),
    (FullMatrixBackward, "never the whole N x N matrix"),
    (SdpaFunction, "write the attention yourself"),
    (TiledForwardAutogradBackward, "ran autograd again"),
], ids=["autograd-through-naive", "recompute-without-L", "full-P-in-backward", "sdpa",
        "autograd-backward"])
def test_flash_attention2_shortcuts_fail(cls, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why) as info:
        check.attention.flash_attention2(cls)
    assert " 0/8 cases passed" in str(info.value)


# -- lab 03: the selective-recomputation policy ------------------------------------------------

def _policy(saved_ops):  # noqa: ANN001, ANN202
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return CheckpointPolicy.MUST_SAVE if saved_ops is None or op in saved_ops else (
            CheckpointPolicy.PREFER_RECOMPUTE)

    return policy


def test_the_selective_policy_solution_passes(capsys) -> None:  # noqa: ANN001
    check.checkpointing.selective_policy(exercises("03_checkpointing")["selective_policy"])
    assert as_shown(capsys.readouterr().out).strip() == "PASS selective_policy: 5/5 cases passed"


@pytest.mark.parametrize(("saved", "why"), [
    (None, "s x s tensor"),  # save everything: no checkpointing at all
    ((), "a linear layer is recomputed"),  # recompute everything: full checkpointing
    (("mm", "addmm", "bmm"), "s x s tensor"),  # keep the attention scores too
    (("addmm",), "a linear layer is recomputed"),  # forget the bias-free matmuls
], ids=["save-all", "recompute-all", "save-scores", "addmm-only"])
def test_selective_policy_shortcuts_fail(saved, why: str) -> None:  # noqa: ANN001
    aten = torch.ops.aten
    ops = None if saved is None else tuple(getattr(aten, n).default for n in saved)
    with pytest.raises(CheckFailed, match=why):
        check.checkpointing.selective_policy(_policy(ops))


# -- lab 00: the benchmark timer ---------------------------------------------------------------

def _timer(*, pre_sync: bool = True, post_sync: bool = True, warm: bool = True,
           own_clock: bool = False):  # noqa: ANN202
    import time

    def benchmark(fn, sync=lambda: None, warmup=1, repeat=5,  # noqa: ANN001, ANN202
                  clock=time.perf_counter):
        if own_clock:
            clock = time.perf_counter
        for _ in range(warmup if warm else 0):
            fn()
        times = []
        for _ in range(repeat):
            if pre_sync:
                sync()
            start = clock()
            fn()
            if post_sync:
                sync()
            times.append(clock() - start)
        return times

    return benchmark


def test_the_timer_solution_passes(capsys) -> None:  # noqa: ANN001
    check.roofline.benchmark(exercises("00_why_gpus")["benchmark"])
    assert as_shown(capsys.readouterr().out).strip() == "PASS benchmark: 5/5 cases passed"


@pytest.mark.parametrize(("timer", "why"), [
    (_timer(post_sync=False, pre_sync=False), "before the device finished"),
    (_timer(pre_sync=False), "includes earlier work"),
    (_timer(warm=False), "warm up"),
    (_timer(own_clock=True), "read the time with the `clock` you are given"),
], ids=["no-sync", "no-sync-before-start", "no-warmup", "own-clock"])
def test_timer_shortcuts_fail(timer, why: str) -> None:  # noqa: ANN001
    with pytest.raises(CheckFailed, match=why):
        check.roofline.benchmark(timer)


def test_a_timer_that_is_labsims_fails() -> None:
    from labsim.lab import time_fn

    def wrapped(fn, sync=lambda: None, warmup=1, repeat=5, clock=None):  # noqa: ANN001, ANN202
        return list(time_fn(fn, warmup=warmup, repeat=repeat).times_s)

    with pytest.raises(CheckFailed, match=REFERENCE):
        check.roofline.benchmark(wrapped)


def test_a_timer_that_raises_fails_with_its_error() -> None:
    def broken(fn, sync=lambda: None, warmup=1, repeat=5, clock=None):  # noqa: ANN001, ANN202
        raise RuntimeError("no clock")

    with pytest.raises(CheckFailed, match="no clock"):
        check.roofline.benchmark(broken)


# -- lab 01: what is alive after each phase of two training steps ------------------------------

def _timeline(*, lazy: bool = True, frees: bool = True, backward_frees: bool = True):  # noqa: ANN202
    """A learner's ``predict_timeline`` that gets one of PyTorch's lifetimes wrong."""

    def predict_timeline(n_params, activation_bytes, optimizer, set_to_none):  # noqa: ANN001, ANN202
        buffers = {"adam": 2, "sgd": 0, "sgd-momentum": 1}[optimizer]
        grads, state, a = 4 * n_params, 4 * buffers * n_params, activation_bytes
        early = 0 if lazy else state
        kept = 0 if set_to_none and frees else grads
        left = 0 if backward_frees else a
        return [early + a, early + grads + left, grads + state,
                state + kept + a, grads + state + left, grads + state + left]

    return predict_timeline


@pytest.mark.slow
def test_the_timeline_solution_passes(capsys) -> None:  # noqa: ANN001
    check.memory.predict_timeline(exercises("01_memory")["predict_timeline"])
    assert as_shown(capsys.readouterr().out).strip() == "PASS predict_timeline: 8/8 cases passed"


@pytest.mark.slow
@pytest.mark.parametrize(("cheat", "why"), [
    (_timeline(lazy=False), r"adam.*\[0\]"),
    (_timeline(frees=False), r"set_to_none=True.*\[3\]"),
    (_timeline(backward_frees=False), r"\[1\]"),
    (lambda n, a, optimizer, set_to_none: [a + 16 * n] * 6, r"\[0\]"),
], ids=["eager-adam-state", "gradients-never-freed", "activations-outlive-backward",
        "sixteen-bytes-everywhere"])
def test_timeline_shortcuts_fail(cheat, why: str) -> None:  # noqa: ANN001
    import re

    with pytest.raises(CheckFailed, match=re.compile(why, re.S)):
        check.memory.predict_timeline(cheat)


@pytest.mark.slow
def test_a_timeline_from_labsims_byte_counts_fails() -> None:
    import labsim

    def from_library(n, a, optimizer, set_to_none):  # noqa: ANN001, ANN202
        _, grad, state = (b * n for b in labsim.memory.bytes_per_param("fp32", optimizer))
        return [a, grad, grad + state, state + a, grad + state, grad + state]

    with pytest.raises(CheckFailed, match=REFERENCE):
        check.memory.predict_timeline(from_library)
