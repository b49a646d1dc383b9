"""One bad manifest quarantines its job; the daemon starts and the other jobs recover."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offloadd.errors import JobQuarantinedError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

ARENA_NBYTES = 4 << 20


def connect(daemon: PrivateDaemon, job: str) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=job, arena_nbytes=ARENA_NBYTES)


def flushed_jobs(tmp_path: Path, swap: Path) -> dict[str, bytes]:
    """Four jobs, each flushed; ``torn`` flushes twice (its first flush is what survives)."""
    payloads = {name: os.urandom(1 << 20) for name in ("good", "corrupt", "moved", "torn")}
    with PrivateDaemon.start(tmp_path / "first", swap_dirs=[str(swap)]) as daemon:
        for name, payload in payloads.items():
            client = connect(daemon, name)
            client.put("x", payload)
            client.flush("one")
            if name == "torn":
                client.put("x", bytes(1 << 20))  # zeros: the second flush
                client.flush("two")
            client.close()
    return payloads


def test_a_bad_manifest_quarantines_only_its_job(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    payloads = flushed_jobs(tmp_path, swap)
    root = swap / "offloadd"
    (root / "corrupt" / "manifest.json").write_bytes(b'{"format": 1, "job": "corr')
    moved = json.loads((root / "moved" / "manifest.json").read_text())
    moved["dirs"] = ["/mnt/replaced-drive"]
    (root / "moved" / "manifest.json").write_text(json.dumps(moved))
    newest = root / "torn" / "manifest.json"
    newest.write_bytes(newest.read_bytes()[: len(newest.read_bytes()) // 2])

    with PrivateDaemon.start(tmp_path / "second", swap_dirs=[str(swap)],
                             extra_args=["--recover"]) as daemon:
        assert connect(daemon, "good").get("x") == payloads["good"]
        # The torn newest generation recovers the one before it.
        assert connect(daemon, "torn").get("x") == payloads["torn"]
        for name in ("corrupt", "moved"):
            with pytest.raises(JobQuarantinedError, match=f"job '{name}' is quarantined"):
                connect(daemon, name)
        quarantined = connect(daemon, "good").stats()["swap"]["quarantined"]
        assert sorted(quarantined) == ["corrupt", "moved"]
        assert "/mnt/replaced-drive" in quarantined["moved"]
        status = subprocess.run([sys.executable, "-m", "offloadd", "status", "--socket",
                                 daemon.socket_path], capture_output=True, text=True, timeout=60)
        assert "QUARANTINED job 'corrupt'" in status.stdout
    log = Path(daemon.log_path).read_text()
    assert "event=job_quarantined job=corrupt" in log
    assert "event=job_quarantined job=moved" in log
    # Quarantine keeps the files: nothing of the bad jobs was deleted.
    assert (root / "corrupt" / "swap.0").exists() and (root / "moved" / "swap.0").exists()
