"""What is alive during two training steps (labsim.experiments.memory), measured."""

from __future__ import annotations

import pytest

from labsim.experiments.memory import PHASES, step_timeline

CONFIG = {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64, "batch": 2}


@pytest.mark.slow
@pytest.mark.parametrize(("optimizer", "buffers"), [("adam", 2), ("sgd-momentum", 1),
                                                    ("sgd", 0)])
def test_state_appears_in_the_first_step_and_gradients_are_freed(optimizer: str,
                                                                 buffers: int) -> None:
    run = step_timeline(CONFIG, optimizer, set_to_none=True)
    grads, state, a = 4 * run.n_params, 4 * buffers * run.n_params, run.activation_bytes
    assert len(run.after) == len(PHASES)
    assert list(run.after) == [a, grads, grads + state, state + a, grads + state, grads + state]
    assert run.peaks[0] >= max(run.after[:3]) and run.peaks[1] >= max(run.after[3:])
    kept = step_timeline(CONFIG, optimizer, set_to_none=False)
    assert kept.after[3] == run.after[3] + grads


def test_an_unknown_optimizer_is_refused() -> None:
    with pytest.raises(ValueError, match="adam"):
        step_timeline(CONFIG, "lion")


def test_a_recipe_outside_the_list_is_refused() -> None:
    from labsim.experiments.memory import recipe_step

    with pytest.raises(ValueError, match="fp32"):
        recipe_step(CONFIG, "fp8")
    with pytest.raises(ValueError, match="adam"):
        recipe_step(CONFIG, "fp32", "lion")


def test_master_copies_live_in_the_optimizer_and_the_model_trains() -> None:
    import torch

    from labsim.experiments.memory import recipe_step

    model, opt = recipe_step(CONFIG, "mixed-bf16", "adam")
    params = list(model.parameters())
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert {p.dtype for p in masters} == {torch.float32} and len(masters) == len(params)
    assert all(m.grad is None for m in masters)  # dropped after the update
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters))


@pytest.mark.slow
def test_the_memory_timeline_peaks_in_the_second_backward() -> None:
    from labsim.experiments.memory import CATEGORIES, memory_timeline

    config = {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 256, "batch": 2}
    tl = memory_timeline(config)
    assert tuple(tl.by_category) == CATEGORIES
    assert all(len(v) == len(tl.times_ms) for v in tl.by_category.values())
    assert list(tl.times_ms) == sorted(tl.times_ms)
    assert [p[0] for p in tl.phases] == [f"{phase} {s}" for s in (1, 2) for phase in
                                         ("zero_grad", "forward", "backward", "step")]
    run = step_timeline(config, "adam", set_to_none=True)
    weights = 4 * run.n_params
    peak = tl.at(tl.peak_index)
    assert tl.phase_at(tl.times_ms[tl.peak_index]) == "backward 2"
    assert peak["parameters"] == weights
    assert peak["optimizer state"] >= 8 * run.n_params  # the moments (and step counters)
    # the peak holds every activation of forward 2 and the loss's gradient over the vocabulary
    assert peak["activations"] >= run.activation_bytes - 64 * 1024
    assert max(tl.totals) >= weights + run.after[3] + 2 * 16 * 2 * 256 * 4
