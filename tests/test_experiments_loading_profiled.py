"""A training loop under torch.profiler (labsim.experiments.loading.profiled)."""

import json
import multiprocessing

import pytest
import torch

from labsim.experiments.loading.profiled import (
    DATA,
    STEP,
    merged_length,
    profile_loop,
    records_of,
    split_records,
    timeline,
)
from labsim.lab.datasets import SyntheticImages
from labsim.lab.models import TrainStep


def test_merged_length_counts_overlaps_once():
    assert merged_length([]) == 0.0
    assert merged_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4.0


def test_split_records_reads_the_host_labels_only():
    rows = [("ProfilerStep*", 1, 0.0, 100.0, "cpu"),
            (DATA, 1, 10.0, 40.0, "cpu"), ("aten::div", 1, 12.0, 20.0, "cpu"),
            (STEP, 1, 45.0, 80.0, "cpu"), ("aten::mm", 2, 50.0, 90.0, "cpu"),
            (STEP, 7, 50.0, 95.0, "cuda"), ("sgemm", 7, 50.0, 95.0, "cuda"),
            (DATA, 1, 85.0, 90.0, "cpu")]
    split = split_records(rows)
    assert split == pytest.approx({"data_s": 35e-6, "compute_s": 35e-6, "idle_s": 10e-6})
    with pytest.raises(ValueError, match="no 'data' or 'step'"):
        split_records([("aten::mm", 1, 0.0, 1.0, "cpu")])


@pytest.fixture(scope="module")
def profiled_runs():
    torch.set_num_threads(1)
    data = SyntheticImages(n_items=64, side_px=64, timed=True)
    step = TrainStep(width=64)
    runs = [profile_loop(data, step, batch_size=4, num_workers=0, steps=4, checkpoint_every=2)]
    if "fork" in multiprocessing.get_all_start_methods():
        runs.append(profile_loop(data, step, batch_size=4, num_workers=1, steps=3))
    return runs


def test_a_profiled_loop_labels_every_fetch_and_step(profiled_runs):
    for run in profiled_runs:
        records = records_of(run.events)
        names = [r[0] for r in records]
        assert names.count(DATA) == names.count(STEP) == run.steps
        assert any(n.startswith("enumerate(DataLoader)#") for n in names)
        split = split_records(records)
        assert min(split.values()) >= 0 and split["compute_s"] > 0


def test_the_timeline_tiles_the_window_with_the_split(profiled_runs):
    run = profiled_runs[0]
    trace = run.timeline()
    split = split_records(records_of(run.events))
    main = trace.filter(stream="main thread")
    assert main.busy_s(kind="load") == pytest.approx(split["data_s"])
    assert main.busy_s(kind="compute") == pytest.approx(split["compute_s"])
    assert main.busy_s(kind="idle") == pytest.approx(split["idle_s"], abs=1e-9)
    assert main.start_s == 0.0 and main.end_s == pytest.approx(sum(split.values()))
    operators = trace.filter(stream="torch operators")
    assert len(operators) > 0 and operators.end_s <= main.end_s + 1e-12
    assert not trace.filter(stream="GPU kernels").spans  # no GPU here
    # the checkpoint between steps 1 and 2 and 3 and 4 shows as idle
    assert main.busy_s(kind="idle") > 0
    with pytest.raises(ValueError, match="no 'data' or 'step'"):
        timeline([])


def test_the_chrome_trace_opens_as_json(profiled_runs, tmp_path):
    path = profiled_runs[0].to_chrome(tmp_path / "loop.json")
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {DATA, STEP} <= names and any(str(n).startswith("ProfilerStep#") for n in names)
    with pytest.raises(ValueError, match="does not exist"):
        profiled_runs[0].to_chrome(tmp_path / "missing" / "loop.json")
