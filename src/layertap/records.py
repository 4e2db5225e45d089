"""Records that pass between the data, the extraction and the store: plain values, no behaviour.

>>> from layertap.records import SkippedSample
>>> SkippedSample(3, "cat.png", "CorruptImageError: truncated").id
'cat.png'
"""

from __future__ import annotations

from typing import Any, NamedTuple


class SkippedSample(NamedTuple):
    """A sample that could not be loaded (recorded with ``on_error='skip'``)."""

    # the field shadows tuple.index on purpose (it is the sample's index); mypy reports any such field
    index: int  # type: ignore[assignment]
    id: Any
    error: str


__all__ = ["SkippedSample"]
