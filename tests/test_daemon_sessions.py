"""Sessions against the real daemon process: hello, SO_PEERCRED, arenas, `offloadd serve`."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _uids import become
from conftest import (
    JOB_ARENA_NBYTES,
    call,
    error_code,
    hello,
    hide_native_module,
    is_closed,
    raw_socket,
    read_reply,
    start_daemon,
)

from offloadd import protocol as p
from offloadd.compute import native_adam
from offloadd.config import DaemonConfig, parse_size
from offloadd.errors import (
    DaemonUnavailableError,
    OverBudgetError,
    PermissionDeniedError,
)
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

NOBODY = 65534


# -- hello ------------------------------------------------------------------------------


def test_hello_reply_carries_version_sizes_and_the_job_memfd(daemon: PrivateDaemon,
                                                           job: str) -> None:
    sock = raw_socket(daemon.socket_path)
    sock.sendall(p.encode_frame(p.Hello(9, p.PROTOCOL_VERSION, job, 1, 4, 1, "cpu",
                                        JOB_ARENA_NBYTES)))
    reply, fds = read_reply(sock)
    try:
        assert isinstance(reply, p.HelloOk)
        assert (reply.rid, reply.protocol_version) == (9, p.PROTOCOL_VERSION)
        assert reply.arena_nbytes == JOB_ARENA_NBYTES
        assert reply.daemon_pid == daemon.pid
        assert len(fds) == 1  # the arena, by SCM_RIGHTS
        assert os.readlink(f"/proc/self/fd/{fds[0]}").startswith(f"/memfd:offloadd:{job}")
        assert os.fstat(fds[0]).st_size == JOB_ARENA_NBYTES
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


def test_ranks_of_one_job_get_the_same_memfd_and_other_jobs_another(daemon: PrivateDaemon,
                                                                   job: str) -> None:
    inodes = []
    for job_name, rank in ((job, 0), (job, 1), (f"{job}-other", 0)):
        sock = raw_socket(daemon.socket_path)
        sock.sendall(p.encode_frame(p.Hello(1, p.PROTOCOL_VERSION, job_name, rank, 2, rank,
                                            "cpu", JOB_ARENA_NBYTES)))
        _reply, fds = read_reply(sock)
        inodes.append(os.fstat(fds[0]).st_ino)
        os.close(fds[0])
        sock.close()
    assert inodes[0] == inodes[1] != inodes[2]


def test_requests_before_hello_get_no_session(daemon: PrivateDaemon, witness) -> None:
    sock = raw_socket(daemon.socket_path)
    assert error_code(call(sock, p.Stats(3))) == "no_session"
    assert error_code(call(sock, p.Acquire(4, ["x"], "r"))) == "no_session"
    witness()


@pytest.mark.parametrize("job_name, rank, world_size", [
    ("", 0, 1), ("a/b", 0, 1), (".hidden", 0, 1), ("x" * 129, 0, 1),
    ("ok", 1, 1), ("ok", -1, 2), ("ok", 0, 0),
])
def test_hello_with_a_bad_identity_is_invalid_and_the_connection_can_retry(
        daemon: PrivateDaemon, job: str, job_name: str, rank: int, world_size: int,
        witness) -> None:
    sock = raw_socket(daemon.socket_path)
    reply = hello(sock, job_name if job_name != "ok" else job, rank=rank,
                  world_size=world_size)
    assert error_code(reply) == "invalid"
    assert isinstance(hello(sock, job), p.HelloOk)
    witness()


def test_second_hello_on_a_connection_is_invalid(daemon: PrivateDaemon, job: str) -> None:
    sock = raw_socket(daemon.socket_path)
    assert isinstance(hello(sock, job), p.HelloOk)
    assert error_code(hello(sock, job)) == "invalid"
    assert isinstance(call(sock, p.Stats(5)), p.StatsOk)


def test_hello_with_another_protocol_version_is_a_version_mismatch(daemon: PrivateDaemon,
                                                                  job: str, witness) -> None:
    sock = raw_socket(daemon.socket_path)
    reply = hello(sock, job, version=p.PROTOCOL_VERSION + 1)
    assert error_code(reply) == "version_mismatch"
    assert "protocol" in reply.message  # type: ignore[union-attr]
    assert error_code(call(sock, p.Stats(2))) == "no_session"  # no session was opened
    witness()


# -- SO_PEERCRED ------------------------------------------------------------------------


def as_uid(uid: int, action: Callable[[], str]) -> str:
    """Run ``action`` in a forked child with uid and gid ``uid``; return what it returned."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        outcome = "crashed"
        try:
            become(uid)
            outcome = action()
        except PermissionDeniedError as exc:
            outcome = f"denied: {exc}"
        except BaseException as exc:  # report everything to the parent
            outcome = f"error: {exc!r}"
        finally:
            os.write(write_end, outcome.encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        return pipe.read().decode()


def first_reply_as(uid: int, socket_path: str, job: str) -> str:
    """In a forked child running as ``uid``: connect, say hello; return what happened.

    SO_PEERCRED reports the uid of the process that called connect(), so the child
    drops its uid before connecting. Needs root (to setuid) and a socket others may open.
    """
    def connect() -> str:
        client = OffloadClient.connect(socket_path, job=job, timeout_s=10)
        return f"connected uid={os.getuid()} arena={client.arena.nbytes}"

    return as_uid(uid, connect)


def open_to_everyone(daemon: PrivateDaemon) -> None:
    """Let ``nobody`` reach the socket (pytest's tmp_path parents are 0700)."""
    os.chmod(daemon.workdir, 0o755)
    os.chmod(daemon.socket_path, 0o666)  # so the file mode is not what denies the peer


def sessions_opened(daemon: PrivateDaemon, outcome: str) -> float:
    from test_daemon_metrics import scrape

    return scrape(daemon).get(("offloadd_sessions_opened_total", (("outcome", outcome),)), 0.0)


@pytest.mark.skipif(os.geteuid() != 0, reason="forking a peer with another uid needs root")
def test_peer_uid_not_in_allowed_uids_is_denied_with_a_typed_error() -> None:
    """Root is always allowed (session.py), so the test connects as ``nobody`` instead.

    The default allowlist is the daemon's own uid (root here): a peer with uid 65534 is
    refused by SO_PEERCRED with PermissionDeniedError, then the connection is closed.
    """
    assert DaemonConfig().allowed_uids == [os.getuid()]
    with start_daemon(None, arena_size="32MiB") as daemon:  # /tmp/offloadd-*, not tmp_path
        open_to_everyone(daemon)
        outcome = first_reply_as(NOBODY, daemon.socket_path, "denied-job")
        assert outcome.startswith("denied:"), outcome
        assert "uid 65534 is not allowed" in outcome
        assert sessions_opened(daemon, "denied") == 1
        sock = raw_socket(daemon.socket_path)  # root itself still gets in
        assert isinstance(hello(sock, "root-job"), p.HelloOk)


@pytest.mark.skipif(os.geteuid() != 0, reason="forking a peer with another uid needs root")
def test_a_uid_listed_in_allowed_uids_gets_a_session(tmp_path: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text(f"allowed_uids = [{NOBODY}]\n")
    with start_daemon(None, arena_size="32MiB", extra_args=["--config", str(config)]) as daemon:
        open_to_everyone(daemon)
        outcome = first_reply_as(NOBODY, daemon.socket_path, "nobody-job")
        assert outcome.startswith(f"connected uid={NOBODY}"), outcome


@pytest.mark.skipif(os.geteuid() == 0, reason="root is always allowed; see the test above")
def test_own_uid_missing_from_allowed_uids_is_denied(tmp_path: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text(f"allowed_uids = [{os.getuid() + 1}]\n")
    with start_daemon(tmp_path / "d", arena_size="32MiB",
                      extra_args=["--config", str(config)]) as daemon:
        sock = raw_socket(daemon.socket_path)
        reply, _fds = read_reply(sock)
        assert error_code(reply) == "permission"
        assert is_closed(sock)


# -- arenas and the node budget ---------------------------------------------------------


def test_total_arenas_never_exceed_the_budget(tmp_path: Path) -> None:
    budget = 32 << 20
    with start_daemon(tmp_path / "d", arena_size=budget) as daemon:
        first = OffloadClient.connect(daemon.socket_path, job="a", arena_nbytes=16 << 20)
        with pytest.raises(OverBudgetError, match="budget is free"):
            OffloadClient.connect(daemon.socket_path, job="b", arena_nbytes=17 << 20)
        fair = OffloadClient.connect(daemon.socket_path, job="c")  # half of what is free
        assert fair.arena.nbytes == 8 << 20
        exact = OffloadClient.connect(daemon.socket_path, job="d", arena_nbytes=8 << 20)
        with pytest.raises(OverBudgetError):
            OffloadClient.connect(daemon.socket_path, job="e", arena_nbytes=4096)
        stats = first.stats()
        assert stats["reserved_nbytes"] == stats["budget_nbytes"] == budget
        assert stats["num_jobs"] == 3
        first.put("still", b"works")  # the refused hellos harmed nobody
        assert first.get("still") == b"works"
        for client in (first, fair, exact):
            client.close()


# -- offloadd serve -----------------------------------------------------------------------

READY = re.compile(r"^offloadd ready socket=(\S+) pid=(\d+) arena_size=(\d+)"
                   r"( metrics_addr=\S+)?$")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_one_ready_line_and_exits_0_after_closing_sessions(
        tmp_path: Path, signum: int) -> None:
    daemon = PrivateDaemon.start(tmp_path / "d", arena_size="16MiB")
    match = READY.match(daemon.ready_line)
    assert match, daemon.ready_line
    assert (match[1], int(match[2]), int(match[3])) == (daemon.socket_path, daemon.pid,
                                                        16 << 20)
    client = OffloadClient.connect(daemon.socket_path, job="j", arena_nbytes=4 << 20)
    client.put("x", b"1")
    daemon.process.send_signal(signum)
    assert daemon.process.wait(30) == 0
    assert daemon.process.stdout is not None
    assert daemon.process.stdout.read() == b""  # nothing after the ready line
    with pytest.raises(DaemonUnavailableError):
        client.stats()  # its session was closed
    client.close()
    assert not os.path.exists(daemon.socket_path)
    assert "event=stopping sessions=1" in Path(daemon.log_path).read_text()
    daemon.stop()


def serve(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "offloadd", "serve", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def ready_line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("native", [True, False], ids=["native", "no-native-module"])
def test_the_daemon_loads_torch_only_to_step_without_its_native_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    """Serving shards needs no torch, nor do steps with the native kernels. Without the
    native module a step needs torch: a rank creating optimizer state (a step's length
    before its first step) starts that import on the worker thread, so the first step
    does not wait for it."""
    import torch

    if native and not native_adam.kernels():
        pytest.skip("offloadd._native is not built")
    if not native:
        hide_native_module(monkeypatch, tmp_path)
    with start_daemon(tmp_path / "d", arena_size="16MiB") as daemon, \
            OffloadClient.connect(daemon.socket_path, job="lazy") as client:
        state = torch.full((64,), 2.0)
        client.put_many({f"blob{index}.data": state for index in range(4)})
        assert client.get("blob0.data") == state.numpy().tobytes()
        kernel = client.stats()["adam_kernel"]
        assert (kernel in ("avx512", "avx2", "scalar")) if native else kernel == "torch"
        assert not _maps_torch(daemon.process.pid)  # serving shards needs no torch
        client.put_many({f"u.{name}": state for name in ("master", "exp_avg", "exp_avg_sq",
                                                          "grad")})
        if not native:
            deadline = time.monotonic() + 60
            while not _maps_torch(daemon.process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _maps_torch(daemon.process.pid)  # loaded before any step asked for it
        client.optimizer_step("u", step=1, lr=0.1)
        assert client.get("u.master") != state.numpy().tobytes()
        assert _maps_torch(daemon.process.pid) is not native


def test_toml_config_takes_the_same_keys_as_the_flags_and_flags_win(tmp_path: Path) -> None:
    socket_path = tmp_path / "toml.sock"
    config = tmp_path / "offloadd.toml"
    config.write_text(f'socket = "{socket_path}"\narena-size = "48MiB"\n'
                      'metrics_addr = "127.0.0.1:0"\nlog-level = "warning"\n')
    process = serve("--config", str(config))
    try:
        line = ready_line(process)
        assert f"socket={socket_path} " in line and "arena_size=50331648" in line
        assert "metrics_addr=127.0.0.1:" in line
        client = OffloadClient.connect(str(socket_path), job="t", arena_nbytes=4096)
        assert client.stats()["budget_nbytes"] == 48 << 20
        client.close()
    finally:
        process.terminate()
        assert process.wait(30) == 0
    process = serve("--config", str(config), "--arena-size", "8388608")
    try:
        assert "arena_size=8388608" in ready_line(process)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0


@pytest.mark.parametrize("knob, value", [
    ("chunk_size", 1000), ("io_queue_depth", 0), ("hash_threads", -1),
    ("job_arena_share", 1.5), ("io_engine", "spdk"), ("metrics_addr", "nohost"),
])
def test_a_bad_config_value_is_refused_naming_the_key(knob: str, value: object) -> None:
    with pytest.raises(ValueError, match=knob):
        DaemonConfig(**{knob: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("text, nbytes", [
    ("1GiB", 1 << 30), ("512MiB", 512 << 20), ("4096", 4096), ("64KiB", 64 << 10),
    (" 2 MiB ", 2 << 20), ("3G", 3 << 30), ("100B", 100), (123, 123),
])
def test_sizes_parse_binary_units_and_plain_bytes(text: str | int, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["12XB", "1.2.3GiB", "", "-1", "GiB", -5])
def test_bad_sizes_raise_value_errors_naming_the_knob(text: str | int) -> None:
    with pytest.raises(ValueError, match="arena_size"):
        parse_size(text, knob="arena_size")


@pytest.mark.parametrize("args, message", [
    (["--arena-size", "12XB"], "cannot parse size"),
    (["--arena-size", "100"], "at least 4KiB"),
    (["--metrics-addr", "nohostport"], "HOST:PORT"),
])
def test_serve_refuses_bad_flags_with_exit_2(tmp_path: Path, args: list[str],
                                             message: str) -> None:
    process = serve("--socket", str(tmp_path / "s.sock"), *args)
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert message in err


def test_serve_refuses_unknown_toml_keys_with_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "offloadd.toml"
    config.write_text('arena_size = "8MiB"\nno_such_knob = 1\n')
    process = serve("--config", str(config))
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "unknown keys ['no_such_knob']" in err


def test_a_second_daemon_on_a_live_socket_exits_1_and_the_first_keeps_serving(
        daemon: PrivateDaemon, witness) -> None:
    process = serve("--socket", daemon.socket_path, "--arena-size", "8MiB")
    _out, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert f"(pid {daemon.pid}, uid {os.geteuid()}) is listening" in err
    assert stat.S_ISSOCK(os.stat(daemon.socket_path).st_mode)
    witness()


def test_a_stale_socket_file_from_a_crash_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody listens
    process = serve("--socket", str(path), "--arena-size", "8MiB")
    try:
        assert ready_line(process).startswith("offloadd ready")
        client = OffloadClient.connect(str(path), job="after-crash", arena_nbytes=4096)
        client.close()
    finally:
        process.terminate()
        assert process.wait(30) == 0
    assert not path.exists()
