"""Plan: defaults, derived counts, and every invalid plan raising a ValueError that names the
fix."""

import pytest

from labsim.plan import Plan
from labsim.workload import Transformer


def test_profile_defaults_fill_what_the_plan_leaves_open():
    assert Plan().overlap_grad_reduce and Plan().bucket_bytes == 25 * 2**20  # PyTorch DDP: 25 MiB
    old = Plan(software="megatron-lm-2021")
    assert not old.overlap_grad_reduce and old.attention == "standard"
    assert not Plan(software="megatron-lm-2021", overlap_grad_reduce=True).tp_comm_overlap
    assert Plan(software="megatron-core-te").tp_comm_overlap
    assert Plan(software="deepspeed-zero3-2021").zero3_prefetch == 0


def test_megatron_lm_2022_is_2021_with_its_own_sustained_fraction():
    """Korthikanti et al. 2022 ran the same schedule and communication a year later on the
    same cluster (docs/step.md section 3): only the fitted fraction and the texts differ, and
    the newer code is the faster one."""
    from dataclasses import fields

    from labsim.software import PROFILES

    old, new = PROFILES["megatron-lm-2021"], PROFILES["megatron-lm-2022"]
    differ = {f.name for f in fields(old) if getattr(old, f.name) != getattr(new, f.name)}
    assert differ == {"name", "description", "sustained", "source", "calibration"}
    assert new.sustained["ampere"] > old.sustained["ampere"]


def test_the_generic_profile_sits_between_the_calibrated_ones():
    from labsim.software import PROFILES

    generic = PROFILES["generic"].sustained
    for arch in ("ampere", "hopper"):
        fitted = [p.sustained[arch] for p in PROFILES.values()
                  if p.calibration and p.fitted == "sustained" and arch in p.sustained]
        assert len(fitted) >= 2 and min(fitted) <= generic[arch] <= max(fitted)


def test_defaults_and_derived_counts():
    plan = Plan(dp=4, tp=2, pp=2, micro_batch=2, global_batch=64)
    assert plan.gpus == 16
    assert plan.microbatches == 64 // (4 * 2)
    assert Plan(dp=3, micro_batch=2).global_batch == 6  # one micro-batch per replica
    assert Plan().bytes_per_element == 2 and Plan(precision="fp32").bytes_per_element == 4


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(dp=4, micro_batch=2, global_batch=12), "multiple of 8"),
        (dict(pp=1, schedule="interleaved", virtual_stages=2), "set pp > 1"),
        (dict(pp=2, schedule="interleaved", virtual_stages=1), "virtual_stages >= 2"),
        (dict(pp=2, virtual_stages=2), "schedule='interleaved'"),
        (dict(pp=4, schedule="interleaved", virtual_stages=2, global_batch=6), "multiple of pp"),
        (dict(schedule="zb"), "choose one of"),
        (dict(zero_stage=4), "0, 1, 2 or 3"),
        (dict(zero_stage=2, pp=2), "zero_stage <= 1"),
        (dict(recompute="some"), "choose one of"),
        (dict(sequence_parallel=True), "tp > 1"),
        (dict(tp=0), "whole number >= 1"),
        (dict(bucket_bytes=0), "> 0"),
        (dict(bucket_bytes=float("nan")), "finite"),
        (dict(bucket_bytes=1), ">= 1e3"),
        (dict(dp=4.7), "whole number"),
        (dict(dp=float("nan")), "whole number"),
        (dict(dp=True), "whole number"),
        (dict(global_batch=10**18), "100,000,000"),
        (dict(global_batch=1e18), "whole number"),
        (dict(overlap_grad_reduce="no"), "True or False"),
        (dict(sequence_parallel="yes", tp=2), "True or False"),
        (dict(software="megatron"), "choose one of"),
        (dict(precision=16), "name such as"),
        (dict(zero_stage=True), "0, 1, 2 or 3"),
        (dict(dp=2**11, tp=2**10), "1,048,576"),
    ],
)
def test_invalid_plans_name_the_fix(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Plan(**kwargs)


def test_validate_for_model_and_gpus():
    model = Transformer(layers=12, hidden=768, heads=12, seq_len=128, vocab=1000)
    Plan(dp=2, tp=4, pp=3).validate_for(model, 24)
    with pytest.raises(ValueError, match="does not divide heads=12"):
        Plan(tp=8).validate_for(model)
    with pytest.raises(ValueError, match="layers=12 is not divisible by pp"):
        Plan(pp=8).validate_for(model)
    with pytest.raises(ValueError, match="at least one layer; use pp"):
        Plan(pp=16).validate_for(model)
    with pytest.raises(ValueError, match="layers=12 is not divisible"):
        Plan(pp=2, schedule="interleaved", virtual_stages=4, global_batch=2).validate_for(model)
    with pytest.raises(ValueError, match="change dp to 4"):
        Plan(dp=3, tp=2, pp=1).validate_for(model, 8)
    with pytest.raises(ValueError, match="change tp or pp"):
        Plan(dp=1, tp=3, pp=1).validate_for(model, 8)


def test_the_embedding_and_the_loss_can_count_as_layers():
    """Megatron-Core's account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_
    split, Llama 3 405B's layout: 126 layers + 2 over 16 stages of 8 chunks."""
    both = Plan(pp=16, schedule="interleaved", virtual_stages=8, global_batch=16,
                account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True)
    assert both.chunk_layers(126) == (0,) + (1,) * 126 + (0,)
    first = Plan(pp=4, account_for_embedding_in_pipeline_split=True)
    assert first.chunk_layers(23) == (5, 6, 6, 6)
    assert Plan(pp=4).chunk_layers(24) == (6, 6, 6, 6)
    one = Plan(account_for_embedding_in_pipeline_split=True,
               account_for_loss_in_pipeline_split=True)
    assert one.chunk_layers(12) == (12,)  # one chunk holds everything either way
    with pytest.raises(ValueError, match=r"layers=24 \+ 1 \(the embedding / loss counted as "
                       r"layers\) is not divisible by pp \* virtual_stages = 4"):
        first.chunk_layers(24)
    with pytest.raises(ValueError, match="at least one layer"):
        both.chunk_layers(125)
    with pytest.raises(ValueError, match="True or False"):
        Plan(pp=2, account_for_loss_in_pipeline_split=1)
    model = Transformer(layers=14, hidden=512, heads=8, seq_len=128, vocab=1000)
    Plan(pp=4, account_for_embedding_in_pipeline_split=True,
         account_for_loss_in_pipeline_split=True).validate_for(model)
    with pytest.raises(ValueError, match="layers=14 is not divisible by pp"):
        Plan(pp=4).validate_for(model)
