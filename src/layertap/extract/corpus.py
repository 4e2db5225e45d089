"""A corpus: the documents of a ``texts`` argument, with their ids, read as data.

Accepted ``texts`` (see `layertap.extract_tokens`):

- a list (or any sequence) of strings, or of token-id lists / arrays (already tokenized);
- a dict ``{"input_ids": [...]}`` of already-tokenized documents (a tokenizer's ``BatchEncoding``
  too), with the padding its ``"attention_mask"`` masks left out of each document;
- a ``.txt`` file (one document per line: lines end at ``\n``, and a ``\r`` before it is dropped), a ``.jsonl`` / ``.json`` file (records, or a list of
  them), a ``.csv`` or a ``.parquet`` file, whose ``text_field`` column holds the text and
  ``id_field`` (optional) the ids;
- a Hugging Face ``datasets.Dataset`` (in memory, or loaded from disk), by the same fields.

Files are read as data only: JSON is parsed, CSV split, Parquet decoded by pyarrow; nothing in
them is run. Text files are UTF-8 (a byte-order mark, as spreadsheet programs write, is dropped). A document that is missing or not a string is kept as it is here and refused (or
skipped, with ``on_error="skip"``) when it is tokenized, naming its index.

>>> corpus = read_corpus(["a cat", "a dog"])
>>> len(corpus), corpus.doc_ids, corpus.pretokenized
(2, None, False)
"""

from __future__ import annotations

import csv
import io
import json
import re
import reprlib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, require

_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")
_SHORT = reprlib.Repr()  # a value from a file, in a message: a few items, a few levels, never all of it
_SHORT.maxstring = _SHORT.maxother = 80


@dataclass
class Corpus:
    """The documents of a ``texts`` argument.

    Attributes:
        docs: one entry per document: a string, or a sequence of token ids (``pretokenized``),
            or whatever the file held there (refused when tokenized).
        doc_ids: the documents' ids (``id_field``), or ``None`` when they are the indices.
        description: what the documents came from, for messages.
        pretokenized: whether ``docs`` are token ids, not text.
    """

    docs: Sequence[Any]
    doc_ids: list | None
    description: str
    pretokenized: bool

    def __len__(self) -> int:
        return len(self.docs)

    def id_of(self, index: int) -> Any:
        return self.doc_ids[index] if self.doc_ids is not None else int(index)


def _is_ids(doc: Any) -> bool:
    """Whether a document is token ids: a sequence (list, tuple, array, tensor) of integers."""
    if isinstance(doc, (str, bytes)) or not hasattr(doc, "__len__"):
        return False
    values = np.asarray(doc)
    return values.ndim == 1 and (values.dtype.kind in "iu" or (values.size == 0 and values.dtype.kind == "f"))


def _records(rows: list, text_field: str, id_field: str | None, where: str) -> tuple[list, list | None]:
    """The text and ids of a list of records (dicts), each missing field kept as ``None``."""
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataError(f"record {bad} of {where} is a {type(rows[bad]).__name__}, not an object with a {text_field!r} field")
    docs = [r.get(text_field) for r in rows]
    if rows and all(text_field not in r for r in rows):
        fields = sorted(k for k in rows[0] if isinstance(k, str))  # a CSV row's extra fields are under None
        raise DataError(f"no record of {where} has a {text_field!r} field (it has {fields}): pass text_field=")
    if id_field is None:
        return docs, None
    ids = [r.get(id_field) for r in rows]
    _check_ids(ids, id_field, where)
    return docs, ids


def _check_ids(ids: list, id_field: str, where: str) -> None:
    missing = next((i for i, v in enumerate(ids) if not isinstance(v, (str, int)) or isinstance(v, bool)), None)
    if missing is not None:
        raise DataError(f"document {missing} of {where} has no {id_field!r} (a string or an integer): {_SHORT.repr(ids[missing])}")
    seen: dict = {}
    for i, v in enumerate(ids):
        key = str(v)  # 1 and "1" are one id once stored (the store keeps ids of mixed types as text)
        if key in seen:
            first, shown = _SHORT.repr(ids[seen[key]]), _SHORT.repr(v)
            same = f"the same {id_field!r} {shown}" if ids[seen[key]] == v else f"the {id_field!r}s {first} and {shown}, one id as text"
            raise DataError(f"documents {seen[key]} and {i} of {where} have {same}: ids must be unique")
        seen[key] = i


def _text(path: Path) -> str:
    """A text file's content: UTF-8, a leading byte-order mark dropped, line ends as they are
    (Python's universal newlines would end a line at a lone ``\r`` inside a document)."""
    try:
        with path.open(encoding="utf-8-sig", newline="") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start : e.start + 1]!r}): save it as UTF-8") from e


def _json_rows(path: Path, text_field: str) -> list:
    text = _text(path)
    if path.suffix == ".json":
        value = _json(text, path, None, text_field)
        if isinstance(value, dict):  # {"data": [...]} as some exports write it
            lists = [v for v in value.values() if isinstance(v, list)]
            value = lists[0] if len(lists) == 1 else value
        if not isinstance(value, list):
            raise DataError(f"{path} holds a JSON {type(value).__name__}, not a list of records: give a list, or a .jsonl file")
        return value
    # a JSON text holds no raw line break: any of \r\n, \r, \n ends a record
    return [_json(line, path, n, text_field) for n, line in enumerate(re.split(r"\r\n|\r|\n", text), 1) if line.strip()]


def _json(text: str, path: Path, line: int | None, text_field: str) -> Any:
    """``text`` parsed as JSON: all of a .json file (``line`` None), or one line of a .jsonl file."""
    where, fix = (f"line {line} of {path}", "fix it, or remove the line") if line else (str(path), "fix the file")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"{e.msg} at line {e.lineno}" if line is None else e.msg
        raise DataError(f"{where} is not valid JSON ({at}): {fix}") from e
    except RecursionError as e:  # json nests by recursion
        if line is None:
            where = f"line {_deep_line(text)} of {path}"
        raise DataError(f"{where} is nested too deeply to read as JSON: a record is one object with a {text_field!r} field; {fix}") from e
    except ValueError as e:  # a number longer than Python converts (sys.get_int_max_str_digits)
        raise DataError(f"{where} cannot be read as JSON ({str(e).split(':')[0]}): {fix}") from e


def _deep_line(text: str) -> int:
    """The line of a JSON text where its nesting gets too deep (or is deepest), for a message."""
    depth = deepest = at = 0
    for match in re.finditer(r'"(?:[^"\\]|\\.)*"|[][{}]', text):  # strings skipped, brackets counted
        if match.group() in "[{":
            depth += 1
            if depth > deepest:
                deepest, at = depth, match.start()
            if depth >= sys.getrecursionlimit():
                break
        elif match.group() in "]}":
            depth -= 1
    return text.count("\n", 0, at) + 1


def _no_surrogates(docs: list, ids: list | None, where: str) -> None:
    """Refuse a string parsed from a JSON escape of half a surrogate pair (``"\\ud800"``): no
    character, so no tokenizer or store takes it."""
    for kind, values in (("document", docs), ("the id of document", ids or [])):
        for i, value in enumerate(values):
            if isinstance(value, str) and not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise DataError(
                        f"{kind} {i} of {where} holds {value[e.start]!r}, half of a UTF-16 surrogate pair (a "
                        "JSON \\u escape) without its other half, which is no character: fix the escape"
                    ) from e


def _csv_rows(path: Path) -> list:
    """A CSV file's records (dicts by the header's fields); no field is too long (csv's own limit,
    128 K characters, is lifted while the file is read: no field is longer than the file)."""
    text = _text(path)
    limit = csv.field_size_limit()
    csv.field_size_limit(max(limit, len(text) + 1))
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))  # csv ends records itself, at \n and \r only
        try:
            return list(reader)
        except csv.Error as e:
            raise DataError(f"line {reader.reader.line_num} of {path} is not valid CSV ({e}): fix it, or remove the line") from e
    finally:
        csv.field_size_limit(limit)


def _parquet(path: Path, text_field: str, id_field: str | None) -> tuple[list, list | None]:
    pa = require("pyarrow", "text")
    pq = require("pyarrow.parquet", "text")
    try:
        with pq.ParquetFile(path) as parquet:  # the file alone (read_table's datasets refuse duplicate names)
            table = parquet.read()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} cannot be read as Parquet ({_first_line(e)}): fix or re-export the file") from e

    def column(name: str) -> list:
        try:
            return table.column(name).to_pylist()
        except (pa.ArrowException, ValueError, OverflowError) as e:
            raise DataError(f"column {name!r} of {path} cannot be read ({_first_line(e)}): fix or re-export the file") from e

    return _columns(table.column_names, column, text_field, id_field, str(path))


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _lines(text: str) -> list[str]:
    """A file's lines, ended by ``\n`` alone (``str.splitlines`` also ends them at form feeds,
    U+2028 and other separators inside a document), a ``\r`` before it dropped."""
    lines = text.split("\n")
    if lines[-1] == "":  # the end of the last line, not an empty document after it
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _file(path: Path, text_field: str, id_field: str | None) -> tuple[list, list | None]:
    if path.suffix == ".txt":
        return _lines(_text(path)), None
    if path.suffix in (".json", ".jsonl"):
        docs, ids = _records(_json_rows(path, text_field), text_field, id_field, str(path))
        _no_surrogates(docs, ids, str(path))
        return docs, ids
    if path.suffix == ".csv":
        return _records(_csv_rows(path), text_field, id_field, str(path))
    return _parquet(path, text_field, id_field)


def _columns(names: Sequence[str], column: Any, text_field: str, id_field: str | None, where: str) -> tuple[list, list | None]:
    """The text and id columns of a table (a Parquet file, a ``datasets.Dataset``)."""
    for field in (text_field, id_field):
        if field is not None and field not in names:
            hint = " (text_field='input_ids' for token ids)" if field == text_field and "input_ids" in names else ""
            raise DataError(f"{where} has no column {field!r} (it has {list(names)}): pass text_field={hint} / id_field=")
        if field is not None and list(names).count(field) > 1:
            raise DataError(f"{where} has {list(names).count(field)} columns named {field!r}: rename all but one")
    ids = None if id_field is None else list(column(id_field))
    if ids is not None:
        _check_ids(ids, id_field or "", where)
    return list(column(text_field)), ids


def _unpadded(ids: Any, mask: Any) -> Any:
    """Tokenized documents without the positions their ``attention_mask`` masks (the padding); one
    document's encoding (``tokenizer("text")``: a list of ids) is a corpus of one."""
    if hasattr(ids, "cpu"):  # a tensor, on any device
        ids, mask = ids.cpu().numpy(), None if mask is None else mask.cpu().numpy()
    if len(ids) and np.ndim(ids[0]) == 0:  # one document, not a batch
        ids, mask = [ids], None if mask is None else [mask]
    if mask is None:
        return ids
    rows, masks = list(ids), list(mask)
    shapes = [(np.shape(i), np.shape(m)) for i, m in zip(rows, masks)]
    if len(rows) != len(masks) or any(a != b or len(a) != 1 for a, b in shapes):
        raise DataError("the attention_mask of the tokenized documents does not have the shape of their input_ids: give both as the tokenizer made them")
    return [np.asarray(i)[np.asarray(m) != 0] for i, m in zip(rows, masks)]


def _single_segments(encoding: Mapping) -> None:
    """Refuse model inputs beside the ids that the run would drop: each document runs as one
    segment (``token_type_ids`` 0) from position 0, as layertap batches it."""
    given = [k for k in ("position_ids", "inputs_embeds") if encoding.get(k) is not None]
    segments: Any = encoding.get("token_type_ids")
    if hasattr(segments, "cpu"):
        segments = segments.cpu().numpy()
    rows = [] if segments is None else [segments] if len(segments) and np.ndim(segments[0]) == 0 else list(segments)
    if any(np.any(np.asarray(row) != 0) for row in rows):  # a tokenizer gives zeros for single texts
        given.append("token_type_ids")
    if given:
        raise DataError(
            f"the tokenized documents come with {', '.join(given)}, which extract_tokens does not pass to the model (each "
            "document runs as one segment, from position 0): give each document's ids alone (a pair as one text)"
        )


def read_corpus(texts: Any, *, text_field: str = "text", id_field: str | None = None) -> Corpus:
    """The documents of ``texts`` (see the module's docstring), with their ids."""
    if isinstance(texts, (str, Path)):
        path = Path(texts).expanduser()
        if path.suffix not in _SUFFIXES:
            raise DataError(f"{path}: texts are read from {', '.join(_SUFFIXES)} files; give one of those, or a list of strings")
        if not path.is_file():
            raise DataError(f"{path} is not a file: check the path")
        docs, ids = _file(path, text_field, id_field)
        return Corpus(docs, ids, str(path), False)
    if type(texts).__module__.startswith("datasets") and hasattr(texts, "column_names"):
        if isinstance(texts.column_names, dict):  # a DatasetDict: its splits' columns
            splits = list(texts.column_names)
            raise DataError(f"texts is a {type(texts).__name__} of the splits {splits}: give one split, e.g. texts[{splits[0] if splits else 'train'!r}]")
        docs, ids = _columns(texts.column_names, lambda c: texts[c], text_field, id_field, "the dataset")
        if docs and _is_ids(docs[0]):
            _single_segments({k: texts[k] for k in ("token_type_ids", "position_ids", "inputs_embeds") if k in texts.column_names})
            return Corpus(docs, ids, f"a dataset of {len(docs)} tokenized documents", True)
        return Corpus(docs, ids, f"a dataset of {len(docs)} documents", False)
    if isinstance(texts, Mapping):  # a dict, or a tokenizer's BatchEncoding
        if "input_ids" not in texts:
            raise DataError(f"a dict of documents needs an 'input_ids' entry (it has {sorted(texts)}): or give a list of strings")
        _single_segments(texts)
        texts = _unpadded(texts["input_ids"], texts.get("attention_mask"))
    if (hasattr(texts, "dim") and texts.dim() == 2) or (isinstance(texts, np.ndarray) and texts.ndim == 2):
        texts = list(texts)  # a [documents, tokens] array: its rows
    if not isinstance(texts, Sequence) and not isinstance(texts, np.ndarray):
        raise DataError(
            f"texts is a {type(texts).__name__}: give a list of strings, a .txt/.jsonl/.json/.csv/.parquet file, a "
            "datasets.Dataset, or tokenized documents (lists of token ids)"
        )
    docs = list(texts)
    tokenized = bool(docs) and _is_ids(docs[0])
    return Corpus(docs, None, f"{len(docs)} {'tokenized ' if tokenized else ''}documents", tokenized)
