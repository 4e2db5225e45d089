"""`summary`: every layer of a model as one forward sees it, before you tap any.

>>> import torch, torchvision, layertap
>>> table = layertap.summary(torchvision.models.resnet18(), torch.randn(1, 3, 64, 64), depth=1)
>>> table["layer4"].output, table["layer4"].calls
(torch.Size([1, 512, 2, 2]), 1)
>>> print(table)                                           # doctest: +SKIP
Layer    Type    Input           Output           Dtype    Calls  Params  Total params  Out/sample
(model)  ResNet  [1, 3, 64, 64]  [1, 1000]        float32      1       0    11,689,512      4.0 KB
conv1    Conv2d  [1, 3, 64, 64]  [1, 64, 32, 32]  float32      1   9,408         9,408    262.1 KB
...

The forward runs once, in eval mode, without autograd, under a `layertap.tap` whose observer
(``observe=``) notes only the shape, dtype and bytes of each value inside the hook and keeps no
tensor, so a summary costs no more memory than the forward itself. Byte figures are those a tap
of the same layers would store. With ``ops=True`` the tap also lists the ops inside each
module's own forward (``"MODULE:*"``), each under a name `layertap.tap` accepts:

>>> table = layertap.summary(torchvision.models.resnet18(), torch.randn(1, 3, 64, 64), ops=True)
>>> [(row.name, row.output) for row in table if row.name.endswith(":add_")][:2]
[('layer1.0:add_', torch.Size([1, 64, 16, 16])), ('layer1.1:add_', torch.Size([1, 64, 16, 16]))]
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from . import nested
from .modelinfo import model_info
from .runtime import place_model, running
from .select import Layers, Selection, Spec, owner, selection, split_op, unescape
from .tables import Table
from .tap import Inputs, tap
from .units import human_bytes

_COLUMNS = ("Layer", "Type", "Input", "Output", "Dtype", "Calls", "Params", "Total params", "Out/sample")
_NUMERIC = {"Calls", "Params", "Total params", "Out/sample"}
_CELL_WIDTH = 44  # the text table shortens longer shape cells; to_dicts() has them whole


@dataclasses.dataclass
class LayerRow:
    """One module (or op) as the forward called it (the last call when it was called several times).

    ``input`` and ``output`` hold the call's structure with every tensor replaced by its
    ``torch.Size`` (non-tensor values left out); ``None`` when the module never ran. An op's
    ``type`` is ``"op"``, its input its tensor arguments.
    """

    name: str
    type: str
    input: Any
    output: Any
    dtype: str
    calls: int
    params: int  # its own parameters
    params_total: int  # with its submodules'
    bytes: int  # output bytes of one call for the whole example batch
    bytes_per_sample: float

    @property
    def depth(self) -> int:
        return _depth(self.name)

    def to_dict(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        row["input"], row["output"] = _jsonable(self.input), _jsonable(self.output)
        return row


class LayerTable(Sequence):
    """The rows of `summary`, in execution order; index by position or by layer name (as shown,
    or as the module has it: see `layertap.select` for the names shown escaped).

    Prints as an aligned text table, renders as HTML in a notebook, converts with `to_dicts`
    and `to_json`.
    """

    def __init__(
        self, rows: list[LayerRow], model: str, params: int, trainable: int, batch_size: int
    ) -> None:
        self.rows = rows
        self.model = model
        self.params = params
        self.trainable = trainable
        self.batch_size = batch_size

    @overload
    def __getitem__(self, key: int | str) -> LayerRow: ...
    @overload
    def __getitem__(self, key: slice) -> list[LayerRow]: ...
    def __getitem__(self, key):
        if isinstance(key, str):
            # the name as shown, else as the module has it (``"d:relu"`` is shown ``"d\\:relu"``)
            for row in sorted(self.rows, key=lambda row: row.name != key):
                if key in (row.name, unescape(row.name)):
                    return row
            shown = ", ".join(self.names[:10]) + (", ..." if len(self) > 10 else "")
            raise KeyError(f"no layer {key!r} in this summary; its layers: {shown}")
        return self.rows[key]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[LayerRow]:
        return iter(self.rows)

    @property
    def names(self) -> list[str]:
        return [row.name for row in self.rows]

    @property
    def bytes_per_sample(self) -> float:
        """What tapping the outputs of these rows keeps per sample (last call of each)."""
        return sum(row.bytes_per_sample for row in self.rows)

    def to_dicts(self) -> list[dict[str, Any]]:
        """One JSON-able dict per row; shapes become lists."""
        return [row.to_dict() for row in self.rows]

    def to_json(self, indent: int | None = None) -> str:
        """The table as JSON: the model's totals and ``layers``, the rows of `to_dicts`."""
        return json.dumps(
            {
                "model": self.model,
                "params": self.params,
                "trainable_params": self.trainable,
                "batch_size": self.batch_size,
                "bytes_per_sample": self.bytes_per_sample,
                "layers": self.to_dicts(),
            },
            indent=indent,
        )

    def _cells(self) -> list[list[str]]:
        return [
            [
                row.name or "(model)",
                row.type,
                _show(row.input),
                _show(row.output),
                row.dtype or "-",
                str(row.calls),
                f"{row.params:,}",
                f"{row.params_total:,}",
                human_bytes(row.bytes_per_sample) if row.calls else "-",
            ]
            for row in self.rows
        ]

    def footer(self) -> str:
        return (
            f"{self.model}: {self.params:,} parameters ({self.trainable:,} trainable); example batch of "
            f"{self.batch_size}; the outputs of these {len(self)} layers take "
            f"{human_bytes(self.bytes_per_sample)} per sample"
        )

    def _table(self, indent: str, width: int | None) -> Table:
        """The rows as a `Table`: names indented by nesting, cells cut at ``width`` characters."""
        lines = self._cells()
        if width is not None:
            lines = [[c if len(c) <= width else c[: width - 1] + "…" for c in line] for line in lines]
        top = min((max(row.depth, 1) for row in self.rows), default=1)
        for line, row in zip(lines, self.rows):
            line[0] = indent * max(row.depth - top, 0) + line[0]
        return Table(_COLUMNS, lines, numeric=_NUMERIC, notes=["", self.footer()])

    def __str__(self) -> str:
        return self._table("  ", _CELL_WIDTH).text()

    __repr__ = __str__

    def to_html(self) -> str:
        """The table as escaped HTML (a notebook shows it), shapes whole."""
        return self._table("\u00a0\u00a0", None).html()  # no-break spaces: HTML keeps them

    _repr_html_ = to_html


# ---------------------------------------------------------------------------- value structure
def _structure(value: Any) -> Any:
    """``value`` with tensors replaced by their ``torch.Size``; non-tensor leaves are left out."""
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, Inputs):  # shown as a plain value when only args or only kwargs hold tensors
        args, kwargs = _structure(tuple(value.args)), _structure(dict(value.kwargs))
        if args and kwargs:
            return {"args": args, "kwargs": kwargs}
        return kwargs or (args[0] if args and len(args) == 1 else args)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):  # dicts and Hugging Face ModelOutput
        entries = {str(k): _structure(v) for k, v in value.items()}
        return {k: v for k, v in entries.items() if v is not None} or None
    if isinstance(value, (tuple, list)):
        items = [s for s in map(_structure, value) if s is not None]
        return (tuple(items) if isinstance(value, tuple) else items) or None
    return None


def _show(structure: Any) -> str:
    if structure is None:
        return "-"
    if isinstance(structure, torch.Size):
        return str(list(structure))
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in structure.items()) + "}"
    inner = ", ".join(map(_show, structure))
    return f"({inner})" if isinstance(structure, tuple) else f"[{inner}]"


def _jsonable(structure: Any) -> Any:
    if isinstance(structure, dict):
        return {k: _jsonable(v) for k, v in structure.items()}
    if isinstance(structure, (tuple, list)):  # torch.Size included
        return [_jsonable(v) for v in structure]
    return structure


def _depth(name: str) -> int:
    """The dotted parts of a module's name; an op sits one level below its module."""
    module = owner(name)
    return (module.count(".") + 1 if module else 0) + (module != name)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in nested.tensors(value))


# ---------------------------------------------------------------------------- the forward
@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the forward (no batch-norm statistics updated), then every flag as it was."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _batch_size(example: Any) -> int:
    """The first input's first dim; a ``PackedSequence`` (whose data is all steps) counts sequences."""
    first = nested.first_tensor(example)
    if first is None or first.dim() == 0:
        return 1
    leaves = pytree.tree_leaves(example, is_leaf=lambda x: isinstance(x, PackedSequence))
    packed = next((x for x in leaves if isinstance(x, PackedSequence) and x.data is first), None)
    return int(packed.batch_sizes[0]) if packed is not None else first.shape[0]


def _every_op(modules: set[str]) -> list[Spec]:
    """``"MODULE:*"`` for each of ``modules`` as one predicate spec (each op spec's module is
    matched against every layer: one spec per module would cost a pass each), and ``":*"`` for
    the model's own ops, which no predicate matches."""
    specs: list[Spec] = [":*"] if "" in modules else []
    if modules - {""}:
        specs.append((lambda name, _module: name in modules, "*"))
    return specs


def _tapped(model: nn.Module, layers: Layers | None, ops: bool) -> Selection:
    """What `summary` taps, resolved from one walk of the model: ``layers`` (default: every module),
    and with ``ops`` every op of each module among them."""
    chosen = selection(model, "" if layers is None else layers)
    if layers is None and len(chosen.layers) > 1:  # the root is selected by its name only; nn.Module matches every other layer
        chosen = chosen.select(["", nn.Module])
    if ops:  # every op of each module listed, named "MODULE:OP#K" as it runs
        chosen = chosen.select([*chosen.names, *_every_op({name for name in chosen.names if name not in chosen.ops})])
    return chosen


def _op_names(ran: list[str]) -> dict[str, str]:
    """The name each op a ``"MODULE:*"`` tap named ``"MODULE:OP#K"`` is shown under:
    ``"MODULE:OP"`` when its module's forward calls it once (that spec taps the same call)."""
    calls: dict[tuple[str, str], int] = {}
    for name in ran:
        op = split_op(name)
        if op is not None and op.call is not None:
            calls[op.module, op.op] = max(calls.get((op.module, op.op), 0), op.call)
    return {
        name: f"{op.module}:{op.op}" if calls[op.module, op.op] == 1 else name
        for name in ran
        if (op := split_op(name)) is not None and op.call is not None
    }


def summary(
    model: nn.Module,
    *example_inputs: Any,
    layers: Layers | None = None,
    depth: int | None = None,
    ops: bool = False,
    **example_kwargs: Any,
) -> LayerTable:
    """Run ``model(*example_inputs, **example_kwargs)`` once and describe each layer it called.

    One row per module (or per layer of ``layers``, any `layertap.select` spec), in the order the
    forward first called them, then any that never ran (0 calls): qualified name, class, input
    and output shapes (nested values by structure), output dtype, number of calls, own and total
    parameters, and bytes of the output per sample, which is what `layertap.tap` keeps for that
    layer (its last call). ``depth`` keeps names with at most that many dotted parts (0: the
    model itself). Without example inputs a random one comes from `layertap.model_info`.

    ``ops=True`` adds a row for each op (torch function returning a tensor) inside the own
    ``forward`` of each module listed, in the order they ran among its submodules, named as
    `layertap.tap` takes them: ``"layer1.0:add_"`` for an op called once per forward of its
    module, ``"MODULE:OP#K"`` for each call of one called several times (see `layertap.select`).

    A forward that fails raises `layertap.LayerForwardError` naming the layer, its class and
    input shapes, with the original exception chained.

    >>> import torch, layertap
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    >>> [(row.name, row.output, row.bytes_per_sample) for row in layertap.summary(model, torch.randn(2, 8))]
    [('', torch.Size([2, 4]), 16.0), ('0', torch.Size([2, 4]), 16.0), ('1', torch.Size([2, 4]), 16.0)]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if depth is not None and depth < 0:
        raise ValueError(f"depth must be >= 0, got {depth}")
    if not example_inputs and not example_kwargs:
        example_inputs = (model_info(model).example().to(place_model(model, None)),)
    chosen = _tapped(model, layers, ops)
    all_layers = chosen.layers
    batch = _batch_size((example_inputs, example_kwargs))

    inputs: dict[str, Any] = {}  # name -> the structure of its last call's input
    outputs: dict[str, tuple[Any, str, int]] = {}  # name -> its last output's structure, dtypes, bytes
    calls: dict[str, int] = {}

    def observe(name: str, kind: str, call: int, value: Any) -> None:
        # only what a row shows; torch functions that return no tensor, so an op tap sees none
        if kind == "input":
            inputs[name] = _structure(value)
            return
        dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in nested.tensors(value)}))
        outputs[name] = (_structure(value), dtypes, _nbytes(value))
        calls[name] = call + 1

    # detach=False: under no_grad there is no graph to drop, and the hook makes no tensor
    tapped = tap(model, chosen, capture=("input", "output"), detach=False, observe=observe)
    with running(model), _eval_mode(model), tapped:
        model(*example_inputs, **example_kwargs)

    ran = tapped.order
    started = set(ran)
    shown = _op_names(ran)
    rows = []
    for name in ran + [name for name in tapped.names if name not in started]:
        if depth is not None and _depth(owner(name)) > depth:
            continue
        module = all_layers[owner(name)]
        is_op = split_op(name) is not None
        output, dtypes, size = outputs.get(name, (None, "", 0))
        rows.append(
            LayerRow(
                name=shown.get(name, name),
                type="op" if is_op else type(module).__name__,
                input=inputs.get(name),
                output=output,
                dtype=dtypes,
                calls=calls.get(name, 0),
                params=0 if is_op else sum(p.numel() for p in module.parameters(recurse=False)),
                params_total=0 if is_op else sum(p.numel() for p in module.parameters()),
                bytes=size,
                bytes_per_sample=size / batch,
            )
        )
    params = list(model.parameters())
    return LayerTable(
        rows,
        model=type(all_layers[""]).__name__,
        params=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        batch_size=batch,
    )


__all__ = ["summary", "LayerTable", "LayerRow"]
