"""Checkpoints a stranger hands over, done as the stranger would: real checkpoints written by
the engine (ZeRO ``save_checkpoint`` and HF ``save_16bit_model``), then edited to name files
outside their directory (``../``, absolute paths, symlinks) or to claim counts (world size,
partition sizes, tensor shapes) that would size allocations. Loading raises
``CheckpointError`` naming the file and entry, and reads nothing outside: a readable,
valid file waits there (a loader that followed the name would succeed), and its access
time shows whether it was read."""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from _dist import base_config, make_model

import trainer
from trainer.state.export import export_checkpoint, iter_units
from trainer.state.hf_checkpoint import CheckpointError, CheckpointReader

TAG = "t"


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    engine, _, _, _ = trainer.initialize(model=make_model(), config=base_config(
        zero_optimization={"stage": 2}))
    yield engine
    engine.close()


@pytest.fixture
def saved(engine: Any, tmp_path: Path) -> Path:
    """A save dir holding checkpoint ``t`` (``latest`` names it)."""
    save_dir = tmp_path / "ckpt"
    engine.save_checkpoint(save_dir, tag=TAG)
    assert (save_dir / "latest").read_text() == TAG
    return save_dir


@pytest.fixture
def hf_dir(engine: Any, tmp_path: Path) -> Path:
    """An HF model directory, one shard per tensor, with model.safetensors.index.json."""
    directory = tmp_path / "hf"
    engine.save_16bit_model(directory, max_shard_size=1)
    assert (directory / "model.safetensors.index.json").exists()
    return directory


@contextmanager
def never_read(*paths: Path) -> Iterator[None]:
    """Asserts that no file under ``paths`` is read inside the block (their access times,
    set back to the epoch first: a read moves them on this relatime file system)."""
    files = [file for path in paths
             for file in ([path] if path.is_file() else sorted(path.rglob("*")))
             if file.is_file()]
    probe = files[0].with_name(files[0].name + ".probe")
    probe.write_bytes(b"probe")
    os.utime(probe, (0, probe.stat().st_mtime))
    probe.read_bytes()
    if probe.stat().st_atime == 0:
        pytest.skip("this file system does not record reads (noatime): cannot tell")
    probe.unlink()
    for file in files:
        os.utime(file, (0, file.stat().st_mtime))
    yield
    read = [str(file) for file in files if file.stat().st_atime != 0]
    assert not read, f"files outside the checkpoint were read: {read}"


@contextmanager
def memory_capped(extra_nbytes: int) -> Iterator[None]:
    """This process may grow its data by ``extra_nbytes`` at most inside the block (so a
    loader sized by a hostile count fails with MemoryError instead of taking the node)."""
    status = Path("/proc/self/status").read_text()
    data_nbytes = int(next(line for line in status.splitlines()
                           if line.startswith("VmData:")).split()[1]) * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (data_nbytes + extra_nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def edit_meta(save_dir: Path, **changes: Any) -> None:
    meta_path = save_dir / TAG / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(changes)
    meta_path.write_text(json.dumps(meta))


# -- ZeRO checkpoints: names ----------------------------------------------------------------


def test_latest_naming_a_directory_outside_is_refused(engine: Any, saved: Path) -> None:
    outside = saved.parent / "x"
    shutil.copytree(saved / TAG, outside)  # a whole checkpoint: following '../x' would work
    (saved / "latest").write_text("../x")
    with never_read(outside):
        with pytest.raises(CheckpointError, match=r"'latest' file names '\.\./x'.*not inside"):
            engine.load_checkpoint(saved)
        with pytest.raises(CheckpointError, match=r"'latest' file names '\.\./x'"):
            export_checkpoint(saved, saved.parent / "out.bin")
    assert engine.load_checkpoint(saved, tag=TAG)[0] == str(saved / TAG)  # the real one loads


def test_latest_naming_an_absolute_path_is_refused(engine: Any, saved: Path) -> None:
    outside = saved.parent / "x"
    shutil.copytree(saved / TAG, outside)
    (saved / "latest").write_text(str(outside))
    with never_read(outside), pytest.raises(CheckpointError, match="not inside"):
        engine.load_checkpoint(saved)


def test_latest_as_a_symlink_to_a_file_outside_is_refused(engine: Any, saved: Path) -> None:
    secret = saved.parent / "secret"
    secret.write_text(TAG)  # read as a tag, it would even load the checkpoint
    (saved / "latest").unlink()
    (saved / "latest").symlink_to(secret)
    with never_read(secret), pytest.raises(CheckpointError, match=r"symlink to .*secret"):
        engine.load_checkpoint(saved)


def test_a_tag_directory_or_rank_file_linked_outside_is_refused(engine: Any,
                                                                saved: Path) -> None:
    outside = saved.parent / "x"
    shutil.copytree(saved / TAG, outside)
    (saved / "linked").symlink_to(outside, target_is_directory=True)
    (saved / "latest").write_text("linked")
    rank_file = saved / TAG / "rank_00000.pt"
    rank_file.unlink()
    rank_file.symlink_to(outside / "rank_00000.pt")
    with never_read(outside):
        with pytest.raises(CheckpointError, match=r"'linked', a symlink to .*x, outside"):
            engine.load_checkpoint(saved)
        with pytest.raises(CheckpointError, match=r"rank_00000.pt', a symlink to .*outside"):
            engine.load_checkpoint(saved, tag=TAG)
        with pytest.raises(CheckpointError, match=r"rank 0 file names 'rank_00000.pt'"):
            export_checkpoint(saved, saved.parent / "out.bin", tag=TAG)


# -- ZeRO checkpoints: counts ---------------------------------------------------------------


def test_a_world_size_of_a_billion_is_refused_before_anything_is_sized_by_it(
        engine: Any, saved: Path) -> None:
    edit_meta(saved, world_size=10**9)
    with memory_capped(512 << 20):
        with pytest.raises(CheckpointError, match=r"meta.json has world_size=1000000000"):
            engine.load_checkpoint(saved)
        with pytest.raises(CheckpointError, match=r"meta.json has world_size=1000000000"):
            export_checkpoint(saved, saved.parent / "out.bin")
        with pytest.raises(CheckpointError, match=r"meta.json has world_size=1000000000"):
            next(iter_units(saved))


@pytest.mark.parametrize("world_size", [0, -3, True, "8", 2.5, None])
def test_a_world_size_that_is_no_count_is_refused(engine: Any, saved: Path,
                                                  world_size: object) -> None:
    edit_meta(saved, world_size=world_size)
    with pytest.raises(CheckpointError, match=r"meta.json has world_size=.*positive int"):
        engine.load_checkpoint(saved)
    with pytest.raises(CheckpointError, match=r"meta.json has world_size="):
        export_checkpoint(saved, saved.parent / "out.bin")


def test_partition_sizes_that_disagree_with_the_rank_files_are_refused(engine: Any,
                                                                       saved: Path) -> None:
    """meta.json claims two ranks, each holding half of unit 0; the rank files (both copies
    of the one real rank's) hold all of it. Resharding must not trust either count."""
    meta = json.loads((saved / TAG / "meta.json").read_text())
    shutil.copyfile(saved / TAG / "rank_00000.pt", saved / TAG / "rank_00001.pt")
    unit = meta["units"][0]
    padded = unit["numel"] + unit["numel"] % 2
    units = [{**unit, "padded_numel": padded, "part_numel": padded // 2}, *meta["units"][1:]]
    edit_meta(saved, world_size=2, units=units)
    with pytest.raises(CheckpointError, match=rf"unit 0 holds .*not the {padded // 2} elem"):
        engine.load_checkpoint(saved)


def test_a_unit_larger_than_its_rank_files_is_refused_by_the_exporter(saved: Path) -> None:
    meta = json.loads((saved / TAG / "meta.json").read_text())
    shutil.copyfile(saved / TAG / "rank_00000.pt", saved / TAG / "rank_00001.pt")
    units = [{**meta["units"][0], "numel": 2 * 10**11, "padded_numel": 2 * 10**11,
              "part_numel": 10**11}, *meta["units"][1:]]
    layout = meta["layout"]
    layout[0][0] = {**layout[0][0], "numel": 10**11, "shape": [10**11]}
    edit_meta(saved, world_size=2, units=units, layout=layout)
    with memory_capped(512 << 20), pytest.raises(
            CheckpointError, match=r"not the 100000000000 elements its meta.json gives"):
        export_checkpoint(saved, saved.parent / "out.bin")


def test_a_partitioning_no_engine_makes_is_refused(engine: Any, saved: Path) -> None:
    meta = json.loads((saved / TAG / "meta.json").read_text())
    units = [{**meta["units"][0], "padded_numel": 10**12}, *meta["units"][1:]]
    edit_meta(saved, units=units)
    with pytest.raises(CheckpointError, match=r"units\[0\] has numel=.*padded_numel=10{12}"):
        engine.load_checkpoint(saved)


def test_a_layout_reaching_past_its_unit_is_refused(saved: Path) -> None:
    meta = json.loads((saved / TAG / "meta.json").read_text())
    layout = meta["layout"]
    layout[0][0] = {**layout[0][0], "offset": 10**12}
    edit_meta(saved, layout=layout)
    with pytest.raises(CheckpointError, match=r"meta.json: a parameter of unit 0 in 'layout'"):
        export_checkpoint(saved, saved.parent / "out.bin")


# -- HF checkpoints -------------------------------------------------------------------------


def _point_first_shard_at(hf_dir: Path, name: str) -> str:
    """Rewrite the index so the tensors of its first shard come from ``name``."""
    index_path = hf_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"].values()))
    index["weight_map"] = {tensor: name if file == first else file
                           for tensor, file in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    return first


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_weight_map_entry_outside_the_directory_is_refused(hf_dir: Path, kind: str) -> None:
    first = sorted(hf_dir.glob("model-*.safetensors"))[0]
    outside = hf_dir.parent / "outside.safetensors"
    shutil.copyfile(first, outside)  # a valid shard: following the entry would load it
    name = "../outside.safetensors" if kind == "relative" else str(outside)
    _point_first_shard_at(hf_dir, name)
    with never_read(outside), pytest.raises(CheckpointError) as raised:
        CheckpointReader(hf_dir)
    message = str(raised.value)
    assert "model.safetensors.index.json's weight_map" in message and repr(name) in message


def test_a_shard_linked_outside_the_directory_is_refused(hf_dir: Path) -> None:
    first = sorted(hf_dir.glob("model-*.safetensors"))[0]
    outside = hf_dir.parent / "outside.safetensors"
    shutil.move(first, outside)
    first.symlink_to(outside)
    with never_read(outside), pytest.raises(CheckpointError, match=r"a symlink to .*outside"):
        CheckpointReader(hf_dir)


def test_a_hugging_face_cache_snapshot_still_loads(hf_dir: Path, tmp_path: Path) -> None:
    """The HF hub cache keeps a snapshot's files as symlinks into the repo's blobs/."""
    repo = tmp_path / "hub" / "models--someone--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in hf_dir.iterdir():
        blob = repo / "blobs" / f"blob-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("../..") / "blobs" / blob.name)
    reader, direct = CheckpointReader(snapshot), CheckpointReader(hf_dir)
    assert reader.names() == direct.names()
    for name in reader.names():
        assert reader.read(name).equal(direct.read(name))


def test_a_safetensors_header_larger_than_its_file_is_refused(hf_dir: Path) -> None:
    first = sorted(hf_dir.glob("model-*.safetensors"))[0]
    data = first.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = next(key for key in header if key != "__metadata__")
    nbytes = 10**12 * 4
    header[name] = {**header[name], "shape": [10**12], "data_offsets": [0, nbytes]}
    encoded = json.dumps(header).encode()
    first.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])
    with memory_capped(512 << 20), pytest.raises(CheckpointError, match=rf"tensor {name} has"):
        CheckpointReader(hf_dir).read(name)
    first.write_bytes(struct.pack("<Q", 1 << 62) + data[8:])
    with memory_capped(512 << 20), pytest.raises(CheckpointError, match=r"header claims"):
        CheckpointReader(hf_dir)
