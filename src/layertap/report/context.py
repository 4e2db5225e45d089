"""What the report knows about a store: its rows, class names, image files and the matching model.

The trust rules of `layertap.report` live here: the store's model spec is loaded, and its image
folder read, only with ``trust_store``; a sample id is opened only inside the image folder.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError, StoreError
from ..extract.digests import model_fingerprint
from ..images import load_image
from ..loading import load_model, spec_kind
from ..modelinfo import model_info
from ..store import FeatureStore
from ..summary import LayerTable, summary
from .render import plain_list

BLOCK_BYTES = 32 << 20  # rows read from the store at a time, at most
FEATURES = 2048  # features per sample a layer is reduced to, at most, for its plots and probe
MAX_LAYERS = 24  # stored layers drawn, probed and listed, by default
MAX_POINTS = 1000  # points per plot, by default


class Unavailable(Exception):
    """A section cannot be made; the message says why and what to pass (shown on the page)."""


class Context:
    """The store and what can be found about it: class names, image files, the matching model."""

    def __init__(
        self,
        store: FeatureStore,
        model: nn.Module | str | None,
        images: str | Path | None,
        max_samples: int,
        trust_store: bool = False,
        max_layers: int = MAX_LAYERS,
        max_points: int = MAX_POINTS,
    ) -> None:
        self.store = store
        self.meta = store.meta
        self.ids = store.ids
        self.labels = store.labels
        self.valid = np.flatnonzero(store.valid)  # read and written rows only
        if not len(self.valid):
            raise StoreError(_no_rows(store))
        self.sample = spread(self.valid, max_samples)
        self.points = spread(self.sample, max_points)  # the samples drawn in each plot
        self.keys = list(store)
        # the arrays drawn, probed and listed: evenly spread, the first and the last among them
        self.shown = [self.keys[i] for i in spread(np.arange(len(self.keys)), max_layers)]
        self.classes = self._class_names()
        self.root, self.root_note = self._image_root(images, trust_store)
        self.model, self.model_note = self._model(model, trust_store)

    def _class_names(self) -> list[str] | None:
        if self.labels is None:
            return None
        if self.meta.get("classes"):
            return list(self.meta["classes"])
        if self.meta["ids"] == "path":  # ImageFolder labels: the sorted class sub-folders
            tops = sorted({i.split("/")[0] for i in self.ids.tolist() if "/" in i})
            if tops and int(self.labels.max()) < len(tops):
                return tops
        return None

    def class_name(self, label: int) -> str:
        if self.classes is not None and 0 <= label < len(self.classes):
            return self.classes[label]
        return f"class {label}"

    def _image_root(self, images: str | Path | None, trust_store: bool) -> tuple[Path | None, str]:
        """The image folder, and why there is none: the one given, or with consent the recorded one."""
        if self.meta["ids"] != "path":
            return None, "the store's samples are not image files (their ids are indices), so there are no images to show"
        if images is None:
            root = self.meta.get("root")
            data = str(self.meta.get("data", ""))
            if root is None and data.startswith("images "):  # extract_dataset's description of a folder
                root = data.removeprefix("images ")
            if root is None:
                return None, "the store does not record its image folder; pass it with images= / --images DIR"
            if not trust_store:
                return None, (
                    f"the store records its images as {root!r}, which is read only if you trust the store; pass the "
                    "folder with images= / --images DIR, or trust_store=True / --trust"
                )
            images = root
        found = Path(images)
        return (found.parent if found.is_file() else found), ""

    def _model(self, model: nn.Module | str | None, trust_store: bool) -> tuple[nn.Module | None, str]:
        """The model, and a note when it cannot explain the stored features.

        A spec given here must load. The spec the store records is only tried, and only with
        ``trust_store``: it is data from whoever wrote the store, and loading it runs code.
        """
        if isinstance(model, str):
            model = load_model(model)
        elif model is None:
            spec = str(self.meta.get("model", ""))
            try:
                spec_kind(spec)  # parses the text only
            except ModelLoadError:
                return None, f"the store names its model only as {spec!r}, not as a spec to load; pass the model with model= / --model SPEC"
            if not trust_store:
                return None, (
                    f"the store records its model as {spec!r}, which is loaded only if you trust the store (loading a model "
                    f"runs code); pass the model with model= / --model SPEC, or trust_store=True / --trust to load {spec!r}"
                )
            # quoted: the text is the store's, and must not pass control characters to the terminal
            print(f"layertap: loading the model the store records (trusted): {spec!r}", file=sys.stderr, flush=True)
            try:
                model = load_model(spec, trust=True)
            except Exception as e:  # a model that no longer loads only costs the sections that need it
                return None, f"the store's model {spec!r} could not be loaded ({one_line(e)}); pass it with model= / --model SPEC"
        expected = (self.meta.get("settings") or {}).get("model")
        if expected is not None and model_fingerprint(model) != expected:
            return model, (
                "the model's weights are not those that wrote the store (new random weights, or another "
                "checkpoint), so it cannot explain its features; pass the model that wrote them"
            )
        return model, ""

    def matching_model(self) -> nn.Module:
        if self.model is None or self.model_note:
            raise Unavailable(self.model_note or "no model")
        return self.model

    @functools.cached_property
    def layer_table(self) -> LayerTable:
        """`layertap.summary` of the model (one example forward), for its layers and its output."""
        if self.model is None:
            raise Unavailable(self.model_note)
        return summary(self.model)

    @functools.cached_property
    def model_classes(self) -> list[str] | None:
        """The class names of the model's outputs, when its weights say them."""
        return model_info(self.model).classes if self.model is not None else None

    def predicted_name(self, index: int) -> str:
        classes = self.model_classes
        return classes[index] if classes and index < len(classes) else f"class {index}"

    @functools.cached_property
    def output_key(self) -> str | None:
        """The stored array that holds the model's output (its logits), if one does.

        The last stored layer, in the order the forward ran them, whose output has the model's
        own output shape: argmax over it is the model's prediction, without running the model.
        """
        if self.model is None:
            return None
        try:
            rows = self.layer_table
        except Exception:  # the example forward failed: the layers section says why
            return None
        final = rows[""].output if "" in rows.names else None
        shapes = {a["key"]: tuple(a["shape"]) for a in self.meta["arrays"]}
        if final is None or not hasattr(final, "__len__") or len(final) != 2:
            return None
        hits = [row.name for row in rows if row.name and row.output == final and shapes.get(row.name) == tuple(final[1:])]
        return hits[-1] if hits else None

    @functools.cached_property
    def predictions(self) -> dict[int, int]:
        """The model's predicted class of each sampled row, from the stored output (empty without one)."""
        if self.output_key is None:
            return {}
        predicted = [block.argmax(1) for block in blocks(self.store[self.output_key], self.sample)]  # a block at a time
        return dict(zip(self.sample.tolist(), np.concatenate(predicted).tolist()))

    def left_out(self, what: str) -> str:
        """A sentence saying which stored arrays a section leaves out (``""`` when none)."""
        return left_out(what, self.shown, self.keys)

    def true_name(self, row: int) -> str | None:
        if self.labels is None or int(self.labels[row]) < 0:
            return None
        return self.class_name(int(self.labels[row]))

    def is_wrong(self, row: int, predicted: int) -> bool | None:
        """Whether the prediction misses the true class; ``None`` when they cannot be compared
        (no label, or the store's class names are not the model's)."""
        true = self.true_name(row)
        if true is None or not self.model_classes or true not in self.model_classes:
            return None
        return true != self.predicted_name(predicted)

    def image_paths(self, rows: np.ndarray) -> list[Path]:
        if self.root is None:
            raise Unavailable(self.root_note)
        root = self.root.resolve()
        paths: list[Path] = []
        outside: list[str] = []
        for i in rows:
            path = _inside(root, str(self.ids[i]))
            if path is None:
                outside.append(str(self.ids[i]))
            else:
                paths.append(path)
        if outside:  # checked before any file is touched: a store must not show images from elsewhere
            more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
            raise Unavailable(
                f"the store's sample id {outside[0]!r}{more} leads outside its image folder {root}, and layertap reads "
                "no image outside it; the store was altered: extract it again from the images"
            )
        missing = [p for p in paths if not p.is_file()]
        if missing:
            raise Unavailable(f"{len(missing)} of the store's image files are not where it says, e.g. {missing[0]}; pass the image folder with images= / --images DIR")
        return paths

    def thumbnails(self, rows: np.ndarray, size: int) -> list[Any]:
        """The images of ``rows`` at most ``size`` pixels on a side (`Unavailable` as `image_paths`)."""
        pictures = []
        for path in self.image_paths(rows):
            picture = load_image(path, draft=(size, size))
            picture.thumbnail((size, size))
            pictures.append(picture)
        return pictures


def left_out(what: str, shown: Sequence[str], every: Sequence[str], how: str = "evenly spread from the first to the last") -> str:
    """A sentence saying which of ``every`` a section leaves out (``""`` when it shows them all)."""
    if len(shown) == len(every):
        return ""
    kept = set(shown)
    missing = [k for k in every if k not in kept]
    return (
        f" {what} {len(shown)} of the {len(every):,} stored layers, {how}; left out: {plain_list(missing, 12)}. "
        "Pass max_layers= / --max-layers N to show more."
    )


def _no_rows(store: FeatureStore) -> str:
    """Why a store has no row to show, and what to do."""
    n = store.num_samples
    if n and len(store.failed) == n:
        return f"none of the {n:,} samples of the feature store {store.path} could be read (its failed list says why): fix the data and extract again"
    if store.complete:
        return f"the feature store {store.path} holds no samples: extract it from data that has some"
    return (
        f"the feature store {store.path} holds no complete rows yet: its extraction stopped before writing its first chunk; "
        "run the same extraction again to resume it, then make the report"
    )


def _inside(root: Path, name: str) -> Path | None:
    """``root / name`` resolved (links followed) when it lies inside ``root`` (resolved), else ``None``."""
    try:
        path = (root / name).resolve()
    except (OSError, ValueError):  # a loop of links, a NUL byte
        return None
    return path if path.is_relative_to(root) else None


def spread(rows: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` of ``rows``, evenly spaced (folders are sorted by class: every class shows)."""
    if len(rows) <= k:
        return rows
    return rows[np.unique(np.linspace(0, len(rows) - 1, k).round().astype(np.int64))]


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def blocks(array: Any, rows: np.ndarray) -> Iterator[np.ndarray]:
    """``array[rows]`` (sorted rows), block by block: every read is a contiguous slice."""
    row_bytes = max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize)
    block = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, int(array.shape[0]), block):
        picked = rows[(rows >= start) & (rows < start + block)]
        if len(picked):
            yield np.asarray(array[start : start + block])[picked - start]


def vectors(array: Any, rows: np.ndarray) -> tuple[np.ndarray, int, str]:
    """Rows of a stored array as ``[N, D]`` vectors, the number of features they stand for, and
    how they were made.

    Maps are averaged per channel (as ``reduce="mean"``), tokens averaged; more than `FEATURES`
    features are hashed into that many (signed feature hashing: each feature is added, with a
    sign, to one of them; it keeps the samples' dot products, so their distances and principal
    components, approximately). Each block of rows is reduced as it is read: memory is bounded
    by the rows, not by the layer's width.
    """
    shape = tuple(array.shape[1:])
    if len(shape) >= 3:  # [C, *spatial]
        width, how = shape[0], "each channel averaged over its positions"
    elif len(shape) == 2:  # [tokens, D]
        width, how = shape[1], "averaged over tokens"
    else:
        width, how = int(np.prod(shape, dtype=np.int64)), ""
    hashed = _hashing(width) if width > FEATURES else None
    if hashed is not None:
        how = (how + "; " if how else "") + f"hashed into {FEATURES:,} by signed feature hashing"
    parts = []
    for block in blocks(array, rows):
        x = torch.from_numpy(np.ascontiguousarray(block))
        x = x if x.dtype == torch.float64 else x.float()  # half and integer features too
        if x.ndim >= 4:
            x = x.flatten(2).mean(-1)
        elif x.ndim == 3:
            x = x.mean(1)
        flat = x.reshape(len(x), -1).numpy()
        if hashed is not None:  # a row at a time: torch's index_add_ would copy the block several times over
            buckets, signs = hashed
            flat = np.stack([np.bincount(buckets, weights=row * signs, minlength=FEATURES) for row in flat])
        parts.append(flat)
    return np.concatenate(parts), width, how


@functools.cache
def _hashing(width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each feature's bucket and sign (seeded: the same on every run)."""
    rng = np.random.default_rng(width)
    return rng.integers(0, FEATURES, width), rng.choice(np.array([-1, 1], dtype=np.float32), width)
