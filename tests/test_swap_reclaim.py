"""Swap space is given back: jobs that end, a private daemon's exit, one daemon per swap dir,
and a tight swap budget that refuses with the size it needs instead of wedging."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offloadd.config import DaemonConfig
from offloadd.errors import OverBudgetError
from offloadd.memory.shards import Lease, Shard
from offloadd.ops.embedded import PrivateDaemon
from offloadd.protocol import Placed
from offloadd.service.jobs import Job
from offloadd.service.server import Daemon
from trainer.client import OffloadClient

ARENA_NBYTES = 4 << 20
SHARD_NBYTES = 1 << 20
CYCLES = int(os.environ.get("OFFLOADD_SWAP_CYCLES", "6"))


def job_dirs(swap: Path) -> list[str]:
    root = swap / "offloadd"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


async def train(job: Job, num_shards: int, round_: int) -> None:
    """Write every shard (four times the arena: most of it goes to swap), then read it back."""
    for index in range(num_shards):
        leases: dict[Shard, Lease] = {}
        placed = job.alloc(0, [f"s{index}"], [SHARD_NBYTES], ["uint8"], leases, "w")
        if not isinstance(placed, Placed):
            placed = await placed
        job.arena.slice(placed.offsets[0], SHARD_NBYTES)[:8] = bytes([round_, index] * 4)
        job.release(0, [f"s{index}"], True, leases)
    for index in range(num_shards):
        leases = {}
        placed = job.acquire(0, [f"s{index}"], "r", leases)
        if not isinstance(placed, Placed):
            placed = await placed
        assert bytes(job.arena.slice(placed.offsets[0], 8)) == bytes([round_, index] * 4)
        job.release(0, [f"s{index}"], False, leases)


def test_jobs_that_end_give_their_swap_back_over_many_cycles(tmp_path: Path, run_async) -> None:
    swap = tmp_path / "swap"

    async def cycles() -> None:
        config = DaemonConfig(socket=str(tmp_path / "d.sock"), arena_size=4 * ARENA_NBYTES,
                              swap_dirs=[str(swap)], swap_size=64 << 20, chunk_size=1 << 20,
                              io_engine="python", mlock=False, arena_hugepages="off")
        daemon = Daemon(config)
        await daemon.start()
        try:
            for round_ in range(CYCLES):
                jobs = [daemon.open_job(f"job{round_}-{i}", ARENA_NBYTES) for i in range(2)]
                for job in jobs:
                    await train(job, 4 * ARENA_NBYTES // SHARD_NBYTES, round_)
                    assert job.swap_usage()[0] > 0
                if round_ % 2:
                    await jobs[0].flush("kept")
                for job in jobs:
                    daemon.jobs.close_job(job.name)
                    await daemon.swap.release_job(job.name)
                assert job_dirs(swap) == []
                assert [d.reserved_nbytes for d in daemon.swap.dirs] == [0]
                assert daemon.swap.tiers == {}
            # A released job's name can start again: nothing stale is left to refuse it.
            await train(daemon.open_job("job0-0", ARENA_NBYTES), 2, 99)
        finally:
            await daemon.stop()

    run_async(cycles(), 60)


def test_release_keeps_a_flushed_job_for_recover_when_asked(tmp_path: Path, run_async) -> None:
    swap = tmp_path / "swap"

    async def scenario() -> None:
        config = DaemonConfig(socket=str(tmp_path / "d.sock"), arena_size=2 * ARENA_NBYTES,
                              swap_dirs=[str(swap)], chunk_size=1 << 20, io_engine="python",
                              mlock=False, arena_hugepages="off")
        daemon = Daemon(config)
        await daemon.start()
        try:
            flushed, scratch = (daemon.open_job(n, ARENA_NBYTES) for n in ("flushed", "scratch"))
            for job in (flushed, scratch):
                await train(job, 6, 1)
            await flushed.flush(None)
            for job in (flushed, scratch):
                daemon.jobs.close_job(job.name)
                await daemon.swap.release_job(job.name, keep_flushed=True)
            assert job_dirs(swap) == ["flushed"]
        finally:
            await daemon.stop()

    run_async(scenario(), 60)


def test_a_private_daemon_removes_the_swap_files_it_created_at_exit(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    with PrivateDaemon.start(tmp_path / "d", arena_size=2 * ARENA_NBYTES, swap_dirs=[str(swap)],
                             release_swap_at_exit=True) as daemon:
        for name in ("a", "b"):
            client = OffloadClient.connect(daemon.socket_path, job=name,
                                           arena_nbytes=ARENA_NBYTES)
            for index in range(8):
                client.put(f"s{index}", os.urandom(SHARD_NBYTES))
            if name == "a":
                client.flush()
            client.close()
        assert job_dirs(swap) == ["a", "b"]
    assert daemon.process.returncode == 0
    assert job_dirs(swap) == []


def test_a_second_daemon_on_the_same_swap_dir_is_refused_naming_the_dir_and_holder(
        tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    with PrivateDaemon.start(tmp_path / "d1", swap_dirs=[str(swap)]) as first:
        second = subprocess.run(
            [sys.executable, "-m", "offloadd", "serve", "--socket", str(tmp_path / "d2.sock"),
             "--arena-size", "64MiB", "--swap-dir", str(swap)],
            capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert f"swap dir {swap.resolve()} is in use" in second.stderr
        assert f"pid {first.process.pid}" in second.stderr
        client = OffloadClient.connect(first.socket_path, job="still", arena_nbytes=ARENA_NBYTES)
        client.put("x", b"served")
        assert client.get("x") == b"served"
        client.close()
    # The lock dies with its holder: the next daemon takes the dir.
    with PrivateDaemon.start(tmp_path / "d3", swap_dirs=[str(swap)]):
        pass


def test_a_tight_swap_size_refuses_with_the_size_needed_and_never_wedges(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap_nbytes = 3 * SHARD_NBYTES
    with PrivateDaemon.start(tmp_path / "d", arena_size=2 * ARENA_NBYTES, swap_dirs=[str(swap)],
                             extra_args=["--swap-size", str(swap_nbytes)]) as daemon:
        client = OffloadClient.connect(daemon.socket_path, job="tight", arena_nbytes=ARENA_NBYTES)
        written: dict[str, bytes] = {}
        with pytest.raises(OverBudgetError) as refused:
            for index in range(4 * ARENA_NBYTES // SHARD_NBYTES):
                payload = os.urandom(SHARD_NBYTES)
                client.put(f"s{index}", payload)
                written[f"s{index}"] = payload
        message = str(refused.value)
        needed = int(re.search(r"at least (\d+) bytes", message).group(1))
        assert needed > swap_nbytes
        assert "--swap-size" in message and "copy-on-write" in message
        # Nothing wedged: the daemon answers, dropping makes room again, and what was
        # committed and kept reads back.
        dropped = list(written)[: len(written) // 2]
        client.drop(dropped)
        for shard_id in dropped:
            del written[shard_id]
        for shard_id, payload in written.items():
            assert client.get(shard_id) == payload
        client.put("after", b"room again")
        assert client.get("after") == b"room again"
        client.close()


def test_private_daemons_of_two_jobs_share_an_nvme_path_and_leave_it_empty(
        tmp_path: Path) -> None:
    from _dist import base_config

    from trainer.config import parse_config
    from trainer.offload.daemon_connect import _start_private_daemon

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    config = parse_config(base_config(zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}))
    daemons = [_start_private_daemon(config, name, 2 * ARENA_NBYTES) for name in ("j1", "j2")]
    try:
        for name, daemon in zip(("j1", "j2"), daemons):
            client = OffloadClient.connect(daemon.socket_path, job=name,
                                           arena_nbytes=ARENA_NBYTES)
            for index in range(8):
                client.put(f"s{index}", os.urandom(SHARD_NBYTES))
            client.close()
        assert len(list(nvme.iterdir())) == 2  # one locked scratch dir per private daemon
    finally:
        for daemon in daemons:
            daemon.stop()
    assert list(nvme.iterdir()) == []


def test_a_mistyped_nvme_path_leaves_no_dirs_behind_but_those_in_use(tmp_path: Path) -> None:
    """An nvme_path whose dirs do not exist (a typo, an unmounted disk) is created for the
    job; its private daemon removes the dirs it created once they are empty, deepest first,
    and keeps one another job's daemon still swaps into. The workdir's the same."""
    from _dist import base_config

    from trainer.config import parse_config
    from trainer.offload.daemon_connect import _start_private_daemon

    def start(nvme: Path, workdir: Path, job: str) -> PrivateDaemon:
        config = parse_config(base_config(
            offloadd={"workdir": str(workdir)},
            zero_optimization={"stage": 3,
                               "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}}))
        daemon = _start_private_daemon(config, job, 2 * ARENA_NBYTES)
        with OffloadClient.connect(daemon.socket_path, job=job,
                                   arena_nbytes=ARENA_NBYTES) as client:
            for index in range(8):  # twice the arena: half of it is swapped out
                client.put(f"s{index}", os.urandom(SHARD_NBYTES))
        return daemon

    alone = start(tmp_path / "mnt" / "nvme0" / "offload", tmp_path / "run" / "a", "alone")
    assert len(list((tmp_path / "mnt" / "nvme0" / "offload").iterdir())) == 1
    alone.stop()
    assert list(tmp_path.iterdir()) == []

    typo = tmp_path / "mnt" / "nvme1" / "offload"
    first = start(typo, tmp_path / "run" / "a", "j1")
    # Another job's path below the first's: dirs of its own inside the ones the first made.
    second = start(typo / "other", tmp_path / "run" / "b", "j2")
    try:
        first.stop()
        # The first's scratch dirs are gone, and of the dirs it made those the second uses
        # stay.
        assert [p.name for p in typo.iterdir()] == ["other"]
        assert len(list((typo / "other").iterdir())) == 1
        assert [p.name for p in (tmp_path / "run").iterdir()] == ["b"]
    finally:
        first.stop()
        second.stop()
    # The second removes only what it made: the first's dirs, empty now, stay behind.
    assert not (typo / "other").exists() and not (tmp_path / "run" / "b").exists()
    assert [p for p in tmp_path.rglob("*") if not p.is_dir()] == []


def test_a_marker_cannot_name_a_dir_outside_its_own_chain(tmp_path: Path) -> None:
    """The made dirs a scratch marker names are taken only when they lie above the scratch
    dir, and removed only while empty: an edited marker naming a sibling (or a dir
    above that holds something) removes nothing of it."""
    from offloadd.swap.swapdirs import claim_scratch_dir, make_scratch_dir, release_scratch_dir

    sibling, made = tmp_path / "sibling", tmp_path / "made"
    sibling.mkdir()
    made.mkdir()
    (tmp_path / "kept.txt").write_text("not the daemon's")
    scratch = Path(make_scratch_dir(made, "s-", [str(made), str(sibling), str(tmp_path)]))
    claim = claim_scratch_dir(scratch)
    assert claim.made_parents == (made, tmp_path)
    release_scratch_dir(claim)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "sibling"]


def test_a_parent_another_daemon_removed_is_made_again(tmp_path: Path) -> None:
    """Two engines (or jobs) on one ``nvme_path`` that neither found: the first one's
    daemon, exiting, removes the parent it made once it is empty, which it is between the
    next launcher's ``make_dirs`` and its scratch dir. Seen in Lightning's validate-then-fit
    under load: ``FileNotFoundError`` for the new scratch dir. The parent is made again and
    the scratch dir records it as made for it, so its daemon removes it in turn."""
    from offloadd.swap.swapdirs import (
        claim_scratch_dir,
        make_dirs,
        make_scratch_dir,
        release_scratch_dir,
    )

    swap = tmp_path / "run" / "swap"
    made = make_dirs(swap)
    assert made == [str(swap), str(swap.parent)]
    first = claim_scratch_dir(Path(make_scratch_dir(swap, "first-", made)))
    second_made = make_dirs(swap)  # the next engine: the parent is there, not its own
    assert second_made == []
    release_scratch_dir(first)  # the first daemon's exit removes what it made
    assert not swap.parent.exists()
    second = claim_scratch_dir(Path(make_scratch_dir(swap, "second-", second_made)))
    assert second.path.parent == swap
    assert second.made_parents == (swap, swap.parent)
    release_scratch_dir(second)
    assert list(tmp_path.iterdir()) == []


def test_a_relative_nvme_path_and_workdir_are_the_launchers_cwds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nvme_path: "nvme/x"`` and ``workdir: "work"``, relative as DeepSpeed takes them:
    the private daemon starts with dirs under the launcher's cwd (it refused the relative
    scratch dirs before), swaps there, and leaves nothing behind."""
    from _dist import base_config

    from trainer.config import parse_config
    from trainer.offload.daemon_connect import _start_private_daemon

    monkeypatch.chdir(tmp_path)
    config = parse_config(base_config(
        offloadd={"workdir": "work"},
        zero_optimization={"stage": 3,
                           "offload_optimizer": {"device": "nvme", "nvme_path": "nvme/x"}}))
    daemon = _start_private_daemon(config, "relative", 2 * ARENA_NBYTES)
    try:
        parents = {Path(path).parent for path in daemon.scratch_dirs}
        assert {tmp_path / "nvme" / "x", tmp_path / "work"} <= parents, parents
        with OffloadClient.connect(daemon.socket_path, job="relative",
                                   arena_nbytes=ARENA_NBYTES) as client:
            for index in range(8):  # twice the arena: half of it is swapped out
                client.put(f"s{index}", os.urandom(SHARD_NBYTES))
            assert client.stats()["swap_used_nbytes"] > 0
    finally:
        daemon.stop()
    assert list(tmp_path.iterdir()) == []


def test_an_nvme_path_that_cannot_be_made_names_its_config_key(tmp_path: Path) -> None:
    """An nvme_path below a regular file: the error names the key to change, and the
    swap dir it could not make, before any dir of the daemon's is made."""
    from _dist import base_config

    from trainer.config import parse_config
    from trainer.offload.daemon_connect import _start_private_daemon

    (tmp_path / "a-file").write_text("")
    nvme = str(tmp_path / "a-file" / "nvme")
    config = parse_config(base_config(
        offloadd={"workdir": str(tmp_path / "work")},
        zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"},
                           "offload_param": {"device": "nvme", "nvme_path": nvme}}))
    with pytest.raises(ValueError, match=re.escape(
            f"config key zero_optimization.offload_param.nvme_path={nvme!r}: cannot make "
            f"the swap dir {nvme} (Not a directory)")):
        _start_private_daemon(config, "unmade", 2 * ARENA_NBYTES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
