"""A client that does not read its replies, or floods the daemon with requests, costs
bounded memory and loop time; the optimizer serves jobs in turn. Real daemon, real sockets."""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import hello, raw_socket, read_reply, start_daemon
from test_daemon_limits import NOBODY, limited_daemon
from test_daemon_metrics import scrape, value
from test_daemon_sessions import as_uid, open_to_everyone

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

UNIT_ELEMENTS = 1 << 16


def rss_nbytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def answered(daemon: PrivateDaemon, op: str) -> float:
    return value(scrape(daemon), "offloadd_requests_total", op=op, status="ok")


def test_a_client_that_never_reads_is_not_served_past_its_socket_buffers() -> None:
    """200 KB of stats requests on a connection that reads nothing: the daemon answers
    only what fits in the socket and transport buffers, another job is served meanwhile,
    and once the client reads, every request gets its reply in order."""
    with start_daemon(None, arena_size="64MiB") as daemon:
        greedy = raw_socket(daemon.socket_path)
        greedy.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        assert isinstance(hello(greedy, "greedy"), p.HelloOk)
        frames = [p.encode_frame(p.Stats(rid)) for rid in range(256, 10_256)]
        frame_nbytes = len(frames[0])
        assert all(len(frame) == frame_nbytes for frame in frames)
        payload = b"".join(frames)
        assert len(payload) > 100_000
        rss_before = rss_nbytes(daemon.process.pid)
        greedy.setblocking(False)
        sent = 0
        while sent < len(payload):
            try:
                sent += greedy.send(payload[sent : sent + 65536])
            except BlockingIOError:
                break  # the daemon stopped reading us: what the backpressure is for
            time.sleep(0.01)  # let the daemon answer what it has (it must stop at some point)
        with OffloadClient.connect(daemon.socket_path, job="witness", arena_nbytes=1 << 20,
                                   timeout_s=30) as witness:
            assert witness.stats()["job"] == "witness"
        served = answered(daemon, "stats") - 1  # the witness's
        assert served < len(frames) / 4, f"{served} of {len(frames)} answered to a non-reader"
        assert rss_nbytes(daemon.process.pid) - rss_before < 32 << 20
        greedy.setblocking(True)
        greedy.settimeout(30)
        for rid in range(256, 256 + sent // frame_nbytes):  # every whole frame is answered
            reply, _fds = read_reply(greedy)
            assert isinstance(reply, p.StatsOk) and reply.rid == rid, reply
        greedy.close()
        assert daemon.process.poll() is None


def make_unit(client: OffloadClient, unit: str, elements: int = UNIT_ELEMENTS) -> None:
    zeros = np.zeros(elements, np.float32)
    for suffix in ("master", "exp_avg", "exp_avg_sq", "grad"):
        client.put(f"{unit}.{suffix}", zeros)


def optimizer_stats(client: OffloadClient) -> dict[str, float]:
    return client.stats()["optimizer"]


def step_frame(rid: int, unit: str, step: int) -> bytes:
    return p.encode_frame(p.OptimizerStep(rid, unit, step, 1e-3, 0.9, 0.999, 1e-8))


def test_requests_in_flight_per_connection_are_bounded(tmp_path: Path) -> None:
    """50 pipelined optimizer steps on one connection with max_requests_in_flight = 4:
    never more than 4 of them wait in the daemon at once; all 50 are answered."""
    with limited_daemon(tmp_path, "max_requests_in_flight = 4\n", arena_size="64MiB") as daemon, \
            OffloadClient.connect(daemon.socket_path, job="flood", arena_nbytes=8 << 20) as owner, \
            OffloadClient.connect(daemon.socket_path, job="observer", arena_nbytes=1 << 20) as seen:
        make_unit(owner, "u")
        sock = raw_socket(daemon.socket_path, timeout_s=60)
        assert isinstance(hello(sock, "flood", arena_nbytes=8 << 20), p.HelloOk)
        sock.sendall(b"".join(step_frame(rid, "u", rid) for rid in range(1, 51)))
        most_waiting = 0
        while optimizer_stats(seen)["steps"] < 50:
            most_waiting = max(most_waiting, optimizer_stats(seen)["queued"])
        assert most_waiting <= 3  # one running, at most three queued
        for rid in range(1, 51):
            reply, _fds = read_reply(sock)
            assert isinstance(reply, p.Ok) and reply.rid == rid, reply


def test_one_jobs_queued_steps_do_not_delay_another_jobs_step() -> None:
    """Job A queues 200 optimizer steps; job B's one step runs after at most one more of
    A's, not after A's whole queue (the optimizer takes jobs in turn).

    A's unit is 16x B's, so each of A's steps outlasts the round trips between reading
    the step count and queuing B's step (with equal small units a loaded host ran 8 of
    A's steps in that window, counted as if they had run ahead of B's)."""
    with start_daemon(None, arena_size="64MiB") as daemon, \
            OffloadClient.connect(daemon.socket_path, job="a", arena_nbytes=32 << 20) as a, \
            OffloadClient.connect(daemon.socket_path, job="b", arena_nbytes=8 << 20) as b:
        make_unit(a, "u", 16 * UNIT_ELEMENTS)
        make_unit(b, "u")
        queue = raw_socket(daemon.socket_path, timeout_s=120)
        assert isinstance(hello(queue, "a", arena_nbytes=32 << 20), p.HelloOk)
        queue.sendall(b"".join(step_frame(rid, "u", rid) for rid in range(1, 201)))
        while True:
            asked = time.perf_counter()
            stats = optimizer_stats(b)
            answered = time.perf_counter()
            if stats["queued"] >= 100:  # A's queue is in the daemon
                break
        before = stats["steps"]
        sending = time.perf_counter()
        b.optimizer_step("u", step=1, lr=1e-3)
        returned = time.perf_counter()
        final = optimizer_stats(b)
        counted = time.perf_counter()
        after = final["steps"]
        # A's steps that ran while the count's reply was on its way, while this process
        # got to sending B's step (a loaded host can hold it there for 16 of A's steps) and
        # while B's request was on its way are not ahead of B's, nor those that ran after
        # B's step returned, while the final count was asked for: allow as many as fit in
        # those times at the mean step time (B's small step in them only makes the
        # allowance larger).
        on_the_way = (sending - asked) + (answered - asked) + (counted - returned)
        in_transit = math.ceil(on_the_way / (final["step_s"] / final["steps"]))
        assert after - before <= 3 + in_transit, (
            f"{after - before - 1} of A's steps ran before B's one ({in_transit} may have run "
            "while B's step was on its way)")
        for rid in range(1, 201):
            reply, _fds = read_reply(queue)
            assert isinstance(reply, p.Ok) and reply.rid == rid, reply


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root")
def test_node_status_is_spaced_per_uid(tmp_path: Path) -> None:
    """node_status costs a pass over every visible job: one uid's flood of them is answered
    one per node_status_interval_s, while another uid is answered at once."""
    toml = f"allowed_uids = [{NOBODY}]\nnode_status_interval_s = 3600\n"
    with limited_daemon(tmp_path, toml, arena_size="32MiB") as daemon:
        open_to_everyone(daemon)
        flood = raw_socket(daemon.socket_path)
        flood.sendall(b"".join(p.encode_frame(p.NodeStatus(rid)) for rid in range(1, 6)))
        first, _fds = read_reply(flood)
        assert isinstance(first, p.StatsOk) and first.rid == 1

        def ask() -> str:
            reply = read_reply_of(daemon.socket_path)
            return "answered" if isinstance(reply, p.StatsOk) else repr(reply)

        assert as_uid(NOBODY, ask) == "answered"
        assert answered(daemon, "node_status") == 2  # root's first and nobody's one
        flood.close()


def read_reply_of(socket_path: str) -> p.Reply | None:
    sock = raw_socket(socket_path)
    sock.sendall(p.encode_frame(p.NodeStatus(1)))
    return read_reply(sock)[0]
