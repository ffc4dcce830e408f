"""The judging process ``labsim.course.judge.Judge`` starts (``python -m
labsim.course.judge_main LAB [EXTRA]``): it builds the lab's expectations as the grader does,
then judges one check's results per request under its memory budget (``labsim.course.judge``'s
module doc).  A module of its own so that ``judge`` -- which the grader imports -- does not
import the grader back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from labsim.course import grade as gr
from labsim.course import rebuild as rb
from labsim.course.judge import MEMORY_BYTES, _address_space, verdict_of


def serve(lab: str, extra: str) -> int:
    """The judging process: build the expectations, then answer one JSON line per request
    line on stdin (``{"index", "out", "stem"}``) until stdin closes."""
    import resource

    released = rb.read_lab(Path(lab))
    checks = released.checks
    if extra:
        checks = checks + rb.read_extra_checks(Path(extra), released).checks
    exp = gr.Expectations.build(checks)
    used = _address_space()
    limit = used + MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out = sys.stdout
    out.write(json.dumps({"ready": len(checks)}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            index = int(request["index"])
            answer = verdict_of(exp.specs[index], exp.cases[index], Path(request["out"]),
                                str(request["stem"]))
        except MemoryError:
            answer = {"unreadable": "its results need more memory than the grader allows"}
        except RecursionError:
            answer = {"unreadable": "its results are nested too deeply"}
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the judge
            answer = {"unreadable": f"its results could not be judged ({type(exc).__name__})"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""))
