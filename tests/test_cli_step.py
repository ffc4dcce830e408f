"""`labsim simulate CONFIG [--trace OUT]`: the example configs run, bad input exits 2."""

import json
from pathlib import Path

import pytest

from labsim.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["gpt3-175b.toml", "llama2-7b.toml"])
def test_example_configs(name, tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["simulate", str(CONFIGS / name), "--trace", str(out)]) == 0
    text = capsys.readouterr().out
    for word in ("step", "MFU", "memory", "fits", "stage 0"):
        assert word in text
    doc = json.loads(out.read_text())
    assert any(e.get("cat") == "forward" for e in doc["traceEvents"])


def test_json_config_and_custom_model(tmp_path, capsys):
    config = {
        "model": {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 1000},
        "cluster": {"gpu": "H100-SXM", "nodes": 1, "gpus_per_node": 4,
                    "intra_node": "nvlink4", "inter_node": "ib-ndr"},
        "plan": {"dp": 2, "pp": 2, "global_batch": 8},
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert main(["simulate", str(path)]) == 0
    assert "dp=2 tp=1 pp=2" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n", "[plan]"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n[plan]\nfoo=1\n",
     "unknown keys ['foo']"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n[plan]\ndp=4\n",
     "change dp to 8"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='tpu'\n[plan]\n", "unknown cluster"),
    ("not toml [", "cannot parse"),
])
def test_bad_configs_exit_2(text, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["simulate", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_missing_file_exits_2(capsys):
    assert main(["simulate", "no/such/config.toml"]) == 2
    assert "not found" in capsys.readouterr().err
