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
    for word in ("step", "MFU", "memory", "fits", "stage 0", "trust    typically ±"):
        assert word in text
    doc = json.loads(out.read_text())
    assert any(e.get("cat") == "forward" for e in doc["traceEvents"])


def test_the_bloom_config_is_the_published_run(capsys):
    """configs/bloom-176b.toml is BigScience's run as ``labsim.published`` holds it, and
    prints the closed form's step and memory."""
    from labsim.cli.step import build, load_config
    from labsim.published import runs

    model, cluster, plan = build(load_config(CONFIGS / "bloom-176b.toml"))
    run = next(r for r in runs() if r.id == "bigscience2022_bloom_176b_384gpu")
    assert (model, cluster, plan) == (run.model, run.cluster, run.plan)
    assert main(["simulate", str(CONFIGS / "bloom-176b.toml"), "--estimate"]) == 0
    text = capsys.readouterr().out
    assert "inter=4 x opa-100, 2 NCCL channels across nodes" in text
    assert "software=megatron-deepspeed-2022" in text
    assert "109.9 s" in text and "46.9 GB" in text


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


def test_the_embedding_and_the_loss_counted_as_layers_on_the_command_line(tmp_path, capsys):
    config = {
        "model": {"layers": 6, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 1000},
        "cluster": {"preset": "dgx-a100", "nodes": 1},
        "plan": {"dp": 2, "pp": 4, "global_batch": 8,
                 "account_for_embedding_in_pipeline_split": True,
                 "account_for_loss_in_pipeline_split": True},
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert main(["simulate", str(path)]) == 0
    assert "embedding counted as a layer, loss counted as a layer" in capsys.readouterr().out


def test_a_micro_batch_group_on_the_command_line(tmp_path, capsys):
    config = {
        "model": {"layers": 8, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 1000},
        "cluster": {"preset": "dgx-a100", "nodes": 1},
        "plan": {"dp": 2, "pp": 4, "schedule": "interleaved", "virtual_stages": 2,
                 "global_batch": 24, "microbatch_group": 6},
    }
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    assert main(["simulate", str(path)]) == 0
    assert "(v=2, interleaved in groups of 6)" in capsys.readouterr().out
    config["plan"]["microbatch_group"] = 5
    path.write_text(json.dumps(config))
    assert main(["simulate", str(path)]) == 2
    assert "last group of 2, fewer than p=4" in capsys.readouterr().err


def test_missing_file_exits_2(capsys):
    assert main(["simulate", "no/such/config.toml"]) == 2
    assert "not found" in capsys.readouterr().err


PRESETS = "[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n"


@pytest.mark.parametrize("text, message", [
    (PRESETS + "[plan]\ndp=8\nglobal_batch=1e18\n", "whole number"),
    (PRESETS + "[plan]\ndp=8\nglobal_batch=8000000000000000000\n", "100,000,000"),
    (PRESETS + "[plan]\ndp=8\nbucket_bytes=1\n", ">= 1e3"),
    (PRESETS + "[plan]\ndp=8\nbucket_bytes=nan\n", "finite"),
    (PRESETS + "[plan]\ndp=8\noverlap_grad_reduce='no'\n", "True or False"),
    (PRESETS + "[plan]\ndp=4.7\n", "whole number"),
    (PRESETS + "[plan]\ndp=8\npp=99999\n", "at least one layer"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\nnodes=nan\n[plan]\n",
     "nodes = nan"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\ngpu='A100-80GB'\nnodes=1\ngpus_per_node=8\n"
     "intra_node='nvlink3'\ninter_node='ib-hdr'\n[plan]\ndp=8\npp=1\n[extra]\n", "unknown"),
    ("[model]\npreset='gpt2-124m'\nlayers='twelve'\n[cluster]\npreset='dgx_a100'\n[plan]\n",
     "[model]"),
    ("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n[plan]\ndp=8\npp=24\n"
     "global_batch=24\n", "at least one layer"),
    (PRESETS + "[plan]\ndp=4\npp=2\naccount_for_loss_in_pipeline_split='yes'\n",
     "True or False"),
    (PRESETS + "[plan]\ndp=4\npp=2\naccount_for_loss_in_pipeline_split=true\n",
     "layers=12 + 1 (the embedding / loss counted as layers) is not divisible"),
])
def test_bad_values_are_one_line_naming_the_key(text, message, tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and "Traceback" not in err


def test_a_hundred_thousand_nodes_is_answered(tmp_path, capsys):
    path = tmp_path / "big.toml"
    path.write_text("[model]\npreset='gpt2-124m'\n[cluster]\npreset='dgx_a100'\n"
                    "nodes=100000\n[plan]\ndp=800000\n")
    assert main(["simulate", str(path)]) == 0  # one replica is simulated, whatever dp
    assert "dp=800000" in capsys.readouterr().out


def test_a_config_that_is_not_utf8_names_the_file(tmp_path, capsys):
    path = tmp_path / "utf16.toml"
    path.write_bytes(PRESETS.encode("utf-16"))
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "utf16.toml" in err and "UTF-8" in err


def test_trace_into_a_missing_folder_fails_before_simulating(capsys):
    assert main(["simulate", str(CONFIGS / "gpt3-175b.toml"), "--trace",
                 "/no/such/dir/t.json"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_closed_form_on_the_command_line(capsys):
    assert main(["simulate", str(CONFIGS / "gpt3-175b.toml"), "--estimate"]) == 0
    text = capsys.readouterr().out
    assert "MFU" in text and "stage 0" not in text
