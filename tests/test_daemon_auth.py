"""Per-job authorization against the real daemon: job owners, job secrets, node_status scope.

Peers with other uids are forked children that drop to that uid before they connect
(SO_PEERCRED reports the uid of the connecting process), so these tests need root.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import call, error_code, hello, raw_socket, read_reply, start_daemon
from test_daemon_sessions import as_uid, open_to_everyone

from offloadd import protocol as p
from offloadd.errors import PermissionDeniedError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.ops.status import live_jobs
from trainer.client import OffloadClient

NOBODY = 65534
OTHER = 65533
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="peers with other uids need root")


def attach(daemon: PrivateDaemon, job: str) -> Callable[[], str]:
    def action() -> str:
        client = OffloadClient.connect(daemon.socket_path, job=job, timeout_s=10)
        client.put("x", b"mine")
        client.close()
        return f"connected uid={os.getuid()}"
    return action


def node_status(daemon: PrivateDaemon) -> dict:
    reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
    assert isinstance(reply, p.StatsOk), reply
    return reply.stats


@pytest.fixture
def shared_daemon(tmp_path: Path):
    """A daemon whose allowlist holds two unprivileged uids, reachable by both."""
    config = tmp_path / "offloadd.toml"
    config.write_text(f"allowed_uids = [{NOBODY}, {OTHER}]\n")
    with start_daemon(None, arena_size="32MiB", extra_args=["--config", str(config)]) as daemon:
        open_to_everyone(daemon)
        yield daemon


def test_an_allowlisted_uid_cannot_attach_to_another_uids_job(shared_daemon) -> None:
    daemon = shared_daemon
    assert isinstance(hello(raw_socket(daemon.socket_path), "root-job"), p.HelloOk)
    denied = as_uid(NOBODY, attach(daemon, "root-job"))
    assert denied.startswith("denied:") and "belongs to uid 0" in denied, denied
    assert as_uid(NOBODY, attach(daemon, "nobody-job")) == f"connected uid={NOBODY}"
    assert as_uid(NOBODY, attach(daemon, "nobody-job")) == f"connected uid={NOBODY}"  # reattach
    denied = as_uid(OTHER, attach(daemon, "nobody-job"))
    assert denied.startswith("denied:") and f"belongs to uid {NOBODY}" in denied, denied
    # Root may attach to any job (documented in deploy/README.md): it can read arenas anyway.
    with OffloadClient.connect(daemon.socket_path, job="nobody-job") as client:
        assert client.get("x") == b"mine"


def test_node_status_shows_a_uid_only_its_own_jobs(shared_daemon) -> None:
    daemon = shared_daemon
    assert isinstance(hello(raw_socket(daemon.socket_path), "root-job"), p.HelloOk)
    assert as_uid(NOBODY, attach(daemon, "nobody-job")).startswith("connected")
    assert as_uid(OTHER, attach(daemon, "other-job")).startswith("connected")

    def seen() -> str:
        stats = node_status(daemon)
        return f"{stats['scope']} {sorted(stats['jobs'])}"

    assert as_uid(NOBODY, seen) == "own ['nobody-job']"
    assert as_uid(OTHER, seen) == "own ['other-job']"
    stats = node_status(daemon)
    assert stats["scope"] == "all"
    assert sorted(stats["jobs"]) == ["nobody-job", "other-job", "root-job"]


def test_gc_refuses_when_the_daemon_shows_only_the_callers_jobs(shared_daemon,
                                                                 tmp_path: Path) -> None:
    daemon = shared_daemon

    def gc_view() -> str:
        return str(live_jobs(daemon.socket_path, [], force=False))

    assert "Refusing; run gc as root" in as_uid(NOBODY, gc_view)
    assert live_jobs(daemon.socket_path, [], force=False) == set()  # root sees every job


def test_job_secret_required_and_compared(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text("require_job_secret = true\n")
    with start_daemon(tmp_path / "d", arena_size="32MiB",
                      extra_args=["--config", str(config)]) as daemon:
        monkeypatch.delenv(p.JOB_SECRET_ENV, raising=False)
        with pytest.raises(PermissionDeniedError, match="require_job_secret"):
            OffloadClient.connect(daemon.socket_path, job="secret-job")
        monkeypatch.setenv(p.JOB_SECRET_ENV, "s3cret")
        with OffloadClient.connect(daemon.socket_path, job="secret-job", world_size=2) as rank0:
            rank0.put("w", b"weights")
            monkeypatch.setenv(p.JOB_SECRET_ENV, "guess")
            with pytest.raises(PermissionDeniedError, match="wrong or missing job secret"):
                OffloadClient.connect(daemon.socket_path, job="secret-job", rank=1, world_size=2)
            monkeypatch.setenv(p.JOB_SECRET_ENV, "s3cret")
            with OffloadClient.connect(daemon.socket_path, job="secret-job", rank=1,
                                       world_size=2) as rank1:
                assert rank1.stats()["job"] == "secret-job"


def test_a_job_created_with_a_secret_binds_later_ranks_without_the_config_flag(
        tmp_path: Path) -> None:
    with start_daemon(tmp_path / "d", arena_size="32MiB") as daemon:
        sock = raw_socket(daemon.socket_path)
        sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, "s-job", 0, 2, 0, "cpu",
                                            4 << 20, job_secret="abc")))
        reply, fds = read_reply(sock)
        for fd in fds:
            os.close(fd)
        assert isinstance(reply, p.HelloOk), reply
        assert error_code(hello(raw_socket(daemon.socket_path), "s-job", rank=1,
                                world_size=2)) == "permission"
