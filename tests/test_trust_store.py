"""A store from someone else is data: crafted metadata, paths leading out, HDF5 links, Zarr codecs,
changed data on resume, full disks, two writers, --limit. Each case ends in a clear one-line
`StoreError` or in a correct result, never in a write outside the store or a wrong complete store."""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import slow_model
import torch
from torch import nn

import layertap
from layertap.errors import DataChangedError, StoreError, StoreLockedError
from layertap.store.lock import StoreLock
from layertap.store.writer import StoreWriter

FORMATS = {"zarr": "s.zarr", "hdf5": "s.h5", "npy": "s"}


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3)).eval()


def data(n: int = 10, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, 2, 2, generator=g), torch.arange(n) % 3)


def extract(out, format, dataset=None, **options):
    options = {"batch_size": 2, "chunk_size": 4, "progress": False, **options}
    return layertap.extract_dataset(tiny(), data() if dataset is None else dataset, ["1", "3"], out, format=format, **options)


def contents(store) -> dict:
    return {
        "keys": list(store),
        **{k: store.to_numpy(k) for k in store},
        "ids": store.ids,
        "labels": store.labels,
        "failed": store.failed,
    }


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype):
                return False
            if not np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                return False
        elif x != y:
            return False
    return True


def one_line(e: BaseException) -> bool:
    return "\n" not in str(e) and "Traceback" not in str(e)


# ---------------------------------------------------------------- reading and writing metadata
def read_meta(path: Path, format: str) -> dict:
    if format == "zarr":
        import zarr

        return zarr.open_group(str(path), mode="r").attrs.asdict()["layertap"]
    if format == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            return json.loads(f.attrs["layertap"])
    return json.loads((path / "layertap.json").read_text())


def write_meta(path: Path, format: str, meta) -> None:
    if format == "zarr":
        import zarr

        zarr.open_group(str(path), mode="r+").attrs.update({"layertap": meta})
    elif format == "hdf5":
        import h5py

        with h5py.File(path, "r+") as f:
            f.attrs["layertap"] = json.dumps(meta)
    else:
        (path / "layertap.json").write_text(json.dumps(meta))


# ------------------------------------------------------------------- 3: paths that leave the store
def test_an_npy_array_path_leading_out_is_refused_and_the_victim_kept(tmp_path):
    out = tmp_path / "store" / "s"
    extract(out, "npy").close()
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.npy").write_bytes(b"precious")
    meta = read_meta(out, "npy")
    meta["arrays"][0]["path"] = "../../victim/data"
    meta["complete"] = False
    write_meta(out, "npy", meta)
    with pytest.raises(StoreError, match=r"arrays\[0\]\.path") as e:
        layertap.open_features(out)
    assert one_line(e.value)
    with pytest.raises(StoreError, match=r"arrays\[0\]\.path"):  # resuming: refused before writing anything
        extract(out, "npy")
    assert (victim / "data.npy").read_bytes() == b"precious"


def test_a_zarr_root_metadata_linked_out_of_the_store_is_refused_before_zarr_reads_it(tmp_path, monkeypatch):
    # the root zarr.json is read by Zarr when the group opens, before the walk for links out
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    elsewhere = tmp_path / "elsewhere.json"
    os.replace(out / "zarr.json", elsewhere)
    (out / "zarr.json").symlink_to(elsewhere)
    import zarr

    opened = []
    real = zarr.open_group
    monkeypatch.setattr(zarr, "open_group", lambda *a, **k: opened.append(a) or real(*a, **k))
    with pytest.raises(StoreError, match=r"its entry 'zarr\.json' leads outside the store \(to .*elsewhere\.json\)") as e:
        layertap.open_features(out)
    assert one_line(e.value) and opened == []


@pytest.mark.parametrize("format", ["npy", "zarr"])
def test_a_symlink_leading_out_of_a_store_is_refused(tmp_path, format):
    out = tmp_path / FORMATS[format]
    extract(out, format).close()
    outside = tmp_path / "outside"
    outside.mkdir()
    if format == "npy":
        target = out / "features" / "1.npy"
        (outside / "1.npy").write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(outside / "1.npy")
    else:
        target = out / "features" / "1" / "c"
        target.rename(outside / "c")
        target.symlink_to(outside / "c", target_is_directory=True)
    before = sorted(p.name for p in outside.rglob("*"))
    with pytest.raises(StoreError, match="leads outside the store") as e:
        layertap.open_features(out)
    assert one_line(e.value)
    with pytest.raises(StoreError, match="leads outside the store"):
        extract(out, format, overwrite=False)
    assert sorted(p.name for p in outside.rglob("*")) == before


def test_npy_markers_through_a_symlink_are_refused(tmp_path):
    out = tmp_path / "s"
    extract(out, "npy").close()
    elsewhere = tmp_path / "elsewhere"
    (out / "_chunks").rename(elsewhere)
    (out / "_chunks").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StoreError, match="_chunks"):
        layertap.open_features(out)


def test_hdf5_external_links_and_external_storage_are_refused(tmp_path):
    import h5py

    secret = tmp_path / "secret.h5"
    with h5py.File(secret, "w") as f:
        f["data"] = np.ones((10, 5), np.float32)
    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    with h5py.File(out, "r+") as f:
        del f["features/1"]
        f["features/1"] = h5py.ExternalLink(str(secret), "data")
    with pytest.raises(StoreError, match="ExternalLink, which leads outside the file") as e:
        layertap.open_features(out)
    assert one_line(e.value)

    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.ones((10, 5), np.float32).tobytes())
    extract(tmp_path / "t.h5", "hdf5").close()
    with h5py.File(tmp_path / "t.h5", "r+") as f:
        del f["features/1"]
        f.create_dataset("features/1", shape=(10, 5), dtype=np.float32, external=[(str(raw), 0, h5py.h5f.UNLIMITED)])
    with pytest.raises(StoreError, match="keeps its data outside the file"):
        layertap.open_features(tmp_path / "t.h5")
    with pytest.raises(StoreError, match="keeps its data outside the file"):
        extract(tmp_path / "t.h5", "hdf5")  # resuming would write into raw.bin
    assert raw.read_bytes() == np.ones((10, 5), np.float32).tobytes()


@pytest.mark.parametrize("filters", [dict(compression="gzip"), dict(compression="lzf", shuffle=True), dict(fletcher32=True)])
def test_hdf5_arrays_stored_through_filters_are_refused_before_a_chunk_is_read(tmp_path, filters):
    """layertap writes HDF5 arrays without filters; a file with them may hide a compression bomb
    (deflate inflates until its stream ends, whatever the chunk's size) or name a plugin."""
    import h5py

    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    with h5py.File(out, "r+") as f:
        values = f["features/1"][:]
        del f["features/1"]
        f.create_dataset("features/1", data=values, chunks=(5, *values.shape[1:]), **filters)
    with pytest.raises(StoreError, match=r"array 'features/1' is stored through HDF5 filters \[.+\], which layertap never writes") as e:
        layertap.open_features(out)
    assert one_line(e.value)
    with pytest.raises(StoreError, match="stored through HDF5 filters"):
        extract(out, "hdf5")  # nor is it resumed


@pytest.mark.parametrize("ids", ["path", "index"])
def test_hdf5_ids_of_object_references_are_refused_in_one_line(tmp_path, ids):
    import h5py

    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    meta = read_meta(out, "hdf5")
    meta["ids"] = ids
    write_meta(out, "hdf5", meta)
    with h5py.File(out, "r+") as f:
        del f["ids"]
        f.create_dataset("ids", shape=(10,), dtype=h5py.ref_dtype)
        f["ids"][0] = f["features/1"].ref
    expected = "its ids are not paths \\(text\\) as its metadata says, but HDF5 object references" if ids == "path" else "its ids are not indices"
    for read in (layertap.open_features, lambda path: extract(path, "hdf5")):  # reading, and resuming
        with pytest.raises(StoreError, match=expected) as e:
            read(out)
        assert one_line(e.value) and "extract again into a new path" in str(e.value)


def test_a_zarr_array_with_a_codec_that_is_not_plain_data_is_refused(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    meta_file = out / "features" / "1" / "zarr.json"
    array = json.loads(meta_file.read_text())
    array["codecs"].append({"name": "numcodecs.pickle", "configuration": {}})
    meta_file.write_text(json.dumps(array))
    with pytest.raises(StoreError, match="Zarr cannot read its array|which layertap does not read") as e:
        layertap.open_features(out)
    assert one_line(e.value)
    array["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "numcodecs.zlib", "configuration": {"level": 1}}]
    meta_file.write_text(json.dumps(array))
    with pytest.raises(StoreError, match="which layertap does not read"):
        layertap.open_features(out)


def test_a_zarr_gzip_bomb_is_refused_before_a_chunk_inflates(tmp_path):
    """gzip frames say nothing checkable about their size: a 9 MB chunk inflated to 2 GiB (8.4 GB of
    memory at the peak) before Zarr found it the wrong size. layertap never writes gzip: refused."""
    import gzip

    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    meta_file = out / "features" / "1" / "zarr.json"
    array = json.loads(meta_file.read_text())
    array["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip", "configuration": {"level": 1}}]
    meta_file.write_text(json.dumps(array))
    for chunk in (out / "features" / "1" / "c").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(gzip.compress(bytes(64 << 20), compresslevel=9))  # 64 MiB of zeros in about 64 KB
    with pytest.raises(StoreError, match=r"array 'features/1' uses codecs \['gzip'\], which layertap does not read") as e:
        layertap.open_features(out)
    assert one_line(e.value)


# ------------------------------------------------------------ 9: fuzzing the metadata, field by field
JUNK = [None, True, 0, -1, 7, 10**20, 1.5, "", "x", "../../etc/passwd", "/etc/passwd", "features/../../x",
        "builtins:breakpoint", "os:abort", "object", "O", "<U3", "float64", [], [1, -2], {}, {"a": 1}]


def paths_of(node, prefix=()):
    """Every (path, value) in a JSON tree."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths_of(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths_of(v, (*prefix, i))


def mutate(meta: dict, rng: random.Random) -> tuple[dict, str]:
    meta = copy.deepcopy(meta)
    where, _ = rng.choice([p for p in paths_of(meta) if p[0]])
    parent = meta
    for k in where[:-1]:
        parent = parent[k]
    key = where[-1]
    action = rng.choice(["delete", "junk", "junk", "type"])
    if action == "delete":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
    elif action == "junk":
        parent[key] = rng.choice(JUNK)
    else:  # the same kind of value, changed
        value = parent[key]
        if isinstance(value, bool):
            parent[key] = not value
        elif isinstance(value, int):
            parent[key] = value + rng.choice([-1, 1, 1000])
        elif isinstance(value, str):
            parent[key] = rng.choice([value + "x", value.upper(), "features/" + value, ""])
        elif isinstance(value, list):
            parent[key] = value[:-1] if value and rng.random() < 0.5 else [*value, value[0] if value else 1]
        else:
            parent[key] = None
    return meta, f"{action} {'.'.join(map(str, where))}"


@pytest.mark.parametrize("format", list(FORMATS))
def test_fuzzed_metadata_is_refused_in_one_line_or_read_correctly(tmp_path, format):
    out = tmp_path / FORMATS[format]
    with extract(out, format) as store:
        original, meta = contents(store), store.meta
    rng = random.Random(f"fuzz-{format}")
    outcomes = {"refused": 0, "same": 0}
    for trial in range(250):
        mutated, what = mutate(meta, rng)
        write_meta(out, format, mutated)
        try:
            with pytest.warns() if False else _quiet():
                with layertap.open_features(out) as store:
                    got = contents(store)
        except StoreError as e:
            assert one_line(e), (what, str(e))
            outcomes["refused"] += 1
            continue
        except Exception as e:
            pytest.fail(f"trial {trial}, {what}: {type(e).__name__}: {e}")
        assert same(got, original), f"trial {trial}, {what}: read wrong data instead of refusing"
        outcomes["same"] += 1
    write_meta(out, format, meta)
    assert outcomes["refused"] > 100 and outcomes["same"] > 10, outcomes  # both outcomes were exercised
    assert sorted(p.name for p in tmp_path.iterdir()) == [FORMATS[format]]  # nothing written beside it


@pytest.mark.parametrize("format", list(FORMATS))
def test_resuming_a_store_with_fuzzed_metadata_refuses_or_finishes_it_right(tmp_path, format):
    whole = extract(tmp_path / f"whole-{FORMATS[format]}", format)
    expected = contents(whole)
    whole.close()
    out = tmp_path / FORMATS[format]
    extract(out, format, limit=None).close()
    meta = read_meta(out, format)
    meta["complete"] = False
    rng = random.Random(f"resume-{format}")
    for trial in range(25):
        mutated, what = mutate(meta, rng)
        write_meta(out, format, mutated)
        try:
            store = extract(out, format)
        except StoreError as e:
            assert one_line(e), (what, str(e))
        else:
            assert store.complete and same(contents(store), expected), f"trial {trial}, {what}"
            store.close()
        write_meta(out, format, meta)


class _quiet:
    """Incomplete stores warn; the fuzzing reads them on purpose."""

    def __enter__(self):
        import warnings

        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self.catch.__exit__(*exc)


# ----------------------------------------------------------------- 4: resume proves the same data
def forget(out: Path, chunk: int) -> None:
    """Unmark ``chunk`` of a Zarr store, as a run killed before writing it would leave it."""
    writer = StoreWriter.open(out)
    writer.meta["complete"] = False
    writer.backend.write_meta(writer.meta)
    writer.backend.root["_chunks"][chunk] = ""
    writer.close()


def test_a_resume_over_changed_tensors_names_the_first_changed_sample(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    forget(out, 2)
    changed = data()
    changed.tensors[0][5] += 1  # sample 5, in chunk 1, which is written
    with pytest.raises(DataChangedError, match="sample 5 is not what") as e:
        extract(out, "zarr", dataset=changed)
    assert one_line(e.value) and "--overwrite" in str(e.value)
    store = extract(out, "zarr")  # the original data still resumes
    assert store.complete


def test_a_resume_over_changed_image_files_is_refused_and_its_cost_is_a_read(tmp_path):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    model = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 4)).eval()
    options = dict(batch_size=2, chunk_size=2, progress=False, num_workers=0, transform=lambda im: torch.from_numpy(np.array(im)).permute(2, 0, 1).float())
    out = tmp_path / "s.zarr"
    layertap.extract_dataset(model, folder, "2", out, **options).close()
    forget(out, 3)  # 3 chunks of 4 written
    # same names, new pixels: a replaced file
    Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(folder / "3.png")
    with pytest.raises(DataChangedError, match="sample '3.png' is not what"):
        layertap.extract_dataset(model, folder, "2", out, **options)
    assert not StoreWriter.open(out).meta["complete"]


def test_a_stream_is_checked_as_it_is_read_again(tmp_path):
    x = data().tensors[0]
    batches = [x[i : i + 2] for i in range(0, 10, 2)]

    def breaking():
        yield from batches[:4]
        raise RuntimeError("the data source broke")

    out = tmp_path / "s.zarr"
    with pytest.raises(RuntimeError, match="broke"):
        layertap.extract_dataset(tiny(), breaking(), "1", out, chunk_size=4, progress=False)
    changed = [b.clone() for b in batches]
    changed[1][0] += 1  # sample 2
    with pytest.raises(DataChangedError, match="sample 2 is not what"):
        layertap.extract_dataset(tiny(), iter(changed), "1", out, chunk_size=4, progress=False)
    store = layertap.extract_dataset(tiny(), iter(batches), "1", out, chunk_size=4, progress=False)
    assert store.complete and store.num_samples == 10


# --------------------------------------------------------------------------- 7: one writer at a time
@pytest.mark.parametrize("format", ["zarr", "hdf5"])
def test_a_second_writer_is_refused_naming_the_first_even_with_overwrite(tmp_path, format):
    array = tmp_path / "x.npy"
    np.save(array, np.random.default_rng(0).standard_normal((60, 3, 32, 32), dtype=np.float32))
    out = tmp_path / FORMATS[format]
    first = subprocess.Popen([sys.executable, slow_model.__file__, str(array), str(out), format], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().startswith("batch")
        for overwrite in (False, True):
            with pytest.raises(StoreLockedError, match=f"process {first.pid} on .* since") as e:
                layertap.extract_dataset(slow_model.Slow(), str(array), ["conv", "pool"], out, format=format, batch_size=4, chunk_size=8, overwrite=overwrite, progress=False)
            assert one_line(e.value)
        assert first.wait(timeout=120) == 0, "the first writer was disturbed"
    finally:
        first.kill()
        first.stdout.close()
    with layertap.open_features(out) as store:
        assert store.complete and store.num_samples == 60
    store = layertap.extract_dataset(slow_model.Slow(), str(array), ["conv", "pool"], out, format=format, batch_size=4, chunk_size=8, progress=False)
    assert store.complete  # the lock went with its holder


def test_a_killed_writers_lock_is_taken_over(tmp_path):
    out = tmp_path / "s.zarr"
    holder = subprocess.Popen([sys.executable, "-c", f"import layertap.store.lock as s, time; s.StoreLock({str(out)!r}, 'zarr').acquire(); print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(StoreLockedError, match=str(holder.pid)):
        StoreLock(out, "zarr").acquire()
    holder.kill()
    holder.wait()
    holder.stdout.close()
    StoreLock(out, "zarr").acquire().release()  # the system dropped the dead process's lock


def test_an_object_store_lease_refuses_a_live_writer_and_takes_over_a_stale_one():
    import fsspec

    url = f"memory://layertap-lock-{os.getpid()}/s.zarr"
    first = StoreLock(url, "zarr").acquire()
    with pytest.raises(StoreLockedError, match=f"process {os.getpid()}"):
        StoreLock(url, "zarr").acquire()
    first.release()
    fs = fsspec.filesystem("memory")
    lease = f"/layertap-lock-{os.getpid()}/s.zarr/.layertap.lock"
    fs.pipe(lease, json.dumps({"host": "elsewhere", "pid": 1, "started": "then", "expires": time.time() - 1}).encode())
    StoreLock(url, "zarr").acquire().release()  # expired
    fs.pipe(lease, json.dumps({"host": StoreLock(url, "zarr").owner["host"], "pid": 2**22 + 17, "started": "then", "expires": time.time() + 600}).encode())
    StoreLock(url, "zarr").acquire().release()  # its process is gone from this host
    fs.pipe(lease, json.dumps({"host": "elsewhere", "pid": 1, "started": "then", "expires": time.time() + 600}).encode())
    with pytest.raises(StoreLockedError, match="process 1 on elsewhere"):
        StoreLock(url, "zarr").acquire()
    fs.rm(f"/layertap-lock-{os.getpid()}", recursive=True)


# ------------------------------------------------------------------------------- 8: --limit
@pytest.mark.parametrize("format", list(FORMATS))
def test_limit_writes_exactly_the_first_rows_in_every_format(tmp_path, format):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(12):
        Image.new("RGB", (4, 4), (i * 20, 0, 0)).save(folder / f"{i:02d}.png")
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 2)).eval()
    to_tensor = lambda im: torch.from_numpy(np.array(im)).permute(2, 0, 1).float()
    store = layertap.extract_dataset(model, folder, "1", tmp_path / FORMATS[format], format=format, limit=5, batch_size=2, num_workers=0, transform=to_tensor, progress=False)
    assert store.complete and store.num_samples == 5
    assert store.ids.tolist() == [f"{i:02d}.png" for i in range(5)]
    assert store.to_numpy("1").shape == (5, 2)


# -------------------------------------------------------------------------- 6: a full disk
class FullDisk(torch.utils.data.Dataset):
    """Samples that fill the disk under the store once sample ``at`` is read: the disk fills in
    the middle of the run, after the size check passed."""

    def __init__(self, base, filler: Path, at: int) -> None:
        self.base, self.filler, self.at = base, filler, at

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        if i == self.at and not self.filler.exists():
            with open(self.filler, "wb", buffering=0) as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * 4096)
        return self.base[i]


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root; test_a_write_error_leaves_the_store_incomplete covers writes failing")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("this machine cannot mount a tmpfs (a container without the capability)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("format", list(FORMATS))
def test_a_disk_that_fills_during_the_run_fails_in_one_line_and_resumes(tmp_path, small_disk, format):
    dataset = data(200)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 512)).eval()  # 2 KB per sample: 400 KB in all
    whole = layertap.extract_dataset(model, dataset, "1", tmp_path / f"whole-{FORMATS[format]}", format=format, batch_size=8, chunk_size=16, progress=False)
    filler = small_disk / "filler"
    out = small_disk / FORMATS[format]
    code = (
        "import sys, torch, layertap; sys.path.insert(0, %r); import test_trust_store as t\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Flatten(), nn.Linear(12, 512)).eval(); model.load_state_dict(torch.load(%r))\n"
        "layertap.extract_dataset(model, t.FullDisk(t.data(200), __import__('pathlib').Path(%r), 100), '1', %r, format=%r, batch_size=8, chunk_size=16, progress=False, num_workers=0)\n"
        "print('wrote', flush=True)\n"
    )
    torch.save(model.state_dict(), tmp_path / "model.pt")
    run = subprocess.run(
        [sys.executable, "-c", code % (str(Path(__file__).parent), str(tmp_path / "model.pt"), str(filler), str(out), format)],
        capture_output=True, text=True, timeout=300,
    )
    if format == "hdf5":  # its space is allocated when the file is made: a disk that fills later cannot stop it
        assert run.returncode == 0 and "wrote" in run.stdout, run.stderr[-2000:]
    else:
        assert run.returncode == 1, (run.returncode, run.stderr[-2000:])  # an exception, no crash
        assert "wrote" not in run.stdout
        last = run.stderr.strip().splitlines()[-1]
        assert "disk is full" in last and "resume" in last, last
        with _quiet():
            with layertap.open_features(out) as partial:
                assert not partial.complete
    filler.unlink()  # space freed
    resumed = layertap.extract_dataset(model, dataset, "1", out, format=format, batch_size=8, chunk_size=16, progress=False)
    assert resumed.complete and same(contents(resumed), contents(whole))


def test_a_write_error_leaves_the_store_incomplete(tmp_path, monkeypatch):
    """Without root: the disk refuses writes from the 3rd chunk on (ENOSPC from pwrite)."""
    out = tmp_path / "s"
    whole = extract(tmp_path / "whole", "npy")
    real, calls = os.pwrite, []

    def failing(fd, data, offset):
        calls.append(1)
        if len(calls) > 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", failing)
    with pytest.raises(StoreError, match="the disk is full; the store stays incomplete") as e:
        extract(out, "npy")
    assert one_line(e.value)
    monkeypatch.setattr(os, "pwrite", real)
    writer = StoreWriter.open(out)
    assert not writer.meta["complete"] and 0 < len(writer.done()) < 3
    writer.close()
    assert same(contents(extract(out, "npy")), contents(whole))


def test_overwrite_replaces_a_store_and_never_anything_else(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    store = extract(out, "zarr", overwrite=True, dataset=data(seed=1))
    assert store.complete and not np.array_equal(store.to_numpy("1"), extract(tmp_path / "o.zarr", "zarr").to_numpy("1"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    with pytest.raises(StoreError, match="is not a layertap feature store"):
        extract(mine, "zarr", overwrite=True)
    assert (mine / "thesis.tex").read_text() == "years of work" and sorted(os.listdir(mine)) == ["thesis.tex"]


# ------------------------------------------------------- found by an outside tester, each a test
@pytest.mark.parametrize("format", ["zarr", "hdf5"])
def test_a_lock_file_that_is_a_symlink_is_never_written_through(tmp_path, format):
    out = tmp_path / FORMATS[format]
    extract(out, format).close()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = out / ".layertap.lock" if format == "zarr" else tmp_path / f".{out.name}.layertap.lock"
    lock.symlink_to(victim)
    with pytest.raises(StoreError, match="lock") as e:
        extract(out, format)
    assert one_line(e.value) and victim.read_text() == "precious"


def test_a_zarr_store_missing_a_chunk_file_is_not_read_as_fill_values(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    shutil.rmtree(out / "features" / "1" / "c" / "1")  # lost in a partial copy
    with pytest.raises(StoreError, match="stored pieces .* of its array 'features/1' are missing"):
        layertap.open_features(out)


def test_a_complete_store_missing_a_marker_is_refused(tmp_path):
    out = tmp_path / "s"
    extract(out, "npy").close()
    (out / "_chunks" / "000000001.json").unlink()
    with pytest.raises(StoreError, match="says it is complete, but 1 of its 3 chunks"):
        layertap.open_features(out)


def test_an_npy_array_in_fortran_order_is_refused(tmp_path):
    out = tmp_path / "s"
    extract(out, "npy").close()
    file = out / "features" / "1.npy"
    np.save(file, np.asfortranarray(np.load(file)))
    with pytest.raises(StoreError, match="Fortran order"):
        layertap.open_features(out)


def test_a_fifo_in_a_store_is_refused_instead_of_hanging(tmp_path):
    out = tmp_path / "s"
    extract(out, "npy").close()
    os.mkfifo(out / "_chunks" / "000000099.json")
    with pytest.raises(StoreError, match="neither a file nor a folder"):
        layertap.open_features(out)


def test_a_zarr_marker_array_of_a_million_slots_is_refused_at_once(tmp_path):
    import zarr

    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    zarr.open_group(str(out), mode="r+")["_chunks"].resize((10**6,))
    started = time.perf_counter()
    with pytest.raises(StoreError, match="1000000 chunk markers for 3 chunks"):
        layertap.open_features(out)
    assert time.perf_counter() - started < 10  # refused from the shape, not after reading it


@pytest.mark.parametrize(
    "marker",
    ['{"failed": [[Infinity, 0, "x"]], "process": 0, "digests": null}', '{"failed": [[true, 0, "x"]], "process": 0}', "\udcff", "[" * 100000],
)
def test_junk_markers_are_refused_in_one_line(tmp_path, marker):
    out = tmp_path / "s"
    extract(out, "npy").close()
    (out / "_chunks" / "000000000.json").write_bytes(marker.encode(errors="surrogateescape"))
    with pytest.raises(StoreError, match="marker") as e:
        layertap.open_features(out)
    assert one_line(e.value)


def test_a_marker_without_digests_cannot_skip_the_content_check(tmp_path):
    out = tmp_path / "s"
    extract(out, "npy").close()
    meta = read_meta(out, "npy")
    meta["complete"] = False
    write_meta(out, "npy", meta)
    (out / "_chunks" / "000000002.json").unlink()
    marker = out / "_chunks" / "000000000.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "digests": None}))
    with pytest.raises(StoreError, match="chunk 0 has no digests"):
        extract(out, "npy", dataset=data(seed=5))  # other data: it must not slip through chunk 0


def _unallocated(f, name: str, shape: tuple, dtype, chunks=None) -> None:
    """Replace ``name`` in the open HDF5 file ``f`` by an array of ``shape`` that was never written:
    HDF5 allocates it late, when first written, so the file holds none of its bytes."""
    import h5py

    del f[name]
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_LATE)
    if chunks is not None:
        dcpl.set_chunk(chunks)
    f.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)


@pytest.mark.parametrize("layout", ["contiguous", "chunked"])
@pytest.mark.parametrize("width", [5, 10**9], ids=["its width", "1e9 wide"])
def test_an_hdf5_array_without_storage_for_its_rows_is_refused_whatever_its_layout(tmp_path, layout, width):
    import h5py

    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    with h5py.File(out, "r+") as f:  # never written: it would read fill values (zeros) as features
        _unallocated(f, "features/1", (10, width), np.float32, chunks=(4, min(width, 1024)) if layout == "chunked" else None)
    meta = read_meta(out, "hdf5")
    meta["arrays"][0]["shape"] = [width]
    write_meta(out, "hdf5", meta)
    assert out.stat().st_size < 100_000  # declaring 10 x 1e9 floats (40 GB) in a small file
    for read in (layertap.open_features, lambda path: extract(path, "hdf5")):  # reading, and resuming
        with pytest.raises(StoreError, match="array 'features/1' has no storage for all its rows") as e:
            read(out)
        assert one_line(e.value)


def test_hdf5_chunk_markers_without_storage_or_wider_than_written_are_refused_before_they_are_read(tmp_path):
    import h5py

    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    with h5py.File(out, "r+") as f:  # 3 markers of 1 GB each, in a file of a few KB
        _unallocated(f, "_chunks", (3, 10**9), np.uint8)
    with pytest.raises(StoreError, match="array '_chunks' has no storage for all its rows") as e:
        layertap.open_features(out)
    assert one_line(e.value)
    with h5py.File(out, "r+") as f:  # stored, but far wider than a writer makes markers for chunks of 4
        del f["_chunks"]
        f.create_dataset("_chunks", data=np.zeros((3, 100_000), np.uint8))
    with pytest.raises(StoreError, match="its chunk markers are 100000 bytes each, more than the 4192 its writer makes"):
        layertap.open_features(out)


def _deep(text: str) -> str:
    """JSON metadata with a field nested deeper than Python's recursion limit."""
    return text.rstrip()[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}"


def _craft_deep_npy(out: Path) -> None:
    (out / "layertap.json").write_text(_deep((out / "layertap.json").read_text()))


def _craft_deep_hdf5(out: Path) -> None:
    import h5py

    with h5py.File(out, "r+") as f:
        f.attrs["layertap"] = _deep(f.attrs["layertap"])


def _craft_numeric_markers(out: Path) -> None:
    import h5py

    with h5py.File(out, "r+") as f:  # a 1-D marker array, not text, and no flags
        del f["_chunks"], f["_done"]
        f.create_dataset("_chunks", data=np.zeros(3, dtype=np.uint8))


def _craft_done_group(out: Path) -> None:
    import h5py

    with h5py.File(out, "r+") as f:
        del f["_done"]
        f.create_group("_done")


def _craft_versions(out: Path) -> None:
    meta = read_meta(out, "npy")
    meta["versions"] = ["torch", "2.0"]
    write_meta(out, "npy", meta)


@pytest.mark.parametrize(
    "format, craft, message",
    [
        ("npy", _craft_deep_npy, "its layertap.json is not JSON that can be read .*recursion"),
        ("hdf5", _craft_deep_hdf5, "its metadata is not JSON that can be read .*recursion"),
        ("hdf5", _craft_numeric_markers, "its chunk markers are missing \\(it has no array '_done'\\)"),
        ("hdf5", _craft_done_group, "'_done' is a group, not an array"),
        ("npy", _craft_versions, "its metadata field 'versions' is not an object of version strings"),
    ],
    ids=["npy deep JSON", "hdf5 deep JSON", "hdf5 numeric markers without flags", "hdf5 flags as a group", "versions a list"],
)
def test_crafted_metadata_and_markers_are_a_store_error_not_a_raw_exception(tmp_path, format, craft, message):
    out = tmp_path / FORMATS[format]
    extract(out, format).close()
    craft(out)
    for read in (layertap.open_features, lambda path: extract(path, format)):  # reading, and resuming
        with pytest.raises(StoreError, match=message) as e:
            read(out)
        assert one_line(e.value) and "extract again into a new path" in str(e.value)
