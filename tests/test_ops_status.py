"""``offloadd status`` and ``offloadd gc`` as an operator runs them, against a real daemon."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from offloadd.ops.status import format_nbytes
from trainer.client import OffloadClient


def offloadd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "offloadd", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture(scope="module")
def swap_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("swap")


@pytest.fixture(scope="module")
def daemon(swap_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    with PrivateDaemon.start(tmp_path_factory.mktemp("status"), arena_size="32MiB",
                             swap_dirs=[str(swap_dir)]) as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon: PrivateDaemon) -> Iterator[OffloadClient]:
    with OffloadClient.connect(daemon.socket_path, job="live", rank=0, world_size=2) as rank0:
        rank0.put("u0.param", torch.ones(1024))
        rank0.flush("t0")
        yield rank0


def fake_job(swap_dir: Path, name: str, *extra: str) -> Path:
    """A job folder as the NVMe tier leaves it, for a job the daemon does not know."""
    job = swap_dir / "offloadd" / name
    job.mkdir(parents=True)
    (job / "swap.0").write_bytes(b"\0" * 8192)
    (job / "manifest.json").write_text("{}")
    (job / "manifest.step-9.json").write_text("{}")
    for name_ in extra:
        (job / name_).write_text("keep me")
    return job


def test_node_status_answers_before_hello(daemon: PrivateDaemon, client: OffloadClient) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(daemon.socket_path)
        sock.sendall(p.encode_frame(p.NodeStatus(rid=7)))
        (length,) = p.HEADER.unpack(sock.recv(p.HEADER_NBYTES))
        reply = p.reply_decoder.decode(sock.recv(length, socket.MSG_WAITALL))
    assert isinstance(reply, p.StatsOk) and reply.rid == 7
    assert reply.stats["jobs"]["live"]["num_shards"] == 1
    assert reply.stats["node"]["daemon_pid"] == daemon.pid
    assert reply.stats["swap_dirs"] == [str(daemon_swap(daemon))]


def daemon_swap(daemon: PrivateDaemon) -> str:
    args = daemon.process.args
    assert isinstance(args, list)
    return str(args[args.index("--swap-dir") + 1])


def test_status_table(daemon: PrivateDaemon, client: OffloadClient) -> None:
    result = offloadd("status", "--socket", daemon.socket_path, "--interval", "0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"pid={daemon.pid}" in lines[0] and "rank_sessions=1" in lines[0]
    assert lines[1].startswith("arena budget ") and "cut to" not in lines[1]
    header = next(line for line in lines if line.startswith("JOB"))
    assert header.split()[:3] == ["JOB", "SESSIONS", "SHARDS"]
    row = next(line for line in lines if line.startswith("live "))
    assert row.split()[1:3] == ["1", "1"]
    stats = client.stats()
    pages = "2M" if stats["arena_hugepages"] else "4K"
    match = re.search(r"\s(2M|4K)\s+(\S+ \S+)$", row)
    assert match is not None, row
    assert match.groups() == (pages, format_nbytes(stats["swap_used_nbytes"])), row
    swap = next(line for line in lines if line.startswith(daemon_swap(daemon)))
    assert swap.endswith("B/s"), swap  # IO rates from two samples
    assert any("prefetch: issued=" in line for line in lines)


def test_status_json(daemon: PrivateDaemon, client: OffloadClient) -> None:
    result = offloadd("status", "--socket", daemon.socket_path, "--json", "--interval", "0.1")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["jobs"]["live"]["sessions"] == 1
    assert set(status["swap_rates"]) == {daemon_swap(daemon)}


def test_status_without_daemon_fails_clearly(tmp_path: Path) -> None:
    result = offloadd("status", "--socket", str(tmp_path / "none.sock"))
    assert result.returncode == 1 and "no offloadd answers on" in result.stdout


def test_gc_removes_only_jobs_the_daemon_does_not_know(daemon: PrivateDaemon, swap_dir: Path,
                                                      client: OffloadClient) -> None:
    live = swap_dir / "offloadd" / "live"
    assert (live / "manifest.json").exists()
    gone = fake_job(swap_dir, "finished")
    odd = fake_job(swap_dir, "odd", "notes.txt")
    dry = offloadd("gc", "--dry-run", "--socket", daemon.socket_path, "--swap-dir", str(swap_dir))
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "would remove job 'finished'" in dry.stdout and "remove job 'live'" not in dry.stdout
    assert f"kept job 'live' in {swap_dir}: live" in dry.stdout
    assert (gone / "swap.0").exists()

    real = offloadd("gc", "--socket", daemon.socket_path, "--swap-dir", str(swap_dir))
    assert real.returncode == 0, real.stdout + real.stderr
    assert "removed 2 job(s)" in real.stdout and "kept 1 live job(s)" in real.stdout
    assert not gone.exists() and (live / "manifest.json").exists()
    assert sorted(p.name for p in odd.iterdir()) == ["notes.txt"]  # foreign files stay
    client.get("u0.param")  # the live job still reads its shard


def test_gc_refuses_without_a_daemon_unless_forced(tmp_path: Path) -> None:
    job = fake_job(tmp_path, "orphan")
    args = ("gc", "--socket", str(tmp_path / "none.sock"), "--swap-dir", str(tmp_path))
    refused = offloadd(*args)
    assert refused.returncode == 3 and "Refusing" in refused.stdout and "--force" in refused.stdout
    assert job.exists()
    forced = offloadd(*args, "--force")
    assert forced.returncode == 0 and not job.exists(), forced.stdout + forced.stderr


def test_gc_refuses_a_swap_dir_the_daemon_does_not_use(daemon: PrivateDaemon,
                                                       tmp_path: Path) -> None:
    job = fake_job(tmp_path, "elsewhere")
    result = offloadd("gc", "--socket", daemon.socket_path, "--swap-dir", str(tmp_path))
    assert result.returncode == 3 and "does not use swap dir" in result.stdout
    assert job.exists()


def test_gc_reads_socket_and_swap_dirs_from_the_config(tmp_path: Path) -> None:
    fake_job(tmp_path / "swap", "old")
    config = tmp_path / "offloadd.toml"
    config.write_text(f'socket = "{tmp_path / "none.sock"}"\nswap_dirs = ["{tmp_path / "swap"}"]\n')
    result = offloadd("gc", "--config", str(config), "--dry-run", "--force")
    assert result.returncode == 0 and "would remove job 'old'" in result.stdout, result.stdout
