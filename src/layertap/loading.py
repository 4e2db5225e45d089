"""Loading a model from one string, shared by every command, with the refusals that keep it safe.

Accepted specs:

- ``torchvision:NAME[:WEIGHTS]``: ``torchvision.models.get_model(NAME)``, random weights unless
  ``WEIGHTS`` names a weights enum member (``IMAGENET1K_V2``, ``DEFAULT``);
- ``timm:NAME[:pretrained]``: ``timm.create_model(NAME)``, random weights unless ``:pretrained``;
- ``hf:PATH_OR_NAME``: Hugging Face ``transformers.AutoModel`` from a local folder or the Hub.
  A folder that brings its own Python code (``auto_map`` in its config or its image processor's
  config) is refused unless ``trust=True`` (``--trust``), and pickled ``.bin`` weights are read
  only as plain tensors. A folder's files are data: each file at its top (config, weights,
  tokenizer and processor files) and each shard a shard index (``model.safetensors.index.json``,
  ``pytorch_model.bin.index.json``) names must be a regular file inside the folder (no absolute
  shard name, no ``..``, no link out, no device or FIFO), checked before any is opened; a Hub cache
  snapshot (``models--ORG--NAME/snapshots/REV/``) may link only into that repo's ``blobs/``.
  A path that does not exist is an error, not a Hub name;
- ``PATH.pt`` / ``PATH.pth``: a state dict for ``arch=`` (another spec). Files are read with
  ``torch.load(weights_only=True)``, which never runs code from the file; a pickled ``nn.Module``
  is refused unless ``trust=True`` (``--trust``). An archive whose records would inflate to more
  than `MAX_INFLATION` times its size on disk (a zip bomb) is refused before anything is inflated:
  ``torch.save`` stores its records uncompressed, so a file it wrote never comes near that;
- ``package.module:callable``: a factory (or class) called without arguments, or a module object;
- ``layertap:shapes``: the small CNN bundled with layertap (offline).

TorchScript is refused, from a file (a TorchScript archive is recognised without being loaded)
or from a factory: a ``ScriptModule`` takes no forward hooks, so none of its layers could be
tapped. Load the original ``nn.Module`` instead, by its factory or with its state dict and
``arch=`` (``torch.jit.load(path).state_dict()`` has the original module's names).

A weights download that fails (no network) says where the file comes from and where to put it,
or to drop the weights for random ones.

Every model is returned in eval mode, with what the spec tells about it (input size,
preprocessing, class names) recorded for `model_info` (`layertap.modelinfo`, which also knows
models built elsewhere). Random weights are drawn from a fixed seed (the caller's random state
is left alone), so every process of a ``torchrun`` job, and every run that resumes an
extraction, builds the same model.

>>> import layertap
>>> model = layertap.load_model("torchvision:resnet18")
>>> info = layertap.model_info(model)
>>> info.spec, info.input_size, info.kind
('torchvision:resnet18', (3, 224, 224), 'vision')
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib
import json
import os
import pickle
import re
import stat
import urllib.parse
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .errors import ModelLoadError, require
from .hfcode import AUTO_MAP, names_code
from .modelinfo import ModelInfo, hf_info, model_info, timm_info
from .shapes.data import ShapesTransform

DEFAULT_SPEC = "layertap:shapes"

SPEC_FORMS = (
    "torchvision:NAME[:WEIGHTS] (e.g. torchvision:resnet50, torchvision:resnet50:IMAGENET1K_V2)",
    "timm:NAME[:pretrained] (e.g. timm:convnext_tiny)",
    "hf:PATH_OR_NAME (a Hugging Face model folder or Hub name, e.g. hf:bert-base-uncased)",
    "PATH.pt / PATH.pth (a state dict together with --arch SPEC; not TorchScript, which cannot be tapped)",
    "package.module:callable (a factory returning an nn.Module, e.g. mypkg.models:build)",
    "layertap:shapes (the bundled example model)",
)
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
MAX_INFLATION = 4  # the most a .pt archive's records may hold, as a multiple of the file's size
# the shard indexes transformers reads from a folder (it takes no variant from layertap)
_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model")  # where trainers nest the weights
# how the pickle of torch.save's legacy (pre-zip) format starts: its magic number, as any protocol >= 2 writes it
_LEGACY_MAGIC = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)[2:-1]


# ---------------------------------------------------------------------------- the loaders
def _torchvision(name: str, weights_name: str | None) -> tuple[nn.Module, ModelInfo]:
    models = require("torchvision.models", "vision")
    spec = f"torchvision:{name}" + (f":{weights_name}" if weights_name else "")
    if name not in models.list_models():
        raise ModelLoadError(f"torchvision has no model {name!r}; see torchvision.models.list_models()")
    try:
        enum = models.get_model_weights(name)
    except (KeyError, ValueError):
        enum = None  # an architecture without published weights
    weights = None
    if weights_name:
        if enum is None or weights_name not in enum.__members__:
            known = ", ".join(enum.__members__) if enum is not None else "none"
            raise ModelLoadError(
                f"torchvision model {name!r} has no weights {weights_name!r}; available: {known}"
            )
        weights = enum[weights_name]
    try:
        model = models.get_model(name, weights=weights)
    except OSError as e:  # only weights are downloaded (URLError, a full disk, an unwritable cache)
        if weights is None:
            raise
        raise ModelLoadError(
            f"could not download the weights {weights_name} of torchvision:{name} ({_reason(e)}): where there "
            f"is a network, download {weights.url} and put it at {_hub_checkpoint(weights.url)} (torch.hub's "
            f"cache; TORCH_HOME moves it), or drop ':{weights_name}' for random weights"
        ) from e
    # random weights still take the preprocessing (and input size) of the published ones
    preset = weights or (enum.DEFAULT if enum is not None else None)
    if preset is None:
        return model, ModelInfo(spec)
    transform = preset.transforms()
    crop = getattr(transform, "crop_size", [224])
    classes = weights.meta.get("categories") if weights is not None else None
    return model, ModelInfo(spec, (3, crop[0], crop[-1]), transform=transform, classes=classes)


def _timm(name: str, pretrained: str | None) -> tuple[nn.Module, ModelInfo]:
    timm = require("timm", "timm")
    if pretrained not in (None, "pretrained"):
        raise ModelLoadError(f"timm:{name}:{pretrained}: the only option after the name is ':pretrained'")
    try:
        model = timm.create_model(name, pretrained=pretrained is not None)
    except RuntimeError as e:
        if "Unknown model" not in str(e):
            raise
        close = difflib.get_close_matches(name.split(".")[0], timm.list_models(), n=5)
        raise ModelLoadError(
            f"timm has no model {name!r}" + (f"; similar: {', '.join(close)}" if close else "")
        ) from e
    except OSError as e:  # only pretrained weights are downloaded (the Hub offline, a URLError)
        if pretrained is None:
            raise
        raise _timm_download_failed(timm, name, e) from e
    return model, timm_info(model, f"timm:{name}" + (":pretrained" if pretrained else ""))


def _timm_download_failed(timm: Any, name: str, error: OSError) -> ModelLoadError:
    """Where timm would have got the weights of ``name`` from, and how to get them there."""
    cfg = timm.models.get_pretrained_cfg(name)  # found: timm got as far as downloading
    if cfg.hf_hub_id:  # timm prefers the Hub when the weights are there
        cache = require("huggingface_hub.constants", "timm").HF_HUB_CACHE
        where = (
            f"from the Hugging Face Hub ({cfg.hf_hub_id}): where there is a network, download them "
            f"(hf download {cfg.hf_hub_id}) and copy the Hugging Face cache {cache} here (HF_HOME moves it)"
        )
    else:
        where = (
            f"from {cfg.url}: where there is a network, download them and put the file at "
            f"{_hub_checkpoint(cfg.url)} (torch.hub's cache; TORCH_HOME moves it)"
        )
    return ModelLoadError(
        f"could not download the pretrained weights of timm:{name} ({_reason(error)}) {where}; "
        "or drop ':pretrained' for random weights"
    )


def _hub_checkpoint(url: str) -> Path:
    """Where ``torch.hub.load_state_dict_from_url`` looks for the download of ``url`` first."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urllib.parse.urlparse(url).path).name


def _reason(e: BaseException) -> str:
    """The gist of ``e`` in one line: its first sentence (library messages go on with advice)."""
    text = " ".join(str(getattr(e, "reason", None) or e).split()).split(". ")[0].rstrip(".")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# a class, not a closure, so that a loaded model (which carries its info) still pickles
@dataclasses.dataclass(frozen=True)
class ProcessorTransform:
    """A Hugging Face image processor as a one-image transform."""

    processor: Any

    def __call__(self, image: Any) -> torch.Tensor:
        return self.processor(images=image.convert("RGB"), return_tensors="pt")["pixel_values"][0]


def _custom_code(spec: str, what: str = AUTO_MAP) -> ModelLoadError:
    return ModelLoadError(
        f"{spec} brings {what}, which runs when it is loaded; layertap runs it only if you trust the "
        "folder: read the code it names, then pass --trust (trust=True)"
    )


def _unpickling(e: BaseException | None) -> bool:
    """Whether ``e`` comes from a refused unpickling (older transformers wrap it in an OSError)."""
    while e is not None:
        if isinstance(e, pickle.UnpicklingError):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextlib.contextmanager
def _hf_refusals(spec: str) -> Iterator[None]:
    """Turn transformers' refusals of code (custom modules, pickles) into one-line errors."""
    try:
        yield
    except (ValueError, OSError, pickle.UnpicklingError) as e:
        if isinstance(e, ValueError) and "trust_remote_code" in str(e):
            raise _custom_code(spec) from e
        if _unpickling(e):
            raise ModelLoadError(
                f"{spec} holds pickled weights (a .bin file) with objects other than plain tensors; unpickling "
                "them could run code from the file, so layertap refuses them: save the model as safetensors "
                "(save_pretrained) where you trust it"
            ) from e
        raise


def _is_path(path_or_name: str) -> bool:
    """Whether an ``hf:`` spec can only be a path: a Hub name is ``NAME`` or ``ORG/NAME``, never
    absolute, never starting with ``.`` or ``~``, and with at most one ``/``."""
    return Path(path_or_name).is_absolute() or path_or_name.startswith((".", "~")) or path_or_name.count("/") > 1


_NOT_REGULAR = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


@dataclasses.dataclass(frozen=True)
class _Folder:
    """Where the files of a model folder may lie: in the folder itself, or, for a Hugging Face
    cache snapshot (``<cache>/models--ORG--NAME/snapshots/<revision>/``), in that same repo's
    ``blobs/``, which its files link to."""

    root: Path  # resolved
    blobs: Path | None

    @classmethod
    def of(cls, folder: Path) -> _Folder:
        root = folder.resolve()
        repo = root.parent.parent
        hub = root.parent.name == "snapshots" and repo.name.startswith("models--") and len(repo.name) > 8
        return cls(root, repo / "blobs" if hub else None)

    def problem(self, path: Path) -> str | None:
        """Why ``path`` may not be read as one of the folder's files, or None: checked with
        ``stat`` alone, as opening a FIFO blocks and a device reads anything."""
        try:
            mode = path.stat().st_mode  # follows links
        except OSError:  # missing, a link that leads nowhere (or round in a loop)
            return f"is a broken link (to {os.readlink(path)})" if path.is_symlink() else "is not in the folder"
        target = path.resolve()
        if not stat.S_ISREG(mode):
            linked = f", {target}" if path.is_symlink() else ""
            return f"is not a regular file but {_NOT_REGULAR.get(stat.S_IFMT(mode), 'a special file')}{linked}"
        if not (target.is_relative_to(self.root) or target.parent == self.blobs):
            return f"links to {target}, outside the folder"
        return None


def _shards_inside(spec: str, folder: _Folder, index: Path) -> list[str]:
    """The shards an index names, refused unless all are regular files inside ``folder``, before any is opened.

    transformers joins each name to the folder as it is: an absolute name, or one with ``..``,
    would read any file (``/dev/stdin``, ``/etc/passwd``, another model's weights); a FIFO hangs.
    """
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(f"{spec}: its shard index {index.name} cannot be read as JSON with a weight_map ({_reason(e)}); save the model again") from e
    for name in sorted(shards, key=str):
        if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts or "\\" in name or "\0" in name:
            problem: str | None = "is not a file name inside the folder"
        else:
            problem = folder.problem(index.parent / name)
        if problem is not None:
            raise ModelLoadError(
                f"{spec}: its shard index {index.name} names the shard {name!r}, which {problem}; a shard index may "
                "name only weight files in the model's folder: fix the index, or put the shards there"
            )
    return sorted(shards)


def _folder_files(spec: str, path: Path) -> list[str]:
    """The weight files transformers may read from the model folder ``path``, before it opens any.

    Every file at the top of the folder (config, weights, shard indexes, tokenizer and processor
    files: the list grows with transformers' versions, so all are checked) and every shard an
    index names must be a regular file inside the folder: a link out of it would load another
    model's (or anyone's) file, a FIFO hangs, a device reads endlessly. Folders are not read.
    """
    folder = _Folder.of(path)
    weights = ["pytorch_model.bin"]
    for name in _SHARD_INDEXES:  # first, so that a bad shard is named as the index's
        index = path / name
        if index.is_file() and folder.problem(index) is None:  # else refused below
            weights += _shards_inside(spec, folder, index)
    for entry in sorted(path.iterdir()):
        problem = None if entry.is_dir() else folder.problem(entry)
        if problem is not None:
            raise ModelLoadError(
                f"{spec}: its file {entry.name!r} {problem}; layertap reads only regular files inside the "
                "model's folder: put the file itself there (cp -L copies what a link points to), or remove it"
            )
    return weights


def _hf(path_or_name: str, trust: bool) -> tuple[nn.Module, ModelInfo]:
    transformers = require("transformers", "hf")
    spec = f"hf:{path_or_name}"
    folder = Path(path_or_name).expanduser()
    if _is_path(path_or_name) and not folder.is_dir():
        raise ModelLoadError(
            f"{spec}: there is no model folder at {folder}: check the path (a Hub model is named NAME or ORG/NAME)"
        )
    if folder.is_dir():  # a Hub model's files are downloaded by name into the cache's own folder
        for name in _folder_files(spec, folder):  # transformers torch.loads pickled weights, inflating them whole
            if name.endswith(".bin") and (folder / name).is_file():
                _check_zip_weights(folder / name)
    # with trust_remote_code=False, transformers would quietly use its own class for a known model
    # type: refuse instead, as the folder means its own code
    code = names_code(transformers.PretrainedConfig.get_config_dict(path_or_name)[0], where=f"{spec}: config.json")
    if not trust and code is not None:
        raise _custom_code(spec, code)
    # trust_remote_code is always given: left None, transformers asks on stdin whether to run code;
    # and unless trusted no Hub kernels (transformers 5 swaps layers for them by default: code fetched and imported)
    with _hf_refusals(spec):
        model = transformers.AutoModel.from_pretrained(path_or_name, trust_remote_code=trust, **({} if trust else {"use_kernels": False}))
    info = hf_info(model, spec)
    if info.kind == "vision":
        try:  # the model's own preprocessing, when it was saved with the model (custom code still refused)
            with _hf_refusals(spec):
                # transformers quietly takes its own processor class when the config also names one
                if not trust and "auto_map" in transformers.ImageProcessingMixin.get_image_processor_dict(path_or_name)[0]:
                    raise _custom_code(spec)
                processor = transformers.AutoImageProcessor.from_pretrained(path_or_name, trust_remote_code=trust)
        except ModelLoadError:  # a refusal (a ValueError too) is not a missing processor
            raise
        except (OSError, ValueError):
            processor = None
        if processor is not None:
            info.transform = ProcessorTransform(processor)
    return model, info


def _factory(spec: str) -> tuple[nn.Module, ModelInfo]:
    module_name, attr = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ModelLoadError(f"cannot import {module_name!r} for model {spec!r}: {e}") from e
    try:
        obj = functools.reduce(getattr, attr.split("."), obj)
    except AttributeError as e:
        raise ModelLoadError(f"module {module_name!r} has no {attr!r} (model {spec!r})") from e
    model = obj if isinstance(obj, nn.Module) else obj()
    if not isinstance(model, nn.Module):
        raise ModelLoadError(f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, dataclasses.replace(model_info(model), spec=spec)


def _shapes() -> tuple[nn.Module, ModelInfo]:
    from .shapes import CLASSES, load_shapes_model

    model = load_shapes_model()
    _, height, width = model.input_size
    transform = ShapesTransform((width, height))
    return model, ModelInfo(DEFAULT_SPEC, model.input_size, transform=transform, classes=list(CLASSES))


_NO_HOOKS = "which layertap cannot tap (TorchScript modules take no forward hooks)"


def _check_saved(path: Path) -> None:
    """Refuse, before unpickling anything, a file that torch.save did not write, and TorchScript."""
    with path.open("rb") as f:
        head = f.read(64)
    if not head:
        raise ModelLoadError(f"{path} is empty (0 bytes): it was not saved or copied completely")
    if head.startswith(b"PK\x03\x04"):  # a zip archive: torch.save's format since PyTorch 1.6, and TorchScript's
        try:
            with zipfile.ZipFile(path) as archive:
                records = archive.infolist()
        except zipfile.BadZipFile as e:
            raise ModelLoadError(
                f"{path} is damaged: it begins as a zip archive but its index (at the end) is missing or broken, "
                "as when a copy or download stops early; save or copy it again"
            ) from e
        _check_inflation(path, records)
        # only TorchScript stores code and constants
        if any(r.filename.endswith("/constants.pkl") or "/code/" in r.filename for r in records):
            raise ModelLoadError(
                f"{path} is a TorchScript archive, {_NO_HOOKS}: load the original nn.Module instead, with its "
                "package.module:factory spec, or its state dict with --arch SPEC (arch=); "
                "torch.jit.load(PATH).state_dict() has the original names"
            )
    elif not (head.startswith(b"\x80") and _LEGACY_MAGIC in head):
        raise ModelLoadError(
            f"{path} is not a file written by torch.save (neither a zip archive nor a PyTorch pickle): it is "
            "damaged, or in another format"
        )


def _check_inflation(path: Path, records: list[zipfile.ZipInfo]) -> None:
    """Refuse an archive whose records (sizes from its central directory, as torch's reader
    allocates them) hold more than `MAX_INFLATION` times the file's size: a zip bomb."""
    size = path.stat().st_size
    inflated = sum(r.file_size for r in records)
    if inflated > MAX_INFLATION * size:
        raise ModelLoadError(
            f"{path} would inflate from {size} bytes to {inflated} (more than {MAX_INFLATION}x its size): torch.save "
            "stores records uncompressed, so this archive was made to exhaust memory (a zip bomb); refused unread"
        )


def _check_zip_weights(path: Path) -> None:
    """Refuse a zip bomb among a folder's pickled weights; any other problem is transformers' to report."""
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except (OSError, zipfile.BadZipFile):  # a legacy pickle, or unreadable
        return
    _check_inflation(path, records)


def _state_dict(obj: Any) -> dict[str, torch.Tensor] | None:
    """The state dict in ``obj``: itself, or under a trainer's usual key."""
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    if isinstance(obj, dict):
        for key in _CHECKPOINT_KEYS:
            found = _state_dict(obj.get(key))
            if found is not None:
                return found
    return None


def _file(path: Path, arch: str | None, trust: bool) -> tuple[nn.Module, ModelInfo]:
    if not path.is_file():
        raise FileNotFoundError(f"no model file at {path}")
    _check_saved(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses any object that is not plain data
        if not trust:
            raise _refused(path, e) from e
        try:
            obj = torch.load(path, map_location="cpu", weights_only=False)
        except (pickle.UnpicklingError, EOFError) as broken:  # the pickle itself, not an object in it
            raise _damaged(path, broken) from broken
    except OSError:  # unreadable, not damaged: its message says why
        raise
    except Exception as e:  # a damaged file fails in many ways: RuntimeError, EOFError, KeyError, ...
        raise _damaged(path, e) from e
    if isinstance(obj, nn.Module):
        return obj, dataclasses.replace(model_info(obj), spec=str(path))
    state = _state_dict(obj)
    if state is None:
        raise ModelLoadError(f"{path} holds a {type(obj).__name__}, neither a state dict nor a model")
    if arch is None:
        raise ModelLoadError(
            f"{path} is a state dict, which holds weights but no architecture: say which model it belongs "
            "to with --arch SPEC (arch=), e.g. --arch torchvision:resnet50"
        )
    model = load_model(arch)
    nn.modules.utils.consume_prefix_in_state_dict_if_present(state, "module.")  # saved under DDP
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ModelLoadError(
            f"{path} does not fit {arch}: {len(result.missing_keys)} missing keys (e.g. "
            f"{result.missing_keys[:3]}), {len(result.unexpected_keys)} unexpected "
            f"(e.g. {result.unexpected_keys[:3]}); check --arch"
        )
    return model, dataclasses.replace(model_info(model), spec=str(path))


def _refused(path: Path, error: pickle.UnpicklingError) -> ModelLoadError:
    """Why ``torch.load(weights_only=True)`` refused ``path``: a class it names, or a pickle it cannot read."""
    found = re.search(r"(?:GLOBAL|Unsupported class) (\S+)", str(error))  # torch < 2.4: "Unsupported class"
    if found is not None:
        return ModelLoadError(
            f"{path} holds a pickled {found.group(1)} (e.g. a whole nn.Module saved with torch.save); unpickling it can "
            "run arbitrary code from the file, so layertap refuses it. If you trust the file, pass "
            "--trust (trust=True); better, save a state dict (torch.save(model.state_dict(), path)) "
            "and load it with --arch SPEC"
        )
    detail = re.search(r"WeightsUnpickler error:\s*(.+)", str(error))
    return ModelLoadError(
        f"{path} holds a pickle that torch.load(weights_only=True) cannot read "
        f"({detail.group(1).strip() if detail else _reason(error)}): the file is damaged (save or copy it again), "
        "or was saved in a form that only full unpickling reads (e.g. pickle_protocol=4), which can run code "
        "from the file: pass --trust (trust=True) only if you trust it"
    )


def _damaged(path: Path, error: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is damaged: torch.load cannot read it ({_reason(error)}); save or copy it again"
    )


def spec_kind(spec: str, arch: str | None = None) -> str:
    """Which form ``spec`` has, checked without loading anything.

    Returns ``"torchvision"``, ``"timm"``, ``"hf"``, ``"layertap"``, ``"file"`` or ``"factory"``;
    raises `ModelLoadError` listing the accepted forms for anything else.

    >>> spec_kind("timm:convnext_tiny"), spec_kind("weights.pth", arch="torchvision:resnet50")
    ('timm', 'file')
    """
    prefix, _, rest = spec.partition(":")
    if prefix in ("torchvision", "timm", "hf") and rest:
        kind = prefix
    elif prefix == "layertap":
        if spec != DEFAULT_SPEC:
            raise ModelLoadError(f"layertap bundles one model, {DEFAULT_SPEC!r}, not {spec!r}")
        kind = "layertap"
    elif spec.lower().endswith((".pt", ".pth")):
        kind = "file"
    elif _FACTORY.fullmatch(spec):
        kind = "factory"
    else:
        forms = "\n  ".join(SPEC_FORMS)
        raise ModelLoadError(f"unknown model spec {spec!r}; use one of:\n  {forms}")
    if arch is not None:
        if kind != "file":
            raise ModelLoadError(f"--arch (arch=) goes with a state-dict file (.pt/.pth), not with {spec!r}")
        spec_kind(arch)
    return kind


def load_model(spec: str, *, arch: str | None = None, trust: bool = False) -> nn.Module:
    """Build the model named by ``spec`` (see the module docs for the forms), in eval mode.

    Args:
        arch: for a state-dict file, the spec of the architecture to load it into.
        trust: allow code that comes with the model to run: unpickling a whole ``nn.Module`` from a
            file, a Hugging Face folder's own modeling code (``auto_map``). Never asked on stdin.

    >>> import layertap
    >>> layertap.load_model("torch.nn:Identity")
    Identity()
    """
    kind = spec_kind(spec, arch)
    rest = spec.partition(":")[2]
    # random weights are seeded: each process of a torchrun job, and each run (a resume), gets the same
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)  # models are built on the CPU; CUDA's seeds stay the caller's
        if kind == "torchvision":
            name, _, weights = rest.partition(":")
            model, info = _torchvision(name, weights or None)
        elif kind == "timm":
            name, _, option = rest.partition(":")
            model, info = _timm(name, option or None)
        elif kind == "hf":
            model, info = _hf(rest, trust)
        elif kind == "layertap":
            model, info = _shapes()
        elif kind == "file":
            model, info = _file(Path(spec), arch, trust)
        else:
            model, info = _factory(spec)
    if isinstance(model, torch.jit.ScriptModule):  # from a factory, or a trusted pickle
        raise ModelLoadError(
            f"{spec} gives a TorchScript module, {_NO_HOOKS}: give the nn.Module itself, before torch.jit.script/trace"
        )
    model.layertap_info = info  # type: ignore[assignment]  # torch types Module.__setattr__'s value as Tensor | Module; any value is kept
    return model.eval()


__all__ = [
    "load_model",
    "spec_kind",
    "DEFAULT_SPEC",
    "SPEC_FORMS",
]
