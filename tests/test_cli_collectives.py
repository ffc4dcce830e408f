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


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv, words", [
    (["collective", "allreduce", "1e30"], "1 PiB"),
    (["collective", "allreduce", "1GiB", "--nodes", "1000000000"], "1,048,576"),
    (["collective", "allreduce", "1GiB", "--nodes", "4.7"], "whole number"),
    (["collective", "allreduce", "1GiB", "--nodes", "nan"], "whole number"),
    (["collective", "allreduce", "1GiB", "--gpus", "9"], "has 8 GPUs"),
    (["collective", "allreduce", "nan"], "cannot read"),
    (["collective", "allreduce", "1.5"], "whole number"),
    (["collective", "allreduce", "1GiB", "--protocol", "LL64"], "LL128"),
    (["collective", "allreduce", "1GiB", "--algorithm", "hierarchical"],
     "pass --protocol alpha-beta"),
    (["collective", "allreduce", "1GiB", "--detail", "most"], "detail"),
    (["collective", "allreduce", "1GiB", "--trace", "/no/such/folder/t.json"],
     "does not exist"),
    (["collective", "allreduce", "1GiB", "--nodes", "1024", "--protocol", "alpha-beta"],
     "transfers"),
])
def test_bad_input_is_one_line_and_exit_2(argv, words, capsys):
    assert main(argv) == 2
    assert words in one_line_error(capsys)


def test_the_trace_is_written_whole_or_not_at_all(tmp_path, capsys, monkeypatch):
    out = tmp_path / "t.json"
    out.write_text("old")
    import labsim.cli._guard as guard

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(guard.os, "replace", boom)
    assert main(["collective", "allreduce", "1MiB", "--trace", str(out)]) == 2
    assert "disk full" in one_line_error(capsys)
    assert out.read_text() == "old" and list(tmp_path.iterdir()) == [out]


def test_textbook_algorithms_on_the_command_line(capsys):
    assert main(["collective", "allreduce", "1GiB", "--nodes", "2", "--algorithm",
                 "hierarchical", "--protocol", "alpha-beta"]) == 0
    assert "hierarchical/alpha-beta" in capsys.readouterr().out
