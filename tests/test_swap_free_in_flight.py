"""A job freed while its flush writes back: the files close only after the last write.

A rank that sends flush and disconnects (killed, or a script that exits) with
``job_linger_s = 0`` gets its job freed while the write-backs of that flush are in the IO
engine; were the swap files closed under them, their writes would go to closed fd numbers,
or to whatever file reuses a number next. Real daemon, real swap files on disk."""

from __future__ import annotations

from pathlib import Path

from conftest import hello, raw_socket, start_daemon
from test_daemon_metrics import scrape, value
from test_job_lifecycle import wait_until_gone

from offloadd import protocol as p
from trainer.client import OffloadClient

SHARDS = 48
SHARD_NBYTES = 1 << 20


def test_flush_in_flight_when_the_job_is_freed(tmp_path: Path, swap_root: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text("job_linger_s = 0\n")
    with start_daemon(tmp_path / "d", arena_size="128MiB",
                      extra_args=["--config", str(config), "--swap-dir", str(swap_root)]) as daemon:
        sock = raw_socket(daemon.socket_path)
        assert isinstance(hello(sock, "leaver", arena_nbytes=64 << 20), p.HelloOk)
        with OffloadClient.connect(daemon.socket_path, job="leaver") as writer:
            writer.put_many({f"s{i}": bytes([i]) * SHARD_NBYTES for i in range(SHARDS)})
            sock.sendall(p.encode_frame(p.Flush(2, "last")))  # then both sessions go away
        sock.close()
        wait_until_gone(daemon, "leaver")
        # Another job right after: its files may take the freed descriptor numbers.
        with OffloadClient.connect(daemon.socket_path, job="next") as other:
            other.put_many({f"n{i}": bytes([100 + i]) * SHARD_NBYTES for i in range(8)})
            other.flush("n")
            for index in range(8):
                assert other.get(f"n{index}") == bytes([100 + index]) * SHARD_NBYTES
        samples = scrape(daemon)
        assert value(samples, "offloadd_swap_io_errors_total", op="write") == 0
        assert value(samples, "offloadd_swap_io_errors_total", op="sync") == 0
        assert "Bad file descriptor" not in Path(daemon.log_path).read_text()

