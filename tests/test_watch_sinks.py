"""The watch's file sinks: a resumed run continues its log, a failing sink never stops training,
and no sink writes through a symbolic link.

The reference for a continued log is the log of the same training run without a break: the
same model, data and steps, so the same bytes. Sinks are written inside ``optimizer.step()``
(``watch(optimizer=...)``), where the cases raised.
"""

from __future__ import annotations

import copy
import csv
import warnings

import pytest
import torch
from test_atomic_write import FullDisk, file_size_limit
from torch import nn

from layertap.errors import LayertapError
from layertap.watch import CSV, Parquet, WatchWarning, watch


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def train(model: nn.Module, opt: torch.optim.Optimizer, sinks: list, steps: range, **options) -> list[int]:
    """Train on ``steps`` (each its own seeded batch) under a watch sampling every 2nd step;
    return the steps that ran to the end."""
    done = []
    with watch(model, every=2, sinks=sinks, alerts=False, optimizer=opt, start=steps.start, **options):
        for step in steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()  # the watch's step, and its sinks' writes, happen in here
            done.append(step)
    return done


def whole_run(path, steps: int = 10) -> bytes:
    model, opt = fresh()
    train(model, opt, [path], range(steps))
    return path.read_bytes()


def test_start_continues_the_csv_log(tmp_path):
    """The case: ``watch(start=100)`` on the same CSV truncated the rows of steps 0-90."""
    reference = whole_run(tmp_path / "whole.csv")
    log = tmp_path / "w.csv"
    model, opt = fresh()
    train(model, opt, [log], range(0, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is replaced, so nothing to say
        train(model, opt, [log], range(6, 10))
    assert log.read_bytes() == reference
    assert [int(r["step"]) for r in csv.DictReader(log.open())][::6] == [0, 2, 4, 6, 8]


def test_a_run_resumed_from_an_earlier_checkpoint_replaces_the_steps_it_runs_again(tmp_path):
    reference = whole_run(tmp_path / "whole.csv")
    log = tmp_path / "w.csv"
    model, opt = fresh()
    train(model, opt, [log], range(0, 6))
    checkpoint = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, [log], range(6, 10))  # then the run died, and is resumed from step 6
    model.load_state_dict(checkpoint[0])
    opt.load_state_dict(checkpoint[1])
    with pytest.warns(WatchWarning, match=r"w\.csv held rows of steps 6-8, at or after this run's first step 6: they are replaced"):
        train(model, opt, [log], range(6, 10))
    assert log.read_bytes() == reference


def test_start_continues_the_parquet_log(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    model, opt = fresh()
    train(model, opt, [tmp_path / "whole.parquet"], range(10))
    log = tmp_path / "w.parquet"
    model, opt = fresh()
    train(model, opt, [log], range(0, 6))
    train(model, opt, [log], range(6, 10))
    assert pq.read_table(log).to_pylist() == pq.read_table(tmp_path / "whole.parquet").to_pylist()


def test_a_file_that_is_not_a_watch_log_is_never_overwritten(tmp_path):
    other = tmp_path / "results.csv"
    other.write_text("epoch,accuracy\n1,0.93\n")
    model, opt = fresh()
    with pytest.warns(WatchWarning, match=r"results\.csv is not a layertap watch log .*: choose another path"):
        assert train(model, opt, [other], range(4)) == [0, 1, 2, 3]
    assert other.read_text() == "epoch,accuracy\n1,0.93\n"


@pytest.mark.parametrize("sink", [CSV, Parquet])
def test_a_bad_path_is_refused_in_one_line_before_training(tmp_path, sink):
    """The case: a folder as the path raised a raw IsADirectoryError from inside optimizer.step()."""
    if sink is Parquet:
        pytest.importorskip("pyarrow")
    folder = tmp_path / "logs"
    folder.mkdir()
    model, _ = fresh()
    with pytest.raises(LayertapError, match=rf"^cannot write the watch log {folder}: it is a folder; name a file$"):
        watch(model, sinks=[sink(folder)])
    (tmp_path / "file").write_text("")
    with pytest.raises(LayertapError, match=r"file is not a folder$"):
        watch(model, sinks=[tmp_path / "file" / "w.csv"])


def test_a_symlink_is_refused_and_what_it_points_to_kept(tmp_path):
    """The case: a CSV path that was a symbolic link was followed, and its target overwritten."""
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me")
    link = tmp_path / "w.csv"
    link.symlink_to(victim)
    model, opt = fresh()
    with pytest.raises(LayertapError, match=r"w\.csv: it is a symbolic link, and layertap writes no file through a link; give the real path$"):
        watch(model, sinks=[link])
    parquet = tmp_path / "w.parquet"
    parquet.symlink_to(victim)
    with pytest.raises(LayertapError, match=r"w\.parquet: it is a symbolic link"):
        watch(model, sinks=[parquet])
    # a link put there after the watch began: its first write refuses it, and training goes on
    link.unlink()
    sink = CSV(link)
    link.symlink_to(victim)
    with pytest.warns(WatchWarning, match=r"w\.csv: it is a symbolic link") as caught:
        assert train(model, opt, [sink], range(4)) == [0, 1, 2, 3]
    assert len(caught) == 1 and victim.read_text() == "keep me"


def test_a_full_disk_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    """The case: a full disk raised a raw OSError from inside optimizer.step(). The log keeps
    the steps that fitted, whole; the sink stops, the other sinks go on."""
    reference = whole_run(tmp_path / "whole.csv", steps=4)  # steps 0 and 2
    folder = tmp_path / "logs"
    folder.mkdir()
    log = folder / "w.csv"
    rows = []
    model, opt = fresh()
    FullDisk(monkeypatch, folder, room=len(reference) * 3 // 4)  # the header and step 0 fit, step 2 half
    with pytest.warns(WatchWarning) as caught:
        done = train(model, opt, [log, lambda step, records: rows.append(step)], range(8))
    assert done == list(range(8)) and rows == [0, 2, 4, 6]
    messages = [str(w.message) for w in caught]
    assert messages == [f"cannot write the watch log {log}: the disk is full; the watch writes nothing more to it, and training goes on"]
    written = log.read_bytes()
    assert reference.startswith(written) and written.count(b"\n") == 1 + 6  # the header and step 0's rows, no cut row


def test_a_kernel_size_limit_on_the_log_warns_and_training_goes_on(tmp_path):
    """The same through the kernel: the log may not grow past its size after step 0."""
    reference = whole_run(tmp_path / "whole.csv", steps=4)
    log = tmp_path / "w.csv"
    model, opt = fresh()
    train(model, opt, [log], range(2))
    with file_size_limit(log.stat().st_size + 100), pytest.warns(WatchWarning, match=r"w\.csv: the file would pass") as caught:
        assert train(model, opt, [log], range(2, 6)) == [2, 3, 4, 5]
    assert len(caught) == 1 and reference.startswith(log.read_bytes()) and log.read_bytes().count(b"\n") == 7


def test_a_full_disk_keeps_the_old_parquet_log(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    folder = tmp_path / "logs"
    folder.mkdir()
    log = folder / "w.parquet"
    model, opt = fresh()
    train(model, opt, [log], range(4))
    before = log.read_bytes()
    FullDisk(monkeypatch, folder, room=len(before) // 2)
    with pytest.warns(WatchWarning, match=rf"^cannot write the watch log {log}: the disk is full; the watch writes nothing more"):
        assert train(model, opt, [log], range(4, 40)) == list(range(4, 40))
    assert log.read_bytes() == before and sorted(p.name for p in folder.iterdir()) == ["w.parquet"]


def test_a_failing_sink_of_any_kind_is_named_and_dropped(tmp_path):
    calls = []

    def flaky(step, records):
        calls.append(step)
        raise RuntimeError("the server went away")

    kept = []
    model, opt = fresh()
    with pytest.warns(WatchWarning, match=r"^the watch sink .*flaky failed: RuntimeError: the server went away; the watch writes nothing more") as caught:
        assert train(model, opt, [flaky, lambda step, records: kept.append(step)], range(6)) == list(range(6))
    assert len(caught) == 1 and calls == [0] and kept == [0, 2, 4]
