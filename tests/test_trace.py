"""``Trace.to_chrome`` writes what Perfetto and chrome://tracing read: valid trace events, and
no track on which two slices overlap without nesting (concurrent flows get a lane each)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

import labsim
from labsim.trace import Trace


def check_chrome(doc: dict) -> None:
    """Raise AssertionError unless ``doc`` is trace-event JSON whose "X" slices on each
    (pid, tid) track are disjoint or nested."""
    assert set(doc) >= {"traceEvents"} and isinstance(doc["traceEvents"], list)
    tracks: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    named = set()
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M") and isinstance(e["name"], str) and e["name"]
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and e["args"]["name"]
            named.add((e["pid"], e["tid"]) if e["name"] == "thread_name" else (e["pid"], None))
            continue
        assert e["ts"] >= 0 and e["dur"] >= 0 and isinstance(e.get("args", {}), dict)
        tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for (pid, tid), slices in tracks.items():
        assert (pid, tid) in named and (pid, None) in named
        open_ends: list[float] = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start + 1e-6:  # µs; float rounding
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-9, \
                f"track {pid}/{tid}: {name} overlaps an earlier slice without nesting in it"
            open_ends.append(end)


def test_the_checker_catches_false_nesting() -> None:
    t = Trace()
    t.add(0, "net", "send", 0.0, 2.0)
    t.add(0, "net", "send", 1.0, 3.0)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "r"}},
              {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "net"}},
              {"name": "a", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 2},
              {"name": "b", "ph": "X", "pid": 0, "tid": 1, "ts": 1, "dur": 2}]
    with pytest.raises(AssertionError, match="overlaps"):
        check_chrome({"traceEvents": events})
    check_chrome(t.to_chrome())  # the trace itself puts them on two lanes
    names = [e["args"]["name"] for e in t.to_chrome()["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["net 1/2", "net 2/2"]


def test_a_ring_on_a_cluster_draws_each_concurrent_channel_on_its_own_lane() -> None:
    result = labsim.simulate_collective("allreduce", 64 << 20, labsim.dgx_h100(nodes=2))
    check_chrome(result.trace.to_chrome())


def test_a_training_step_names_its_processes_as_pipeline_stages(tmp_path: Path) -> None:
    gpt = labsim.Transformer.preset("gpt2-124m")
    step = labsim.simulate_step(gpt, labsim.dgx_a100(nodes=1),
                                labsim.Plan(dp=2, pp=4, global_batch=16))
    doc = step.trace.to_chrome(tmp_path / "step.json")
    check_chrome(json.loads((tmp_path / "step.json").read_text()))
    procs = [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert procs == [f"pipeline stage {s}" for s in range(4)]


def test_writing_into_a_missing_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        Trace().to_chrome(tmp_path / "nope" / "t.json")


@pytest.mark.parametrize("detail, words", [("op", "one bar per operation"),
                                           ("phase", "one bar per phase"), ("full", "")])
def test_a_gantt_title_says_what_a_bar_is_in_words(detail: str, words: str) -> None:
    import matplotlib.pyplot as plt

    from labsim.plots.trace import gantt

    trace = Trace(detail=detail)
    trace.add(0, "comm", "send", 0.0, 1e-3, "ring step 1/3", 1e6)
    fig = gantt(trace, title="A ring")
    title = fig.axes[0].get_title()
    plt.close(fig)
    assert title.startswith("A ring") and words in title and "detail" not in title
