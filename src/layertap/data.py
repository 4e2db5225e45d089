"""Turning a ``data`` argument into batches of model inputs, with sample ids, labels and indices.

Accepted ``data`` (the same everywhere a layertap function or command takes a dataset):

- an image folder or file (``str``/``Path``): searched recursively; class sub-folders become
  labels as in torchvision's ``ImageFolder``; ids are the paths relative to the folder;
- a ``.npy`` file: its rows are the samples, read through a memory map;
- a map-style ``Dataset`` (or a tensor / array, whose rows are the samples);
- a ``DataLoader``: its batches as they are (batch size, workers, collate function);
- an ``IterableDataset`` or any iterable of batches (a list of tensors, a generator).

A sample (or batch) may be ``(input, label)`` with a numeric label per sample, a dict (its
``"label"``/``"labels"`` entry is the label, the rest are keyword inputs) or a bare input; a
tuple input is passed as positional arguments (see `layertap.features.run_model`).

Every sample has a fixed global index (its position in the data), so any subset can be
visited (``shard=``) and the batches over a subset are cut exactly as in a full pass.

The DataLoader workers that layertap starts end with their parent process (`layertap.workers`).

>>> import torch
>>> batches = iter_batches(torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10)), batch_size=4)
>>> [(b.inputs.shape[0], b.labels.tolist(), b.index.tolist()) for b in batches][-1]
(2, [8, 9], [8, 9])
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler, default_collate

from . import nested
from .errors import CorruptImageError, DataError
from .images import find_images, load_image, pixel_limit
from .records import SkippedSample
from .workers import EndWithParent, default_workers

OnError = Literal["fail", "skip"]
_ON_ERROR = ("fail", "skip")
_LABEL_KEYS = ("label", "labels")


@dataclass
class Batch:
    """A batch of samples, with where they sit in the data.

    Attributes:
        inputs: a tensor, a tuple of positional or a dict of keyword inputs (batch first).
        labels: one label per sample (1-D tensor), or ``None`` when the data has none.
        ids: the id of each sample: its file path, else its global index.
        index: the global index of each sample (``int64`` array), in batch order.
        failed: samples of this batch that could not be loaded (``on_error='skip'``); they
            are not in ``inputs``.
    """

    inputs: Any
    labels: torch.Tensor | None
    ids: Sequence
    index: np.ndarray
    failed: list[SkippedSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.index)

    def take(self, rows: np.ndarray) -> Batch:
        """The samples at positions ``rows`` of this batch (its ``failed`` list is kept as is)."""
        if len(rows) == len(self):
            return self
        keep = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        inputs = nested.map_leaves(lambda t: t[keep], self.inputs)
        labels = None if self.labels is None else self.labels[keep]
        return Batch(inputs, labels, [self.ids[i] for i in rows], self.index[rows], self.failed)

    def row_tensors(self) -> list[torch.Tensor]:
        """What each sample's content is, as batch-first tensors: a resumed run's digests are of these."""
        return nested.tensors(self.inputs) + ([self.labels] if self.labels is not None else [])


# ------------------------------------------------------------------------- samples and batches
def _is_scalar(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return x.dim() == 0
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _batch_size(inputs: Any) -> int:
    first = nested.first_tensor(inputs)
    if first is None or first.dim() == 0:
        raise DataError(
            f"a batch must hold tensors with the samples along dim 0, got {type(inputs).__name__}: "
            "turn the inputs into tensors (e.g. with a transform or a collate_fn)"
        )
    return first.shape[0]


def split_batch(batch: Any) -> tuple[Any, torch.Tensor | None]:
    """``(inputs, labels)`` of a collated batch; ``labels`` is ``None`` when it has none.

    ``(x, y)`` with ``y`` one number per sample is an input and its labels; a dict's
    ``"label"``/``"labels"`` entry is taken out as labels; a list of inputs becomes positional
    arguments. Pass a model needing a second per-sample argument a dict, so it is not read as
    a label.
    """
    if isinstance(batch, dict):
        rest = {k: v for k, v in batch.items() if k not in _LABEL_KEYS}
        labels = next((batch[k] for k in _LABEL_KEYS if k in batch), None)
        if labels is not None and _is_label_column(labels, _batch_size(rest)):
            return rest, torch.as_tensor(labels)
        return dict(batch), None
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and _is_label_column(batch[1], _batch_size(batch[0])):
            inputs = batch[0]
            return (tuple(inputs) if isinstance(inputs, list) else inputs), torch.as_tensor(batch[1])
        return tuple(batch), None
    return batch, None


def _is_label_column(labels: Any, n: int) -> bool:
    if isinstance(labels, (list, tuple)):
        return len(labels) == n and all(_is_scalar(v) for v in labels)
    if isinstance(labels, (torch.Tensor, np.ndarray)):
        return labels.ndim == 1 and labels.shape[0] == n and labels.dtype != object
    return False


def image_to_tensor(image: Any) -> torch.Tensor:
    """RGB ``PIL.Image`` -> float ``[3, H, W]`` tensor in [0, 1] (the default image transform)."""
    return torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).float().div_(255)


class ImageFiles(Dataset):
    """Image files as a dataset: ``(transform(image), label)`` or ``transform(image)``.

    An image over ``max_image_pixels`` (see `layertap.images.load_image`) is a `CorruptImageError`.
    """

    def __init__(
        self,
        paths: Sequence[Path],
        labels: Sequence[int] | None,
        transform: Callable | None,
        *,
        max_image_pixels: int | None = None,
    ) -> None:
        self.paths, self.labels = list(paths), labels
        self.transform = transform or image_to_tensor
        self.max_image_pixels = pixel_limit(max_image_pixels)  # fixed here: worker processes get this number

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        image = self.transform(load_image(self.paths[i], self.max_image_pixels))
        return image if self.labels is None else (image, self.labels[i])


class ArrayRows(Dataset):
    """The rows of an array (a ``.npy`` memory map, an ndarray or a tensor) as samples.

    ``name`` says what the array is in the error about a 0-d array, which has no rows.
    """

    def __init__(self, array: np.ndarray | torch.Tensor, name: str = "the array") -> None:
        if array.ndim == 0:
            raise DataError(
                f"{name} holds a single value (a 0-d array), not samples: stack the samples along the "
                "first axis, shape [N, ...]"
            )
        self.array = array

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.array[i]
        return row if isinstance(row, torch.Tensor) else torch.from_numpy(np.array(row))


class _MapDataset(Protocol):
    """A map-style dataset that knows its length (torch's ``Dataset`` does not declare ``__len__``)."""

    def __getitem__(self, i: int, /) -> Any: ...

    def __len__(self) -> int: ...


_Catch = type[BaseException] | tuple[type[BaseException], ...]


class _Failed(NamedTuple):
    error: str  # what went wrong, without the path (the sample id says it)
    message: str  # the full message, for on_error='fail'


class _Guarded(Dataset):
    """``dataset[i] -> (i, sample)``, or ``(i, _Failed)`` for a sample that could not be read.

    The failure travels back from a worker as text (a layertap exception with extra arguments
    cannot be rebuilt from a pickle), and the main process raises or records it.
    """

    def __init__(self, dataset: _MapDataset, catch: _Catch) -> None:
        self.dataset, self.catch = dataset, catch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> tuple[int, Any]:
        try:
            return i, self.dataset[i]
        except self.catch as e:
            error = e.reason if isinstance(e, CorruptImageError) else " ".join(f"{type(e).__name__}: {e}".split())
            return i, _Failed(error, str(e))


class _Collate:
    """Collates the readable samples with the dataset's own collate function; keeps the rest apart."""

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[tuple[int, Any]]) -> tuple[Any, np.ndarray, list[tuple[int, _Failed]]]:
        good = [(i, s) for i, s in items if not isinstance(s, _Failed)]
        failed = [(i, s) for i, s in items if isinstance(s, _Failed)]
        try:
            batch = self.collate([s for _, s in good]) if good else None
        except RuntimeError as e:
            if "stack expects each tensor to be equal size" not in str(e):
                raise
            raise DataError(
                f"the samples of a batch have different shapes ({e}); give a transform that resizes "
                "them to one size (e.g. the model's preprocessing, layertap.model_info(model).transform)"
            ) from e
        return batch, np.array([i for i, _ in good], dtype=np.int64), failed


# ----------------------------------------------------------------------------------- sources
class DataSource:
    """The samples of one ``data`` argument: how many, their ids, and batches over any subset.

    Use `open_data` to make one.
    """

    num_samples: int | None
    """The number of samples, ``None`` when the data only says so at its end."""
    ids: Sequence | None
    """The id of every sample (file paths), or ``None`` when the ids are the indices."""
    description: str
    transform: Callable | None = None
    """The transform applied to image files (``None`` when the data is not image files)."""
    batch_size: int | None = None
    """Samples per batch (``None`` when the batches come as they are)."""
    root: Path | None = None
    """The folder that image ids are relative to (``None`` when the data is not image files)."""
    classes: list[str] | None = None
    """The class names that labels index (an image folder's class sub-folders)."""
    indexed: bool = False
    """Whether any sample can be read on its own (a map-style dataset), not only in order."""

    def id_of(self, index: int) -> Any:
        return self.ids[index] if self.ids is not None else int(index)

    def batches(self, shard: Sequence[int] | np.ndarray | None = None) -> Iterator[Batch]:
        """Batches over the samples ``shard`` (sorted global indices; default all), in order."""
        raise NotImplementedError


class _Indexed(DataSource):
    """A map-style dataset: any sample can be read on its own, so a shard reads only its samples."""

    indexed = True
    num_samples: int  # a map-style dataset always knows its length

    def __init__(
        self,
        dataset: _MapDataset,
        *,
        ids: Sequence | None,
        description: str,
        on_error: OnError,
        batch_size: int,
        loader_options: dict,
        catch_in_fail_mode: _Catch = (),
        limit: int | None,
    ) -> None:
        self.dataset = dataset
        self.num_samples = len(dataset) if limit is None else min(limit, len(dataset))
        self.ids = ids
        self.description = description
        self.on_error = on_error
        self.batch_size = batch_size
        self.loader_options = loader_options
        self.catch: _Catch = Exception if on_error == "skip" else catch_in_fail_mode

    def batches(self, shard: Sequence[int] | np.ndarray | None = None) -> Iterator[Batch]:
        indices = range(self.num_samples) if shard is None else np.asarray(shard, dtype=np.int64)
        if not len(indices):
            return
        options = dict(self.loader_options)
        collate = options.pop("collate_fn", None) or default_collate
        if options.get("num_workers"):
            options["worker_init_fn"] = EndWithParent(options.get("worker_init_fn"))
        loader = DataLoader(
            _Guarded(self.dataset, self.catch),
            batch_size=self.batch_size,
            sampler=indices,
            collate_fn=_Collate(collate),
            **options,
        )
        for raw, index, failed in loader:
            failures = [SkippedSample(int(i), self.id_of(i), f.error) for i, f in failed]
            if failed and self.on_error == "fail":
                raise DataError(failed[0][1].message)
            inputs, labels = split_batch(raw) if raw is not None else (None, None)
            yield Batch(inputs, labels, [self.id_of(i) for i in index], index, failures)


class _Stream(DataSource):
    """An iterable of batches: read in order; a shard still reads (but does not return) the rest."""

    def __init__(self, iterable: Iterable, *, num_samples: int | None, description: str, limit: int | None) -> None:
        self.iterable = iterable
        self.num_samples = num_samples if limit is None or num_samples is None else min(limit, num_samples)
        self.limit = limit
        self.ids = None
        self.description = description

    def batches(self, shard: Sequence[int] | np.ndarray | None = None) -> Iterator[Batch]:
        wanted = None if shard is None else np.asarray(shard, dtype=np.int64)
        if wanted is not None and not len(wanted):
            return
        start = 0
        for raw in self.iterable:
            inputs, labels = split_batch(raw)
            n = _batch_size(inputs)
            index = np.arange(start, start + n, dtype=np.int64)
            batch = Batch(inputs, labels, index.tolist(), index)
            start += n
            if self.limit is not None and start > self.limit:
                batch = batch.take(np.flatnonzero(index < self.limit))
            if wanted is not None:
                if index[0] > wanted[-1]:
                    return
                batch = batch.take(np.flatnonzero(np.isin(batch.index, wanted)))
            if len(batch):
                yield batch
            if self.limit is not None and start >= self.limit:
                return


def _npy_rows(path: Path) -> ArrayRows:
    """The rows of a ``.npy`` file, memory-mapped; a file that is not one is a `DataError`."""
    if not path.is_file():
        raise FileNotFoundError(f"no .npy file at {path}")
    with path.open("rb") as f:
        magic = f.read(6)
    if not magic:
        raise DataError(f"{path} is empty (0 bytes): it was not saved or copied completely")
    if magic != b"\x93NUMPY":  # else numpy reads it as a pickle and suggests allow_pickle
        raise DataError(f"{path} is not a .npy file (it lacks the header numpy.save writes): it is damaged, or in another format")
    try:
        array = np.load(path, mmap_mode="r")
    except (EOFError, ValueError) as e:  # a cut header, an unknown version, Python objects (never unpickled)
        raise DataError(f"{path} cannot be read as a .npy array: {' '.join(str(e).split())}") from e
    return ArrayRows(array, str(path))


def _loader_options(loader: DataLoader) -> dict:
    """The options of a user's DataLoader that a rebuilt one over a subset must keep."""
    options = dict(
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


def _dataset_ids(dataset: _MapDataset) -> list[str] | None:
    samples = getattr(dataset, "samples", None)  # torchvision's DatasetFolder and ImageFolder
    if isinstance(samples, list) and samples and isinstance(samples[0], tuple) and len(samples) == len(dataset):
        return [str(s[0]) for s in samples]
    return None


def open_data(
    data: Any,
    *,
    batch_size: int = 64,
    num_workers: int | None = None,
    transform: Callable[[Any], Any] | None = None,
    on_error: OnError = "fail",
    limit: int | None = None,
    pin_memory: bool = False,
    max_image_pixels: int | None = None,
) -> DataSource:
    """The `DataSource` of ``data`` (see the module docs for what ``data`` may be).

    Args:
        batch_size, num_workers: of the DataLoader made for a dataset, folder or array (a
            DataLoader given as ``data`` keeps its own). ``num_workers=None``: a few worker
            processes for image files, none otherwise.
        transform: ``PIL.Image -> tensor`` for image files (default: to a [0, 1] tensor).
        on_error: ``"fail"`` stops at an unreadable sample with its path; ``"skip"`` leaves it
            out of the batch and lists it in ``Batch.failed`` (datasets and folders only).
        limit: use only the first ``limit`` samples.
        max_image_pixels: an image file with more pixels is unreadable (a decompression bomb):
            default PIL's limit (``PIL.Image.MAX_IMAGE_PIXELS``: it refuses twice that, about 179
            million pixels); ``0``: no limit. See `layertap.images`.
    """
    if on_error not in _ON_ERROR:
        raise ValueError(f"unknown on_error={on_error!r}: use 'fail' or 'skip'")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")

    def indexed(
        dataset: _MapDataset,
        description: str,
        *,
        ids: Sequence | None = None,
        files: bool = False,
        catch: _Catch = (),
        batch: int = batch_size,
        loader_options: dict | None = None,
    ) -> _Indexed:
        if loader_options is None:  # a DataLoader of layertap's own
            workers = default_workers(files) if num_workers is None else num_workers
            loader_options = dict(num_workers=workers, pin_memory=pin_memory)
        return _Indexed(
            dataset,
            ids=ids,
            description=description,
            on_error=on_error,
            batch_size=batch,
            loader_options=loader_options,
            catch_in_fail_mode=catch,
            limit=limit,
        )

    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.suffix == ".npy":
            return indexed(_npy_rows(path), f"array {path}")
        images = find_images(path)
        dataset = ImageFiles(images.paths, images.labels, transform, max_image_pixels=max_image_pixels)
        source = indexed(dataset, f"images {path}", ids=images.ids(), files=True, catch=CorruptImageError)
        source.transform = dataset.transform
        source.root, source.classes = images.root.absolute(), images.classes
        return source
    if isinstance(data, DataLoader):
        if isinstance(data.sampler, RandomSampler):
            raise DataError(
                "this DataLoader shuffles (shuffle=True), so samples have no fixed position to resume "
                "from or to label by: pass a DataLoader with shuffle=False, or the dataset itself"
            )
        inner = data.dataset
        if isinstance(data.sampler, SequentialSampler) and data.batch_size is not None and not isinstance(inner, IterableDataset):
            # a SequentialSampler reads range(len(dataset)), so this dataset has a length
            mapped = _as_map(inner)
            description = f"DataLoader over {type(inner).__name__}"
            return indexed(mapped, description, ids=_dataset_ids(mapped), batch=data.batch_size, loader_options=_loader_options(data))
        return _Stream(data, num_samples=_length(data.dataset), description="DataLoader", limit=limit)
    if isinstance(data, (np.ndarray, torch.Tensor)):
        rows = ArrayRows(data, f"this {type(data).__name__}")
        return indexed(rows, f"{type(data).__name__} of {len(data)} rows")
    if isinstance(data, IterableDataset):
        loader = DataLoader(data, batch_size=batch_size)  # workers would each read the whole iterable
        return _Stream(loader, num_samples=_length(data), description=type(data).__name__, limit=limit)
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, (list, tuple))):
        mapped = _as_map(data)
        return indexed(mapped, type(data).__name__, ids=_dataset_ids(mapped))
    if isinstance(data, Iterable) and not isinstance(data, (str, bytes, dict)):
        return _Stream(data, num_samples=None, description=f"{type(data).__name__} of batches", limit=limit)
    raise DataError(
        f"cannot read samples from {type(data).__name__}: give an image folder or file, a .npy path, "
        "a Dataset, a DataLoader, a tensor or array of samples, or an iterable of batches"
    )


def _as_map(dataset: Any) -> _MapDataset:
    """A map-style dataset as such: by torch's convention it defines ``__len__``, which its base
    class does not declare (one that lacks it fails at ``len()`` in `_Indexed`, unchanged)."""
    return cast(_MapDataset, dataset)


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None


def iter_batches(
    data: Any,
    *,
    batch_size: int = 64,
    num_workers: int | None = None,
    transform: Callable[[Any], Any] | None = None,
    on_error: OnError = "fail",
    shard: Sequence[int] | np.ndarray | None = None,
    max_image_pixels: int | None = None,
) -> Iterator[Batch]:
    """`Batch` after `Batch` of ``data``: inputs, labels, ids and global indices.

    Args:
        data: an image folder or file, a ``.npy`` path, a Dataset, a DataLoader, a tensor of
            samples or an iterable of batches (see the module docs).
        batch_size, num_workers, transform, on_error, max_image_pixels: see `open_data`.
        shard: the global indices of the samples to visit (sorted), e.g. one process's share;
            default all. Batches are cut from this list, so a shard made of whole runs of
            ``batch_size`` samples gets the same batches as a full pass.

    >>> import torch
    >>> [b.index.tolist() for b in iter_batches(torch.randn(6, 2), batch_size=2, shard=[2, 3, 4, 5])]
    [[2, 3], [4, 5]]
    """
    source = open_data(
        data,
        batch_size=batch_size,
        num_workers=num_workers,
        transform=transform,
        on_error=on_error,
        max_image_pixels=max_image_pixels,
    )
    return source.batches(shard)


__all__ = [
    "Batch",
    "DataSource",
    "ImageFiles",
    "ArrayRows",
    "iter_batches",
    "open_data",
    "split_batch",
    "image_to_tensor",
]
