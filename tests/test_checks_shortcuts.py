"""Shortcuts through the checks of labs 00-06, 10 and 11 fail, naming the rule; each lab's own
solution (from ``solutions/``) passes beside them.  (Labs 07-09 and 12: their own check tests;
more shortcuts of labs 10 and 11 in ``test_checks_tensor_parallel`` and
``test_checks_pipeline``.)"""

from __future__ import annotations

import math

import pytest
import torch

from labsim import checks as check
from labsim.checks import CheckFailed

from .solution_cells import exercises

REFERENCE = "calls labsim's own reference"


def test_labs_00_01_solutions_pass_and_library_answers_do_not(capsys) -> None:  # noqa: ANN001
    s0, s1 = exercises("00_why_gpus"), exercises("01_memory")
    check.roofline.matmul_flops(s0["matmul_flops"])
    check.memory.gpt_params(s1["gpt_params"])
    assert capsys.readouterr().out.count("PASS") == 2
    import labsim

    with pytest.raises(CheckFailed, match=REFERENCE):
        check.roofline.roofline_time(lambda f, b, p, bw: labsim.Roofline("x", p, bw).op_time(f, b))
    with pytest.raises(CheckFailed, match=REFERENCE):
        check.memory.gpt_params(lambda layers, hidden, vocab, seq: labsim.Transformer(
            layers, hidden, max(1, hidden // 64), seq, vocab, tied_embeddings=True).params)
    with pytest.raises(CheckFailed, match=REFERENCE):
        check.memory.zero_model_state_bytes(
            lambda n, stage, dp: labsim.training_memory(n, zero_stage=stage, dp=dp).model_states)


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
    assert "PASS loss_scaler: 10/10 cases passed" in capsys.readouterr().out


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
    assert capsys.readouterr().out.count("PASS") == 2
    from labsim.checks.checkpointing import forward_segments, plan_segments

    for spec, ref in ((check.checkpointing.checkpointed_forward, forward_segments),
                      (check.checkpointing.segment_plan, plan_segments)):
        with pytest.raises(CheckFailed, match=REFERENCE):
            spec(lambda *a, ref=ref: ref(*a))


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
    assert capsys.readouterr().out.splitlines() == [
        "PASS naive_attention: 8/8 cases passed", "PASS tiled_attention: 12/12 cases passed"]


def test_a_full_row_softmax_is_not_tiled() -> None:
    with pytest.raises(CheckFailed, match="no full rows of scores") as info:
        check.attention.tiled_attention(full_rows)
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
    assert capsys.readouterr().out.splitlines() == [
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
    assert capsys.readouterr().out.splitlines() == [
        "PASS gpipe: 8/8 cases passed", "PASS one_f_one_b: 8/8 cases passed",
        "PASS interleaved: 7/7 cases passed", "PASS pipeline_step: 9/9 cases passed"]
    with pytest.raises(CheckFailed, match="(?s)0/7.*breaks a rule of this exercise: "
                       "interleaved 1F1B holds no more"):
        pp.interleaved(gpipe_over_chunks)
