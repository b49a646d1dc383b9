"""A rank's drop that lands while another rank's flush starts its write-backs (found by
the adversity soak): the flush must skip the dropped shard, not fail with an internal
error. The window is one loop iteration, so the test pipelines many rounds."""

from __future__ import annotations

import os
import time
from pathlib import Path

from conftest import hello, raw_socket, read_reply

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon

ROUNDS = int(os.environ.get("OFFLOADD_RACE_ROUNDS", "300"))


def test_drops_racing_flushes_never_fail_them(tmp_path: Path, swap_root: Path) -> None:
    with PrivateDaemon.start(tmp_path / "d", arena_size="32MiB",
                             swap_dirs=[str(swap_root)]) as daemon:
        flusher, dropper = raw_socket(daemon.socket_path), raw_socket(daemon.socket_path)
        assert isinstance(hello(flusher, "race", rank=0, world_size=2,
                                arena_nbytes=4 << 20), p.HelloOk)
        assert isinstance(hello(dropper, "race", rank=1, world_size=2), p.HelloOk)
        ids = [f"s{i}" for i in range(8)]
        put = p.encode_frame(p.Acquire(0, ids, "w", [4096] * 8, ["uint8"] * 8))
        release = p.encode_frame(p.Release(0, ids, True))
        drop = p.encode_frame(p.Drop(0, ids))
        failures = []
        for round_index in range(ROUNDS):
            dropper.sendall(put + release)
            for _reply in range(2):
                read_reply(dropper)
            flusher.sendall(p.encode_frame(p.Flush(1)))
            time.sleep((round_index % 25) * 40e-6)  # sweep the drop across the flush's start
            dropper.sendall(drop)
            flushed, _fds = read_reply(flusher)
            dropped, _fds = read_reply(dropper)
            if not isinstance(flushed, p.StatsOk):
                failures.append(flushed)
            assert isinstance(dropped, p.Ok), dropped
        assert not failures, failures[:3]
