"""layertap.summary: rows in execution order, shapes, calls, parameters, bytes, failures, rendering."""

import json
import xml.etree.ElementTree as ET

import pytest
import torch
import torchvision
from models import Reordered
from test_tap import EMA  # an EMA-style wrapper whose child is named `module`
from torch import nn

import layertap
from conftest import hook_state
from layertap import nested
from layertap.summary import LayerTable, summary


@pytest.fixture(scope="module")
def resnet50_table():
    model = torchvision.models.resnet50()
    return model, summary(model, torch.randn(1, 3, 224, 224))


@pytest.fixture(scope="module")
def resnet18():
    return torchvision.models.resnet18()


def reference_calls(model, *inputs):
    """Independent reference: plain hooks on every module, recording start order, calls, output shapes."""
    names = {m: n for n, m in model.named_modules()}
    order, calls, outputs = [], {}, {}

    def pre(m, args):
        if names[m] not in calls:
            order.append(names[m])
        calls[names[m]] = calls.get(names[m], 0) + 1

    def post(m, args, out):
        outputs[names[m]] = nested.shapes(out)

    handles = [h for m in names for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    with torch.no_grad():
        model.eval()(*inputs)
    for h in handles:
        h.remove()
    return order, calls, outputs


def test_resnet50_stages_have_the_documented_shapes(resnet50_table):
    model, table = resnet50_table
    documented = {  # torchvision ResNet-50 at 224x224 (He et al. 2015, table 1)
        "conv1": [1, 64, 112, 112],
        "maxpool": [1, 64, 56, 56],
        "layer1": [1, 256, 56, 56],
        "layer2": [1, 512, 28, 28],
        "layer3": [1, 1024, 14, 14],
        "layer4": [1, 2048, 7, 7],
        "fc": [1, 1000],
    }
    assert {name: list(table[name].output) for name in documented} == documented
    stages = [row.name for row in table if row.depth == 1 and row.name.startswith("layer")]
    assert stages == ["layer1", "layer2", "layer3", "layer4"]
    assert [len(model.get_submodule(s)) for s in stages] == [3, 4, 6, 3]
    assert table["layer4"].input == torch.Size([1, 1024, 14, 14])
    assert table["layer4"].dtype == "float32"


def test_resnet50_parameters_match_torchvision(resnet50_table):
    model, table = resnet50_table
    documented = torchvision.models.ResNet50_Weights.IMAGENET1K_V2.meta["num_params"]
    assert table.params == table[""].params_total == documented
    assert table["conv1"].params == table["conv1"].params_total == 64 * 3 * 7 * 7
    assert table["fc"].params == 2048 * 1000 + 1000
    assert table["layer4"].params == 0  # a container owns none itself
    assert table["layer4"].params_total == sum(p.numel() for p in model.layer4.parameters())
    assert table.trainable == documented


def test_rows_match_plain_hooks_order_calls_and_shapes(resnet18):
    x = torch.randn(2, 3, 64, 64)
    order, calls, outputs = reference_calls(resnet18, x)
    table = summary(resnet18, x)
    assert table.names == order  # every module, in the order the forward started them
    assert {row.name: row.calls for row in table} == calls
    assert table["layer1.0.relu"].calls == 2  # BasicBlock calls its one ReLU twice
    assert {row.name: row.to_dict()["output"] for row in table} == outputs


def test_execution_order_repeated_and_unused_modules():
    table = summary(Reordered(), torch.randn(2, 4))
    assert table.names == ["", "act", "body", "head", "unused"]
    assert [row.calls for row in table] == [1, 2, 1, 1, 0]
    assert table["act"].input == table["act"].output == torch.Size([2, 8])  # its last call
    unused = table["unused"]
    assert (unused.input, unused.output, unused.bytes) == (None, None, 0)
    assert "-" in str(table).splitlines()[5]


def test_tuple_returning_module_shows_every_shape():
    lstm = nn.Sequential(nn.Embedding(50, 6), nn.LSTM(6, 8, batch_first=True))
    tokens = torch.randint(0, 50, (2, 5))
    table = summary(lstm, tokens)
    row = table["1"]
    assert row.output == (torch.Size([2, 5, 8]), (torch.Size([1, 2, 8]), torch.Size([1, 2, 8])))
    assert "([2, 5, 8], ([1, 2, 8], [1, 2, 8]))" in str(table)
    assert row.to_dict()["output"] == [[2, 5, 8], [[1, 2, 8], [1, 2, 8]]]
    assert table["0"].input == torch.Size([2, 5]) and table["0"].dtype == "float32"
    assert table[""].input == torch.Size([2, 5])
    assert row.bytes == 4 * (2 * 5 * 8 + 2 * 2 * 8)


class KwargsAndDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x, scale=None):
        return self.inner(x, mask=x > 0, scale=scale)


class Inner(nn.Module):
    def forward(self, x, mask, scale=None):
        return {"out": x * mask, "count": mask.sum(1), "note": "text"}


def test_keyword_inputs_and_dict_outputs_by_structure():
    table = summary(KwargsAndDict(), torch.randn(3, 4), scale=None)
    row = table["inner"]
    assert row.input == {"args": (torch.Size([3, 4]),), "kwargs": {"mask": torch.Size([3, 4])}}
    assert row.output == {"out": torch.Size([3, 4]), "count": torch.Size([3])}  # non-tensors left out
    assert row.dtype == "float32, int64"
    assert row.bytes == 3 * 4 * 4 + 3 * 8


def test_bytes_per_sample_equal_what_tap_captures(resnet18):
    x = torch.randn(2, 3, 64, 64)
    table = summary(resnet18, x)
    with torch.no_grad(), layertap.tap(resnet18, table.names) as taps:
        resnet18(x)
    real = {
        name: sum(t.numel() * t.element_size() for t in nested.tensors(taps[name])) for name in taps.names
    }
    assert {row.name: row.bytes for row in table} == real
    assert {row.name: row.bytes_per_sample for row in table} == {n: b / 2 for n, b in real.items()}


def test_layers_selection_is_a_dry_run_of_extract(resnet18):
    x = torch.randn(2, 3, 64, 64)
    table = summary(resnet18, x, layers=["layer*", nn.Linear])
    assert (
        table.names
        == layertap.select(resnet18, ["layer*", nn.Linear])
        == ["layer1", "layer2", "layer3", "layer4", "fc"]
    )
    feats = layertap.extract(resnet18, x, ["layer*", nn.Linear])
    assert table.bytes_per_sample == sum(f.numel() * f.element_size() for f in feats.values()) / 2


def test_low_precision_dtype_and_bytes():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    table = summary(model, x)
    assert {row.dtype for row in table} == {"bfloat16"}
    assert table["0"].bytes_per_sample == 32 * 2


def test_depth_limits_rows(resnet18):
    x = torch.randn(1, 3, 32, 32)
    assert summary(resnet18, x, depth=0).names == [""]
    top = summary(resnet18, x, depth=1).names
    assert top == ["", *(n for n, _ in resnet18.named_children())]
    with pytest.raises(ValueError, match="depth"):
        summary(resnet18, x, depth=-1)


def test_wrong_input_shape_names_the_failing_layer(resnet18):
    before = hook_state(resnet18)
    with pytest.raises(layertap.LayerForwardError) as info:
        summary(resnet18, torch.randn(1, 1, 64, 64))
    err = info.value
    assert err.layer == "conv1" and err.module_type == "Conv2d"
    assert "[[1, 1, 64, 64]]" in str(err)
    assert isinstance(err.__cause__, RuntimeError) and "channels" in str(err.__cause__)
    assert hook_state(resnet18) == before  # the tap's hooks are gone


def test_deep_failure_names_the_inner_layer():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Sequential(nn.ReLU(), nn.Linear(10, 2)))
    with pytest.raises(layertap.LayerForwardError, match=r"layer '2\.1' \(Linear\).*\[\[2, 144\]\]"):
        summary(model, torch.randn(2, 3, 8, 8))


def test_forward_runs_in_eval_mode_and_restores_flags():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    model[2].eval()  # mixed flags come back as they were
    stats = model[1].running_mean.clone()
    summary(model, torch.randn(2, 3, 8, 8))
    assert [m.training for m in model.modules()] == [True, True, True, False]
    assert torch.equal(model[1].running_mean, stats)


def test_default_example_input_comes_from_model_info():
    class Declares(nn.Module):
        input_size = (3, 24, 20)

        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 2, 3)

        def forward(self, x):
            return self.conv(x)

    table = summary(Declares())
    assert table[""].input == torch.Size([1, 3, 24, 20]) and table.batch_size == 1
    assert table["conv"].output == torch.Size([1, 2, 22, 18])


def test_model_without_submodules():
    table = summary(nn.Linear(3, 2), torch.randn(5, 3))
    assert table.names == [""] and table[""].params == 8 and table.batch_size == 5


def test_text_table_is_aligned_and_complete(resnet18):
    table = summary(resnet18, torch.randn(1, 3, 32, 32), depth=1)
    lines = str(table).splitlines()
    header = lines[0]
    assert header.split()[:4] == ["Layer", "Type", "Input", "Output"]
    rows = lines[1 : 1 + len(table)]
    for line, row in zip(rows, table):
        assert line[header.index("Type") :].startswith(row.type)
        assert line.split()[0] == (row.name or "(model)")
    assert "[1, 512, 1, 1]" in rows[table.names.index("layer4")]
    assert lines[len(table) + 2].startswith("ResNet: 11,689,512 parameters")
    assert repr(table) == str(table)


def test_html_json_and_dicts(resnet18):
    table = summary(resnet18, torch.randn(1, 3, 32, 32), depth=1)
    root = ET.fromstring(table._repr_html_())
    cells = [[c.text for c in tr] for tr in root.iter("tr")]
    assert cells[0][0] == "Layer" and len(cells) == len(table) + 1
    assert cells[1 + table.names.index("fc")][3] == "[1, 1000]"
    data = json.loads(table.to_json())
    assert data["layers"] == table.to_dicts()
    assert data["params"] == 11689512 and data["batch_size"] == 1
    fc = table.to_dicts()[table.names.index("fc")]
    assert fc["output"] == [1, 1000] and fc["calls"] == 1 and fc["bytes"] == 4000


def test_layer_table_lookup():
    table = summary(Reordered(), torch.randn(1, 4))
    assert isinstance(table, LayerTable) and len(table) == 5
    assert table[1] is table["act"] and table[-1].name == "unused"
    with pytest.raises(KeyError, match="no layer 'nope'"):
        table["nope"]


def test_a_child_named_module_keeps_its_rows():
    model = EMA(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    order, calls, outputs = reference_calls(model, x)
    table = summary(model, x)
    assert table.names == order == ["", "module", "module.0", "module.1", "module.2"]
    assert {row.name: row.calls for row in table} == calls
    assert {row.name: row.to_dict()["output"] for row in table} == outputs
    dp = summary(nn.DataParallel(model), x)  # only the real wrapper's segment is dropped
    assert dp.names == order


def packed_reader():
    from torch.nn.utils.rnn import pack_sequence

    class Reader(nn.Module):
        def __init__(self, features=3):
            super().__init__()
            self.lstm = nn.LSTM(features, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, seq):
            _, (h, _) = self.lstm(seq)
            return self.head(h[-1])

    seqs = [torch.randn(5, 3), torch.randn(2, 3), torch.randn(4, 3)]
    return Reader, pack_sequence(seqs, enforce_sorted=False)


def test_packed_sequence_through_an_lstm():
    Reader, seq = packed_reader()
    model = Reader()
    seen = {}
    model.lstm.register_forward_hook(lambda m, a, out: seen.update(out=out))
    table = summary(model, seq)
    packed, (h, c) = seen["out"]  # reference: a plain hook on the same forward
    row = table["lstm"]
    assert row.calls == 1 and row.type == "LSTM"
    assert row.output[0][0] == packed.data.shape and row.output[1] == (h.shape, c.shape)
    assert row.input[0] == seq.data.shape and row.input[1] == seq.batch_sizes.shape
    assert table.batch_size == 3 and table["head"].output == torch.Size([3, 2])  # 3 sequences
    assert row.bytes == 4 * (packed.data.numel() + h.numel() + c.numel())  # the data, not the indices


def test_a_failure_with_a_packed_input_names_the_layer():
    Reader, seq = packed_reader()
    with pytest.raises(layertap.LayerForwardError, match=r"layer 'lstm' \(LSTM\).*\[11, 3\]") as info:
        summary(Reader(features=5), seq)  # the LSTM expects 5 features, gets 3
    assert isinstance(info.value.__cause__, RuntimeError)


# ---------------------------------------------------------------------------- ops=True
def plain_hook_values(model, x, names, kind="output"):
    """Independent reference: a clone of each named module's output (or first input) as it returns."""
    seen = {}

    def keep(name):
        def hook(module, args, out):
            seen[name] = (out if kind == "output" else args[0]).clone()

        return hook

    handles = [model.get_submodule(name).register_forward_hook(keep(name)) for name in names]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


@pytest.fixture(scope="module")
def one_thread():
    # small inputs gain nothing from a second thread, which waits on the first at every op
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def resnet_references(model, x):
    plain = plain_hook_values(model, x, ["layer1.0.bn2", "fc"], "output")
    [fc_input] = plain_hook_values(model, x, ["fc"], "input").values()
    with torch.no_grad():  # layer1.0's residual sum, by hand from its children
        h = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        block = model.layer1[0]
        add = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(h))))) + h
    return {"layer1.0:add_": add, "layer1.0.bn2:batch_norm": plain["layer1.0.bn2"], ":flatten": fc_input, "fc:linear": plain["fc"]}


def densenet_references(model, x):
    names = ["features.pool0", "features.denseblock1", "features"]
    plain = plain_hook_values(model, x, names)
    [classifier_input] = plain_hook_values(model, x, ["classifier"], "input").values()
    return {
        "features.denseblock1.denselayer1:cat": plain["features.pool0"],  # the cat of its one input
        "features.denseblock1:cat": plain["features.denseblock1"],  # the block returns its cat
        ":relu": torch.relu(plain["features"]),  # F.relu(features, inplace=True) in DenseNet.forward
        ":flatten": classifier_input,
    }


@pytest.mark.parametrize(
    ("build", "size", "references"),
    [(torchvision.models.resnet18, 64, resnet_references), (torchvision.models.densenet121, 32, densenet_references)],
    ids=["resnet18", "densenet121"],
)
def test_ops_rows_are_names_the_tap_takes_with_their_values(one_thread, build, size, references):
    torch.manual_seed(0)
    model = build().eval()
    x = torch.randn(2, 3, size, size)
    table = summary(model, x, ops=True)
    ops = [row for row in table if row.type == "op"]
    assert len(ops) > len(table) // 3 and all(row.params_total == 0 for row in ops)
    for row in ops:  # after its module's row, one level deeper
        module = row.name.rpartition(":")[0]
        assert table.names.index(module) < table.names.index(row.name) and row.depth == table[module].depth + 1
    # every name is one the tap takes, and it gives what the row describes, call for call
    with torch.no_grad(), layertap.tap(model, table.names, keep="all") as taps:
        model(x)
    for row in table:
        values = taps.outputs[row.name]
        assert len(values) == row.calls and list(values[-1].shape) == list(row.output), row.name
        assert row.bytes == values[-1].numel() * values[-1].element_size()
    expected = references(model, x)
    assert set(expected) <= set(table.names)
    for name, reference in expected.items():
        assert torch.equal(taps.outputs[name][-1], reference), name


class Twice(nn.Module):
    """One op called twice per forward, one once."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(torch.relu(x)) + 1)


def test_ops_called_several_times_get_a_name_per_call():
    model, x = Twice(), torch.randn(3, 4)
    table = summary(model, x, ops=True)
    assert table.names == ["", ":relu#1", "fc", "fc:linear", ":add", ":relu#2"]
    with torch.no_grad(), layertap.tap(model, [":relu#1", ":add", ":relu#2"]) as taps:
        model(x)
    h = model.fc(torch.relu(x)).detach()
    assert torch.equal(taps[":relu#1"], torch.relu(x)) and torch.equal(taps[":add"], h + 1)
    assert torch.equal(taps[":relu#2"], torch.relu(h + 1))


def test_ops_of_the_modules_listed_and_depth(resnet18):
    x = torch.randn(1, 3, 32, 32)
    assert summary(resnet18, x, layers=["layer1.0", "fc"], ops=True).names == ["layer1.0", "layer1.0:add_", "fc", "fc:linear"]
    assert summary(resnet18, x, depth=0, ops=True).names == ["", ":flatten"]
    assert [r.name for r in summary(resnet18, x, depth=1, ops=True) if r.type == "op"] == [
        "conv1:conv2d", "bn1:batch_norm", "relu:relu", "maxpool:max_pool2d", "avgpool:adaptive_avg_pool2d", ":flatten", "fc:linear",
    ]  # fmt: skip
