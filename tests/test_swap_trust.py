"""What a swap dir hands back at ``--recover`` is what this daemon wrote there: manifests
that raise quarantine only their job, and chunk checksums are bound to their place. Real
daemons, real files, manifests edited on disk between two runs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from offloadd.embedded import PrivateDaemon
from offloadd.errors import ChecksumError, JobQuarantinedError
from trainer.client import OffloadClient

CHUNK_NBYTES = 64 << 10


def connect(daemon: PrivateDaemon, job: str) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=job, arena_nbytes=4 << 20)


def start(workdir: Path, swap: Path, *extra: str) -> PrivateDaemon:
    config = workdir.parent / f"{workdir.name}.toml"
    config.write_text(f'chunk_size = "{CHUNK_NBYTES}"\n')
    return PrivateDaemon.start(workdir, arena_size="64MiB", swap_dirs=[str(swap)],
                               extra_args=["--config", str(config), *extra])


def flush_jobs(workdir: Path, swap: Path, jobs: dict[str, dict[str, bytes]]) -> None:
    with start(workdir, swap) as daemon:
        for job, shards in jobs.items():
            with connect(daemon, job) as client:
                for shard_id, payload in shards.items():
                    client.put(shard_id, payload)
                client.flush("one")


def edit_manifest(swap: Path, job: str, change) -> None:
    path = swap / "offloadd" / job / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def entries(manifest: dict) -> dict[str, dict]:
    return {entry["id"]: entry for entry in manifest["shards"]}


def test_a_manifest_that_raises_quarantines_only_its_job(tmp_path: Path,
                                                         swap_root: Path) -> None:
    payload = os.urandom(100_000)
    flush_jobs(tmp_path / "first", swap_root,
               {name: {"x": payload} for name in ("good", "deep", "owner")})
    deep = swap_root / "offloadd" / "deep" / "manifest.json"
    depth = 200_000  # json.loads raises RecursionError, which is no ValueError
    deep.write_text('{"format": 2, "job": "deep", "shards": ' + "[" * depth + "]" * depth + "}")
    edit_manifest(swap_root, "owner", lambda m: m.update(owner={"uid": "root"}))

    with start(tmp_path / "second", swap_root, "--recover") as daemon:
        assert connect(daemon, "good").get("x") == payload
        for name in ("deep", "owner"):
            with pytest.raises(JobQuarantinedError, match=f"job '{name}' is quarantined"):
                connect(daemon, name)
        quarantined = connect(daemon, "good").stats()["swap"]["quarantined"]
        assert sorted(quarantined) == ["deep", "owner"]
        assert "owner record" in quarantined["owner"]


def test_chunk_checksums_are_bound_to_job_rank_shard_version_and_index(
        tmp_path: Path, swap_root: Path) -> None:
    """Chunk lists moved to another shard, another version or another order in the manifest
    fail their checksum; none serves some other shard's bytes as its own."""
    one, two = os.urandom(2 * CHUNK_NBYTES), os.urandom(2 * CHUNK_NBYTES)
    jobs = {name: {"a": one, "b": two}
            for name in ("intact", "swapped", "reordered", "reversioned", "moved")}
    flush_jobs(tmp_path / "first", swap_root, jobs)

    def swap_shards(manifest: dict) -> None:
        by_id = entries(manifest)
        by_id["a"]["chunks"], by_id["b"]["chunks"] = by_id["b"]["chunks"], by_id["a"]["chunks"]

    def reorder(manifest: dict) -> None:
        for entry in manifest["shards"]:
            entry["chunks"].reverse()

    def reversion(manifest: dict) -> None:
        for entry in manifest["shards"]:
            entry["version"] += 1

    edit_manifest(swap_root, "swapped", swap_shards)
    edit_manifest(swap_root, "reordered", reorder)
    edit_manifest(swap_root, "reversioned", reversion)
    # Another job's manifest (and so its owner) over this job's chunks: the job is named
    # by its folder, and its chunks were written for "moved", not for "intact".
    intact = (swap_root / "offloadd" / "intact" / "manifest.json").read_text()
    (swap_root / "offloadd" / "moved" / "manifest.json").write_text(
        intact.replace('"job": "intact"', '"job": "moved"'))
    shutil.copyfile(swap_root / "offloadd" / "intact" / "swap.0",
                    swap_root / "offloadd" / "moved" / "swap.0")

    with start(tmp_path / "second", swap_root, "--recover") as daemon:
        with connect(daemon, "intact") as client:
            assert client.get("a") == one and client.get("b") == two
        for job in ("swapped", "reordered", "reversioned", "moved"):
            with connect(daemon, job) as client:
                for shard_id in ("a", "b"):
                    with pytest.raises(ChecksumError, match="failed its checksum"):
                        client.get(shard_id)
