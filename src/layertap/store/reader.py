"""Reading a store: `open_features` and `FeatureStore`, a read-only mapping of layer name to lazy array.

A store is opened only checked (`layertap.store.trust`): what opening one can meet is data, and
a damaged or crafted store is refused in one line before anything of it is read. The arrays
are the format's own lazy ones, so slicing reads only what is asked.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..printable import printable
from ..records import SkippedSample
from ..tables import Table
from ..units import human_bytes
from .format import ArraySpec
from .paths import _bad, location
from .trust import _open_backend, _parse_marker


class FeatureStore(Mapping[str, Any]):
    """A read-only feature store: layer name -> lazily loaded array, with ids, labels and metadata.

    Values are the format's own lazy arrays (``zarr.Array``, ``h5py.Dataset``, ``np.memmap``):
    slicing reads only what is asked. Samples that failed to load (``on_error='skip'``) are
    listed in `failed` and their rows hold NaN (floats) or -1/0 (integers). Opening checks the
    store (see `layertap.store.trust`): a damaged or crafted one is refused with a `StoreError`. A
    notebook shows its arrays, how complete it is and how many samples failed.

    >>> import layertap
    >>> feats = layertap.open_features("features.zarr")       # doctest: +SKIP
    >>> x = feats.to_numpy("avgpool"); y = feats.labels        # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.path = location(path)
        self._backend, self.meta = _open_backend(self.path, "r")
        self._specs = {a["key"]: a for a in self.meta["arrays"]}
        chunk, n = self.meta["chunk_size"], self.num_samples
        try:
            self._markers = {c: _parse_marker(t, c, (c * chunk, min(n, (c + 1) * chunk)), self.path) for c, t in self._backend.markers().items()}
        except BaseException:
            self._backend.close()
            raise

    @property
    def format(self) -> str:
        return self.meta["format"]

    @property
    def complete(self) -> bool:
        """Whether every sample was written (an interrupted run leaves it ``False``)."""
        return bool(self.meta["complete"])

    @property
    def num_samples(self) -> int:
        return self._backend.array("ids").shape[0]

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(a["layer"] for a in self.meta["arrays"]))

    def __getitem__(self, key: str) -> Any:
        if key not in self._specs:
            raise KeyError(f"{key!r} is not in this store; it holds {list(self._specs)}")
        return self._backend.array(self._specs[key]["path"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    @property
    def ids(self) -> np.ndarray:
        """The id of every sample: file paths (str) or indices (int64)."""
        ids = self._backend.array("ids")
        if self.meta["ids"] != "path":
            return np.asarray(ids[:], dtype=np.int64)
        try:
            values = self._backend.read_text(ids)
        except UnicodeDecodeError as e:
            raise _bad(self.path, "its ids are not text") from e
        return np.array(values.tolist(), dtype=str)  # Zarr gives NumPy's variable-width StringDType

    @property
    def labels(self) -> np.ndarray | None:
        """The label of every sample, or ``None`` when the data had none."""
        return np.asarray(self._backend.array("labels")[:]) if self.meta["labels"] else None

    @property
    def failed(self) -> list[SkippedSample]:
        """Samples that could not be loaded: ``SkippedSample(index, id, error)``, by index."""
        return sorted((f for m in self._markers.values() for f in m.failed), key=lambda f: f.index)

    def written_ranges(self) -> list[tuple[int, int]]:
        """The rows of the chunks marked written, as ranges ``(start, end)``, chunks in a row joined."""
        chunk, n, ranges = self.meta["chunk_size"], self.num_samples, list[tuple[int, int]]()
        for c in sorted(self._markers):
            start, end = c * chunk, min(n, (c + 1) * chunk)
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    @property
    def valid(self) -> np.ndarray:
        """Which rows hold features: ``True`` for every sample that was read and written, ``False``
        for samples that could not be read (`failed`) and for chunks not yet written.

        >>> import os, tempfile, torch, layertap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
        >>> feats = layertap.extract_dataset(model, torch.randn(8, 4), "0", out, progress=False)
        >>> good = feats.to_numpy("0")[feats.valid]  # the rows to analyse
        >>> int(feats.valid.sum()), len(good)
        (8, 8)
        """
        mask = np.zeros(self.num_samples, dtype=bool)
        chunk = self.meta["chunk_size"]
        for c in self._markers:
            mask[c * chunk : (c + 1) * chunk] = True
        mask[[f.index for f in self.failed]] = False
        return mask

    def to_numpy(self, key: str) -> np.ndarray:
        """All of ``key``'s array, in memory."""
        return np.asarray(self[key][:])

    def to_torch(self, key: str) -> torch.Tensor:
        """All of ``key``'s array as a CPU tensor."""
        return torch.from_numpy(np.array(self[key][:]))

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        arrays = ", ".join(f"{a['key']} {tuple(a['shape'])} {a['dtype']}" for a in self.meta["arrays"])
        state = "" if self.complete else ", INCOMPLETE"
        return f"<layertap.FeatureStore {self.format} {str(self.path)!r}: {self.num_samples} samples{state}; {arrays}>"

    def _repr_html_(self) -> str:
        """The store in a notebook: what it holds, how complete it is, and its arrays."""
        n, chunk = self.num_samples, self.meta["chunk_size"]
        chunks = -(-n // chunk)
        written = "complete" if self.complete else f"INCOMPLETE: {len(self._markers)} of {chunks} chunks written"
        facts = [
            ("path", str(self.path)),
            ("format", self.format),
            ("samples", f"{n:,} ({written}; {int(self.valid.sum()):,} rows hold features)"),
            ("failed", f"{len(self.failed):,}"),
            ("labels", self.meta["labels"] or "none"),
            ("model", str(self.meta.get("model"))),
            ("reduce", str(self.meta.get("reduce") or "none")),
        ]
        rows = [
            [a["key"], str([n, *a["shape"]]), a["dtype"], human_bytes(n * ArraySpec(**a).sample_bytes)]
            for a in self.meta["arrays"]
        ]
        table = Table(["array", "shape", "dtype", "size"], rows, numeric={"size"}, title="layertap.FeatureStore", facts=facts)
        return table.html()


def open_features(path: str | Path) -> FeatureStore:
    """Open the feature store at ``path`` (written by `layertap.extract_dataset`) for reading.

    An incomplete store (an interrupted run) opens with a warning; rerun the extraction to
    finish it. A store is data: opening one never runs anything from it, and one that is
    damaged or crafted (paths leading out, metadata that disagrees with its arrays) is
    refused with a `StoreError`.
    """
    store = FeatureStore(path)
    if not store.complete:
        warnings.warn(
            printable(
                f"the feature store {path} is incomplete (its extraction was interrupted): rows of unwritten "
                "chunks read as NaN/0; run the same extraction again to finish it"
            ),
            stacklevel=2,
        )
    return store

