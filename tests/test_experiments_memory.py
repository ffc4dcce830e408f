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
