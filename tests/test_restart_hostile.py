"""Restarts, kept swap and gc against a hostile uid: real daemons killed with SIGKILL and
restarted with ``--recover``, real ranks of two real uids (forked children), real files.

- ``--recover`` brings back exactly the jobs that were live, charged to their owners and
  lingering like jobs whose ranks are gone; ended jobs stay files until their owner
  claims them, so an ended job of another uid named to sort first takes no DRAM from a
  live one (issue 32, item 4).
- An ended job's swap is cut to what its manifest names, charged to its owner, shown in
  status, and deleted (oldest first) before a live job's write fails on a full disk
  (item 2); its owner, and nobody else, resumes from it with a hello (item 13).
- ``offloadd gc`` keeps what the daemon keeps and says why (item 7).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import call, raw_socket, start_daemon
from test_daemon_sessions import as_uid, open_to_everyone
from test_swap_full import small_mount

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from offloadd.swap.manifests import JobOwner
from offloadd.swap.nvme import recovery_order
from trainer.client import OffloadClient

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="ranks of two other uids need root")

HOSTILE, VICTIM = 65534, 65533
MIB = 1 << 20
SEGMENT_NBYTES = 256 * MIB
"""A swap file grows by this much at a time (offloadd.swap.nvme.SEGMENT_NBYTES)."""


def start(root: Path, name: str, swap: Path, toml: str = "", *extra: str,
          arena_size: str = "32MiB") -> PrivateDaemon:
    """A daemon both test uids may use, with its own socket dir and the shared swap dir."""
    config = root / f"{name}.toml"
    config.write_text(f"allowed_uids = [{HOSTILE}, {VICTIM}]\n{toml}")
    daemon = start_daemon(None, arena_size=arena_size,
                          extra_args=["--config", str(config), "--swap-dir", str(swap), *extra])
    open_to_everyone(daemon)
    return daemon


def kill_9(daemon: PrivateDaemon) -> None:
    daemon.process.send_signal(signal.SIGKILL)
    assert daemon.process.wait(30) == -signal.SIGKILL
    daemon.stop()


def node_status(daemon: PrivateDaemon) -> dict:
    reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
    assert isinstance(reply, p.StatsOk), reply
    return reply.stats


def wait_for(daemon: PrivateDaemon, done: Callable[[dict], bool], what: str) -> dict:
    deadline = time.monotonic() + 60
    while not done(status := node_status(daemon)):
        assert time.monotonic() < deadline, f"{what} never happened: {status}"
        time.sleep(0.1)
    return status


def payload(job: str, index: int, nbytes: int = 4 * MIB) -> bytes:
    seed = hashlib.sha256(f"{job}/{index}".encode()).digest()
    return seed * (nbytes // len(seed))


def run_job(uid: int, socket_path: str, job: str, *, shards: int, arena_nbytes: int,
            end: bool, shard_nbytes: int = 4 * MIB) -> str:
    """As ``uid``: write ``shards`` shards, flush, then close the job (``end``) or just exit
    (its ranks are gone: the job lingers, live). Returns 'ok' or what went wrong."""
    def rank() -> str:
        client = OffloadClient.connect(socket_path, job=job, arena_nbytes=arena_nbytes,
                                       timeout_s=60)
        for index in range(shards):
            client.put(f"s{index}", payload(job, index, shard_nbytes))
        client.flush(f"{job}-flushed")
        if end:
            client.close_job()
        client.close()
        return "ok"

    return as_uid(uid, rank)


def read_job(uid: int, socket_path: str, job: str, *, shards: int,
             shard_nbytes: int = 4 * MIB) -> str:
    """As ``uid``: hello ``job`` and check every shard is what ``run_job`` flushed."""
    def rank() -> str:
        with OffloadClient.connect(socket_path, job=job, timeout_s=60) as client:
            for index in range(shards):
                if client.get(f"s{index}") != payload(job, index, shard_nbytes):
                    return f"shard s{index} differs"
        return "ok"

    return as_uid(uid, rank)


def manifest_of(swap: Path, job: str) -> dict:
    return json.loads((swap / "offloadd" / job / "manifest.json").read_text())


# -- item 4: --recover ---------------------------------------------------------------


@needs_root
def test_an_ended_job_named_to_sort_first_never_displaces_a_live_job_at_recover(
        tmp_path: Path, swap_root: Path) -> None:
    """The hostile uid's ended job, named to be recovered first and large enough that it
    and the victim's job do not both fit the DRAM budget, stays files; after a kill -9 the
    victim's live job comes back with its last flush, still the victim's."""
    first = start(tmp_path, "first", swap_root)
    assert run_job(HOSTILE, first.socket_path, "aaa-hostile", shards=4,
                   arena_nbytes=24 * MIB, end=True) == "ok"
    wait_for(first, lambda s: "aaa-hostile" in s["retained"], "the hostile job's end")
    assert run_job(VICTIM, first.socket_path, "zzz-victim", shards=3,
                   arena_nbytes=16 * MIB, end=False) == "ok"
    kill_9(first)

    with start(tmp_path, "second", swap_root, "", "--recover") as second:
        status = node_status(second)
        assert sorted(status["jobs"]) == ["zzz-victim"], status
        assert status["node"]["swap"]["quarantined"] == {}
        assert status["node"]["reserved_nbytes"] == 16 * MIB  # the ended job took no DRAM
        kept = status["retained"]["aaa-hostile"]
        assert (kept["uid"], kept["state"]) == (HOSTILE, "ended")
        assert read_job(VICTIM, second.socket_path, "zzz-victim", shards=3) == "ok"
        assert read_job(HOSTILE, second.socket_path, "zzz-victim", shards=3) != "ok"
        assert read_job(VICTIM, second.socket_path, "zzz-victim", shards=3) == "ok"
        assert second.process.poll() is None


@needs_root
def test_a_recovered_job_is_charged_to_its_owner_lingers_and_stays_ended(
        tmp_path: Path, swap_root: Path) -> None:
    """A job live at a kill -9 comes back owned by and counted against its uid, is freed
    after the linger of a job whose ranks are gone, and a second restart keeps it as
    files, which its owner then resumes from."""
    first = start(tmp_path, "first", swap_root)
    assert run_job(VICTIM, first.socket_path, "resumable", shards=2, arena_nbytes=8 * MIB,
                   end=False) == "ok"
    kill_9(first)

    second = start(tmp_path, "second", swap_root,
                   "max_jobs_per_uid = 1\njob_linger_s = 3\n", "--recover")
    assert sorted(node_status(second)["jobs"]) == ["resumable"]

    def another_job() -> str:
        with OffloadClient.connect(second.socket_path, job="second-job",
                                   arena_nbytes=4 * MIB, timeout_s=30):
            return "ok"

    refused = as_uid(VICTIM, another_job)
    assert "max_jobs_per_uid" in refused, refused  # the recovered job counts as its owner's
    # The end is listed at once; the manifest is marked ended right after (off the loop).
    status = wait_for(second, lambda s: not s["jobs"] and "ended_at" in manifest_of(
        swap_root, "resumable"), "the recovered job's linger and its manifest marked ended")
    kept = status["retained"]["resumable"]
    assert (kept["uid"], kept["state"]) == (VICTIM, "ended")
    assert manifest_of(swap_root, "resumable")["ended_at"] > 0
    kill_9(second)

    with start(tmp_path, "third", swap_root, "", "--recover") as third:
        status = node_status(third)
        assert status["jobs"] == {} and status["node"]["reserved_nbytes"] == 0
        assert status["retained"]["resumable"]["uid"] == VICTIM
        assert read_job(VICTIM, third.socket_path, "resumable", shards=2) == "ok"
        status = node_status(third)
        assert "resumable" in status["jobs"] and "resumable" not in status["retained"]
        assert manifest_of(swap_root, "resumable").get("ended_at") is None  # live again


def test_recovery_order_gives_every_owner_a_turn_whatever_the_names() -> None:
    """Many live jobs of one uid, named to sort first, take one turn each: the other
    uid's job comes second, not last."""
    def manifest(uid: int, arena_nbytes: int, flushed_at: float) -> dict:
        return {"format": 2, "owner": JobOwner.create(uid, "").record(),
                "arena_nbytes": arena_nbytes, "created": flushed_at}

    live = [("a1", manifest(HOSTILE, 8 * MIB, 1.0)), ("a2", manifest(HOSTILE, 8 * MIB, 3.0)),
            ("a3", manifest(HOSTILE, 8 * MIB, 2.0)), ("z", manifest(VICTIM, 16 * MIB, 1.0))]
    assert [name for name, _manifest in recovery_order(live)] == ["a2", "z", "a3", "a1"]


# -- item 13: the owner resumes its ended job -----------------------------------------


@needs_root
def test_only_the_owner_resumes_an_ended_jobs_kept_files(tmp_path: Path,
                                                         swap_root: Path) -> None:
    with start(tmp_path, "d", swap_root) as daemon:
        assert run_job(VICTIM, daemon.socket_path, "mine", shards=3, arena_nbytes=8 * MIB,
                       end=True) == "ok"
        wait_for(daemon, lambda s: "mine" in s["retained"], "the job's end")
        assert read_job(HOSTILE, daemon.socket_path, "mine", shards=3) != "ok"
        assert "mine" in node_status(daemon)["retained"]  # the stranger claimed nothing
        assert read_job(VICTIM, daemon.socket_path, "mine", shards=3) == "ok"
        status = node_status(daemon)
        assert "mine" in status["jobs"] and "mine" not in status["retained"]
        assert daemon.process.poll() is None


# -- item 2: kept swap is cut, counted, shown, and gives way to live jobs ---------------


@needs_root
def test_an_ended_jobs_kept_swap_is_cut_to_its_manifest_and_shown_by_owner(
        tmp_path: Path, swap_root: Path) -> None:
    with start(tmp_path, "d", swap_root, 'swap_size = "4GiB"\n') as daemon:
        assert run_job(VICTIM, daemon.socket_path, "small", shards=1, arena_nbytes=8 * MIB,
                       end=True) == "ok"
        # Kept files are listed at the job's end and re-measured once cut: wait for the cut.
        status = wait_for(daemon, lambda s: "small" in s["retained"]
                          and s["retained"]["small"]["nbytes"] < SEGMENT_NBYTES // 16,
                          "the end and the cut of the job's swap file")
        kept = status["retained"]["small"]
        swap_file = swap_root / "offloadd" / "small" / "swap.0"
        assert kept["nbytes"] == swap_file.stat().st_size
        assert 4 * MIB <= kept["nbytes"] < SEGMENT_NBYTES // 16  # the segment's tail is gone
        assert status["node"]["swap"]["dirs"][0]["reserved_nbytes"] == kept["nbytes"]
        shown = subprocess.run([sys.executable, "-m", "offloadd", "status", "--socket",
                                daemon.socket_path], capture_output=True, text=True, timeout=60)
        assert f"ended job small (uid {VICTIM})" in shown.stdout, shown.stdout + shown.stderr
        assert f"kept swap of uid {VICTIM}: 1 job(s)" in shown.stdout, shown.stdout
        assert "kept_jobs=1" in shown.stdout


@needs_root
def test_a_full_disk_deletes_ended_jobs_files_before_a_live_write_fails(
        tmp_path: Path) -> None:
    """The swap budget is larger than the disk (the operator sized it for a bigger one):
    the hostile uid's ended job holds the disk, and the victim's live job still writes and
    flushes everything, because the ended job's kept files go first."""
    toml = 'swap_size = "64MiB"\nchunk_size = "1MiB"\n'
    with small_mount(tmp_path / "swap", "24m") as swap, start(tmp_path, "d", swap, toml) as daemon:
        assert run_job(HOSTILE, daemon.socket_path, "old", shards=12, arena_nbytes=4 * MIB,
                       end=True, shard_nbytes=MIB) == "ok"
        wait_for(daemon, lambda s: "old" in s["retained"], "the ended job's end")
        assert run_job(VICTIM, daemon.socket_path, "new", shards=16, arena_nbytes=4 * MIB,
                       end=False, shard_nbytes=MIB) == "ok"
        status = node_status(daemon)
        assert "old" not in status["retained"] and status["node"]["swap"]["io_errors"] == {}
        assert status["node"]["swap"]["reclaimed_nbytes"] >= 12 * MIB
        assert read_job(VICTIM, daemon.socket_path, "new", shards=16,
                        shard_nbytes=MIB) == "ok"
        assert not (swap / "offloadd" / "old").exists()


# -- item 7: gc keeps what the daemon keeps -------------------------------------------


@needs_root
def test_gc_keeps_the_files_the_daemon_keeps_and_says_why(tmp_path: Path,
                                                          swap_root: Path) -> None:
    with start(tmp_path, "d", swap_root) as daemon:
        assert run_job(VICTIM, daemon.socket_path, "ended", shards=1, arena_nbytes=8 * MIB,
                       end=True) == "ok"
        wait_for(daemon, lambda s: "ended" in s["retained"], "the job's end")
        orphan = swap_root / "offloadd" / "orphan"
        orphan.mkdir(mode=0o700)
        (orphan / "swap.0").write_bytes(b"\0" * 4096)  # a crash before any flush
        gc = subprocess.run([sys.executable, "-m", "offloadd", "gc", "--socket",
                             daemon.socket_path, "--swap-dir", str(swap_root)],
                            capture_output=True, text=True, timeout=60)
        assert gc.returncode == 0, gc.stdout + gc.stderr
        assert (swap_root / "offloadd" / "ended" / "manifest.json").exists()
        assert f"kept job 'ended' in {swap_root}: ended, kept for uid {VICTIM}" in gc.stdout
        assert "removed job 'orphan'" in gc.stdout and "(orphaned)" in gc.stdout
        assert not orphan.exists()
        assert read_job(VICTIM, daemon.socket_path, "ended", shards=1) == "ok"
