"""`layertap.watch`: statistics of sampled training steps, against independent references.

References are made without layertap: outputs cloned in plain forward hooks, gradients from
``torch.autograd.grad`` with respect to those outputs, statistics in numpy float64. The watch
uses `layertap.tensorstats.tensor_stats`, which sums float32 rows in float32, so moments are compared
at a relative 1e-6 of the values' scale; counts, min, max, zeros and dead channels exactly.
"""

from __future__ import annotations

import ast
import copy
import csv
import json
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import layertap
from conftest import hook_state
from layertap.select import leaf_layers
from layertap.watch import (
    COLUMNS,
    CSV,
    STATS,
    Alert,
    Alerts,
    Parquet,
    Record,
    TensorBoard,
    WandB,
    Watch,
    WatchWarning,
    watch,
)


class Twice(nn.Module):
    """A ReLU called twice per forward: rows "act#0" and "act#1"."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(6, 4, 3)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.flat(self.act(self.conv2(self.act(self.conv1(x))))))


def references(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[tuple[str, str], np.ndarray]:
    """``{(row name, "output" | "grad"): float64 values}`` of one step, without layertap."""
    outputs: list[tuple[str, torch.Tensor]] = []
    calls: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if name and next(module.children(), None) is None:

            def hook(m, args, out, name=name):
                outputs.append((f"{name}#{calls.get(name, 0)}", out))
                calls[name] = calls.get(name, 0) + 1

            handles.append(module.register_forward_hook(hook))
    loss = nn.functional.cross_entropy(model(x), y)
    for h in handles:
        h.remove()
    grads = torch.autograd.grad(loss, [o for _, o in outputs])
    repeated = {n.rsplit("#", 1)[0] for n, _ in outputs if not n.endswith("#0")}
    refs = {}
    for (name, out), grad in zip(outputs, grads):
        layer = name.rsplit("#", 1)[0]
        row = name if layer in repeated else layer
        refs[row, "output"] = out.detach().double().numpy()
        refs[row, "grad"] = grad.double().numpy()
    return refs


def check(record: Record, values: np.ndarray) -> None:
    s = record.stats
    scale = max(np.abs(values).max(), 1e-30)
    assert s.count == values.size
    assert abs(s.mean - values.mean()) <= 1e-6 * scale, (record.name, record.kind)
    assert abs(s.std - values.std()) <= 1e-6 * scale, (record.name, record.kind)
    assert (s.min, s.max) == (values.min(), values.max())
    assert s.zero_fraction == (values == 0).mean()
    assert s.nan_fraction == s.inf_fraction == 0
    channels = np.moveaxis(values, 1, -1).reshape(-1, values.shape[1])
    assert s.dead_channels == tuple(np.flatnonzero((channels == 0).all(axis=0)))


def keep_first(kept: dict, name: str):
    """A forward hook that keeps a copy of the first output (and returns None: the output flows on)."""

    def hook(module, args, out) -> None:
        kept.setdefault(name, out.detach().clone())

    return hook


def data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def train(model: nn.Module, w: Watch, steps: int, opt: torch.optim.Optimizer | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(steps):
        x, y = data(seed=i)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        w.step()


# ---------------------------------------------------------------------------- numbers
def test_a_sampled_step_matches_plain_hooks_and_autograd():
    model = Twice()
    x, y = data()
    refs = references(copy.deepcopy(model), x, y)
    rows: list[Record] = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, every=2, sinks=[lambda step, records: rows.extend(records)]) as w:
        for i in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x if i == 0 else data(seed=i)[0]), y).backward()
            opt.step()
            w.step()
    assert sorted({r.step for r in rows}) == [0, 2]
    first = [r for r in rows if r.step == 0]
    # forward order, output then gradient; the ReLU's two calls are rows of their own
    assert [(r.name, r.kind) for r in first][:6] == [
        ("conv1", "output"), ("conv1", "grad"), ("act#0", "output"), ("act#0", "grad"), ("act#1", "output"), ("act#1", "grad"),
    ]  # fmt: skip
    assert {(r.name, r.kind) for r in first} == set(refs)
    for r in first:
        check(r, refs[r.name, r.kind])
    assert first[0].stats.module_type == "Conv2d" and (first[2].stats.layer, first[2].stats.call) == ("act", 0)


def test_outputs_are_summarised_before_an_in_place_op_changes_them():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(144, 3))
    x, y = data()
    kept = {}
    reference = copy.deepcopy(model)
    for i, m in enumerate(reference):
        m.register_forward_hook(keep_first(kept, str(i)))
    reference(x)
    kept = {k: v.double().numpy() for k, v in kept.items()}
    with watch(model, every=1) as w:
        nn.functional.cross_entropy(model(x), y).backward()
    outputs = {r.name: r for r in w.last if r.kind == "output"}
    assert outputs["1"].stats.min < 0  # the BatchNorm's output, before the ReLU made it >= 0
    for name, values in kept.items():
        check(outputs[name], values)


def test_gradient_accumulation_merges_the_micro_batches_of_a_step():
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    xs = [torch.randn(6, 5), torch.randn(10, 5)]
    with watch(model, every=1) as w:
        for x in xs:
            model(x).sum().backward()
    outputs = {r.name: r.stats for r in w.last if r.kind == "output"}
    values = torch.cat([model[1](model[0](x)) for x in xs]).detach().double().numpy()
    assert outputs["1"].count == values.size
    assert abs(outputs["1"].std - values.std()) < 1e-7


def test_cpu_bfloat16_autocast_gives_finite_sensible_statistics():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 36, 3))
    x, y = data()
    kept = {}
    for i, m in enumerate(model):
        m.register_forward_hook(keep_first(kept, str(i)))
    with watch(model, every=1) as w, torch.autocast("cpu", dtype=torch.bfloat16):
        nn.functional.cross_entropy(model(x), y).backward()
    assert kept["0"].dtype == torch.bfloat16  # the conv ran in bfloat16
    rows = {(r.name, r.kind): r for r in w.last}
    assert len(rows) == 8
    for (name, kind), r in rows.items():
        s = r.stats
        assert all(math.isfinite(v) for v in (s.mean, s.std, s.min, s.max)) and s.std > 0, (name, kind)
        if kind == "output":  # the bfloat16 values, summarised in float64 merges
            check(r, kept[name].double().numpy())


# ---------------------------------------------------------------------------- hooks
def test_no_hook_exists_between_sampled_steps():
    model = Twice()
    before = hook_state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    with watch(model, every=3, optimizer=opt) as w:
        for i in range(7):
            x, y = data(seed=i)
            state = hook_state(model)
            if w.global_step % 3:
                assert state == before, f"hooks at unsampled step {w.global_step}"
            else:  # one forward pre-hook on the model itself, which starts the tap
                assert [k for k, v in state.items() if v != before[k]] == [("", "_forward_pre_hooks")]
                assert len(state["", "_forward_pre_hooks"]) == 1
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()  # optimizer=: its post-step hook counts the step
            seen.append(w.global_step)
    assert seen == [1, 2, 3, 4, 5, 6, 7]
    assert hook_state(model) == before
    assert not opt._optimizer_step_post_hooks  # the optimizer's hook is gone too


def test_an_evaluation_inside_a_sampled_step_is_not_counted():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    before = hook_state(model)
    with watch(model, every=1) as w:
        model(torch.randn(5, 4)).sum().backward()
        with torch.no_grad():
            model(torch.randn(50, 4))  # no TapError for gradients under no_grad, and not counted
        with w.paused():
            model(torch.randn(70, 4)).sum()
        model(torch.randn(7, 4)).sum().backward()
    assert {r.stats.count for r in w.last if r.name == "0"} == {(5 + 7) * 3}
    assert hook_state(model) == before


def test_pytorch_facts_the_lazy_start_relies_on():
    model = nn.Sequential(nn.Linear(2, 2))
    seen = []
    # hooks a pre-hook of the model adds on a child run in that very forward
    start = model.register_forward_pre_hook(lambda m, a: model[0].register_forward_hook(lambda *_: seen.append("child")) and None)
    model(torch.randn(1, 2))
    assert seen == ["child"]
    start.remove()
    # a with_kwargs pre-hook removed by an earlier pre-hook in the same call is still called,
    # without its kwargs: so the watch's pre-hook goes after the tap's
    late = None

    def early(m, a):
        late.remove()

    model.register_forward_pre_hook(early)
    late = model.register_forward_pre_hook(lambda m, a, kwargs: None, with_kwargs=True)
    with pytest.raises(TypeError, match="kwargs"):
        model(torch.randn(1, 2))


# ---------------------------------------------------------------------------- sinks
def test_tensorboard_event_files_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    rows: list[Record] = []
    sinks = [TensorBoard(tmp_path / "tb"), lambda step, records: rows.extend(records)]
    with watch(model, every=2, sinks=sinks, histogram_bins=16, alerts=False) as w:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            w.step()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {f"{kind}.{stat}/{name}" for kind in ("output", "grad") for stat in STATS for name in "012"}
    for r in rows:
        for stat in ("mean", "std", "max", "zero_fraction"):
            (at_step,) = [e for e in events.Scalars(f"{r.kind}.{stat}/{r.name}") if e.step == r.step]
            assert at_step.value == pytest.approx(r.value(stat), rel=1e-6, abs=1e-30)
    assert [e.step for e in events.Scalars("output.std/1")] == [0, 2]
    assert {"output/1", "grad/1"} <= set(events.Tags()["histograms"])
    (hist,) = [h for h in events.Histograms("output/1") if h.step == 2]
    assert hist.histogram_value.num == 8 * 3


def test_csv_has_one_row_per_step_layer_and_kind(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    rows: list[Record] = []
    with watch(model, every=2, sinks=[CSV(tmp_path / "w.csv"), lambda step, records: rows.extend(records)], alerts=False) as w:
        train_regression(model, w, 5)
    with open(tmp_path / "w.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS)
    assert [(int(t["step"]), t["name"], t["kind"]) for t in table] == [(r.step, r.name, r.kind) for r in rows]
    assert len(table) == 3 * 3 * 2  # steps 0, 2, 4 x 3 layers x output and gradient
    for t, r in zip(table, rows):
        assert float(t["std"]) == r.stats.std and int(t["count"]) == r.stats.count and t["type"] == r.stats.module_type


def test_parquet_holds_the_csv_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    with watch(model, every=2, sinks=[Parquet(tmp_path / "w.parquet"), tmp_path / "w.csv"], alerts=False) as w:
        train_regression(model, w, 3)
    table = pq.read_table(tmp_path / "w.parquet").to_pylist()
    with open(tmp_path / "w.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(table) == len(rows) == 12
    assert [(t["step"], t["name"], t["kind"], t["mean"]) for t in table] == [
        (int(r["step"]), r["name"], r["kind"], float(r["mean"])) for r in rows
    ]


def test_wandb_logs_against_its_own_step_axis(tmp_path, monkeypatch):
    pytest.importorskip("wandb")

    class Run:  # what WandB calls on a run, recorded
        def __init__(self) -> None:
            self.metrics, self.logged = [], []

        def define_metric(self, name, step_metric=None):
            self.metrics.append((name, step_metric))

        def log(self, data):
            self.logged.append(data)

    run = Run()
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    with watch(model, every=2, sinks=[WandB(run, stats=("std",))], histogram_bins=8, alerts=False) as w:
        train_regression(model, w, 3)
    assert run.metrics == [("layertap/step", None), ("layertap/*", "layertap/step")]
    assert [d["layertap/step"] for d in run.logged] == [0, 2]
    assert run.logged[1]["layertap/grad.std/2"] == next(r.stats.std for r in w.last if (r.name, r.kind) == ("2", "grad"))
    assert type(run.logged[0]["layertap/output/1"]).__name__ == "Histogram"


def test_wandb_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="layertap-test", mode="offline", dir=str(tmp_path))
    try:
        model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
        with watch(model, every=1, sinks=[WandB()], alerts=False) as w:
            train_regression(model, w, 2)
        assert run.summary["layertap/step"] == 1
        assert run.summary["layertap/output.std/0"] == pytest.approx(next(r.stats.std for r in w.last if r.name == "0"))
    finally:
        run.finish()


def train_regression(model: nn.Module, w: Watch, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        w.step()


# ---------------------------------------------------------------------------- alerts
class Sqrt(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sqrt()


def test_a_nan_in_the_forward_is_named_with_its_layer_and_step():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.warns(WatchWarning, match=r"step 4, forward: layer '0' \(Linear\) is the first whose output holds non-finite") as caught:
        with watch(model, every=2) as w:
            for step in range(6):
                if step == 3:
                    with torch.no_grad():
                        model[0].weight[0, 0] = math.nan
                model(torch.randn(8, 4)).sum().backward()
                w.step()
    (alert,) = [a for a in w.alerts if a.kind == "nonfinite"]
    assert (alert.step, alert.phase, alert.layer, alert.layers) == (4, "forward", "0", ("0", "1", "2"))
    assert len([c for c in caught if "non-finite" in str(c.message)]) == 1  # once, not at every later step


def test_a_nan_in_the_backward_is_named_in_backward_order():
    # sqrt's gradient at 0 is infinite: the ReLU's output gradient is the first non-finite one
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Sqrt(), nn.Linear(8, 1))
    alerts: list[Alert] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # on_alert replaces the warning
        with watch(model, every=1, on_alert=alerts.append):
            model(torch.randn(16, 4)).sum().backward()
    (alert,) = alerts
    assert (alert.kind, alert.phase, alert.layer, alert.module_type, alert.step) == ("nonfinite", "backward", "1", "ReLU", 0)
    assert "output gradient holds non-finite" in alert.message


def test_explosion_and_dead_units_alert_once_per_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.Linear(64, 1))
    alerts: list[Alert] = []
    x = torch.randn(8, 3, 8, 8)
    with watch(model, every=1, on_alert=alerts.append, alerts=Alerts(explode_threshold=None)) as w:
        for step in range(5):
            with torch.no_grad():
                if step == 2:
                    model[2].weight.mul_(1000)  # layer 2's output: std x1000
                if step == 3:
                    model[0].bias.fill_(-1e3)  # the ReLU after it: every channel dead
            model(x).sum().backward()
            w.step()
    explode = [a for a in alerts if a.kind == "explode" and a.phase == "forward"]
    assert [(a.step, a.layer, a.module_type) for a in explode] == [(2, "2", "Conv2d")]
    assert explode[0].layers == ("2", "3", "4")  # and what follows it
    assert "std" in explode[0].message and "x its first sampled value" in explode[0].message
    dead = [a for a in alerts if a.kind == "dead"]
    assert [(a.step, a.layer) for a in dead] == [(3, "1")]
    assert "4 of 4 channels of layer '1' (ReLU) are dead" in dead[0].message
    # the absolute threshold alone
    with watch(model, every=1, on_alert=alerts.append, alerts=Alerts(explode_factor=None, explode_threshold=1.0)) as w:
        model(torch.randn(8, 3, 8, 8) * 10).sum().backward()
    assert "largest magnitude" in alerts[-1].message


# ---------------------------------------------------------------------------- arguments, imports
def test_arguments_are_checked():
    model = nn.Linear(2, 2)
    with pytest.raises(layertap.ArgumentError, match="every=0"):
        watch(model, every=0)
    with pytest.raises(layertap.ArgumentError, match=r"\.csv or \.parquet"):
        watch(model, sinks=["out.txt"])
    with pytest.raises(layertap.LayertapError, match="outside the watch"):
        watch(model).step()
    assert watch(model).names == leaf_layers(model) == [""]  # a model without children watches itself


def test_no_trainer_library_is_imported_with_layertap():
    # an optional library is imported inside the function that needs it, never at import time
    package = Path(layertap.__file__).parent
    trees = [ast.parse(f.read_text()) for f in [package / "watch.py", *sorted((package / "_watch").glob("*.py"))]]
    top = [n for tree in trees for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name.split(".")[0] for n in top for a in n.names} | {(n.module or "").split(".")[0] for n in top if isinstance(n, ast.ImportFrom)}
    assert not names & {"lightning", "pytorch_lightning", "transformers", "tensorboard", "wandb", "pyarrow"}


def test_a_missing_library_names_what_to_install(monkeypatch):
    module = sys.modules["layertap.watch"]  # `layertap.watch` may be the function
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers", "pyarrow"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(layertap.MissingExtraError, match="pip install lightning"):
        module._lightning_class.__wrapped__()
    with pytest.raises(layertap.MissingExtraError, match="pip install 'layertap\\[hf\\]'"):
        module._hf_class.__wrapped__()
    with pytest.raises(layertap.MissingExtraError, match="pyarrow"):
        Parquet("x.parquet")


# ---------------------------------------------------------------------------- trainers
def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from layertap.watch import LightningWatch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()  # not self(...): the module's own forward never runs

        def validation_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 4)), batch_size=4)
    rows: list[Record] = []
    callback = LightningWatch(every=2, sinks=[lambda step, records: rows.extend(records)])
    trainer = pl.Trainer(
        max_steps=6, accumulate_grad_batches=2, val_check_interval=3, limit_val_batches=2, callbacks=[callback],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, default_root_dir=str(tmp_path), num_sanity_val_steps=1,
    )  # fmt: skip
    trainer.fit(Module(), loader, loader)
    assert sorted({r.step for r in rows}) == [0, 2, 4]
    # two micro-batches of 4 per optimizer step; validation batches are not counted
    assert {r.stats.count for r in rows if r.name == "net.0" and r.kind == "output"} == {2 * 4 * 6}
    assert hook_state(trainer.lightning_module) == hook_state(Module())


def test_hugging_face_callback(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from layertap.watch import HFWatch

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 1))

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": (out.squeeze(-1) - labels).pow(2).mean(), "logits": out}

    dataset = [{"x": torch.randn(4), "labels": torch.tensor(1.0)} for _ in range(40)]
    rows: list[Record] = []
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, disable_tqdm=True,
        eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4,
    )  # fmt: skip
    model = Model()
    callback = HFWatch(every=2, sinks=[lambda step, records: rows.extend(records)])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:8], callbacks=[callback])
    trainer.train()
    assert sorted({r.step for r in rows}) == [0, 2, 4]
    assert {r.stats.count for r in rows if r.name == "net.0" and r.kind == "output"} == {2 * 4 * 6}
    assert hook_state(model) == hook_state(Model())


# ---------------------------------------------------------------------------- two Gloo ranks
def _ddp_model() -> nn.Module:
    torch.manual_seed(6)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _rank(rank: int, world: int, out: str) -> None:
    torch.set_num_threads(1)
    # a file store: no port to pick, and so none that another process can take meanwhile
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    try:
        model = nn.parallel.DistributedDataParallel(_ddp_model())
        kept = []
        model.module[1].register_forward_hook(lambda m, a, o: kept.append(o.detach().clone()))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def sink(step, records):
            Path(f"{out}/sink{rank}.json").write_text(json.dumps([r.row() for r in records]))

        with watch(model, every=1, sinks=[sink]) as w:
            torch.manual_seed(rank)
            x, y = torch.randn(3 + 2 * rank, 3, 8, 8), torch.randint(0, 3, (3 + 2 * rank,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            w.step()
        np.save(f"{out}/kept{rank}.npy", kept[0].double().numpy())
        Path(f"{out}/last{rank}.json").write_text(json.dumps([r.row() for r in w.last if r.step == 0]))
        # DDP's reducer goes before its process group, with both ranks done: else a Gloo thread
        # can outlive it and abort the process at exit
        del model, opt
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_log_merged_statistics_on_rank_0(tmp_path):
    mp.spawn(_rank, args=(2, str(tmp_path)), nprocs=2)  # spawn, not fork (see test_stats)
    assert not (tmp_path / "sink1.json").exists()  # rank 0 writes for the job
    logged = json.loads((tmp_path / "sink0.json").read_text())
    assert logged == json.loads((tmp_path / "last1.json").read_text())  # every rank has the merged numbers
    values = np.concatenate([np.load(tmp_path / f"kept{r}.npy") for r in range(2)])
    (relu,) = [row for row in logged if row["name"] == "1" and row["kind"] == "output"]
    assert relu["count"] == values.size == (3 + 5) * 4 * 6 * 6
    assert abs(relu["mean"] - values.mean()) <= 1e-6 * values.max() and abs(relu["std"] - values.std()) <= 1e-6 * values.max()
    assert (relu["min"], relu["max"]) == (values.min(), values.max())
