"""Per-uid shares of what a node has a fixed amount of, against the real daemon and a real
second uid (``nobody``): descriptors (sized from the daemon's RLIMIT_NOFILE, set low here
with prlimit), shard metadata (scaled from the uid's arenas) and the DRAM budget (a fair
share; lingering arenas of a uid past its share are freed first for a uid within its own).
Each test is an attack from issue 32 (or its EMFILE) that got through before them."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _uids import become
from conftest import call, raw_socket, start_daemon, wait_bounce_backed
from test_daemon_limits import NOBODY, as_nobody_until_refused, nobody_daemon, rejections
from test_daemon_sessions import as_uid, open_to_everyone

from offloadd import protocol as p
from offloadd.errors import LimitExceededError, OffloadError, OverBudgetError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.service.limits import SHARD_METADATA_NBYTES, metadata_limit
from offloadd.service.registry import JobRegistry
from trainer.client import OffloadClient

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
MiB = 1 << 20
FOUR_KIB_PAGES = 'arena_hugepages = "off"\n'
"""The budget arithmetic here counts arenas at their asked sizes: a concurrent test that
reserves huge pages would otherwise round these daemons' arenas up to 2 MiB ("auto")."""


def limit_descriptors(daemon: PrivateDaemon, nofile: int) -> None:
    """What an operator's prlimit does to the running daemon: its soft RLIMIT_NOFILE (the
    one open() checks) becomes ``nofile``; the hard one stays, so it can be raised again."""
    _soft, hard = resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(daemon.process.pid, resource.RLIMIT_NOFILE, (nofile, hard))


def open_fds(daemon: PrivateDaemon) -> list[int]:
    return sorted(int(fd) for fd in os.listdir(f"/proc/{daemon.process.pid}/fd"))


def lingering_tiny_job(socket_path: str, index: int) -> None:
    """A job with a one-page arena whose rank leaves at once: it lingers."""
    OffloadClient.connect(socket_path, job=f"tiny-{index}", arena_nbytes=4096).close()


# -- descriptors ------------------------------------------------------------------------


def test_lingering_jobs_of_one_uid_leave_descriptors_for_everyone_else(tmp_path: Path) -> None:
    """Issue 32 item 1: tiny lingering jobs of one uid took the daemon to 254 of 256 fds
    and another uid's hello failed with an untyped internal OSError(24)."""
    with nobody_daemon(tmp_path, FOUR_KIB_PAGES, arena_size="64MiB") as daemon:
        limit_descriptors(daemon, 256)
        outcome = as_nobody_until_refused(daemon.socket_path, 200, lingering_tiny_job)
        assert outcome.startswith("refused after") and "max_fds_per_uid" in outcome, outcome
        assert "RLIMIT_NOFILE of 256" in outcome, outcome
        assert len(open_fds(daemon)) < 256 // 2 + 32  # its share, and the daemon's own
        with OffloadClient.connect(daemon.socket_path, job="root-job", arena_nbytes=4096) as c:
            c.put("x", b"served")
            assert c.get("x") == b"served"
        assert rejections(daemon, "max_fds_per_uid") == 1
        # root fills its own share the same way: refused with a typed limit, never internal
        with pytest.raises(LimitExceededError, match=r"max_fds_per_uid|RLIMIT_NOFILE"):
            for index in range(1000, 1200):
                lingering_tiny_job(daemon.socket_path, index)


def test_a_hello_that_finds_no_descriptor_left_gets_a_limit_error(tmp_path: Path) -> None:
    """The daemon's RLIMIT_NOFILE lowered under what it holds (an operator's prlimit): a
    new job's hello is refused with `limit` naming RLIMIT_NOFILE, and once the limit is
    back the daemon serves again."""
    with start_daemon(None, arena_size="64MiB", extra_args=["--arena-hugepages", "off"]) as daemon:
        with OffloadClient.connect(daemon.socket_path, job="before", arena_nbytes=4096) as c:
            c.put("x", b"kept")
            limit_descriptors(daemon, max(open_fds(daemon)) + 3)
            with pytest.raises(LimitExceededError, match="RLIMIT_NOFILE"):
                OffloadClient.connect(daemon.socket_path, job="starved", arena_nbytes=4096,
                                      timeout_s=10)
            assert c.get("x") == b"kept"  # the attached job is still served
        limit_descriptors(daemon, 4096)
        with OffloadClient.connect(daemon.socket_path, job="after", arena_nbytes=4096) as c:
            c.put("y", b"ok")


@contextmanager
def descriptors_left(count: int) -> Iterator[None]:
    """This process may open ``count`` more descriptors (its soft RLIMIT_NOFILE lowered)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.dup(0)  # the lowest free descriptor number: every one below is taken
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest + count, hard))
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        os.close(lowest)


def test_an_arena_that_gets_no_descriptor_is_a_limit_error() -> None:
    """EMFILE while a new job's arena is made is a typed `limit` error, not OSError."""
    registry = JobRegistry(4 * MiB, 0.5, lock=False)
    with descriptors_left(0), pytest.raises(LimitExceededError, match="RLIMIT_NOFILE"):
        registry.open("starved", 4096)
    assert "starved" not in registry.jobs and registry.reserved_nbytes == 0
    job, created = registry.open("fed", 4096)
    assert created and job.arena.nbytes == 4096
    registry.close()


# -- shard metadata ----------------------------------------------------------------------


def rss_nbytes(daemon: PrivateDaemon) -> int:
    for line in Path(f"/proc/{daemon.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_shard_metadata_is_bounded_by_what_the_uids_arenas_justify(tmp_path: Path,
                                                                   swap_root: Path) -> None:
    """Issue 32 item 3: two 4 KiB-arena jobs of one uid allocated 200,000 shards each and
    the daemon grew by 287 MiB. Now the uid stops at its metadata share, while a uid with
    larger arenas may hold more."""
    config = tmp_path / "offloadd.toml"
    config.write_text(f"allowed_uids = [{NOBODY}]\n")
    daemon = PrivateDaemon.start(None, arena_size="64MiB", swap_dirs=[str(swap_root)],
                                 extra_args=["--config", str(config)])
    open_to_everyone(daemon)
    with daemon:
        before = rss_nbytes(daemon)

        def many_shards() -> str:
            created = 0
            for job in ("meta-a", "meta-b"):
                client = OffloadClient.connect(daemon.socket_path, job=job, arena_nbytes=4096)
                try:
                    for start in range(0, 200_000, 20_000):
                        client.alloc([f"s{i}" for i in range(start, start + 20_000)], 1)
                        created += 20_000
                except LimitExceededError as exc:
                    return f"refused after {created}: {exc}"
            return "never refused"

        outcome = as_uid(NOBODY, many_shards)
        assert outcome.startswith("refused after") and "max_metadata_nbytes_per_uid" in outcome, \
            outcome
        allowed = metadata_limit(512 * MiB, 2 * 4096) // SHARD_METADATA_NBYTES
        assert int(outcome.split()[2].rstrip(":")) <= allowed
        # The shards outgrew the arenas: the swap tier backed its staging slots meanwhile
        # (offloadd.swap.bounce), memory that is not the shards'.
        bounce = wait_bounce_backed(daemon.socket_path)
        staging = bounce.get("prefaulted_slots", 0) * bounce.get("slot_nbytes", 0)
        assert rss_nbytes(daemon) - before - staging < 64 * MiB
        # a uid whose arena is larger may hold more shards than the small one could
        with OffloadClient.connect(daemon.socket_path, job="root-big", arena_nbytes=48 * MiB) as c:
            for start in range(0, 30_000, 10_000):  # more than the small one's share
                c.alloc([f"r{i}" for i in range(start, start + 10_000)], 1)
            assert c.stats()["num_shards"] == 30_000 > allowed


# -- the DRAM budget ---------------------------------------------------------------------


def arena_nbytes(client: OffloadClient) -> int:
    return client.arena.nbytes


def twelve_default_hellos(socket_path: str, keep: list[OffloadClient]) -> list[int]:
    """Issue 32 item 6's attack: 12 hellos naming no size reserve 63 of 64 MiB."""
    sizes = []
    for index in range(12):
        client = OffloadClient.connect(socket_path, job=f"hog-{index}")
        sizes.append(arena_nbytes(client))
        keep.append(client)
    return sizes


def until_no_rank_attached(daemon: PrivateDaemon, jobs: list[str]) -> None:
    """Return once the daemon has seen every session of ``jobs`` end (as root sees them)."""
    admin = raw_socket(daemon.socket_path)
    while True:
        status = call(admin, p.NodeStatus(1))
        assert isinstance(status, p.StatsOk), status
        if all(status.stats["jobs"][job]["sessions"] == 0 for job in jobs):
            admin.close()
            return


def test_lingering_arenas_of_a_uid_past_its_share_are_freed_for_another(tmp_path: Path) -> None:
    """One uid's 12 default-size hellos took 63 of 64 MiB and lingered; another uid got
    `over_budget` (or a one-page arena). Now its hello frees the lingering arenas of the uid
    past its share, oldest first, and gets its own share's worth."""
    with nobody_daemon(tmp_path, FOUR_KIB_PAGES, arena_size="64MiB") as daemon:
        def hog_and_leave() -> str:
            keep: list[OffloadClient] = []
            sizes = twelve_default_hellos(daemon.socket_path, keep)
            for client in keep:
                client.close()
            return str(sum(sizes))

        assert int(as_uid(NOBODY, hog_and_leave)) > 63 * MiB
        until_no_rank_attached(daemon, [f"hog-{index}" for index in range(12)])
        with OffloadClient.connect(daemon.socket_path, job="default-size") as c:
            assert arena_nbytes(c) >= 16 * MiB  # half of its 32 MiB share, not what was free
        with OffloadClient.connect(daemon.socket_path, job="sized", arena_nbytes=16 * MiB) as c:
            c.put("x", b"fits")
        log = Path(daemon.log_path).read_text()
        assert "event=arena_reclaimed job=hog-0" in log  # the one lingering longest
        assert "job=hog-11" not in log.split("event=arena_reclaimed", 1)[1]


@contextmanager
def held_as_nobody(action: Callable[[], str]) -> Iterator[str]:
    """Run ``action`` in a child as ``nobody`` that keeps what it opened (its connections)
    until the block ends; yields what ``action`` returned."""
    report_read, report_write = os.pipe()
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            become(NOBODY)
            outcome = action()
        except BaseException as exc:
            outcome = f"error: {exc!r}"
        os.write(report_write, outcome.encode() + b"\n")
        os.read(go_read, 1)
        os._exit(0)
    os.close(report_write)
    os.close(go_read)
    with os.fdopen(report_read, "rb") as report:
        try:
            yield report.readline().decode().strip()
        finally:
            os.write(go_write, b"x")
            os.close(go_write)
            os.waitpid(pid, 0)


def test_over_budget_says_the_share_and_who_holds_it(tmp_path: Path) -> None:
    """While one uid's jobs hold the budget with their ranks attached, another uid's hello
    is refused naming its share and the holders by count (not their job names); the holder
    may not grow past its share while the other waits; once its ranks leave, their
    lingering arenas are freed for the waiting uid."""
    with nobody_daemon(tmp_path, FOUR_KIB_PAGES, arena_size="64MiB") as daemon:
        hog: list[OffloadClient] = []

        def hog_and_stay() -> str:
            return str(sum(twelve_default_hellos(daemon.socket_path, hog)))

        with held_as_nobody(hog_and_stay) as held:
            assert int(held) > 63 * MiB
            with pytest.raises(OverBudgetError) as refused:
                OffloadClient.connect(daemon.socket_path, job="waits", arena_nbytes=16 * MiB)
            message = str(refused.value)
            assert "its share is 33554432" in message and "divided among 2 uids" in message
            assert "1 other uids hold" in message and "in 12 jobs" in message, message
            assert "hog" not in message

            def grow() -> str:
                try:
                    OffloadClient.connect(daemon.socket_path, job="more", arena_nbytes=8192)
                except OverBudgetError as exc:
                    return f"refused: {exc}"
                return "grew"

            assert "other uids wait" in as_uid(NOBODY, grow)
        until_no_rank_attached(daemon, [f"hog-{index}" for index in range(12)])
        with OffloadClient.connect(daemon.socket_path, job="waits", arena_nbytes=16 * MiB) as c:
            c.put("x", b"room")
        assert rejections(daemon, "max_arena_nbytes_per_uid") == 2


def test_a_configured_share_caps_every_uid(tmp_path: Path) -> None:
    """``max_arena_nbytes_per_uid`` bounds one uid's arenas, with free room left over: its
    own lingering ones are freed for its new ones (a run killed before it closed its job,
    restarted under a fresh name), oldest first, and a live one past the cap is refused;
    another uid still gets its own."""
    with nobody_daemon(tmp_path, FOUR_KIB_PAGES + 'max_arena_nbytes_per_uid = "8MiB"\n',
                       arena_size="64MiB") as daemon:
        def leave_two() -> str:
            for index in range(2):
                OffloadClient.connect(daemon.socket_path, job=f"left-{index}",
                                      arena_nbytes=4 * MiB).close()  # no close_job: lingers
            return "left"

        def three_live() -> str:
            live = []
            try:
                for index in range(3):
                    live.append(OffloadClient.connect(daemon.socket_path, job=f"live-{index}",
                                                      arena_nbytes=4 * MiB))
            except OffloadError as exc:
                return f"{len(live)} live, refused: {type(exc).__name__}: {exc}"
            finally:
                for client in live:
                    client.close()
            return "never refused"

        assert as_uid(NOBODY, leave_two) == "left"
        until_no_rank_attached(daemon, ["left-0", "left-1"])
        outcome = as_uid(NOBODY, three_live)
        assert outcome.startswith("2 live, refused: OverBudgetError"), outcome
        assert "live jobs hold 8388608 bytes" in outcome, outcome
        assert "max_arena_nbytes_per_uid (8388608)" in outcome, outcome
        reclaimed = [line.partition(" job=")[2].split()[0]
                     for line in Path(daemon.log_path).read_text().splitlines()
                     if "event=arena_reclaimed" in line]
        assert reclaimed == ["left-0", "left-1"], reclaimed
        with OffloadClient.connect(daemon.socket_path, job="root-own", arena_nbytes=8 * MiB) as c:
            c.put("x", b"its own share")
