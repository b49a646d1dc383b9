"""Arena size never delays start-up: a new arena is answered at once and backed behind it.

Unit tests drive ``Arena`` with each ``prefault`` mode; the integration tests start a
daemon whose background prefault is throttled to 1 MiB/s, so a 12 GiB arena stays
"backing" for the whole test while using almost no memory, and check what ranks and
other jobs get while it is built: every hello answered, every shard readable, before
the daemon reports the arena backed. The backing threads are checked to cover every page
exactly once, and a locked arena to be resident and locked page for page, as the kernel
reports it (``/proc/<pid>/smaps``), in this process and in a real daemon; and a rank about to
pin the arena waits for a backing that progresses, not for one that crawls.
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
from collections.abc import Iterator

import pytest
from _smaps import containing, mapping_kib, memfd_named
from conftest import start_daemon

from offloadd.config import DaemonConfig
from offloadd.memory import arena as arena_module
from offloadd.memory import pages
from offloadd.memory.arena import PAGE_NBYTES, Arena, Backing
from offloadd.memory.node import NodeMemory
from offloadd.memory.shards import ShardTable
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient
from trainer.device.copy_engine import TwinCopyEngine
from trainer.dist.collectives import Collectives
from trainer.offload import daemon_backend
from trainer.offload.daemon_backend import DaemonBackend

GIB = 1 << 30
LARGE_ARENA_NBYTES = 12 * GIB
"""At least half of the 24 GiB machine these tests were written on; the memfd is sized
at once and backed at 1 MiB/s, so the test itself needs a few MiB of it."""


def resident_nbytes(fd: int) -> int:
    return os.fstat(fd).st_blocks * 512


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the arena's backing thread"
        time.sleep(0.01)


# -- Arena --------------------------------------------------------------------------------


def test_a_background_arena_is_usable_before_its_pages_are_backed() -> None:
    arena = Arena("background", 16 * GIB, lock=False, prefault="background",
                  prefault_rate=1 << 20)
    other = mmap.mmap(arena.fd, arena.nbytes, flags=mmap.MAP_SHARED)
    try:
        assert arena.backing is Backing.BACKING and arena.nbytes == 16 * GIB
        assert resident_nbytes(arena.fd) < GIB
        last = arena.nbytes - PAGE_NBYTES
        arena.slice(last, 5)[:] = b"tail!"  # far past the backing thread: backed by the touch
        assert other[last : last + 5] == b"tail!"
        assert arena.backing is Backing.BACKING and arena.backed_nbytes < arena.nbytes
    finally:
        other.close()
        arena.close()
    wait_for(lambda: arena.backing is Backing.STOPPED)


def test_background_backing_keeps_bytes_written_before_it_got_there() -> None:
    arena = Arena("keep", 64 << 20, lock=False, prefault="background", prefault_rate=64 << 20)
    try:
        last = arena.nbytes - PAGE_NBYTES
        arena.slice(last, PAGE_NBYTES)[:] = bytes(range(256)) * (PAGE_NBYTES // 256)
        wait_for(lambda: arena.backing is not Backing.BACKING)
        assert arena.backing is Backing.BACKED and arena.backed_nbytes == arena.nbytes
        assert resident_nbytes(arena.fd) >= arena.nbytes
        assert bytes(arena.slice(last, PAGE_NBYTES)) == bytes(range(256)) * (PAGE_NBYTES // 256)
    finally:
        arena.close()


def test_now_backs_everything_before_returning_and_lazy_backs_nothing() -> None:
    now = Arena("now", 8 << 20, lock=False, prefault="now")
    lazy = Arena("lazy", 8 << 20, lock=False, prefault="lazy")
    try:
        assert now.backing is Backing.BACKED and resident_nbytes(now.fd) >= now.nbytes
        assert lazy.backing is Backing.LAZY and resident_nbytes(lazy.fd) == 0
        lazy.slice(PAGE_NBYTES, 3)[:] = b"abc"
        assert resident_nbytes(lazy.fd) == PAGE_NBYTES and lazy.backed_nbytes == 0
    finally:
        now.close()
        lazy.close()


def test_closing_an_arena_stops_its_backing_thread_which_then_closes_the_fd() -> None:
    arena = Arena("closing", 4 * GIB, lock=False, prefault="background", prefault_rate=1 << 20)
    fd = arena.fd
    arena.close()
    wait_for(lambda: arena.backing is Backing.STOPPED)
    wait_for(lambda: not os.path.exists(f"/proc/self/fd/{fd}")
             or not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:offloadd:closing"))
    assert arena.backed_nbytes < arena.nbytes


def test_prefault_knobs_are_checked() -> None:
    with pytest.raises(ValueError, match=r"arena_prefault must be one of now\|background\|lazy"):
        DaemonConfig(arena_prefault="eager")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arena_prefault_rate"):
        DaemonConfig(arena_prefault_rate="fast")  # type: ignore[arg-type]
    size = DaemonConfig(arena_prefault_rate="1MiB")  # type: ignore[arg-type]  # TOML text
    assert size.arena_prefault_rate == 1 << 20


def lockable(nbytes: int) -> bool:
    """RLIMIT_MEMLOCK lets this process lock ``nbytes`` (the 8 MiB default holds what the
    tests below lock)."""
    return pages.mlock_allowed(nbytes)


def test_backing_threads_cover_every_page_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    chunk = 3 * PAGE_NBYTES
    monkeypatch.setattr(arena_module, "BACKING_CHUNK_NBYTES", chunk)
    backed: list[tuple[int, int]] = []
    back_range = Arena._back_range

    def recording(arena: Arena, offset: int, nbytes: int) -> None:
        backed.append((offset, nbytes))
        back_range(arena, offset, nbytes)

    monkeypatch.setattr(Arena, "_back_range", recording)
    nbytes = 7 * chunk + 2 * PAGE_NBYTES  # 8 chunks, the last short, for 3 threads
    arena = Arena("tiles", nbytes, lock=True, prefault="now", prefault_threads=3)
    try:
        assert arena.backing is Backing.BACKED and arena.backed_nbytes == nbytes
        assert arena.backing_threads == (3 if arena.locked else 1)
        ranges = sorted(backed)
        assert ranges[0][0] == 0 and len(ranges) == 8
        assert all(offset + size == after for (offset, size), (after, _) in
                   itertools.pairwise(ranges))
        assert sum(size for _, size in ranges) == nbytes and ranges[-1][1] == 2 * PAGE_NBYTES
        assert resident_nbytes(arena.fd) == nbytes
    finally:
        arena.close()


def test_a_failed_backing_withholds_every_page_it_could_not_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node runs short at the third chunk: from then on no shard is placed where its
    first write would take new memory. Pages a rank already wrote past the stop stay in
    use; the allocator then hands out exactly the pages the memfd holds, as the kernel
    counts them (st_blocks), and writing all of them takes no page more."""
    chunk = 4 * PAGE_NBYTES
    monkeypatch.setattr(arena_module, "BACKING_CHUNK_NBYTES", chunk)
    calls = itertools.count()
    monkeypatch.setattr(arena_module, "shortage",
                        lambda nbytes: "short" if next(calls) >= 2 else "")
    nbytes = 10 * chunk
    arena = Arena("short", nbytes, lock=False, prefault="background", prefault_threads=1)
    try:
        touched = 7 * chunk + PAGE_NBYTES  # a rank's first write, past the stop
        arena.view[touched : touched + 2 * PAGE_NBYTES] = b"\1" * (2 * PAGE_NBYTES)
        wait_for(lambda: arena.withhold_due and arena.backing is not Backing.BACKING)
        wait_for(lambda: arena._backers_running == 0)
        assert arena.backing is Backing.FAILED and arena.backed_nbytes == 2 * chunk
        held = arena.allocator.alloc(PAGE_NBYTES)  # a shard placed before the loop saw it
        assert held == 0
        arena.withhold_unbacked()
        allocator = arena.allocator
        assert not arena.withhold_due and arena.backing_error == "short"
        assert allocator.withheld_nbytes == nbytes - resident_nbytes(arena.fd)
        assert [(e.offset, e.nbytes) for e in allocator.free_extents()] == [
            (PAGE_NBYTES, 2 * chunk - PAGE_NBYTES), (touched, 2 * PAGE_NBYTES)]
        # Everything the allocator still hands out, written whole: no new page.
        resident = resident_nbytes(arena.fd)
        taken = []
        while (offset := allocator.alloc(PAGE_NBYTES)) is not None:
            arena.view[offset : offset + PAGE_NBYTES] = b"\2" * PAGE_NBYTES
            taken.append(offset)
        assert len(taken) * PAGE_NBYTES == 2 * chunk - PAGE_NBYTES + 2 * PAGE_NBYTES
        assert resident_nbytes(arena.fd) == resident
        # A range freed past the stop is checked the same way: its pages are backed now.
        allocator.free(touched, PAGE_NBYTES)
        arena.withhold_freed(touched, PAGE_NBYTES)
        assert allocator.alloc(PAGE_NBYTES) == touched
    finally:
        arena.close()


def test_a_lazy_arena_stops_handing_out_fresh_pages_once_the_node_is_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No thread backs a lazy arena: its pages come with the first write to each range
    the allocator hands out. Once the node is found short (read every
    PLACEMENT_CHECK_NBYTES of such pages), placing fails, the pages nobody wrote are
    withheld, and the shards already placed, written or not, keep their ranges."""
    monkeypatch.setattr(arena_module, "PLACEMENT_CHECK_NBYTES", 4 * PAGE_NBYTES)
    short = {"now": False}
    monkeypatch.setattr(arena_module, "shortage",
                        lambda nbytes: "node short" if short["now"] else "")
    arena = Arena("lazy", 64 * PAGE_NBYTES, lock=False, prefault="lazy")
    try:
        table = ShardTable("lazy", arena)
        shards = [table.create(0, f"s{i}", 2 * PAGE_NBYTES, "uint8") for i in range(32)]
        for shard in shards[:3]:  # 6 fresh pages: the node read once (at 4), room then
            assert table.place_unwritten(shard)
        written = shards[1].offset
        assert written is not None
        arena.view[written : written + 2 * PAGE_NBYTES] = b"\1" * (2 * PAGE_NBYTES)
        short["now"] = True
        assert not table.place_unwritten(shards[3])  # 4 fresh pages since: read, short
        assert arena.backing is Backing.FAILED and arena.backing_error == "node short"
        allocator = arena.allocator
        # Every free page held nothing: all withheld; the placed shards keep their ranges.
        assert allocator.withheld_nbytes == 64 * PAGE_NBYTES - 6 * PAGE_NBYTES
        assert allocator.free_nbytes == 0 and allocator.used_nbytes == 6 * PAGE_NBYTES
        assert shards[3].offset is None
        assert all(s.offset is not None for s in shards[:3])
        # A shard freed after that: its written pages come back, its unwritten ones not.
        table.unplace(shards[1])
        table.unplace(shards[0])
        assert allocator.free_nbytes == 2 * PAGE_NBYTES
        assert table.place_unwritten(shards[5]) and shards[5].offset == written
    finally:
        arena.close()


def test_a_small_nodes_arena_reads_its_memory_within_half_its_reserve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 512 MiB container keeps 16 MiB for everything but arenas: a lazy arena there reads
    the node's memory every 8 MiB of fresh pages, not every PLACEMENT_CHECK_NBYTES (32 MiB,
    which unchecked could take all of the reserve and more); a large node's arena every
    32 MiB."""
    reads: list[int] = []
    monkeypatch.setattr(arena_module, "shortage", lambda nbytes: reads.append(nbytes) or "")
    mib = 1 << 20
    for total, stride in ((512 * mib, 8 * mib), (64 << 30, arena_module.PLACEMENT_CHECK_NBYTES)):
        monkeypatch.setattr(arena_module, "node_memory",
                            lambda total=total: NodeMemory(total, total // 2, "MemTotal"))
        arena = Arena("small", 64 * mib, lock=False, prefault="lazy")
        try:
            assert arena.check_stride == stride
            table = ShardTable("small", arena)
            reads.clear()
            for index in range(64):
                assert table.place_unwritten(table.create(0, f"s{index}", mib, "uint8"))
            assert reads == [stride] * (64 * mib // stride)
        finally:
            arena.close()


def test_withheld_pages_come_back_once_the_node_has_room_and_stay_watched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A job whose pages were withheld looks for room (a placement that finds none): while
    the node is short, or sooner than RESTORE_CHECK_S after the withholding, nothing comes
    back; once it has room (the process that took its memory ended), every withheld page
    is handed out again, and the watch is on as in a lazy arena: the node short once more,
    the unwritten pages are withheld again, the written ones stay in use."""
    monkeypatch.setattr(arena_module, "PLACEMENT_CHECK_NBYTES", 4 * PAGE_NBYTES)
    clock = {"now": 1000.0}
    monkeypatch.setattr(arena_module.time, "monotonic", lambda: clock["now"])
    short = {"now": False}
    reads = []

    def shortage(nbytes: int) -> str:
        reads.append(nbytes)
        return "node short" if short["now"] else ""

    monkeypatch.setattr(arena_module, "shortage", shortage)
    arena = Arena("back", 64 * PAGE_NBYTES, lock=False, prefault="lazy")
    try:
        table = ShardTable("back", arena)
        allocator = arena.allocator
        shards = [table.create(0, f"s{i}", 2 * PAGE_NBYTES, "uint8") for i in range(32)]
        for shard in shards[:3]:  # 6 fresh pages: the node read once (at 4), room then
            assert table.place_unwritten(shard)
        short["now"] = True
        assert not table.place_unwritten(shards[3])  # 4 fresh pages: read, short, withheld
        assert allocator.withheld_nbytes == 58 * PAGE_NBYTES
        # Short still, and too soon: the node's memory is not even read.
        reads.clear()
        assert not table.place_unwritten(shards[3])
        clock["now"] += arena_module.RESTORE_CHECK_S
        assert not table.place_unwritten(shards[3])  # read now: short, nothing back
        assert reads == [4 * PAGE_NBYTES] and allocator.withheld_nbytes == 58 * PAGE_NBYTES
        assert not table.place_unwritten(shards[3]) and len(reads) == 1  # not read again
        # The node has room again: everything comes back at the next look.
        short["now"] = False
        clock["now"] += arena_module.RESTORE_CHECK_S
        assert table.place_unwritten(shards[3])
        assert allocator.withheld_nbytes == 0 and arena.restored_nbytes == 58 * PAGE_NBYTES
        assert allocator.free_nbytes == 64 * PAGE_NBYTES - 8 * PAGE_NBYTES
        written = shards[3].offset
        assert written is not None
        arena.view[written : written + 2 * PAGE_NBYTES] = b"\1" * (2 * PAGE_NBYTES)
        # Watched as before: 4 fresh pages later the node is short again.
        short["now"] = True
        assert not table.place_unwritten(shards[4])  # 2 + 2 fresh pages: read, short
        assert allocator.withheld_nbytes == 64 * PAGE_NBYTES - 8 * PAGE_NBYTES
        table.unplace(shards[3])  # written: its pages are backed and come back as free
        assert allocator.free_nbytes == 2 * PAGE_NBYTES
    finally:
        arena.close()


@pytest.mark.skipif(not lockable(4 << 20), reason="RLIMIT_MEMLOCK below 4 MiB")
def test_a_locked_arena_is_mapped_and_locked_page_for_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena_module, "BACKING_CHUNK_NBYTES", 5 * PAGE_NBYTES)
    nbytes = (2 << 20) + 3 * PAGE_NBYTES  # not a whole number of chunks, nor of threads
    _assert_backed_and_locked_page_for_page("locked-pages", nbytes, threads=4)


@pytest.mark.skipif(not lockable(4 << 20), reason="RLIMIT_MEMLOCK below 4 MiB")
def test_without_mlock2_or_populate_each_chunk_is_fallocated_and_mlocked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel before 5.14 (no MADV_POPULATE_WRITE) or 4.4 (no mlock2): the old way."""
    monkeypatch.setattr(arena_module, "BACKING_CHUNK_NBYTES", 5 * PAGE_NBYTES)
    monkeypatch.setattr(pages, "lock_on_fault", lambda address, nbytes: None)
    nbytes = (2 << 20) + 3 * PAGE_NBYTES
    _assert_backed_and_locked_page_for_page("old-kernel", nbytes, threads=3)
    monkeypatch.undo()
    monkeypatch.setattr(arena_module, "BACKING_CHUNK_NBYTES", 5 * PAGE_NBYTES)
    monkeypatch.setattr(pages, "populate_write", lambda address, nbytes: False)
    _assert_backed_and_locked_page_for_page("no-populate", nbytes, threads=3)


def _assert_backed_and_locked_page_for_page(name: str, nbytes: int, *, threads: int) -> None:
    """A locked arena of ``nbytes`` backed now by ``threads`` threads: every page of its
    memfd is resident, and every page of its mapping here is mapped and locked."""
    arena = Arena(name, nbytes, lock=True, prefault="now", prefault_threads=threads)
    try:
        assert arena.locked and arena.backing is Backing.BACKED
        assert resident_nbytes(arena.fd) == nbytes
        kib = mapping_kib("self", containing(arena.address))
        assert kib["Size"] * 1024 == nbytes
        assert kib["Rss"] * 1024 == nbytes and kib["Locked"] * 1024 == nbytes
    finally:
        arena.close()


def test_an_unlocked_arena_is_backed_by_one_thread_without_mapping_its_pages() -> None:
    arena = Arena("unlocked", 4 << 20, lock=False, prefault="now", prefault_threads=4)
    try:
        assert arena.backing_threads == 1 and resident_nbytes(arena.fd) == arena.nbytes
        assert mapping_kib("self", containing(arena.address))["Rss"] == 0
    finally:
        arena.close()


def test_prefault_threads_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="prefault_threads must be >= 0"):
        Arena("negative", 1 << 20, prefault_threads=-1)
    with pytest.raises(ValueError, match="arena_prefault_threads must be >= 0"):
        DaemonConfig(arena_prefault_threads=-1)


# -- daemon -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_backing_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    instance = start_daemon(tmp_path_factory.mktemp("offloadd"), arena_size=LARGE_ARENA_NBYTES
                            + GIB, extra_args=["--arena-prefault-rate", "1MiB"])
    yield instance
    assert instance.stop() == 0  # stops while the 12 GiB arena is still being backed


def connect(daemon: PrivateDaemon, job: str, rank: int, nbytes: int,
            world_size: int = 2) -> OffloadClient:
    # A timeout far below the seconds that backing 12 GiB takes anywhere (>= 6 s): a
    # hello that waited for the backing would fail here, on any machine.
    return OffloadClient.connect(daemon.socket_path, job=job, rank=rank,
                                 world_size=world_size, local_rank=rank, arena_nbytes=nbytes,
                                 timeout_s=5.0)


def test_every_rank_gets_its_hello_while_a_large_arena_is_being_backed(
        slow_backing_daemon: PrivateDaemon) -> None:
    first = connect(slow_backing_daemon, "big", 0, LARGE_ARENA_NBYTES)
    second = connect(slow_backing_daemon, "big", 1, LARGE_ARENA_NBYTES)
    try:
        stats = second.stats()
        assert stats["arena_nbytes"] == LARGE_ARENA_NBYTES and stats["sessions"] == 2
        assert stats["arena_backing"] == "backing"
        assert stats["arena_backed_nbytes"] < LARGE_ARENA_NBYTES // 2
        # A shard placed past what is backed: the rank's and the daemon's touches back it.
        first.alloc("pad", 8 * GIB, "uint8")
        first.put("tail", b"written before the backing got here")
        assert first.get("tail") == b"written before the backing got here"
        assert first.stats()["arena_backing"] == "backing"
    finally:
        for client in (first, second):  # the job is freed when its last rank closes it
            client.close_job()
            client.close()


def test_a_job_says_hello_while_another_jobs_arena_is_being_backed(
        slow_backing_daemon: PrivateDaemon) -> None:
    builder = connect(slow_backing_daemon, "building", 0, LARGE_ARENA_NBYTES, world_size=1)
    try:
        assert builder.stats()["arena_backing"] == "backing"
        other = connect(slow_backing_daemon, "other", 0, 4 << 20, world_size=1)
        try:
            other.put("x", b"other job")
            assert other.get("x") == b"other job"
            assert other.stats()["arena_nbytes"] == 4 << 20
        finally:
            other.close()
        assert builder.stats()["arena_backing"] == "backing"
    finally:
        builder.close_job()
        builder.close()


def test_a_rank_pins_past_a_slow_backing_without_waiting_for_it(
        slow_backing_daemon: PrivateDaemon) -> None:
    # Registering faults every page in, as cudaHostRegister does: 12 GiB of this host's
    # memory. This test is about the wait, so its twin registers without faulting.
    twin = TwinCopyEngine(populate_on_register=False)
    backend = DaemonBackend(connect(slow_backing_daemon, "pin-slow", 0, LARGE_ARENA_NBYTES,
                                    world_size=1), collectives=Collectives(), copies=twin)
    try:  # 1 MiB/s is far below the rate a rank waits for: it pinned while backing went on
        assert backend.arena_pinned == "pinned"
        assert backend.stats()["arena_backing"] == "backing"
    finally:
        backend.client.close_job()
        backend.close()
        twin.close()


def test_a_rank_waits_for_a_backing_that_progresses_before_it_pins(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Any progress counts as fast here, so the test does not hang on this host's speed.
    monkeypatch.setattr(daemon_backend, "PIN_WAIT_MIN_NBYTES_PER_S", 1)
    daemon = start_daemon(tmp_path, arena_size=256 << 20,
                          extra_args=["--arena-prefault-rate", "128MiB"])
    twin = TwinCopyEngine()
    backend = DaemonBackend(connect(daemon, "pin-wait", 0, 192 << 20, world_size=1),
                            collectives=Collectives(), copies=twin)
    try:
        stats = backend.stats()
        assert stats["arena_backing"] == "backed" and stats["rank_arena_pinned"] == "pinned"
        assert stats["arena_backed_nbytes"] == 192 << 20
    finally:
        backend.client.close_job()
        backend.close()
        twin.close()
        assert daemon.stop() == 0


LOCKED_ARENA_NBYTES = (6 << 20) + 3 * PAGE_NBYTES
"""Under the 8 MiB RLIMIT_MEMLOCK most users get, and two chunks at the 16 MiB/s rate below
(a chunk is a quarter of a second's worth), the second one short."""


@pytest.mark.skipif(not lockable(LOCKED_ARENA_NBYTES), reason="RLIMIT_MEMLOCK below 7 MiB")
def test_the_daemon_backs_and_locks_every_page_of_a_new_arena(tmp_path) -> None:
    daemon = start_daemon(tmp_path, arena_size=16 << 20,
                          extra_args=["--arena-prefault-threads", "3",
                                      "--arena-prefault-rate", "16MiB"])
    client = connect(daemon, "locked", 0, LOCKED_ARENA_NBYTES, world_size=1)
    try:
        wait_for(lambda: client.stats()["arena_backing"] != "backing")
        stats = client.stats()
        assert stats["arena_backing"] == "backed" and stats["arena_locked"] is True
        assert stats["arena_backed_nbytes"] == LOCKED_ARENA_NBYTES
        kib = mapping_kib(daemon.process.pid, memfd_named("offloadd:locked"))
        assert kib["Rss"] * 1024 == LOCKED_ARENA_NBYTES == kib["Locked"] * 1024
        with open(f"/proc/{daemon.process.pid}/status") as status:
            locked_kib = next(int(line.split()[1]) for line in status
                              if line.startswith("VmLck:"))
        assert locked_kib * 1024 >= LOCKED_ARENA_NBYTES
    finally:
        client.close_job()
        client.close()
        assert daemon.stop() == 0
