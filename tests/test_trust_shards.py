"""A Hugging Face shard index is data: every shard it names is a regular file inside the model folder.

Each folder is a real tiny BERT, saved by transformers; its index is rewritten as an attacker
would. Refusals come before any shard is opened: a FIFO would hang the load (a writer process
opens its other end after a few seconds, so that a regression fails instead of hanging),
``/dev/stdin`` would read layertap's stdin.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_trust_models import zip_bomb

from layertap.cli import run
from layertap.loading import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")


def bert(folder: Path, **save) -> Path:
    config = transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    transformers.BertModel(config).save_pretrained(folder, **save)
    return folder


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    """A BERT saved in several safetensors shards, with its ``model.safetensors.index.json``."""
    return bert(tmp_path / "model", max_shard_size="1KB")


def index_of(folder: Path, name: str = "model.safetensors.index.json") -> dict:
    return json.loads((folder / name).read_text())


def point_first_shard(folder: Path, target: str, name: str = "model.safetensors.index.json") -> str:
    """Rewrite the index so that the first shard's tensors are read from ``target``; returns the old name."""
    index = index_of(folder, name)
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (target if v == first else v) for k, v in index["weight_map"].items()}
    (folder / name).write_text(json.dumps(index))
    return first


def refused(folder: Path, start: str, fix: str) -> str:
    """Load the folder, expect a one-line refusal that starts so and says the fix; returns the message."""
    with pytest.raises(ModelLoadError) as error:
        load_model(f"hf:{folder}")
    message = str(error.value)
    assert "\n" not in message, message
    assert message.startswith(f"hf:{folder}: {start}"), message
    assert fix in message
    return message


def refusal(folder: Path, shard: str, problem: str, name: str = "model.safetensors.index.json") -> str:
    """The refusal of an index ``name`` that names ``shard``."""
    return refused(folder, f"its shard index {name} names the shard {shard!r}, {problem}", "fix the index")


def test_control_a_sharded_folder_loads_its_own_weights(sharded):
    assert len(set(index_of(sharded)["weight_map"].values())) > 1  # really sharded
    reference = transformers.BertModel.from_pretrained(sharded)
    loaded = load_model(f"hf:{sharded}")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values(), strict=True))


def test_a_shard_from_another_model_folder_is_refused(sharded, tmp_path):
    """``../other_model/model.safetensors``: transformers loads weights from outside the folder (rc 0)."""
    other = bert(tmp_path / "other_model")
    target = "../other_model/model.safetensors"
    assert (sharded / target).resolve() == (other / "model.safetensors").resolve()
    point_first_shard(sharded, target)
    refusal(sharded, target, "which is not a file name inside the folder")


def test_an_absolute_shard_outside_is_refused_even_when_it_is_the_folders_own_file(sharded, tmp_path):
    own = sharded / point_first_shard(sharded, "placeholder")
    point_first_shard(sharded, str(own))  # an absolute path, even one into the folder, is not a name in it
    index = index_of(sharded)
    assert str(own) in index["weight_map"].values()
    refusal(sharded, str(own), "which is not a file name inside the folder")


def bin_sharded(folder: Path) -> Path:
    """A BERT whose weights are pickled ``.bin`` shards (as older transformers saved), with their index."""
    model = transformers.BertModel(transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    model.config.save_pretrained(folder)
    state = model.state_dict()
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2], "pytorch_model-00002-of-00002.bin": names[len(names) // 2 :]}
    for shard, keys in halves.items():
        torch.save({k: state[k] for k in keys}, folder / shard)
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def test_control_a_bin_sharded_folder_loads(tmp_path):
    folder = bin_sharded(tmp_path / "model")
    reference = transformers.BertModel.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(load_model(f"hf:{folder}").state_dict().values(), reference.state_dict().values(), strict=True))


@pytest.mark.parametrize("name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("target", ["/dev/stdin", "/etc/passwd"])
def test_a_system_file_is_refused_in_either_index(tmp_path, target, name):
    """``/dev/stdin`` reads layertap's stdin; ``/etc/passwd`` goes to the weights-only unpickler (a .bin index)."""
    folder = bert(tmp_path / "model", max_shard_size="1KB") if name.startswith("model") else bin_sharded(tmp_path / "model")
    point_first_shard(folder, target, name)
    refusal(folder, target, "which is not a file name inside the folder", name)


def test_a_shard_name_with_a_nul_byte_is_refused_in_one_line(sharded):
    point_first_shard(sharded, "model\x00.safetensors")  # os.stat would raise a raw ValueError
    refusal(sharded, "model\x00.safetensors", "which is not a file name inside the folder")


def test_a_link_inside_the_folder_to_a_file_outside_is_refused(sharded, tmp_path):
    other = bert(tmp_path / "other_model")
    (sharded / "linked.safetensors").symlink_to(other / "model.safetensors")
    point_first_shard(sharded, "linked.safetensors")
    message = refusal(sharded, "linked.safetensors", "which links to")
    assert f"{(other / 'model.safetensors').resolve()}, outside the folder" in message


def test_a_fifo_is_refused_before_it_is_opened(sharded):
    """A FIFO blocks whoever opens it to read; were it opened, a writer unblocks every open after 3 s.

    The writer is another process: the reader may block holding the GIL (safetensors does).
    """
    fifo = sharded / "pipe.safetensors"
    os.mkfifo(fifo)
    point_first_shard(sharded, fifo.name)
    writer = subprocess.Popen(["sh", "-c", 'sleep 3; while :; do : > "$0"; sleep 0.2; done', str(fifo)])
    start = time.monotonic()
    try:
        refusal(sharded, fifo.name, "which is not a regular file")
    finally:
        writer.kill()
        writer.wait()
    assert time.monotonic() - start < 3.0


def test_a_folder_named_as_a_shard_and_a_missing_shard_are_refused(sharded):
    (sharded / "sub.safetensors").mkdir()
    point_first_shard(sharded, "sub.safetensors")
    refusal(sharded, "sub.safetensors", "which is not a regular file")
    point_first_shard(sharded, "gone.safetensors")
    refusal(sharded, "gone.safetensors", "which is not in the folder")


def test_a_shard_in_a_subfolder_inside_still_loads(sharded):
    reference = transformers.BertModel.from_pretrained(sharded)
    (sharded / "parts").mkdir()
    first = point_first_shard(sharded, "parts/first.safetensors")
    (sharded / first).rename(sharded / "parts" / "first.safetensors")
    loaded = load_model(f"hf:{sharded}")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values(), strict=True))


def test_an_index_that_is_not_json_is_one_line(sharded):
    (sharded / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{sharded}")
    assert "\n" not in str(refused.value) and "shard index model.safetensors.index.json cannot be read" in str(refused.value)


def test_cli_inspect_refuses_in_one_line(sharded, tmp_path, capsys):
    bert(tmp_path / "other_model")
    point_first_shard(sharded, "../other_model/model.safetensors")
    capsys.readouterr()  # transformers' progress bars while saving
    assert run(["inspect", f"hf:{sharded}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"layertap: error: hf:{sharded}: its shard index"), err


@pytest.mark.parametrize("where", ["pytorch_model.bin", "a .bin shard"])
def test_a_zip_bomb_among_pickled_weights_is_refused_before_inflating(tmp_path, monkeypatch, where):
    """transformers would torch.load the 64 MiB record whole; the folder is refused first."""
    folder = bin_sharded(tmp_path / "model")
    if where == "pytorch_model.bin":
        for shard in folder.glob("pytorch_model-*.bin"):
            shard.unlink()
        (folder / "pytorch_model.bin.index.json").unlink()
        bomb = zip_bomb(folder / "pytorch_model.bin", 64 << 20)
    else:
        bomb = zip_bomb(folder / "pytorch_model-00001-of-00002.bin", 64 << 20)
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))  # where inflating would start
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{folder}")
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{bomb} would inflate from ")
    assert "zip bomb" in str(refused.value) and loads == []


# ---------------------------------------------------------------- every file of the folder, not only shards
@pytest.fixture
def nothing_read(monkeypatch) -> list:
    """Records every config read or model load that transformers would start: a refusal comes first."""
    reads: list = []
    monkeypatch.setattr(transformers.PretrainedConfig, "get_config_dict", classmethod(lambda cls, *a, **k: reads.append(a)))
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: reads.append(a))
    return reads


def file_refusal(folder: Path, name: str, problem: str) -> str:
    """The refusal of the folder's own file ``name``."""
    return refused(folder, f"its file {name!r} {problem}", "put the file itself there (cp -L")


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "pytorch_model.bin", "config.json", "generation_config.json", "tokenizer.json", "preprocessor_config.json"],
)
def test_an_unsharded_file_linked_out_of_the_folder_is_refused_unread(tmp_path, name, nothing_read):
    """``model.safetensors -> ../other/secret.safetensors`` loaded the other model's weights (rc 0): any file
    at the top of the folder is checked, as transformers reads weights, config, tokenizer and processor files."""
    folder, other = bert(tmp_path / "model"), bert(tmp_path / "other")
    if name == "pytorch_model.bin":
        (folder / "model.safetensors").unlink()
        torch.save(safetensors.torch.load_file(other / "model.safetensors"), other / "secret.bin")
        secret = other / "secret.bin"
    else:
        secret = other / ("secret.safetensors" if name == "model.safetensors" else name)
        if name == "model.safetensors":
            (other / name).rename(secret)
        elif not secret.exists():
            secret.write_text("{}")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(Path("..") / "other" / secret.name)
    file_refusal(folder, name, f"links to {secret.resolve()}, outside the folder")
    assert nothing_read == []


def test_control_a_file_linked_inside_the_folder_still_loads(tmp_path):
    folder = bert(tmp_path / "model")
    reference = transformers.BertModel.from_pretrained(folder)
    (folder / "store").mkdir()
    (folder / "model.safetensors").rename(folder / "store" / "weights.safetensors")
    (folder / "model.safetensors").symlink_to(Path("store") / "weights.safetensors")
    loaded = load_model(f"hf:{folder}")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    ("name", "make", "problem"),
    [
        ("model.safetensors", "fifo", "is not a regular file but a FIFO"),
        ("pytorch_model.bin", "fifo", "is not a regular file but a FIFO"),
        ("config.json", "fifo", "is not a regular file but a FIFO"),
        ("model.safetensors", "/dev/zero", "is not a regular file but a character device, /dev/zero"),
        ("tokenizer.json", "broken", "is a broken link (to gone.json)"),
    ],
)
def test_a_weights_or_config_file_that_is_not_a_regular_file_is_one_line(tmp_path, name, make, problem, nothing_read):
    """A FIFO or ``/dev/zero`` as the weights gave transformers' raw "no file named model.safetensors"
    (a FIFO config.json: "Unrecognized model"); now it is named, unopened."""
    folder = bert(tmp_path / "model")
    if name == "pytorch_model.bin":  # the folder's only weights
        (folder / "model.safetensors").unlink()
    (folder / name).unlink(missing_ok=True)
    if make == "fifo":
        os.mkfifo(folder / name)
    else:
        (folder / name).symlink_to("gone.json" if make == "broken" else make)
    file_refusal(folder, name, problem)
    assert nothing_read == []


def hub_snapshot(cache: Path, repo: str = "models--org--tiny", revision: str = "0" * 40) -> Path:
    """A sharded model as huggingface_hub caches it: each file of ``snapshots/REV/`` a relative
    link to ``../../blobs/HASH``, ``refs/main`` naming the revision. Returns the snapshot folder."""
    download = bert(cache.parent / f"download-{repo}", max_shard_size="1KB")
    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (cache / repo / "refs").mkdir()
    (cache / repo / "refs" / "main").write_text(revision)
    for file in download.iterdir():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


def test_control_a_hub_cache_snapshot_loads(tmp_path):
    snapshot = hub_snapshot(tmp_path / "hub")
    assert len(set(index_of(snapshot)["weight_map"].values())) > 1 and all(f.is_symlink() for f in snapshot.iterdir())
    reference = transformers.BertModel.from_pretrained(tmp_path / "download-models--org--tiny")
    loaded = load_model(f"hf:{snapshot}")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values(), strict=True))


@pytest.mark.parametrize(
    ("repo", "target"),
    [
        ("x", "elsewhere/stolen.safetensors"),  # a folder under any snapshots/ was taken for a Hub cache
        ("models--org--tiny", "models--org--tiny/elsewhere/stolen.safetensors"),  # beside the repo's blobs/
        ("models--org--tiny", "models--org--other/blobs/stolen"),  # another repo's blobs
        ("models--org--tiny", "models--org--tiny/blobs/sub/stolen"),  # not a blob of the flat blobs/
    ],
)
def test_a_hub_like_snapshot_links_only_into_its_own_repos_blobs(tmp_path, repo, target, nothing_read):
    """The exception is the real layout, ``<cache>/models--ORG--NAME/snapshots/REV/`` linking into
    that ``models--ORG--NAME/blobs/``: a shard linked to a sibling of ``snapshots/`` loaded (rc 0)."""
    cache = tmp_path / "hub"
    snapshot = hub_snapshot(cache, repo)
    if not repo.startswith("models--"):  # as the outside tester had it: the folder's own files, but for one shard
        for file in snapshot.iterdir():
            blob = file.resolve()
            file.unlink()
            shutil.copyfile(blob, file)
    first = sorted(set(index_of(snapshot)["weight_map"].values()))[0]
    stolen = cache / (target if repo.startswith("models--") else f"{repo}/{target}")
    stolen.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(snapshot / first, stolen)
    (snapshot / first).unlink()
    (snapshot / first).symlink_to(stolen)
    refusal(snapshot, first, f"which links to {stolen.resolve()}, outside the folder")
    assert nothing_read == []
