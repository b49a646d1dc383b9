"""A swap dir that fills up: a flush whose manifest cannot be written fails with a typed
error, leaves the last flush in force, and the next flush once space is back succeeds.
Real daemon on a real tmpfs mount of a few MiB (root only)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadd.errors import SwapIOError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

SHARD_NBYTES = 256 << 10


@contextlib.contextmanager
def small_mount(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``path`` (mode 0700), unmounted at exit; skips without root."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Write zeros to ``path`` until the file system is full; returns the filler."""
    filler = path / "filler"
    block = b"\0" * (64 << 10)
    with open(filler, "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def payload(round_index: int, index: int) -> bytes:
    return bytes([round_index * 16 + index]) * SHARD_NBYTES


def test_manifest_enospc_is_retried_by_the_next_flush(tmp_path: Path) -> None:
    with small_mount(tmp_path / "swap", "24m") as swap:
        daemon = PrivateDaemon.start(tmp_path / "d1", arena_size="32MiB", swap_dirs=[str(swap)],
                                     extra_args=["--swap-size", "16MiB"])
        with daemon, OffloadClient.connect(daemon.socket_path, job="full",
                                           arena_nbytes=4 << 20) as client:
            for index in range(4):
                client.put(f"s{index}", payload(0, index))
            client.flush("first")  # the swap file grows by a segment: room for what follows
            filler = fill(swap)
            for index in range(4):
                client.put(f"s{index}", payload(1, index))
            with pytest.raises(SwapIOError, match="manifest") as failed:
                client.flush("second")
            assert "no data is lost" in str(failed.value)
            filler.unlink()
            client.flush("third")  # space is back: not fail-stopped
            for index in range(4):
                client.put(f"s{index}", payload(2, index))
            client.flush("fourth")
        restarted = PrivateDaemon.start(tmp_path / "d2", arena_size="32MiB",
                                        swap_dirs=[str(swap)],
                                        extra_args=["--swap-size", "16MiB", "--recover"])
        with restarted, OffloadClient.connect(restarted.socket_path, job="full") as client:
            for index in range(4):
                assert client.get(f"s{index}") == payload(2, index)
