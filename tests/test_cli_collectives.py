"""`labsim collective`: a summary, a trace file, exit code 2 on bad input."""

from __future__ import annotations

import json

import pytest

from labsim.cli import main


def test_prints_time_algbw_busbw_and_writes_a_trace(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["collective", "allreduce", "1GiB", "--cluster", "dgx-h100", "--nodes", "4",
                 "--algorithm", "ring", "--trace", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("time", "algbw", "busbw", "32 GPUs"):
        assert word in text
    assert any(e["ph"] == "X" for e in json.loads(out.read_text())["traceEvents"])


@pytest.mark.parametrize("argv", [
    ["collective", "allscatter", "1GB"],
    ["collective", "allreduce", "1GB", "--nodes", "0"],
    ["collective", "allreduce", "-5"],
    ["collective", "allreduce", "1GB", "--gpus", "6", "--algorithm", "recursive_doubling"],
    ["collective", "allreduce", "1GB", "--cluster", "dgx-z100"],
])
def test_bad_input_exits_2_with_a_message(argv, capsys):
    assert main(argv) == 2
    assert "error:" in capsys.readouterr().err
