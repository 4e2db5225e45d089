"""The tap's core promises over a zoo of real architectures with random weights and small inputs
(`zoo_models`): all 80 torchvision classifiers, 22 timm families and 4 Hugging Face models (the
pretrained MiniLM, tiny GPT-2, Llama and ViT).

Each model is built once and its checks share a few forwards (cached on the `Case`). Every value
is compared with plain forward hooks that clone what a module returned, on the same forward, so
values must be bit-exact:

- ``values``: a tap on every module (containers and the model itself too), ``keep="last"``,
  under ``no_grad``: each equals the clone; no hook is left behind.
- ``keep_all``: ``keep="all"`` on a handful of modules over two forwards: one entry per call,
  each equal to its clone; a module that never ran is not in the tap.
- ``grad``: ``capture="grad"`` on every module equals ``autograd.grad`` of the same loss with
  respect to a zero *delta* added to that module's output in a second, untapped run of the same
  forwards (so the tap meets the model's own views and in-place ops), to float32 rounding.
- ``grad_keep_all``: ``keep="all"`` gradients over two forwards: one entry per call, each that
  call's own.
- ``summary``: one row per module; the ones that ran in the order their first call started, with
  their call counts; the leaf rows are the leaves that ran.
- ``stop_early``: the forward stops at a leaf a quarter of the way in (the last leaf never runs)
  and the tapped value equals the clone.
- ``gradcam``: ``GradCAM(model)`` picks a layer of the model that the gradient reaches and gives
  ``[B, H, W]`` maps in ``[0, 1]`` (image models).

The backward checks (``grad``, ``grad_keep_all``, ``gradcam``) run once per torchvision
architecture: a variant that differs from its family's model only in widths, depths or patch
size skips them, naming that model. Known library bugs are marked in `XFAIL`
(``strict=True``, the reproduction in the reason). The module takes about 60 s on one core;
``pytest -s`` prints each model's class, input and Grad-CAM layer.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import zoo_models
from torch import nn

import layertap
from conftest import hook_state

SPECS = {spec.name: spec for spec in zoo_models.torchvision_specs() + zoo_models.timm_specs() + zoo_models.hf_specs()}

# (check, model) -> reason: known library bugs, each with a reproduction in the reason. Empty: all
# pass. (At b343404, test_grad[tv-swin_v2_t] failed: a Linear's output that is a view, changed in
# place by the ReLU after it, lost its gradient hook: swin_v2's attn.cpb_mlp.0.)
XFAIL: dict[tuple[str, str], str] = {}

EVERY = ["", lambda name, module: True]  # a predicate leaves out the model itself: name it


def params(check: str) -> list:
    return [
        pytest.param(
            name,
            id=name,
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL[check, name])] if (check, name) in XFAIL else [],
        )
        for name in SPECS
    ]


def zoo(check: str):
    return pytest.mark.parametrize("case", params(check), indirect=True, scope="module")


# ------------------------------------------------------------------------ nested values
def leaves(value: Any) -> list[Any]:
    """Tensor leaves of a nested output, in order (tuples, lists, mappings, dataclasses)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in leaves(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in leaves(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in leaves(getattr(value, f.name))]
    return []


def map_tensors(fn, value: Any) -> Any:
    """``value`` with each tensor leaf replaced by ``fn(leaf)``, in `leaves` order, structure kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        out = {k: map_tensors(fn, v) for k, v in value.items()}
        return type(value)(**out) if hasattr(value, "to_tuple") else type(value)(out)  # ModelOutput
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(fn, v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(fn, v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: map_tensors(fn, getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    return value


def clone(value: Any) -> Any:
    """A detached copy of ``value``'s tensors, in the same structure."""
    return map_tensors(lambda t: t.detach().clone(), value)


def assert_same(got: Any, want: Any, where: str) -> None:
    """Bit-exact equality of two nested values (NaN equals NaN); mappings compare by items."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: got {type(got).__name__}, want a tensor"
        assert got.shape == want.shape and got.dtype == want.dtype, (
            f"{where}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
        )
        if not torch.equal(got, want):  # (the fast path) NaN, or a difference to describe
            torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: got {type(got).__name__}, want a mapping"
        assert list(got.keys()) == list(want.keys()), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), f"{where}: got {got!r:.200}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif dataclasses.is_dataclass(want) and not isinstance(want, type):
        for f in dataclasses.fields(want):
            assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    else:
        assert got is want or got == want, f"{where}: got {got!r:.200}, want {want!r:.200}"


def on_family_model(case: Case, checks: str) -> None:
    """Skip a torchvision variant's ``checks``: they run on its family's model, of the same module
    code (see `zoo_models`)."""
    if case.spec.same_as:
        pytest.skip(f"same architecture as {case.spec.same_as}, where {checks} run")


def backward_checks(case: Case) -> None:
    on_family_model(case, "the backward checks")


def first_float(value: Any) -> torch.Tensor | None:
    return next((t for t in leaves(value) if t.is_floating_point()), None)


# ------------------------------------------------------------------------ reference hooks
class Recorder:
    """The reference: plain forward hooks on chosen modules (all by default).

    ``values[name]`` holds a clone of each call's output, taken when the module returned;
    ``order`` the modules in the order their first call started; ``calls`` the call counts;
    ``aliasing`` the modules that returned one of their inputs (``nn.Identity``, dropout in eval
    mode, in-place ops).
    """

    def __init__(self, model: nn.Module, names: list[str] | None = None) -> None:
        self.modules = dict(model.named_modules())
        self.names = list(self.modules) if names is None else names
        self.values: dict[str, list] = {n: [] for n in self.names}
        self.order: list[str] = []
        self.calls: dict[str, int] = {}
        self.aliasing: set[str] = set()
        self.handles: list = []

    def __enter__(self) -> Recorder:
        for name in self.names:
            module = self.modules[name]
            self.handles.append(module.register_forward_pre_hook(self._started(name)))
            self.handles.append(module.register_forward_hook(self._returned(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def _started(self, name: str):
        def hook(module, args):
            if name not in self.calls:
                self.order.append(name)
                self.calls[name] = 0

        return hook

    def _returned(self, name: str):
        def hook(module, args, output):
            self.calls[name] += 1
            inputs = {id(t) for t in leaves(args)}
            if any(id(t) in inputs for t in leaves(output)):
                self.aliasing.add(name)
            self.values[name].append(clone(output))

        return hook


# ------------------------------------------------------------------------ one model
@dataclasses.dataclass
class Case:
    """A built model, its two input batches and what the checks share."""

    spec: zoo_models.Spec
    model: nn.Module
    inputs: list[tuple[tuple, dict]]
    leaves_ran: list[str] = dataclasses.field(default_factory=list)
    containers_ran: list[str] = dataclasses.field(default_factory=list)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self.modules = dict(self.model.named_modules())
        self.leaves = {name for name, m in self.modules.items() if next(m.children(), None) is None}

    def __call__(self, which: int = 0) -> Any:
        """The model on batch ``which``."""
        args, kwargs = self.inputs[which]
        return self.model(*args, **kwargs)

    def loss(self) -> torch.Tensor:
        """Both forwards' outputs weighted by fixed random numbers, summed; one image per batch."""
        ys = []
        for args, kwargs in self.inputs:
            if self.spec.vision:  # one image: a gradient's code path does not depend on the batch
                args = (args[0][:1],)
            ys.append(first_float(self.model(*args, **kwargs)))
        weights = torch.randn(ys[0].shape, generator=torch.Generator().manual_seed(0), dtype=ys[0].dtype)
        return sum((y * weights).sum() for y in ys)

    def is_leaf(self, name: str) -> bool:
        return name in self.leaves

    def picks(self) -> list[str]:
        """First, middle and last leaf that ran, and the container that ran in the middle.

        Modules that return one of their inputs are passed over when others ran: their gradient
        may have no reference (see `gradient_runs`).
        """
        aliasing = self.results["reference"].aliasing
        leaves = [n for n in self.leaves_ran if n not in aliasing] or self.leaves_ran
        containers = [n for n in self.containers_ran if n not in aliasing]
        picks = [leaves[0], leaves[len(leaves) // 2], leaves[-1]]
        if containers:
            picks.append(containers[len(containers) // 2])
        return list(dict.fromkeys(picks))

    def early(self) -> str:
        """The leaf a quarter of the way through the forward."""
        return self.leaves_ran[len(self.leaves_ran) // 4]


COVERED: dict[str, str] = {}  # model -> its class and input (and Grad-CAM's layer), printed at the end


@pytest.fixture(scope="module", autouse=True)
def _zoo_settings(one_thread):
    # inputs are tiny: one thread (with two, the module took 522 s instead of 65)
    yield
    zoo_models.free_pools()


@pytest.fixture(scope="module")
def case(request) -> Case:
    """The model of ``request.param``, built once for all its checks (pytest groups them)."""
    spec = SPECS[request.param]
    torch.manual_seed(zlib.crc32(spec.name.encode()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spec.build().eval()
    for p in model.parameters():  # weight gradients of the largest matrices (VGG's 100M-weight
        if p.numel() >= 1 << 20:  # classifier) would cost more than the rest: they stay frozen
            p.requires_grad_(False)
    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()))
    inputs = [spec.inputs(g), spec.inputs(g)]
    if spec.vision:
        inputs = [((args[0].requires_grad_(),), kwargs) for args, kwargs in inputs]
    first = next(iter(inputs[0][0]), None) if inputs[0][0] else next(iter(inputs[0][1].values()))
    COVERED[spec.name] = f"{type(model).__name__} {list(first.shape)}" + (f" ({spec.note})" if spec.note else "")
    if spec.same_as:
        COVERED[spec.name] += f", backward checks on {spec.same_as}"
    return Case(spec, model, inputs)


def set_reference(case: Case, ref: Recorder) -> None:
    case.results["reference"] = ref
    case.leaves_ran = [n for n in ref.order if n and case.is_leaf(n)]
    case.containers_ran = [n for n in ref.order if n and not case.is_leaf(n)]


def reference_run(case: Case) -> Recorder:
    """A forward of the first batch under reference hooks on every module (`test_values`'s, if it ran)."""
    if "reference" not in case.results:
        with torch.no_grad(), Recorder(case.model) as ref:
            case()
        set_reference(case, ref)
    return case.results["reference"]


# ------------------------------------------------------------------------ the checks
def first_forwards(case: Case) -> dict[str, Any]:
    """The model's first two forwards (cached), under two taps and the reference hooks.

    A tap on every module (``keep="last"``) is active for the first forward, a tap with
    ``keep="all"`` on a handful of modules (chosen from the module list, so they may not run) for
    both. No tap changes a value without ``edit`` or gradients, so the hooks' order is immaterial.
    """
    if "first" not in case.results:
        leaves = [n for n in case.modules if n in case.leaves]
        containers = [n for n in case.modules if n and n not in case.leaves]
        few = ["", leaves[0], leaves[len(leaves) // 2], leaves[-1], *containers[len(containers) // 2 :][:1]]
        few = list(dict.fromkeys(few))
        before = hook_state(case.model)
        with torch.no_grad(), layertap.tap(case.model, few, keep="all") as every_call:
            with Recorder(case.model) as ref, layertap.tap(case.model, EVERY) as last:
                case(0)
            with Recorder(case.model, few) as ref2:
                case(1)
        hooks_left = hook_state(case.model) != before
        case.results["first"] = dict(last=last, every_call=every_call, few=few, ref=ref, ref2=ref2, hooks_left=hooks_left)
        if "reference" not in case.results:  # the other checks' reference: a tap changes no value
            set_reference(case, ref)
    return case.results["first"]


@zoo("values")
def test_values(case):
    """A tap on every module equals a clone taken when each module returned, in the same forward."""
    run = first_forwards(case)
    ref, taps = run["ref"], run["last"]
    assert not run["hooks_left"], "a tap left hooks behind"
    ran = [n for n in ref.names if ref.values[n]]
    assert sorted(taps.outputs) == sorted(ran)
    for name in ran:
        assert_same(taps[name], ref.values[name][-1], f"{case.spec.name} {name or '(model)'}")


@zoo("keep_all")
def test_keep_all(case):
    """``keep="all"`` over two forwards: one entry per call, each equal to the clone."""
    run = first_forwards(case)
    taps = run["every_call"]
    for name in run["few"]:
        want = run["ref"].values[name] + run["ref2"].values[name]
        if not want:
            assert name not in taps.outputs
            with pytest.raises(layertap.LayerNotRunError):
                taps[name]
            continue
        got = taps[name]
        assert len(got) == len(want), f"{name}: {len(got)} entries for {len(want)} calls"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{case.spec.name} {name or '(model)'} call {i}")


def gradient_runs(case: Case) -> dict[str, Any]:
    """The same two forwards and loss twice (cached): once tapped, once with reference deltas.

    Tapped: ``capture="grad"`` on every module (``keep="last"``) and ``keep="all"`` on the picked
    layers, then ``loss.backward()``. Reference, no tap: a forward hook on every module adds a zero
    tensor that requires grad (a *delta*) to each floating-point output, and ``autograd.grad(loss,
    deltas)`` gives the gradient with respect to each output (``x + 0`` is ``x``: the forward is
    the same). Only what reads the module's returned value sees its delta, so this is the gradient
    of the module's output edge, `layertap.tap`'s definition: an ``nn.Identity`` whose input is
    read elsewhere too gets its own edge's gradient, not that tensor's total.
    """
    if "grad" not in case.results:
        reference_run(case)
        few = case.picks()
        with torch.enable_grad():
            last = layertap.tap(case.model, EVERY, capture="grad")
            every_call = layertap.tap(case.model, few, capture="grad", keep="all")
            with last, every_call:
                case.loss().backward()
        for t in [*case.model.parameters(), *leaves(case.inputs)]:
            t.grad = None

        deltas: dict[tuple, torch.Tensor] = {}  # (name, call, leaf) -> its delta
        outputs: dict[tuple, Any] = {}  # (name, call) -> the output with deltas
        calls: dict[str, int] = {}

        def add_deltas(name: str):
            def hook(module, args, output):
                call = calls[name] = calls.get(name, -1) + 1
                leaf = iter(range(10**6))

                def add(t: torch.Tensor) -> torch.Tensor:
                    key = (name, call, next(leaf))
                    if not t.is_floating_point():
                        return t
                    delta = deltas[key] = torch.zeros_like(t, requires_grad=True)
                    return t + delta

                new = outputs[name, call] = map_tensors(add, output)
                return new

            return hook

        handles = [m.register_forward_hook(add_deltas(n)) for n, m in case.modules.items()]
        try:
            with torch.enable_grad():
                loss = case.loss()
                keys = list(deltas)
                found = torch.autograd.grad(loss, [deltas[k] for k in keys], allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        by_call: dict[tuple, dict[int, Any]] = {}
        for (n, c, i), g in zip(keys, found):
            by_call.setdefault((n, c), {})[i] = g
        case.results["grad"] = dict(few=few, last=last, every_call=every_call, want=by_call, outputs=outputs, calls=calls)
    return case.results["grad"]


# Two runs of the same values through two graphs (the reference adds zero deltas, the tap may add
# identity nodes): on one thread all ~12,000 gradients of the zoo agree bit for bit, but kernels
# may split work by memory alignment or thread count (two threads: 7e-6 relative differences), so
# they must agree to float32 rounding, relative to the largest element. A wrong gradient (another
# tensor version, another call, a lost or doubled contribution) is off by far more.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5


def assert_grad_close(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    atol = GRAD_ATOL * float(want.abs().max()) if want.numel() else 0.0
    if got.shape == want.shape and (torch.equal(got, want) or bool(((got - want).abs() <= atol + GRAD_RTOL * want.abs()).all())):
        return  # (the fast path of the same rule)
    torch.testing.assert_close(got, want, rtol=GRAD_RTOL, atol=atol, msg=lambda m: f"{where}: {m}")


def expected(run: dict, name: str, call: int) -> dict[int, torch.Tensor | None]:
    """Leaf index -> the reference gradient of that output leaf of ``name``'s call ``call``."""
    return run["want"].get((name, call), {})


def check_grads(where: str, got: Any, output: Any, want: dict[int, torch.Tensor | None]) -> None:
    """The tap's gradient ``got`` for a call whose output was ``output``: leaf i equals ``want[i]``."""
    if all(g is None for g in want.values()):
        assert got is None, f"{where}: no backward reached it, yet the tap has a gradient"
        return
    assert got is not None, f"{where}: the tap has no gradient"
    slots = _slots(got, output)
    for i, g in want.items():
        if g is None:
            assert slots[i] is None, f"{where} leaf {i}: no backward reached it, yet the tap has a gradient"
        else:
            assert isinstance(slots[i], torch.Tensor), f"{where} leaf {i}: the tap has no gradient"
            assert_grad_close(slots[i], g, f"{where} leaf {i}")


@zoo("grad")
def test_grad(case):
    """``capture="grad"`` on every module equals ``autograd.grad`` with respect to its output."""
    backward_checks(case)
    run = gradient_runs(case)
    taps = run["last"]
    present = set(taps.grads)
    for name, call in run["calls"].items():  # keep="last": the last call of the second forward
        want = expected(run, name, call)
        where = f"{case.spec.name} {name or '(model)'} grad"
        if all(g is None for g in want.values()):
            assert name not in present, f"{where}: no backward reached it, yet the tap has a gradient"
            continue
        assert name in present, f"{where}: the tap has no gradient"
        check_grads(where, taps.grads[name], run["outputs"][name, call], want)


@zoo("grad_keep_all")
def test_grad_keep_all(case):
    """``keep="all"`` gradients over two forwards: one entry per call, each that call's own."""
    backward_checks(case)
    run = gradient_runs(case)
    taps = run["every_call"]
    for name in run["few"]:
        calls = range(run["calls"][name] + 1)
        if all(g is None for c in calls for g in expected(run, name, c).values()):
            assert name not in taps.grads
            continue
        got = taps.grads[name]
        assert len(got) == len(calls), f"{name}: {len(got)} gradient entries for {len(calls)} calls"
        for call in calls:
            where = f"{case.spec.name} {name or '(model)'} call {call} grad"
            check_grads(where, got[call], run["outputs"][name, call], expected(run, name, call))


def _slots(grads: Any, output: Any) -> list[Any]:
    """The tap's gradient structure flattened alongside the output's tensor leaves (None kept)."""
    found: list[Any] = []

    def walk(g: Any, o: Any) -> None:
        if isinstance(o, torch.Tensor):
            found.append(g)
        elif isinstance(o, Mapping):
            for k in o:
                walk(None if g is None else g.get(k), o[k])  # (ModelOutput leaves out None fields)
        elif isinstance(o, (tuple, list)):
            for i, v in enumerate(o):
                walk(None if g is None else g[i], v)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(None if g is None else getattr(g, f.name), getattr(o, f.name))

    walk(grads, output)
    return found


@zoo("summary")
def test_summary(case):
    """One row per module: the ones that ran in first-call order with their calls, then the rest."""
    on_family_model(case, "the summary checks")
    ref = reference_run(case)
    args, kwargs = case.inputs[0]
    table = layertap.summary(case.model, *args, **kwargs)
    assert len(table) == len(case.modules)
    ran = [row.name for row in table if row.calls]
    assert ran == ref.order
    assert {row.name: row.calls for row in table if row.calls} == ref.calls
    leaf_rows = [row.name for row in table if row.calls and case.is_leaf(row.name)]
    assert leaf_rows == case.leaves_ran and len(leaf_rows) > 0
    for name in case.picks():
        want = ref.values[name][-1]
        if isinstance(want, torch.Tensor):
            assert table[name].output == want.shape, name


@zoo("stop_early")
def test_stop_early(case):
    """``stop_early=True`` ends the forward at a leaf a quarter in; its value equals the clone."""
    reference_run(case)
    early, last = case.early(), case.leaves_ran[-1]
    if early == last:
        pytest.skip("one leaf only")
    with torch.no_grad(), Recorder(case.model, [early, last]) as ref:
        with layertap.tap(case.model, early, stop_early=True) as taps:
            case()
    assert ref.calls.get(last, 0) == 0, f"the forward went on to the last leaf {last!r}"
    assert_same(taps[early], ref.values[early][0], f"{case.spec.name} {early}")


@zoo("gradcam")
def test_gradcam(case):
    """``GradCAM(model)`` picks a layer of the model that the gradient reaches (no warning of a
    blank map) and gives maps in [0, 1] of the input's size."""
    if not case.spec.vision:
        pytest.skip("token inputs: Grad-CAM explains images")
    backward_checks(case)
    x = case.inputs[0][0][0][:1].detach()  # one image: the probe for the layer is one anyway
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", layertap.cam.ZeroGradientWarning)
        cam = layertap.cam.GradCAM(case.model)
        heat = cam(x)
    assert cam.layers and len(cam.layers) == 1 and cam.layers[0] in case.modules
    zero = [str(w.message) for w in caught if issubclass(w.category, layertap.cam.ZeroGradientWarning)]
    assert not zero, f"the default layer {cam.layers[0]!r} gets no gradient: {zero[0]}"
    assert heat.shape == (x.shape[0], *x.shape[2:])
    assert torch.isfinite(heat).all() and heat.min() >= 0 and heat.max() <= 1
    COVERED[case.spec.name] += f", Grad-CAM at {cam.layers[0]}"


def test_zoo_covers_every_torchvision_classifier():
    """Every classifier torchvision lists is in the zoo; prints what the module covered."""
    import torchvision

    listed = {f"tv-{n}" for n in torchvision.models.list_models(module=torchvision.models)}
    assert listed <= set(SPECS)
    print(f"\nzoo: {len(COVERED)} models ({len(listed)} torchvision)")
    for name, what in COVERED.items():
        print(f"  {name}: {what}")
