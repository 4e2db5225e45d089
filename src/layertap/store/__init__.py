"""Feature stores on disk: Zarr (default), HDF5 or NumPy files, written chunk by chunk, read lazily.

A store holds one array per tapped layer (``[samples, *feature shape]``), the samples' ids and
labels, one completion marker per chunk of samples, and metadata. It is written once, chunk by
chunk, by one extraction at a time (several processes for Zarr and NumPy), and read many times.

The package, from the bottom up (each file imports only those above it):

- `format`: what a store holds and its names: array names and keys (`safe_name`,
  `array_specs`), the plan of a new store (`StorePlan`), what a chunk's marker records, how
  arrays are chunked and filled, and the one codec;
- `paths`: where a store is (a local path or an fsspec URL: `Location`), what leads out of it,
  and what in its folder layertap did not write;
- `chunks`: checked Zarr chunk reads: every chunk held to its Blosc header before it is decoded,
  a chunk that does not decode one `StoreError` line, what is stored listed, not read;
- `backends`: Zarr, HDF5 and NumPy, one class each of primitive reads and writes, each declaring
  its suffixes, the package it needs and how many writers it takes (`format_for`,
  `detect_format`, `format_package`, `check_writers`): adding a format is one class there;
- `trust`: the trust boundary: a store is data, never code; `_open_backend` opens one only
  checked, and refuses a damaged or crafted one in one line;
- `lock`: one writer per store (`StoreLock`), taken over from a killed holder at once;
- `writer`: `StoreWriter`, which writes whole chunks and marks each after its data is on disk;
- `lifecycle`: `open_or_create`, the only way in for a writer (lock, then resume, refuse,
  replace or create), and `remove_store`, which deletes only what layertap wrote;
- `reader`: `open_features` and `FeatureStore`, the read-only side.

>>> import os, tempfile, torch, torchvision, layertap
>>> model = torchvision.models.resnet18()
>>> images = torch.randn(8, 3, 64, 64)
>>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
>>> store = layertap.extract_dataset(model, images, "avgpool", out, progress=False)
>>> feats = layertap.open_features(out)
>>> feats["avgpool"].shape, feats.ids[:3].tolist()
((8, 512, 1, 1), [0, 1, 2])
"""

from ..errors import StoreError
from . import backends, chunks, format, lifecycle, lock, paths, reader, tokens, trust, writer  # noqa: F401  (every part loaded with the package)
from .reader import FeatureStore, open_features
from .tokens import TokenStore, open_tokens

__all__ = ["open_features", "FeatureStore", "open_tokens", "TokenStore", "StoreError"]
