"""A Zarr store's chunks are data: a crafted Blosc header (numcodecs#228: read past the buffer), a
compression bomb, declared shapes far beyond the files, and damaged chunks each end in one
`StoreError` line naming the array, never in a crash, garbage features or memory exhausted."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numcodecs
import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.errors import StoreError
from layertap.store.chunks import TEXT_CHUNK_BYTES, blosc_problem, zstd_problem


def extract(out: Path, n: int = 10, width: int = 3, chunk_size: int = 4) -> np.ndarray:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width))
    layertap.extract_dataset(model, torch.randn(n, 4), ["0"], out, batch_size=4, chunk_size=chunk_size, progress=False, num_workers=0)
    with layertap.open_features(out) as store:
        return store.to_numpy("0")


def edit(path: Path, change) -> None:
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


def edit_meta(store: Path, change) -> None:
    edit(store / "zarr.json", lambda d: change(d["attributes"]["layertap"]))


def one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def refused(out: Path, match: str) -> str:
    with pytest.raises(StoreError, match=match) as e:
        with layertap.open_features(out) as store:
            store.to_numpy("0")
    return one_line(e)


# ----------------------------------------------------------------------- 1. Blosc headers
def test_a_blosc_header_claiming_more_bytes_than_the_chunk_holds_is_refused_in_a_child(tmp_path):
    # numcodecs#228: a memcpyed frame of 16 bytes claiming 100 MB made Blosc read past the buffer
    # (a segfault, or heap memory as features); in a child process, so a crash fails the test only
    out = tmp_path / "s.zarr"
    extract(out)
    for claimed in (1000, 100_000_000):
        (out / "features/0/c/0/0").write_bytes(struct.pack("<BBBBIII", 2, 1, 0x33, 4, claimed, claimed, 16 + claimed))
        code = (
            "import layertap, sys\n"
            f"try:\n    layertap.open_features({str(out)!r})['0'][:]\n"
            "except layertap.StoreError as e:\n    print(e); sys.exit(3)\n"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 3, run.stderr[-2000:]
        assert f"a chunk of its array 'features/0' is damaged (features/0/c/0/0: its header says {16 + claimed} bytes, the file holds 16)" in run.stdout


def test_a_small_chunk_cut_to_its_header_is_refused_not_read_as_garbage(tmp_path):
    # a chunk under 128 bytes is stored uncompressed (memcpyed): cut to its header it read back heap memory
    out = tmp_path / "s.zarr"
    good = extract(out, n=8, width=30, chunk_size=1)
    assert (out / "features/0/c/3/0").stat().st_size < 200
    data = (out / "features/0/c/3/0").read_bytes()
    (out / "features/0/c/3/0").write_bytes(data[:16])
    with layertap.open_features(out) as store:
        np.testing.assert_array_equal(store["0"][:3], good[:3])  # the other chunks still read
        with pytest.raises(StoreError, match=r"a chunk of its array 'features/0' is damaged \(features/0/c/3/0: its header says \d+ bytes, the file holds 16\)") as e:
            store["0"][3]
    one_line(e)


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda b: b[: len(b) // 2], r"its header says \d+ bytes, the file holds \d+"),
        (lambda b: b"", "it holds 0 bytes, less than a Blosc header"),
        (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], r"its header says 7 bytes uncompressed, a chunk holds 48"),
    ],
    ids=["truncated", "emptied", "wrong-size"],
)
def test_a_damaged_blosc_chunk_is_refused_in_one_line_naming_the_array(tmp_path, damage, problem):
    out = tmp_path / "s.zarr"
    extract(out)
    chunk = out / "features/0/c/0/0"
    chunk.write_bytes(damage(chunk.read_bytes()))
    refused(out, rf"^{out} is not a valid layertap feature store: a chunk of its array 'features/0' is damaged \(features/0/c/0/0: {problem}\)\. .*extract again")


def test_an_ids_chunk_swapped_into_a_feature_array_is_refused(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out)
    shutil.copy(out / "ids/c/0", out / "features/0/c/0/0")  # a valid Blosc frame, of 32 bytes, not 48
    refused(out, r"features/0/c/0/0: its header says 32 bytes uncompressed, a chunk holds 48")


def test_every_chunk_blosc_writes_passes_the_header_check():
    rng = np.random.default_rng(0)
    for cname in ("lz4", "zstd", "blosclz"):
        codec = numcodecs.Blosc(cname=cname, clevel=5, shuffle=numcodecs.Blosc.SHUFFLE)
        for n in (1, 3, 31, 32, 1000, 100_000, 1_000_000):
            for values in (np.zeros(n, np.float32), rng.standard_normal(n).astype(np.float32), np.arange(n, dtype=np.int64)):
                frame = codec.encode(values)
                assert blosc_problem(np.frombuffer(frame, np.uint8), values.nbytes) is None, (cname, n, values.dtype)
                assert blosc_problem(np.frombuffer(frame, np.uint8), values.nbytes + 4) is not None


def test_blosc_block_offsets_leading_outside_the_chunk_are_refused():
    frame = bytearray(numcodecs.Blosc(cname="lz4").encode(np.random.default_rng(0).standard_normal(100_000).astype(np.float32)))
    assert not frame[2] & 0x02  # compressed, with a table of block offsets after the header
    frame[16:20] = struct.pack("<I", len(frame) + 100)
    assert blosc_problem(np.frombuffer(bytes(frame), np.uint8), 400_000) == "its blocks' offsets lead outside it"


def test_blosc_anywhere_but_last_after_bytes_is_refused_at_open(tmp_path):
    # behind another codec a Blosc frame's size cannot be held to the chunk's: refused before any read
    out = tmp_path / "s.zarr"
    extract(out)

    def chain(d):
        d["codecs"] = [*d["codecs"], {"name": "crc32c"}]

    edit(out / "features/0/zarr.json", chain)
    refused(out, r"its array 'features/0' uses the codecs \['bytes', 'blosc', 'crc32c'\]: Blosc only as the last codec, right after 'bytes', is read")


def test_zstd_anywhere_but_last_is_refused_at_open(tmp_path):
    # a codec decoded after Zstandard (crc32c here; a compressor could be one) is not bounded by its frame header
    out = tmp_path / "s.zarr"
    extract(out)

    def chain(d):
        d["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 3, "checksum": False}}, {"name": "crc32c"}]

    edit(out / "features/0/zarr.json", chain)
    refused(out, r"its array 'features/0' uses the codecs \['bytes', 'zstd', 'crc32c'\]: Zstandard only as the last codec is read")


def test_a_chunk_of_an_array_no_one_checked_is_never_read(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out)
    with layertap.open_features(out) as store:
        backend = store._backend
        import zarr

        group = zarr.open_group(backend.store, mode="r", zarr_format=3)
        backend.store.rules.pop("features/0")
        with pytest.raises(StoreError, match=r"Zarr read 'features/0/c/[0-2]/0', a chunk of no array layertap checked"):
            group["features/0"][:]


def test_the_header_check_costs_one_parse_per_chunk(tmp_path, monkeypatch):
    # what the check adds to a read: one header parse per chunk read, none per row
    out = tmp_path / "s.zarr"
    extract(out, n=64, chunk_size=4)
    import layertap.store.chunks as chunks

    calls = []
    real = chunks.blosc_problem
    monkeypatch.setattr(chunks, "blosc_problem", lambda data, n: calls.append(n) or real(data, n))
    with layertap.open_features(out) as store:
        calls.clear()
        store.to_numpy("0")
    assert len(calls) == 16


# ----------------------------------------------------------------- 2. compression bombs
def test_a_zstd_chunk_declaring_far_more_rows_than_the_array_is_refused_at_open(tmp_path):
    # 1e7 rows declared in one chunk of a 10-row array, a small zstd frame of zeros: reading 2 rows inflated it all
    out = tmp_path / "s.zarr"
    extract(out)
    rows = 10_000_000

    def bomb(d):
        d["chunk_grid"]["configuration"]["chunk_shape"] = [rows, 3]
        d["codecs"] = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd", "configuration": {"level": 3, "checksum": False}}]

    edit(out / "features/0/zarr.json", bomb)
    shutil.rmtree(out / "features/0/c")
    (out / "features/0/c/0").mkdir(parents=True)
    (out / "features/0/c/0/0").write_bytes(numcodecs.Zstd(level=3).encode(np.zeros((rows, 3), "<f4").tobytes()))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(StoreError, match=r"its array 'features/0' is stored in chunks of 10000000 rows, more than the 4 rows layertap puts in one") as e:
        layertap.open_features(out)
    one_line(e)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB: nothing inflated


def test_ids_chunks_of_more_rows_than_the_store_has_are_refused(tmp_path):
    # chunk_size is the store's own word: the chunk is bounded in bytes whatever it says
    out = tmp_path / "s.zarr"
    extract(out)
    edit_meta(out, lambda m: m.update(chunk_size=10**8, complete=True))
    edit(out / "ids/zarr.json", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[10**8]))
    with pytest.raises(StoreError, match=r"its array 'ids' is stored in chunks of 100000000 rows, more than 268.4 MB layertap puts in one"):
        layertap.open_features(out)


# ----------------------------------------------- 3. declared shapes, not files, at open
def _declare_rows(out: Path, rows: int) -> None:
    edit(out / "ids/zarr.json", lambda d: d.update(shape=[rows]))
    edit(out / "features/0/zarr.json", lambda d: d.update(shape=[rows, 3]))

    def unknown(m):
        m.update(num_samples=None, complete=False)
        m["settings"]["num_samples"] = None

    edit_meta(out, unknown)


def test_a_billion_declared_rows_cost_what_the_files_on_disk_cost(tmp_path):
    # the piece check built set(range(rows)) of the declared rows: 1e12 one-row pieces now cost a listing
    out = tmp_path / "s.zarr"
    extract(out, chunk_size=1)
    _declare_rows(out, 10**12)
    with pytest.raises(StoreError, match=r"the stored pieces \[10, 11, 12\] of its array 'ids' are missing") as e:
        layertap.open_features(out)
    one_line(e)


def test_a_hundred_million_marker_slots_are_not_read_when_their_files_are_not_there(tmp_path):
    # markers are read from the marker files there are, not as the declared array, whole
    out = tmp_path / "s.zarr"
    extract(out, chunk_size=1)
    rows = 10**8
    _declare_rows(out, rows)
    edit(out / "_chunks/zarr.json", lambda d: d.update(shape=[rows]))
    for i in range(10, 20):  # the ids' pieces there, so that the markers are reached
        shutil.copy(out / "ids/c/0", out / f"ids/c/{i}")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(StoreError, match=r"the stored pieces \[20, 21, 22\] of its array 'ids' are missing"):
        layertap.open_features(out)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50_000  # KB
    # and with every id there, the markers' 1e8 slots read as the 10 marker files
    from layertap.store.zarr_backend import _ZarrBackend

    backend = _ZarrBackend(out, "r")
    assert sorted(backend.markers()) == list(range(10))
    assert backend.pieces("ids")[1] == set(range(20))


def test_markers_stored_many_to_a_chunk_are_refused_before_they_are_read(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out)
    edit(out / "_chunks/zarr.json", lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[10**8]))
    with pytest.raises(StoreError, match=r"its chunk markers are stored 100000000 to a piece, not one a piece as layertap writes them"):
        layertap.open_features(out)


# --------------------------------------------------------------- 5. decode failures
def test_a_chunk_that_passes_its_header_and_fails_to_decode_is_a_store_error(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out)
    chunk = out / "_chunks/c/0"  # markers: text, Zstd, no Blosc header to check
    chunk.write_bytes(chunk.read_bytes()[:-5])
    with pytest.raises(StoreError, match=r"a chunk of its array '_chunks' is damaged \(RuntimeError: Zstd decompression error") as e:
        layertap.open_features(out)
    one_line(e)


def test_the_report_command_fails_on_a_damaged_chunk(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out)
    chunk = out / "features/0/c/1/0"
    chunk.write_bytes(chunk.read_bytes()[:20])
    layertap_cli = Path(sys.executable).parent / "layertap"
    run = subprocess.run(
        [str(layertap_cli), "report", str(out), "--out", str(tmp_path / "r.html")], capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()
    assert len(last) == 1 and "a chunk of its array 'features/0' is damaged (features/0/c/1/0" in last[0]
    assert not (tmp_path / "r.html").exists()


def test_every_way_zarr_reads_a_chunk_goes_through_the_check(tmp_path):
    # the wrapper's own _get_many would hand requests to the inner store unchecked
    import asyncio

    from zarr.core.buffer import default_buffer_prototype

    from layertap.store.chunks import checked_store

    out = tmp_path / "s.zarr"
    extract(out)
    store = checked_store(out, True, None)
    requests = [("features/0/c/0/0", default_buffer_prototype(), None)]

    async def many():
        return [item async for item in store._get_many(requests)]

    with pytest.raises(StoreError, match=r"a chunk of no array layertap checked"):  # no array registered: refused
        asyncio.run(many())


# ----------------------------------------------- text chunks (Zstandard): bounded before they are decoded
def test_a_text_chunk_whose_frame_claims_too_much_or_does_not_say_is_refused_unread(tmp_path):
    # a few KB of Zstandard can inflate to GBs: the frame header says how much, before decoding
    out = tmp_path / "s.zarr"
    extract(out)
    assert zstd_problem(numcodecs.Zstd().encode(b"x" * 1000), TEXT_CHUNK_BYTES) is None  # what layertap writes passes
    huge = struct.pack("<I", 0xFD2FB528) + bytes([0xE0]) + struct.pack("<Q", 1 << 40)  # single segment, 8-byte size
    unsaid = struct.pack("<I", 0xFD2FB528) + bytes([0x00, 0x48])  # no content size, a window only
    for frame, said in ((huge, r" says it holds 1099511627776 bytes, more than the 268435456"), (unsaid, "s frame does not say how many bytes it holds")):
        (out / "_chunks/c/0").write_bytes(frame)  # the marker of chunk 0, text
        with pytest.raises(StoreError, match=rf"a chunk of its array '_chunks' is damaged \(_chunks/c/0: it{said}"):
            layertap.open_features(out)


def test_a_zstd_frame_header_is_read_as_rfc_8878_says():
    for n in (0, 1, 255, 256, 300, 70_000, 5_000_000):  # the size field's widths: 1, 2 (+256), 4 bytes
        assert zstd_problem(numcodecs.Zstd().encode(bytes(n)), n) is None
        assert (zstd_problem(numcodecs.Zstd().encode(bytes(n + 1)), n) or "").startswith(f"it says it holds {n + 1} bytes")
