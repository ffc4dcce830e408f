"""Checks that notebook check cells call: ``check.<topic>.<name>(learner_fn)``.

One module per topic.  Each public check builds at least five cases (edge cases included),
runs the learner's function through ``run_check`` and prints one PASS line on success.
"""

from labsim.checks._core import SUMMARY_RE, Case, CheckFailed, close, equal, raises, run_check

__all__ = ["SUMMARY_RE", "Case", "CheckFailed", "close", "equal", "raises", "run_check"]
