"""Fault injection on the NVMe tier, each against a real daemon process and real files.

- an unusable swap dir stops the daemon at start, naming the dir;
- a full swap dir (a 16 MiB tmpfs) and an exhausted ``--swap-size`` budget fail the
  request that needed swap with a typed error; the daemon lives on, resident shards
  stay readable, and freeing swap space makes every shard readable again;
- a file system without O_DIRECT (ramfs) is used through the buffered fallback;
- an EIO injected into the IO engine (``OFFLOADD_IO_FAULT``) fails exactly the
  request that hit it with SwapIOError; no other shard is affected, a retry works;
- a byte flipped in a swap file is caught by the checksum (ChecksumError).

Every shard read is compared with the bytes written (by digest); nothing is timed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.errors import ChecksumError, OverBudgetError, SwapIOError, UnknownShardError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

MIB = 1 << 20
ARENA_NBYTES = 16 * MIB
SHARD_NBYTES = 4 * MIB
JOB = "faults"



@contextlib.contextmanager
def running(root: Path, swap_dirs: list[Path], extra_args: list[str] | None = None
            ) -> Iterator[tuple[PrivateDaemon, OffloadClient]]:
    """A daemon with a 16 MiB arena on ``swap_dirs`` and one client of job ``faults``."""
    daemon = PrivateDaemon.start(root / "run", arena_size=ARENA_NBYTES,
                                 swap_dirs=[str(d) for d in swap_dirs], extra_args=extra_args)
    try:
        with OffloadClient.connect(daemon.socket_path, job=JOB, arena_nbytes=ARENA_NBYTES,
                                   timeout_s=30) as client:
            yield daemon, client
    finally:
        alive = daemon.process.poll() is None
        code = daemon.stop()
        assert alive, f"the daemon died; log:\n{Path(daemon.log_path).read_text()[-3000:]}"
        assert code == 0


class Shards:
    """Writes shards of fresh random bytes and checks reads against their digests."""

    def __init__(self, client: OffloadClient) -> None:
        self.client = client
        self.digests: dict[str, bytes] = {}

    def put(self, shard_id: str, nbytes: int = SHARD_NBYTES) -> None:
        data = os.urandom(nbytes)
        self.client.put(shard_id, data)  # raises before the digest is recorded on failure
        self.digests[shard_id] = hashlib.sha256(data).digest()

    def check(self, shard_id: str) -> None:
        with self.client.acquire(shard_id) as lease:
            assert hashlib.sha256(lease.view).digest() == self.digests[shard_id], shard_id

    def check_all(self) -> None:
        for shard_id in self.digests:
            self.check(shard_id)


def swap_stats(client: OffloadClient) -> dict:
    swap = client.stats()["swap"]
    assert swap is not None
    return swap


def o_direct_works(directory: Path) -> bool:
    probe = directory / ".direct-probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return True


# -- start-up -----------------------------------------------------------------------


def test_unusable_swap_dir_stops_the_daemon_at_start_naming_it(swap_root: Path) -> None:
    not_a_dir = swap_root / "regular-file"
    not_a_dir.write_bytes(b"x")
    bad = not_a_dir / "swap"  # its parent is a regular file: cannot be created
    good = swap_root / "good"
    result = subprocess.run(
        [sys.executable, "-m", "offloadd", "serve", "--socket", str(swap_root / "s.sock"),
         "--arena-size", "16MiB", "--swap-dir", str(good), "--swap-dir", str(bad)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "offloadd ready" not in result.stdout
    assert str(bad) in result.stderr, result.stderr
    assert "not usable" in result.stderr and "Not a directory" in result.stderr
    assert not (swap_root / "s.sock").exists()


# -- out of swap space -----------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    # mode=0700: a tmpfs root is 1777 by default, and the daemon refuses swap dirs that
    # others can write (offloadd.swap.swapdirs).
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_until_refused(shards: Shards, error: type[Exception], limit: int = 40) -> Exception:
    for index in range(limit):
        try:
            shards.put(f"s{index}")
        except error as exc:
            return exc
    raise AssertionError(f"{limit * SHARD_NBYTES} bytes were accepted; expected {error.__name__}")


def check_survives_full_swap(daemon: PrivateDaemon, shards: Shards) -> None:
    """After the refusal: alive, resident shards readable, and a drop makes room again."""
    assert daemon.process.poll() is None
    refused = f"s{len(shards.digests)}"
    with pytest.raises(UnknownShardError):  # the failed put left no half-made shard behind
        shards.client.get(refused)
    last = list(shards.digests)[-(ARENA_NBYTES // SHARD_NBYTES):]
    for shard_id in last:  # the newest shards are still in the arena
        shards.check(shard_id)
    victim = next(iter(shards.digests))  # the oldest: on swap
    shards.client.drop(victim)
    del shards.digests[victim]
    shards.check_all()  # every swapped shard comes back through the freed extents
    shards.put("after-drop", SHARD_NBYTES // 2)
    shards.check("after-drop")


def test_full_swap_dir_fails_the_request_not_the_daemon(swap_root: Path) -> None:
    with tmpfs(swap_root / "tiny", "16m") as tiny, running(swap_root, [tiny]) as (daemon, client):
        shards = Shards(client)
        error = fill_until_refused(shards, SwapIOError)
        assert str(tiny) in error.message and "full" in error.message, error.message
        entry = swap_stats(client)["dirs"][0]
        assert entry["direct"] is o_direct_works(tiny)  # tmpfs has O_DIRECT since Linux 6.6
        assert 0 < entry["reserved_nbytes"] <= 16 * MIB
        assert len(shards.digests) >= ARENA_NBYTES // SHARD_NBYTES + 2  # swap did take bytes
        check_survives_full_swap(daemon, shards)


def test_swap_size_budget_is_a_hard_limit(swap_root: Path) -> None:
    budget = 12 * MIB
    with running(swap_root, [swap_root / "nvme0"], ["--swap-size", str(budget)]) as (
            daemon, client):
        shards = Shards(client)
        error = fill_until_refused(shards, OverBudgetError)
        assert "--swap-size" in error.message and str(swap_root / "nvme0") in error.message
        entry = swap_stats(client)["dirs"][0]
        assert entry["budget_nbytes"] == budget
        assert entry["reserved_nbytes"] <= budget
        assert len(shards.digests) == (ARENA_NBYTES + budget) // SHARD_NBYTES
        check_survives_full_swap(daemon, shards)
        assert swap_stats(client)["dirs"][0]["reserved_nbytes"] <= budget


def test_file_system_without_o_direct_uses_buffered_io(swap_root: Path) -> None:
    ram = swap_root / "ram"
    ram.mkdir()
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(ram)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a ramfs (needs root): {mounted.stderr.strip()}")
    try:
        assert not o_direct_works(ram)
        with running(swap_root, [ram, swap_root / "nvme0"]) as (_daemon, client):
            shards = Shards(client)
            for index in range(8):
                shards.put(f"s{index}", SHARD_NBYTES * 3 // 2 + 7)  # 2 chunks, both dirs
            shards.check_all()
            dirs = swap_stats(client)["dirs"]
            assert [d["direct"] for d in dirs] == [False, True]
            assert all(d["written_nbytes"] > 0 and d["read_nbytes"] > 0 for d in dirs)
    finally:
        subprocess.run(["umount", "-l", str(ram)], check=False)


# -- IO errors ---------------------------------------------------------------------


@pytest.fixture
def io_fault(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Set OFFLOADD_IO_FAULT for the daemon started next (the child inherits it)."""
    return lambda spec: monkeypatch.setenv("OFFLOADD_IO_FAULT", spec)


def test_read_error_fails_only_that_acquire(swap_root: Path, io_fault) -> None:  # type: ignore[no-untyped-def]
    io_fault("read:3")
    with running(swap_root, [swap_root / "nvme0"]) as (_daemon, client):
        shards = Shards(client)
        for index in range(8):  # s0..s3 go to swap
            shards.put(f"s{index}")
        assert swap_stats(client)["demand_reads"] == 0
        shards.check("s0")  # swap read 1
        shards.check("s1")  # swap read 2
        with pytest.raises(SwapIOError) as failed:
            shards.check("s2")  # swap read 3: EIO
        assert "swap read" in failed.value.message and "Input/output error" in failed.value.message
        assert client.stats()["leased_nbytes"] == 0
        shards.check("s2")  # the fault was transient: the swap copy is intact
        shards.check_all()
        assert swap_stats(client)["checksum_failures"] == 0


def test_read_error_in_one_chunk_of_a_striped_shard(swap_root: Path, io_fault) -> None:  # type: ignore[no-untyped-def]
    io_fault("read:2")
    dirs = [swap_root / "nvme0", swap_root / "nvme1"]
    with running(swap_root, dirs, ["--io-engine", "io_uring"]) as (_daemon, client):
        shards = Shards(client)
        shards.put("big", 3 * SHARD_NBYTES - 5)  # 3 chunks read concurrently
        for index in range(4):
            shards.put(f"s{index}")  # pushes big out to swap
        with pytest.raises(SwapIOError):
            shards.check("big")  # its second chunk fails; the first and third complete
        # The range big was placed in is reused at once; no late chunk may land there.
        shards.put("reuse", 3 * SHARD_NBYTES - 5)
        shards.check("reuse")
        shards.check_all()
        assert client.stats()["residency"]["reading"] == 0


def test_write_error_fails_the_request_that_needed_its_room(swap_root: Path, io_fault) -> None:  # type: ignore[no-untyped-def]
    io_fault("write:1")
    with running(swap_root, [swap_root / "nvme0"]) as (_daemon, client):
        shards = Shards(client)
        shards.put("small")
        shards.put("big", ARENA_NBYTES - SHARD_NBYTES)  # the arena is full, all dirty
        with client.acquire("big"):  # only "small" can make room, and its write fails
            with pytest.raises(SwapIOError) as failed:
                shards.put("next")
            assert "swap write" in failed.value.message
            stats = client.stats()
            assert stats["residency"]["writing"] == 0 and stats["residency"]["arena_dirty"] == 2
        assert swap_stats(client)["io_errors"] == {"write": 1}
        shards.put("next")  # the fault was transient: the retry writes "small" back
        shards.check_all()
        assert client.stats()["leased_nbytes"] == 0


def test_failed_background_write_back_loses_nothing(swap_root: Path, io_fault) -> None:  # type: ignore[no-untyped-def]
    """A write-behind failure is retried later; requests whose room came from other
    write-backs do not fail for it, and the shard's bytes stay in the arena until then."""
    io_fault("write:3")
    with running(swap_root, [swap_root / "nvme0"]) as (_daemon, client):
        shards = Shards(client)
        for index in range(12):
            with contextlib.suppress(SwapIOError):  # whichever request meets it, if any
                shards.put(f"s{index}")
        assert swap_stats(client)["io_errors"] == {"write": 1}
        for index in range(12):
            if f"s{index}" not in shards.digests:
                shards.put(f"s{index}")
        shards.check_all()
        client.flush("after-fault")  # every dirty shard reaches swap now
        assert client.stats()["residency"]["arena_dirty"] == 0
        shards.check_all()


# -- corruption --------------------------------------------------------------------


@pytest.mark.parametrize("hash_threads", [0, 2], ids=["hash-on-loop", "hash-threads"])
def test_flipped_byte_in_a_swap_file_is_a_checksum_error(swap_root: Path,
                                                         hash_threads: int) -> None:
    dirs = [swap_root / "nvme0", swap_root / "nvme1"]
    config = swap_root / "offloadd.toml"
    config.write_text(f"hash_threads = {hash_threads}\n")
    with running(swap_root, dirs, ["--config", str(config)]) as (daemon, client):
        shards = Shards(client)
        for index in range(3):
            shards.put(f"s{index}", SHARD_NBYTES * 2 - 4096 * index - 3)
        client.flush("before-flip")
        manifest = json.loads((dirs[0] / "offloadd" / JOB / "manifest.json").read_text())
        entry = next(e for e in manifest["shards"] if e["id"] == "s1")
        dir_index, offset, nbytes, _checksum = entry["chunks"][1]
        swap_file = dirs[dir_index] / "offloadd" / JOB / "swap.0"
        fd = os.open(swap_file, os.O_RDWR)  # no O_DIRECT: a one-byte write
        try:
            position = offset + nbytes // 2
            (old,) = os.pread(fd, 1, position)
            os.pwrite(fd, bytes([old ^ 0x40]), position)
            os.fsync(fd)
        finally:
            os.close(fd)
        for index in range(4):  # fill the arena: s0..s2 (clean since the flush) are evicted
            shards.put(f"fill{index}")
        with pytest.raises(ChecksumError) as failed:
            shards.check("s1")
        assert "s1" in failed.value.shard_ids and "checksum" in failed.value.message
        assert str(swap_file) in failed.value.message
        assert swap_stats(client)["checksum_failures"] == 1
        assert daemon.process.poll() is None
        for shard_id in ("s0", "s2", "fill0", "fill3"):
            shards.check(shard_id)
        with pytest.raises(ChecksumError):  # still corrupt: never served as good bytes
            shards.check("s1")
        client.drop("s1")  # the way out: drop and write it again
        shards.put("s1", SHARD_NBYTES)
        shards.check_all()
