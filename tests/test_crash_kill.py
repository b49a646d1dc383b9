"""Crash consistency of flush: SIGKILL the daemon at random moments, recover, check every byte.

Issue 12's proof. Each cycle runs two ranks of one job against a real daemon:
rank 0 rewrites its shards and flushes in a loop; rank 1 keeps writing,
reading and dropping shards of its own through an arena too small for them
(so write-back and eviction run all the time). The daemon is killed with
SIGKILL after a random delay, restarted with ``--recover``, and then:

- no shard fails its checksum;
- rank 0's shards are exactly what its last completed flush saw (or what the
  flush in flight at the kill saw, if that one's manifest made it to disk);
- every other shard that exists is a whole version some write produced.

The power-loss variant runs the daemon with ``OFFLOADD_IO_FAULT=power_loss``:
writes sit in a volatile cache until the tier's fdatasync, so the kill also
loses every write not yet synced, and a manifest naming one would fail.

Knobs: ``OFFLOADD_CRASH_CYCLES`` (cycles of the slow variant), ``OFFLOADD_CRASH_SEED``.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from offloadd.errors import OffloadError, UnknownShardError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.swap.nvme import POWER_LOSS_FAULT
from trainer.client import OffloadClient

KIB = 1 << 10
ARENA_NBYTES = 1 << 20
JOB = "crash"
FLUSHED_IDS = [f"model{i}" for i in range(6)]
BUSY_IDS = [f"busy{i}" for i in range(14)]
CI_CYCLES = 20
SEED = int(os.environ.get("OFFLOADD_CRASH_SEED", "12"))


def shard_nbytes(shard_id: str) -> int:
    """Sizes that cross the 64 KiB chunks unevenly; fixed per id (a put never resizes)."""
    return 100 * KIB + 4099 * (sum(map(ord, shard_id)) % 23)


def payload(shard_id: str, serial: int) -> bytes:
    return random.Random(f"{shard_id}/{serial}").randbytes(shard_nbytes(shard_id))


def digest(data: bytes | memoryview) -> bytes:
    return hashlib.sha256(data).digest()


@dataclass
class History:
    """What the ranks did, across cycles, to judge what a recovery may hold."""

    serial: int = 0
    model: dict[str, bytes] = field(default_factory=dict)
    """Rank 0's shards as its writes left them (digests)."""
    flushed: dict[str, bytes] = field(default_factory=dict)
    """Rank 0's shards as its last completed flush saw them."""
    in_flight: dict[str, bytes] | None = None
    """As the flush that was running at the kill saw them; its manifest may be on disk."""
    written: dict[str, set[bytes]] = field(default_factory=dict)
    """Every version rank 1 ever wrote, per id."""
    flushes: int = 0
    errors: list[BaseException] = field(default_factory=list)

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial


def connect(daemon: PrivateDaemon, rank: int) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=JOB, rank=rank, world_size=2,
                                 arena_nbytes=ARENA_NBYTES, timeout_s=30)


def start(root: Path, cycle: int, recover: bool) -> PrivateDaemon:
    config = root / "offloadd.toml"
    if not config.exists():
        root.mkdir(parents=True, exist_ok=True)
        config.write_text('chunk_size = "64KiB"\nio_queue_depth = 8\nswap_size = "64MiB"\n')
    args = ["--config", str(config)] + (["--recover"] if recover else [])
    return PrivateDaemon.start(root / f"run{cycle}", arena_size=4 * ARENA_NBYTES,
                               swap_dirs=[str(root / "nvme0"), str(root / "nvme1")],
                               extra_args=args)


def flushing_rank(daemon: PrivateDaemon, history: History, rng: random.Random) -> None:
    with connect(daemon, 0) as client:
        while True:
            for shard_id in rng.sample(FLUSHED_IDS, rng.randint(1, len(FLUSHED_IDS))):
                data = payload(shard_id, history.next_serial())
                client.put(shard_id, data)
                history.model[shard_id] = digest(data)
            history.in_flight = dict(history.model)
            client.flush(f"flush{history.flushes}")
            history.flushed, history.in_flight = history.in_flight, None
            history.flushes += 1


def busy_rank(daemon: PrivateDaemon, history: History, rng: random.Random) -> None:
    with connect(daemon, 1) as client:
        while True:
            shard_id = rng.choice(BUSY_IDS)
            action = rng.random()
            if action < 0.6:
                data = payload(shard_id, history.next_serial())
                history.written.setdefault(shard_id, set()).add(digest(data))
                client.put(shard_id, data)
            elif action < 0.85:
                try:
                    with client.acquire(shard_id) as lease:
                        assert digest(lease.view) in history.written[shard_id]
                except UnknownShardError:
                    pass
            else:
                try:
                    client.drop(shard_id)
                except UnknownShardError:
                    pass


def run_rank(target, daemon: PrivateDaemon, history: History, rng: random.Random) -> None:
    try:
        target(daemon, history, rng)
    except (OffloadError, OSError):
        pass  # the daemon was killed under this rank
    except BaseException as exc:  # a wrong byte: reported by the test thread
        history.errors.append(exc)


def run_until_killed(daemon: PrivateDaemon, history: History, rng: random.Random) -> None:
    ranks = [threading.Thread(target=run_rank, args=(rank, daemon, history,
                                                      random.Random(rng.random())))
             for rank in (flushing_rank, busy_rank)]
    for thread in ranks:
        thread.start()
    threading.Event().wait(rng.uniform(0.05, 0.4))
    daemon.process.send_signal(signal.SIGKILL)
    assert daemon.process.wait(30) == -signal.SIGKILL
    for thread in ranks:
        thread.join(30)
    daemon.stop()
    assert not history.errors, history.errors


def check_recovered(daemon: PrivateDaemon, history: History) -> None:
    with connect(daemon, 0) as model, connect(daemon, 1) as busy:
        found = {}
        for shard_id in FLUSHED_IDS:
            with model.acquire(shard_id) as lease:  # a ChecksumError fails the test here
                found[shard_id] = digest(lease.view)
        assert found in (history.flushed, history.in_flight), (
            "rank 0's shards are neither its last completed flush nor the one in flight: "
            + _which(found, history))
        history.model, history.flushed, history.in_flight = dict(found), found, None
        for shard_id in BUSY_IDS:
            try:
                with busy.acquire(shard_id) as lease:
                    assert digest(lease.view) in history.written.get(shard_id, set()), (
                        f"{shard_id} is no version that was ever written")
            except UnknownShardError:
                pass  # never flushed, or dropped before the flush


def _which(found: dict[str, bytes], history: History) -> str:
    """Per shard, which state the recovered bytes are (to tell a torn flush from a lost one)."""
    def name(shard_id: str) -> str:
        states = [label for label, state in (("flushed", history.flushed),
                                             ("in_flight", history.in_flight or {}),
                                             ("latest_write", history.model))
                  if state.get(shard_id) == found[shard_id]]
        return "+".join(states) or "none"

    return ", ".join(f"{shard_id}={name(shard_id)}" for shard_id in sorted(found)) + (
        f" (flushes so far {history.flushes}, a flush in flight: "
        f"{history.in_flight is not None})")


def crash_cycles(root: Path, cycles: int, seed: int) -> History:
    rng = random.Random(seed)
    history = History()
    with start(root, 0, recover=False) as daemon, connect(daemon, 0) as client:
        for shard_id in FLUSHED_IDS:  # a first durable state for rank 0
            data = payload(shard_id, history.next_serial())
            client.put(shard_id, data)
            history.model[shard_id] = digest(data)
        client.flush("initial")
        history.flushed = dict(history.model)
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(30)
    for cycle in range(1, cycles + 1):
        daemon = start(root, cycle, recover=True)
        try:
            check_recovered(daemon, history)
        except BaseException:
            daemon.stop()
            raise
        run_until_killed(daemon, history, rng)
    with start(root, cycles + 1, recover=True) as daemon:
        check_recovered(daemon, history)
    return history


def test_sigkill_during_flushes_and_write_back_never_breaks_recovery(tmp_path: Path) -> None:
    history = crash_cycles(tmp_path, CI_CYCLES, SEED)
    assert history.flushes > 0 and any(history.written.values())


def test_power_loss_drops_unsynced_writes_and_no_manifest_names_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFLOADD_IO_FAULT", POWER_LOSS_FAULT)
    history = crash_cycles(tmp_path / "cycles", 8, SEED + 1)
    assert history.flushes > 0
    # The fault mode really loses what was not synced: a job that never flushed
    # wrote back (its arena is a quarter of its shards) and left only zeros.
    with start(tmp_path / "lost", 0, recover=False) as daemon, connect(daemon, 1) as client:
        for serial, shard_id in enumerate(BUSY_IDS * 3):
            client.put(shard_id, payload(shard_id, serial))
        assert client.stats()["swap"]["writeback_nbytes"] > 0
        daemon.process.send_signal(signal.SIGKILL)
        daemon.process.wait(30)
    swap_files = list((tmp_path / "lost").rglob("swap.0"))
    assert swap_files and all(f.read_bytes().count(0) == f.stat().st_size for f in swap_files)


@pytest.mark.slow
def test_sigkill_soak(tmp_path: Path) -> None:
    cycles = int(os.environ.get("OFFLOADD_CRASH_CYCLES", "40"))
    crash_cycles(tmp_path / "plain", cycles, SEED + 2)
