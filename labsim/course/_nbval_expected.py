"""A pytest plugin for released labs: nbval compares each check cell with the line its
metadata keeps (``metadata.labsim.expected``, ``PASS <name>: k/k cases passed``).

Released labs store no outputs, so a learner never sees a PASS they did not produce; this
plugin gives nbval, for the run only, the output each check cell must print.  ``labsim
check`` loads it (``pytest --nbval-lax -p labsim.course._nbval_expected labs/NN.ipynb``).
"""

from __future__ import annotations

from typing import Any

import nbformat


def pytest_collection_modifyitems(session: Any, config: Any, items: list[Any]) -> None:
    for item in items:
        cell = getattr(item, "cell", None)
        if cell is None:
            continue
        meta = cell.get("metadata", {}).get("labsim", {})
        expected = meta.get("expected") if isinstance(meta, dict) else None
        if meta.get("role") == "check" and isinstance(expected, str) and not cell.get(
                "outputs"):
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout",
                                                   text=expected + "\n")]
            cell.execution_count = 1
