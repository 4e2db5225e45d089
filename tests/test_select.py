"""Layer selection: every spec kind, the unknown-name error, wrapper prefixes."""

import importlib
import re

import pytest
import torch
import torchvision
from torch import nn

import layertap
from layertap import ArgumentError, LayerNotFoundError
from layertap.select import OpName, Selection, leaf_layers, named_layers, selection, split_op


@pytest.fixture(scope="module")
def resnet():
    return torchvision.models.resnet18()


def test_exact_names_in_named_modules_order(resnet):
    names = layertap.select(resnet, ["layer4.1.conv2", "layer1.0.conv1"])
    assert names == ["layer1.0.conv1", "layer4.1.conv2"]  # model order, not the order given


def test_glob_star_stays_in_one_segment(resnet):
    assert layertap.select(resnet, "layer*") == ["layer1", "layer2", "layer3", "layer4"]
    got = layertap.select(resnet, "layer*.0.conv?")
    want = [n for n, _ in resnet.named_modules() if re.fullmatch(r"layer\d\.0\.conv\d", n)]
    assert got == want and len(got) == 8


def test_glob_double_star_spans_segments(resnet):
    got = layertap.select(resnet, "**.bn1")
    want = [n for n, _ in resnet.named_modules() if n == "bn1" or n.endswith(".bn1")]
    assert got == want
    assert "bn1" in got  # '**.' also matches no leading segment
    everything = layertap.select(resnet, "**")
    assert everything == [n for n, _ in resnet.named_modules() if n]


def test_regex_compiled_and_prefixed(resnet):
    a = layertap.select(resnet, re.compile(r"layer[23]\.\d\.downsample\.0"))
    b = layertap.select(resnet, r"re:layer[23]\.\d\.downsample\.0")
    assert a == b == ["layer2.0.downsample.0", "layer3.0.downsample.0"]


def test_class_spec_selects_every_instance(resnet):
    got = layertap.select(resnet, nn.BatchNorm2d)
    want = [n for n, m in resnet.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert got == want and len(got) == 20


def test_predicate_spec(resnet):
    got = layertap.select(resnet, lambda name, m: isinstance(m, nn.Conv2d) and m.stride == (2, 2))
    want = [n for n, m in resnet.named_modules() if isinstance(m, nn.Conv2d) and m.stride == (2, 2)]
    assert got == want and got


def test_mixed_specs_are_deduplicated(resnet):
    got = layertap.select(resnet, ["layer1.0.bn1", nn.BatchNorm2d, "**.bn1"])
    assert len(got) == len(set(got)) == 20


def test_root_only_by_exact_empty_name(resnet):
    assert layertap.select(resnet, "") == [""]
    assert "" not in layertap.select(resnet, "**")


def test_unknown_name_lists_closest_names(resnet):
    with pytest.raises(LayerNotFoundError) as err:
        layertap.select(resnet, "layer4.1.conv3")
    msg = str(err.value)
    assert "'layer4.1.conv3' matches no layer" in msg
    assert "layer4.1.conv2" in msg and "layer4.1.conv1" in msg
    assert isinstance(err.value, KeyError)  # code catching KeyError keeps working


def test_unknown_last_segment_suggests_same_leaf(resnet):
    with pytest.raises(LayerNotFoundError, match=r"Closest names: bn1, layer4\.1\.bn1"):
        layertap.select(resnet, "stem.bn1")


def test_unmatched_class_and_pattern(resnet):
    with pytest.raises(LayerNotFoundError, match="class LSTM.*Conv2d"):
        layertap.select(resnet, nn.LSTM)
    with pytest.raises(LayerNotFoundError, match="'layer9\\*'"):
        layertap.select(resnet, ["layer1", "layer9*"])  # one bad spec fails the whole call


def test_bad_spec_types(resnet):
    with pytest.raises(TypeError, match="nn.Module subclass"):
        layertap.select(resnet, int)
    with pytest.raises(TypeError, match="cannot select layers"):
        layertap.select(resnet, [3.5])
    with pytest.raises(ValueError, match="no layers given"):
        layertap.select(resnet, [])


def test_dataparallel_prefix_resolves(resnet):
    dp = nn.DataParallel(resnet)  # on CPU it just wraps: names gain 'module.'
    assert layertap.select(dp, "layer4.1.conv2") == ["layer4.1.conv2"]
    assert layertap.select(dp, "module.layer4.1.conv2") == ["layer4.1.conv2"]
    assert layertap.select(dp, "layer*") == ["layer1", "layer2", "layer3", "layer4"]


def test_compile_prefix_resolves_and_shared_module_keeps_first_name():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = self.a  # the same module at two paths

        def forward(self, x):
            return self.b(self.a(x))

    model = Shared()
    compiled = torch.compile(model)
    assert layertap.select(compiled, "_orig_mod.a") == ["a"]
    assert layertap.select(compiled, "a") == ["a"]
    with pytest.raises(LayerNotFoundError):  # named_modules() reports a shared module once
        layertap.select(model, "b")


class EMA(nn.Module):
    """An EMA / weight-norm style wrapper: it holds the model as ``self.module``, as DDP does."""

    def __init__(self, model):
        super().__init__()
        self.module = model
        self._orig_mod = nn.Linear(2, 2)  # not torch.compile's: an ordinary child of that name

    def forward(self, x):
        return self.module(x)


def test_children_named_module_and_orig_mod_are_ordinary_layers():
    model = EMA(nn.Sequential(nn.Linear(2, 3), nn.ReLU()))
    reference = [n for n, _ in model.named_modules() if n]  # no wrapper here: the names as they are
    assert layertap.select(model, "**") == reference
    assert "module" in reference and "module.0" in reference and "_orig_mod" in reference
    assert layertap.select(model, "module") == ["module"]
    assert layertap.select(model, "module.*") == ["module.0", "module.1"]
    assert layertap.select(model, "_orig_mod") == ["_orig_mod"]
    assert named_layers(model)["module.0"] is model.module[0]


def test_only_a_real_wrappers_segment_is_dropped():
    inner = EMA(nn.Sequential(nn.Linear(2, 3)))
    dp = nn.DataParallel(inner)  # names gain one 'module.': 'module.module.0'
    raw = [n for n, _ in dp.named_modules()]
    assert "module.module.0" in raw
    assert layertap.select(dp, "**") == [n.removeprefix("module.") for n in raw if n.count(".") >= 1]
    for name in ("module.0", "module.module.0"):  # without and with the wrapper's prefix
        assert layertap.select(dp, name) == ["module.0"]
    assert layertap.select(dp, "module") == ["module"]  # EMA's child, not the wrapped model
    assert layertap.select(dp, "module.module") == ["module"]
    compiled = torch.compile(inner)
    assert layertap.select(compiled, "_orig_mod.module.0") == layertap.select(compiled, "module.0") == ["module.0"]
    assert layertap.select(compiled, "_orig_mod") == ["_orig_mod"]  # EMA's own child of that name
    assert named_layers(compiled)[""] is inner


SPECS = [
    ["layer4.1.conv2", "layer1.0.conv1"],
    "**.bn1",
    nn.BatchNorm2d,
    ["layer1.*:add_", "layer2.0.conv1", ("layer2.0", "relu#2"), "layer3.0:*"],
    ":flatten",
]


@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_a_selection_is_select_resolved_once(resnet, spec):
    chosen = selection(resnet, spec)
    assert isinstance(chosen, Selection) and chosen.model is resnet
    assert list(chosen.names) == list(chosen) == layertap.select(resnet, spec) and len(chosen) == len(chosen.names)
    modules = dict(resnet.named_modules())
    for name in chosen.names:  # every op is parsed once, "module:*" included; every name has its module
        op = chosen.ops.get(name)
        assert op == split_op(name)
        owner = name if op is None else op.module
        assert chosen.modules[owner] is modules[owner]
    owners = {chosen.ops[n].module if n in chosen.ops else n for n in chosen.names}
    assert set(chosen.modules) == owners
    assert chosen.star == {op.module for op in chosen.ops.values() if op.op == "*"}


def test_a_selection_parses_op_sites_and_marks_every_op_of_a_module():
    model = torchvision.models.resnet18()
    chosen = selection(model, ["layer1.0:relu#2", "layer3.0:*"])
    assert dict(chosen.ops) == {"layer1.0:relu#2": OpName("layer1.0", "relu", 2), "layer3.0:*": OpName("layer3.0", "*", None)}
    assert chosen.star == {"layer3.0"} and chosen.modules["layer3.0"] is model.layer3[0]


def test_a_selection_is_immutable_and_of_one_model(resnet):
    chosen = selection(resnet, "layer1")
    with pytest.raises(AttributeError, match="immutable"):
        chosen.names = ("layer2",)
    with pytest.raises(TypeError):
        chosen.modules["layer2"] = resnet.layer2
    assert selection(resnet, chosen) is chosen
    other = torchvision.models.resnet18()
    with pytest.raises(ArgumentError, match="another model") as info:
        layertap.tap(other, chosen)
    assert "\n" not in str(info.value)
    with pytest.raises(ArgumentError, match="another model"):
        selection(other, chosen)


def test_tap_takes_a_selection_and_neither_selects_nor_walks_the_model_again(monkeypatch):
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    spec = ["layer1.0.conv1", "layer2.*.bn2", "layer1.1:add_", "layer3.0:*"]
    chosen = selection(model, spec)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), layertap.tap(model, spec) as by_spec:
        model(x)
    walks = []
    named_modules = nn.Module.named_modules

    def counted(self, *args, **kwargs):
        if self is model:
            walks.append(args)
        return named_modules(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "named_modules", counted)
    monkeypatch.setattr(importlib.import_module("layertap.select"), "_resolve", lambda *a: pytest.fail("selected again"))
    with torch.no_grad(), layertap.tap(model, chosen) as by_selection:
        model(x)
    assert walks == []
    assert by_selection.names == by_spec.names and by_selection.order == by_spec.order
    assert all(torch.equal(by_selection[n], by_spec[n]) for n in by_spec.names)


def test_leaf_layers_are_the_modules_without_children():
    model = torchvision.models.resnet18()
    assert leaf_layers(model) == [n for n, m in model.named_modules() if n and not list(m.children())]
    assert leaf_layers(nn.Linear(2, 2)) == [""]


@pytest.mark.parametrize("change", ["swapped", "replaced"])
def test_a_stale_selection_is_refused_naming_the_module(change):
    # a Selection holds modules: tapping it after the model's module changed would hook a module
    # that no longer runs there (swapped: another position's values under this name, silently)
    model = torchvision.models.resnet18().eval()
    chosen = selection(model, ["layer1.0.bn2", "layer1.0:add_"])
    x = torch.randn(1, 3, 32, 32)
    if change == "swapped":
        model.layer1[0].bn2, model.layer1[1].bn2 = model.layer1[1].bn2, model.layer1[0].bn2
    else:
        model.layer1[0].bn2 = nn.BatchNorm2d(64)
    with pytest.raises(ArgumentError, match=r"stale: module 'layer1\.0\.bn2' .* select again"):
        with layertap.tap(model, chosen):
            model(x)
    with pytest.raises(ArgumentError, match="stale"):
        layertap.extract(model, x, chosen)
    fresh = selection(model, ["layer1.0.bn2"])  # selecting again taps the module that runs now
    reference = {}
    handle = model.layer1[0].bn2.register_forward_hook(lambda m, a, out: reference.update(out=out.clone()))
    with torch.no_grad(), layertap.tap(model, fresh) as t:
        model(x)
    handle.remove()
    assert torch.equal(t["layer1.0.bn2"], reference["out"])


@pytest.mark.parametrize("layers", [42, 3.5, None])
def test_a_spec_of_no_known_kind_is_one_line_naming_the_kinds(layers):
    with pytest.raises(ArgumentError, match=r"^layers must be a name, glob, regex, module class, predicate.*not \w+") as info:
        layertap.tap(nn.Linear(2, 2), layers)
    assert "\n" not in str(info.value)


def test_a_second_path_of_a_shared_module_names_its_first():
    """A module registered twice keeps its first name (named_modules()); its second path is named
    for what it is, not "matches nothing"."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = self.a

    with pytest.raises(LayerNotFoundError, match="^'b' is a second path of layer 'a': .* select 'a'$"):
        layertap.tap(Shared(), "b")
    with pytest.raises(LayerNotFoundError, match="^'c' matches no layer of the model"):
        layertap.tap(Shared(), "c")
