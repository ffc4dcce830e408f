"""`labsim plan CONFIG`: the top plans as a table, the whole ranking as CSV; bad input ends in
one line naming the fix (exit 2), never a traceback."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from labsim.cli import main

from .conftest import ROOT

SMALL = ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx-a100'\n"
         "[search]\nglobal_batch=32\nmicro_batches=[1, 4]\nrecompute=['none']\n")


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_table_and_full_ranking(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = _write(tmp_path, SMALL + "[budget]\ntokens=1e9\nprice='aws-p4d-on-demand'\n")
    out = tmp_path / "rank.csv"
    assert main(["plan", str(cfg), "--csv", str(out), "--top", "3", "--workers", "1",
                 "--quiet"]) == 0
    text = capsys.readouterr().out
    lines = [ln for ln in text.splitlines() if ln[:3].strip().isdigit()]
    assert len(lines) == 3 and "sim" in lines[0] and "$" in lines[0]
    assert "trust    step times typically ±" in text and "published runs" in text
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    fit = int(text.split(" fit;")[0].rsplit(",", 1)[-1].split()[-1].replace(",", ""))
    assert len(rows) == fit > 3
    assert [int(r["rank"]) for r in rows] == list(range(1, fit + 1))
    times = [float(r["step_time_s"]) for r in rows[5:]]
    assert times == sorted(times)
    assert all(float(r["usd"]) > 0 and float(r["days"]) > 0 for r in rows)


def test_json_config_and_default_csv_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    cfg = _write(tmp_path, '{"model": {"preset": "gpt2-124m"}, "cluster": {"preset": '
                 '"dgx-a100"}, "search": {"global_batch": 16, "micro_batches": [2], '
                 '"zero_stages": [0], "recompute": ["none"]}}', "small.json")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(cfg), "--workers", "1", "--quiet"]) == 0
    assert (tmp_path / "small-plans.csv").is_file()
    assert "dollars" not in capsys.readouterr().out  # no [budget], no cost columns


def test_the_example_config_is_valid() -> None:
    """The shipped config parses into a model, a cluster, a search and a budget (searching
    it takes ~25 s on 2 cores: ``labsim plan configs/plan-llama2-70b.toml``)."""
    from labsim.cli.plan import _budget, _search
    from labsim.cli.step import build, load_config

    config = load_config(ROOT / "configs" / "plan-llama2-70b.toml",
                         tables=("model", "cluster", "search"), optional=("budget",))
    model, cluster, _ = build({"model": config["model"], "cluster": config["cluster"],
                               "plan": {}})
    assert cluster.world_size == 64 and model.layers == 80
    assert _search(config["search"])[0] == 1024
    assert _budget(config["budget"])["usd_per_gpu_hour"].usd_per_gpu_hour > 0


@pytest.mark.parametrize("text, fragment", [
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx-a100'\n", "[search]"),
    (SMALL.replace("global_batch=32\n", ""), "global_batch"),
    (SMALL + "colour='red'\n", "unknown keys"),
    (SMALL.replace("micro_batches=[1, 4]", "micro_batches=4"), "non-empty list"),
    (SMALL.replace("global_batch=32", "global_batch=0"), "global_batch"),
    (SMALL.replace("global_batch=32", "global_batch=2.5"), "global_batch"),
    (SMALL + "[budget]\nprice='aws-p4d-on-demand'\n", "tokens"),
    (SMALL + "[budget]\ntokens=1e9\nprice='cheap'\n", "choose one of"),
    (SMALL + "[budget]\ntokens=1e9\nprice='aws-p4d-on-demand'\nusd_per_gpu_hour=2\n",
     "not both"),
    (SMALL + "[budget]\ntokens=-5\n", "tokens"),
    (SMALL + "[budget]\ntokens=1e9\npue=0.5\n", "pue"),
    (SMALL + "[budget]\ntokens=nan\n", "finite"),
    (SMALL + "[extra]\na=1\n", "unknown"),
    (SMALL.replace("'gpt2-124m'", "'gpt5'"), "unknown preset"),
    (SMALL + "software='tensorflow'\n", "software"),
    (SMALL.replace("recompute=['none']", "recompute=['some']"), "recompute"),
])
def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture, text: str,
                               fragment: str) -> None:
    cfg = _write(tmp_path, text)
    assert main(["plan", str(cfg), "--workers", "1", "--quiet", "--csv",
                 str(tmp_path / "o.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("labsim plan: error:") and "\n" not in err and fragment in err, err
    assert "Traceback" not in err


def test_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = _write(tmp_path, SMALL)
    assert main(["plan", str(cfg), "--csv", str(tmp_path / "no" / "o.csv")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plan", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_the_search_tries_fp8_where_the_gpu_has_it(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    h100 = SMALL.replace("dgx-a100", "dgx-h100") + "fp8=['off', 'delayed']\n"
    out = tmp_path / "rank.csv"
    assert main(["plan", str(_write(tmp_path, h100)), "--csv", str(out), "--top", "40",
                 "--workers", "1", "--quiet"]) == 0
    recipes = [r["fp8"] for r in csv.DictReader(out.open(encoding="utf-8"))]
    assert recipes.count("delayed") == recipes.count("") > 0  # every plan with and without
    assert recipes[0] == "delayed"  # FP8 GEMMs are faster here
    assert " fp8 " in capsys.readouterr().out  # the table names the FP8 plans
    a100 = SMALL + "fp8=['off', 'delayed']\n"
    assert main(["plan", str(_write(tmp_path, a100, "a.toml")), "--workers", "1",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "no FP8 tensor cores" in err and len(err.strip().splitlines()) == 1


def test_the_search_takes_ep_and_cp_and_names_a_bad_degree(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    moe = ("[model]\npreset='deepseek-moe-16b'\nseq_len=16384\nlayers=4\n"
           "[cluster]\npreset='dgx-h100'\n[search]\nglobal_batch=8\nmicro_batches=[1]\n"
           "recompute=['full']\nzero_stages=[1]\ntp_max=1\nmax_virtual_stages=1\n"
           "expert_parallel=[1, 8]\ncontext_parallel=[1, 2]\ncp_comm=['p2p', 'a2a']\n")
    out = tmp_path / "rank.csv"
    assert main(["plan", str(_write(tmp_path, moe)), "--csv", str(out), "--top", "5",
                 "--workers", "1", "--quiet"]) == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert {(r["ep"], r["cp"], r["cp_comm"]) for r in rows} >= {
        ("1", "1", "p2p"), ("8", "1", "p2p"), ("1", "2", "p2p"), ("1", "2", "a2a")}
    assert " ep8" in capsys.readouterr().out  # the table names the layouts
    bad = moe.replace("expert_parallel=[1, 8]", "expert_parallel=[3]")
    assert main(["plan", str(_write(tmp_path, bad, "b.toml")), "--workers", "1",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "expert_parallel=(3,)" in err and len(err.strip().splitlines()) == 1
