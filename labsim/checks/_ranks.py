"""What every multi-process check does around its workers: ask the learner's functions once
without a process group (a stub raises ``NotImplementedError`` before any collective), launch
one set of ranks for all the cases' jobs, turn a hang or a crash into every case's failure with
the fix named, and assemble each case's ``Outcome`` from the ranks' results.

A worker returns, per job, either a dict (its ``"references"``, the keys a rule reads, and what
the case compares) or an ``Outcome`` (the learner's function raised on that rank).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from labsim.checks._core import Case, Outcome, Spec, plain_outcome


def stub_outcomes(probes: Sequence[Callable[[], object]], cases: int) -> list[Outcome] | None:
    """Every case failed with the stub's ``NotImplementedError`` if a probe raises one; None
    otherwise (any other error is expected: there is no process group yet)."""
    for probe in probes:
        try:
            probe()
        except NotImplementedError as exc:
            return [Outcome.of_error(exc)] * cases
        except Exception:  # noqa: BLE001, S110 - expected: no process group here
            pass
    return None


def unique_jobs(cases: Sequence[Case], job: Callable[[Case], Hashable]
                ) -> tuple[list[Any], list[int]]:
    """The distinct jobs of ``cases`` in order, and each case's index among them (cases that
    read different results of one run share its job)."""
    jobs: list[Any] = []
    index = []
    for c in cases:
        key = job(c)
        if key not in jobs:
            jobs.append(key)
        index.append(jobs.index(key))
    return jobs, index


def launch_ranks(worker: Callable[..., list[Any]], nprocs: int, args: tuple, spec: Spec,
                 cases: int, timeout_s: float, hang: str | None = None
                 ) -> tuple[list[list[Any]] | None, list[Outcome]]:
    """(each rank's results, []) or (None, every case's failure): a launch that times out
    fails with ``hang`` (what the learner should look for) and the launcher's first line, a
    crashed worker with its error."""
    from labsim.lab.launcher import LaunchTimeout, WorkerError, launch

    try:
        return launch(worker, nprocs, args=args, timeout_s=timeout_s,
                      progress=spec.title).values, []
    except LaunchTimeout as exc:
        if hang is None:
            return None, [Outcome.of_error(exc)] * cases
        first = str(exc).splitlines()[0] if str(exc) else "the ranks were stopped"
        msg = f"{hang} ({first})"
        return None, [Outcome(None, "LaunchTimeout", ("LaunchTimeout",), msg)] * cases
    except WorkerError as exc:
        return None, [Outcome.of_error(exc)] * cases


def rank_outcomes(ranks: list[list[Any]], job_of_case: Sequence[int], observe: Sequence[str],
                  value: Callable[[list[dict], int], Any]) -> list[Outcome]:
    """Each case's ``Outcome``: ``value(runs, i)`` of its job's runs (one per rank), with the
    ``observe`` keys of every rank and the references any rank touched; a rank that raised
    fails the case with its error."""
    references = sorted({ref for r in ranks for run in r if isinstance(run, dict)
                         for ref in run["references"]})
    outcomes = []
    for i, k in enumerate(job_of_case):
        runs = [r[k] for r in ranks]
        observed = {"ranks": [{key: run[key] for key in observe}
                              for run in runs if isinstance(run, dict)],
                    "references": references}
        bad = next((run for run in runs if isinstance(run, Outcome)), None)
        if bad is not None:
            outcomes.append(Outcome(None, bad.error, bad.error_types, bad.message, observed))
        else:
            outcomes.append(plain_outcome(value(runs, i), observed))
    return outcomes
