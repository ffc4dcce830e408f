"""What a withheld reference raises.

While a notebook is graded (``labsim grade``, ``labsim check``) it runs against a copy of
labsim in which the references of the lab's exercises -- the functions and classes that
compute an exercise's answer, and the library routes to it -- keep their names and
signatures but have no body: calling one raises ``ReferenceWithheld``.  Nothing else changes.
Story cells that need a withheld reference do not run while grading (they never count).
"""

from __future__ import annotations


class ReferenceWithheld(RuntimeError):
    """A reference of the graded lab was called; its code is not in the graded copy."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"{name} is withheld while this notebook is graded: it computes (or leads to) an "
            "exercise's answer, so the graded copy of labsim does not contain it; write the "
            "exercise with your own code")
        self.reference = name


def withheld(name: str) -> ReferenceWithheld:
    """The exception a withheld reference's stub raises (``raise withheld("module.name")``)."""
    return ReferenceWithheld(name)
