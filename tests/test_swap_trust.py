"""What a swap dir hands back at ``--recover`` is what this daemon wrote there: manifests
that raise quarantine only their job, and chunk checksums are bound to their place. Real
daemons, real files, manifests edited on disk between two runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_daemon_sessions import as_uid

from offloadd.errors import ChecksumError, JobQuarantinedError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

CHUNK_NBYTES = 64 << 10
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")


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


# -- swap dirs another user can reach ------------------------------------------------------


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A world-writable sticky dir, as /tmp or a shared /scratch is."""
    path = Path(tempfile.mkdtemp(prefix="offloadd-shared-"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victims(tmp_path: Path) -> dict[str, Path]:
    """Root's files that a planted symlink points at; none may change."""
    files = {name: tmp_path / f"victim{name}" for name in (".probe", ".lock", "manifest.tmp")}
    for name, path in files.items():
        path.write_bytes(f"root's {name} target\n".encode())
    return files


def serve_swap(swap_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``offloadd serve`` on ``swap_dir``; stopped at once if it starts."""
    workdir = tempfile.mkdtemp(prefix="offloadd-serve-")
    args = [sys.executable, "-m", "offloadd", "serve", "--socket", f"{workdir}/s.sock",
            "--arena-size", "8MiB", "--swap-dir", str(swap_dir), *extra]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    if process.stdout.readline().startswith("offloadd ready"):
        process.terminate()
    out, err = process.communicate(timeout=60)
    shutil.rmtree(workdir, ignore_errors=True)
    return subprocess.CompletedProcess(args, process.returncode, out, err)


def assert_untouched(victims: dict[str, Path]) -> None:
    for name, path in victims.items():
        assert path.read_bytes() == f"root's {name} target\n".encode(), f"{name} was followed"


@needs_root
def test_a_swap_dir_another_user_prepared_is_refused_and_its_symlinks_not_followed(
        shared_tmp: Path, victims: dict[str, Path]) -> None:
    swap = shared_tmp / "swap"

    def plant() -> str:  # as the other user, before the daemon's first start
        layout = swap / "offloadd"
        (layout / "victimjob").mkdir(parents=True)
        for name, target in victims.items():
            where = layout / "victimjob" if name == "manifest.tmp" else layout
            (where / name).symlink_to(target)
        return "planted"

    assert as_uid(NOBODY, plant) == "planted"
    result = serve_swap(swap)
    assert result.returncode == 1, result
    assert f"{swap} is owned by uid {NOBODY}" in result.stderr
    assert_untouched(victims)


@needs_root
@pytest.mark.parametrize("case", ["world-writable", "layout-of-another-uid",
                                  "ancestor-of-another-uid", "group-writable-layout"])
def test_swap_dirs_others_can_write_are_refused_naming_the_dir(shared_tmp: Path,
                                                                case: str) -> None:
    parent = shared_tmp / "parent"
    parent.mkdir(mode=0o755)
    swap = parent / "swap"
    swap.mkdir(mode=0o755)
    if case == "world-writable":
        os.chmod(swap, 0o1777)
        expected = f"{swap} is writable by group or others"
    elif case == "layout-of-another-uid":
        (swap / "offloadd").mkdir()
        os.chown(swap / "offloadd", NOBODY, NOBODY)
        expected = f"{swap / 'offloadd'} is owned by uid {NOBODY}"
    elif case == "ancestor-of-another-uid":
        os.chown(parent, NOBODY, NOBODY)  # who could rename swap and put their own in place
        expected = f"{parent} on its path is owned by uid {NOBODY}"
    else:
        (swap / "offloadd").mkdir()
        os.chmod(swap / "offloadd", 0o770)
        expected = "is writable by group or others (mode 770)"
    result = serve_swap(swap)
    assert result.returncode == 1, result
    assert expected in result.stderr, result.stderr


def test_files_under_a_private_swap_dir_are_made_without_following_symlinks(
        tmp_path: Path, swap_root: Path, victims: dict[str, Path]) -> None:
    """Defence in depth: even in the daemon's own dirs, a symlink at a name the daemon
    creates (left by an older daemon, a restore, a careless admin) is never written through."""
    layout = swap_root / "offloadd"
    layout.mkdir(mode=0o700)
    (layout / ".probe").symlink_to(victims[".probe"])
    payload = os.urandom(100_000)
    with start(tmp_path / "first", swap_root) as daemon, connect(daemon, "j") as client:
        client.put("x", payload)
        (layout / "j" / "manifest.tmp").symlink_to(victims["manifest.tmp"])
        client.flush("one")
        (layout / "j" / "manifest.prev.json.tmp").symlink_to(victims[".lock"])
        client.flush("two")
    assert_untouched(victims)
    with start(tmp_path / "second", swap_root, "--recover") as daemon:
        assert connect(daemon, "j").get("x") == payload
    (layout / ".lock").unlink()
    (layout / ".lock").symlink_to(victims[".lock"])
    result = serve_swap(swap_root)
    assert result.returncode == 1 and ".lock" in result.stderr, result
    assert_untouched(victims)


@needs_root
def test_recover_quarantines_a_job_dir_another_uid_owns(tmp_path: Path,
                                                        swap_root: Path) -> None:
    payload = os.urandom(100_000)
    flush_jobs(tmp_path / "first", swap_root, {name: {"x": payload} for name in ("mine", "theirs")})
    theirs = swap_root / "offloadd" / "theirs"
    for path in (theirs, *theirs.iterdir()):  # as if another user had put it there
        os.chown(path, NOBODY, NOBODY)
    with start(tmp_path / "second", swap_root, "--recover") as daemon:
        assert connect(daemon, "mine").get("x") == payload
        with pytest.raises(JobQuarantinedError, match=f"owned by uid {NOBODY}"):
            connect(daemon, "theirs")
