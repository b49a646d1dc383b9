"""A node shared by several users, one of them hostile: what one uid can cost the others
and see of them. Real daemon, real sockets, real second and third uids (forked children
that drop to 65534 and 65533 before they connect), so these tests need root.

- A uid that sends node_status on many connections and never reads its replies holds
  at most ``max_pending_nbytes_per_uid`` of daemon memory (plus one reply a connection),
  and another uid is served meanwhile.
- An ended job's name stays its owner's while its files are kept: a stranger's hello
  for it is refused, the owner resumes from the kept flush.
- /metrics (plain HTTP, anyone on the host can scrape it) and another uid's
  node_status never show a job's name.
- The CPU twin's device copies are served only by a daemon started for tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import termios
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from _uids import become
from conftest import call, raw_socket, start_daemon
from test_daemon_metrics import scrape, value
from test_daemon_sessions import as_uid, open_to_everyone
from test_device_copies import TwinSlots

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from offloadd.service.device_copies import TWIN_COPIES_ENV
from offloadd.service.server import JOB_LABEL
from trainer.client import OffloadClient

NOBODY = 65534
OTHER = 65533
CAP_NBYTES = 256 << 10
"""max_pending_nbytes_per_uid of the daemon under attack."""
NUM_CONNECTIONS = 16
REQUESTS_PER_CONNECTION = 2000
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="peers with other uids need root")


def shared_daemon_with(workdir: Path, config: str, extra_args: list[str] | None = None
                       ) -> PrivateDaemon:
    path = workdir / "offloadd.toml"
    path.write_text(f"allowed_uids = [{NOBODY}, {OTHER}]\n{config}")
    daemon = start_daemon(None, arena_size="64MiB",
                          extra_args=["--config", str(path), *(extra_args or [])])
    open_to_everyone(daemon)
    return daemon


# -- a uid that never reads its replies -----------------------------------------------------


class NonReader:
    """A forked child running as ``uid``: opens connections, sends node_status requests on
    each and never reads a reply; on request it reports the reply bytes the kernel holds
    for it (FIONREAD of each socket), which the daemon no longer buffers."""

    def __init__(self, uid: int, socket_path: str) -> None:
        to_child_r, self.to_child = os.pipe()
        self.from_child, from_child_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - runs in the child
            try:
                os.close(self.to_child)
                os.close(self.from_child)
                become(uid)
                self._serve(socket_path, to_child_r, from_child_w)
            finally:
                os._exit(0)
        os.close(to_child_r)
        os.close(from_child_w)
        self.sent = json.loads(self._line())

    @staticmethod
    def _serve(socket_path: str, commands: int, answers: int) -> None:  # pragma: no cover
        frames = b"".join(p.encode_frame(p.NodeStatus(rid))
                          for rid in range(1, REQUESTS_PER_CONNECTION + 1))
        socks = []
        sent = 0
        for _ in range(NUM_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(socket_path)
            sock.setblocking(False)
            socks.append(sock)
            try:
                sent += sock.send(frames)
            except (BlockingIOError, ConnectionError):
                pass
        os.write(answers, f"{sent}\n".encode())
        while os.read(commands, 1) == b"?":
            queued = 0
            for sock in socks:
                size = fcntl.ioctl(sock.fileno(), termios.FIONREAD, struct.pack("i", 0))
                queued += struct.unpack("i", size)[0]
            os.write(answers, f"{queued}\n".encode())

    def _line(self) -> str:
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self.from_child, 64)
            assert chunk, "the non-reading child died"
            data += chunk
        return data.decode()

    def kernel_queued_nbytes(self) -> int:
        os.write(self.to_child, b"?")
        return int(self._line())

    def close(self) -> None:
        os.write(self.to_child, b"q")
        os.waitpid(self.pid, 0)
        os.close(self.to_child)
        os.close(self.from_child)


def node_status_reply_nbytes(socket_path: str) -> int:
    """Bytes of one node_status reply frame as ``NOBODY`` gets it (what the attacker asks)."""
    def ask() -> str:
        sock = raw_socket(socket_path)
        sock.sendall(p.encode_frame(p.NodeStatus(7)))
        (length,) = p.HEADER.unpack(sock.recv(p.HEADER_NBYTES, socket.MSG_WAITALL))
        return str(p.HEADER_NBYTES + length)
    return int(as_uid(NOBODY, ask))


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


@pytest.fixture
def flooded_daemon(tmp_path: Path) -> Iterator[PrivateDaemon]:
    with shared_daemon_with(tmp_path, f"max_pending_nbytes_per_uid = {CAP_NBYTES}\n"
                            "node_status_interval_s = 0.0002\n") as daemon:
        yield daemon


def test_replies_a_uid_never_reads_cost_at_most_its_pending_cap(
        flooded_daemon: PrivateDaemon) -> None:
    """16 connections of one uid each send 2000 node_status and read nothing: the daemon
    stops answering each connection once the uid's buffered requests and replies pass
    its cap, so it holds about the cap (not 16 x 256 replies in flight), and another uid
    is served meanwhile."""
    daemon = flooded_daemon
    reply_nbytes = node_status_reply_nbytes(daemon.socket_path)
    answered_before = value(scrape(daemon), "offloadd_request_duration_seconds_count",
                            op="node_status")
    attacker = NonReader(NOBODY, daemon.socket_path)
    try:
        def settled() -> bool:  # every connection of the attacker left unread or closed
            samples = scrape(daemon)
            unread = value(samples, "offloadd_connections_unread")
            return unread > 0 and unread == value(samples, "offloadd_sessions")

        wait_until(settled, "the non-reading connections were all held")
        samples = scrape(daemon)
        buffered = value(samples, "offloadd_client_buffered_bytes")
        answered = value(samples, "offloadd_request_duration_seconds_count",
                         op="node_status") - answered_before
        # Measured apart from the daemon's own count: replies it wrote, less what the
        # kernel holds for the attacker, is what the daemon still buffers.
        held_by_daemon = answered * reply_nbytes - attacker.kernel_queued_nbytes()
        slack = NUM_CONNECTIONS * (reply_nbytes + 64)
        assert buffered <= CAP_NBYTES + slack, (buffered, CAP_NBYTES)
        assert held_by_daemon <= 2 * CAP_NBYTES, (
            f"the daemon buffers ~{held_by_daemon} reply bytes nobody reads "
            f"({answered:.0f} replies of {reply_nbytes} B); cap {CAP_NBYTES}")

        def witness() -> str:  # another uid: its status and its job are served
            reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
            assert isinstance(reply, p.StatsOk), reply
            with OffloadClient.connect(daemon.socket_path, job="witness",
                                       arena_nbytes=1 << 20, timeout_s=30) as client:
                client.put("w", b"served")
                return f"{client.get('w')!r} {reply.stats['scope']}"

        assert as_uid(OTHER, witness) == "b'served' own"
    finally:
        attacker.close()
    assert daemon.process.poll() is None


# -- job names -------------------------------------------------------------------------------


def test_a_stranger_cannot_take_an_ended_jobs_name_while_its_files_are_kept(
        tmp_path: Path, swap_root: Path) -> None:
    swap_dir = swap_root / "swap"
    swap_dir.mkdir(mode=0o755)
    os.chmod(swap_root, 0o755)
    with shared_daemon_with(tmp_path, "job_linger_s = 0.5\n",
                            ["--swap-dir", str(swap_dir)]) as daemon:
        def victim_runs() -> str:
            with OffloadClient.connect(daemon.socket_path, job="train", timeout_s=30,
                                       arena_nbytes=4 << 20) as client:
                client.put("weights", b"the victim's")
                client.flush("step-1")
                client.close_job()
            return "ended"

        assert as_uid(NOBODY, victim_runs) == "ended"

        def kept() -> bool:
            reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
            assert isinstance(reply, p.StatsOk), reply
            return "train" in reply.stats["retained"] and not reply.stats["jobs"]

        wait_until(kept, "the ended job's files were kept")

        def stranger_takes_it() -> str:
            with OffloadClient.connect(daemon.socket_path, job="train", timeout_s=30,
                                       arena_nbytes=4 << 20) as client:
                client.put("weights", b"the stranger's")
            return "took it"

        refused = as_uid(OTHER, stranger_takes_it)
        assert refused.startswith("denied:") and f"belongs to uid {NOBODY}" in refused, refused

        def victim_resumes() -> str:
            with OffloadClient.connect(daemon.socket_path, job="train", timeout_s=30,
                                       arena_nbytes=4 << 20) as client:
                return repr(client.get("weights"))

        assert as_uid(NOBODY, victim_resumes) == repr(b"the victim's")


def test_metrics_and_other_uids_never_see_a_jobs_name(tmp_path: Path) -> None:
    """/metrics is plain HTTP (any local user scrapes it): job series carry an opaque
    label, which the job's own stats name; another uid's node_status counts the job."""
    name = "payroll-model-v3"
    with shared_daemon_with(tmp_path, "") as daemon:
        def owner_runs() -> str:
            client = OffloadClient.connect(daemon.socket_path, job=name, timeout_s=30,
                                           arena_nbytes=4 << 20)
            client.put("x", b"y" * 5000)
            own_label = client.stats()["metrics_label"]
            reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
            assert isinstance(reply, p.StatsOk), reply
            assert reply.stats["jobs"][name]["metrics_label"] == own_label
            # Still attached while the parent looks: the exit of the child closes it.
            os.write(ready_w, own_label.encode() + b"\n")
            os.read(done_r, 1)
            return "ok"

        ready_r, ready_w = os.pipe()
        done_r, done_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            try:
                become(NOBODY)
                owner_runs()
            finally:
                os._exit(0)
        os.close(ready_w)  # so a child that failed reads as EOF here
        os.close(done_r)
        try:
            metrics_label = os.read(ready_r, 256).decode().strip()
            with urllib.request.urlopen(f"http://{daemon.metrics_addr}/metrics",
                                        timeout=10) as reply:
                exposition = reply.read().decode()
            assert name not in exposition
            assert metrics_label.startswith("j-"), metrics_label
            assert value(scrape(daemon), "offloadd_arena_capacity_bytes",
                         **{JOB_LABEL: metrics_label}) == 4 << 20

            def stranger_looks() -> str:
                reply = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
                assert isinstance(reply, p.StatsOk), reply
                shown = json.dumps(reply.stats)
                return f"{name in shown} {reply.stats['node']['num_jobs']}"

            assert as_uid(OTHER, stranger_looks) == "False 1"
        finally:
            with contextlib.suppress(BrokenPipeError):
                os.write(done_w, b"x")
            os.waitpid(pid, 0)
            os.close(ready_r)
            os.close(done_w)


# -- the CPU twin's device copies --------------------------------------------------------


def twin_staging_path(daemon: PrivateDaemon) -> tuple[str, str]:
    slots = TwinSlots()
    try:
        with OffloadClient.connect(daemon.socket_path, job="twin", timeout_s=30,
                                   arena_nbytes=1 << 20) as client:
            reply = client.request(slots.open_request())
            assert isinstance(reply, p.StagingOk), reply
            return reply.path, reply.reason
    finally:
        slots.close()


def test_twin_copies_are_served_only_by_a_daemon_started_for_tests(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin opens the rank's memfd through /proc with the daemon's (root's)
    credentials: a daemon not started for tests answers path "rank" and copies nothing."""
    monkeypatch.delenv(TWIN_COPIES_ENV)
    with start_daemon(None, arena_size="16MiB") as production:
        assert twin_staging_path(production) == ("rank", "gpu_not_visible")
        samples = scrape(production)
        assert value(samples, "offloadd_device_copies_sessions_total", path="rank",
                     reason="gpu_not_visible") == 1
    monkeypatch.setenv(TWIN_COPIES_ENV, "1")
    with start_daemon(None, arena_size="16MiB") as for_tests:
        assert twin_staging_path(for_tests) == ("daemon", "")

