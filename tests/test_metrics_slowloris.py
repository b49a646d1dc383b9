"""Slowloris on /metrics, done as a hostile local user would: connections that send their
request a byte at a time, each byte well within the idle timeout, reconnecting whenever
the daemon closes one. Against a real daemon's /metrics over real TCP sockets, scraped by
urllib, promtool and a real Prometheus server."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from _ops import free_port, require_tool
from conftest import start_daemon
from prometheus_client.parser import text_string_to_metric_families

from offloadd.ops.embedded import PrivateDaemon

DRIBBLE = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 4096
"""What a slow connection sends, one byte per round; it never finishes its head."""


def closed_by_peer(sock: socket.socket) -> bool:
    """The daemon closed (or cut) this connection; does not block."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except OSError:
        return True


def address(daemon: PrivateDaemon) -> tuple[str, int]:
    assert daemon.metrics_addr, "the daemon was started without --metrics-addr"
    host, port = daemon.metrics_addr.rsplit(":", 1)
    return host, int(port)


class Slowloris:
    """``count`` connections dribbling ``DRIBBLE`` a byte per round; a closed one is
    replaced by a new one at once (on a thread of its own while running)."""

    def __init__(self, daemon: PrivateDaemon, count: int, round_s: float = 0.05) -> None:
        self.addr = address(daemon)
        self.round_s = round_s
        self.sockets = [self._open() for _ in range(count)]
        self.sent = [1] * count
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=30)
        sock.sendall(DRIBBLE[:1])
        return sock

    def wait_until_closed(self, count: int) -> None:
        """Block until the daemon has closed ``count`` of the first connections."""
        closed: set[int] = set()
        while len(closed) < count:
            closed |= {i for i, sock in enumerate(self.sockets)
                       if i not in closed and closed_by_peer(sock)}
            time.sleep(0.01)

    def one_round(self) -> None:
        for index, sock in enumerate(self.sockets):
            if closed_by_peer(sock) or self.sent[index] >= len(DRIBBLE):
                sock.close()
                self.sockets[index], self.sent[index] = self._open(), 1
                self.reconnects += 1
                continue
            try:
                sock.sendall(DRIBBLE[self.sent[index]:self.sent[index] + 1])
                self.sent[index] += 1
            except OSError:
                pass  # closed under us: replaced next round

    def _run(self) -> None:
        while not self._stop.wait(self.round_s):
            self.one_round()

    def __enter__(self) -> Slowloris:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        for sock in self.sockets:
            sock.close()


def scrape_text(daemon: PrivateDaemon) -> str:
    with urllib.request.urlopen(f"http://{daemon.metrics_addr}/metrics", timeout=30) as reply:
        assert reply.status == 200
        return reply.read().decode()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[PrivateDaemon]:
    """A daemon with the default /metrics limits (8 connections, 10 s)."""
    with start_daemon(tmp_path / "d", arena_size="32MiB") as running:
        yield running
        assert running.process.poll() is None, "the daemon died"


@contextmanager
def holding_every_slot(daemon: PrivateDaemon, count: int = 16) -> Iterator[Slowloris]:
    """A slowloris with twice the daemon's 8 slots of connections, started once the daemon
    has answered each of them (8 got a slot; 8 were closed, refused or evicted)."""
    attack = Slowloris(daemon, count)
    attack.wait_until_closed(count - 8)
    for _ in range(5):  # the 8 that hold a slot have sent more bytes, inside the idle timeout
        attack.one_round()
    with attack:
        yield attack


def test_a_scrape_is_served_while_slow_connections_hold_every_slot(
        daemon: PrivateDaemon) -> None:
    with holding_every_slot(daemon) as attack:
        for _ in range(3):
            text = scrape_text(daemon)
            families = {family.name: family for family in text_string_to_metric_families(text)}
            budget = families["offloadd_arena_budget_bytes"].samples[0].value
            assert budget == 32 << 20
        promtool = require_tool("promtool", "prometheus")
        result = subprocess.run([promtool, "check", "metrics"], input=scrape_text(daemon),
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stdout + result.stderr
        assert attack.reconnects >= 1  # the attacker kept at it throughout


def test_a_scrape_does_not_wait_for_a_stalled_connections_next_byte(
        daemon: PrivateDaemon) -> None:
    """Every slot held by connections that have gone quiet (well inside the 10 s idle
    timeout): a scrape takes the oldest one's slot at once. Deciding whom to evict peeks at
    each connection's unread bytes; a peek that waited for data (CPython polls a socket
    with a timeout before any recv) waited out the quiet client, 10 s, under the server's
    lock, so the scrape's 5 s ran out."""
    attack = Slowloris(daemon, 16)
    try:
        attack.wait_until_closed(8)
        for _ in range(3):  # the 8 holding a slot send a little more, then go quiet
            attack.one_round()
            time.sleep(attack.round_s)
        for _ in range(3):
            with urllib.request.urlopen(f"http://{daemon.metrics_addr}/metrics",
                                        timeout=5) as reply:
                assert b"offloadd_arena_budget_bytes" in reply.read()
    finally:
        for sock in attack.sockets:
            sock.close()


def test_a_connection_that_never_finishes_its_request_is_cut_at_the_deadline(
        tmp_path: Path) -> None:
    """A byte every 0.05 s never lets a 1 s idle timeout fire; the deadline for the whole
    request does, long before 400 bytes (20 s of dribbling) are sent."""
    config = tmp_path / "offloadd.toml"
    config.write_text("metrics_idle_timeout_s = 1.0\n")
    with start_daemon(tmp_path / "d", arena_size="32MiB",
                      extra_args=["--config", str(config)]) as daemon:
        attack = Slowloris(daemon, 1)
        sock = attack.sockets[0]
        while not closed_by_peer(sock):
            assert attack.sent[0] < 400, "a dribbling connection was never cut"
            attack.one_round()
            time.sleep(attack.round_s)
        sock.close()
        assert "offloadd_arena_budget_bytes" in scrape_text(daemon)


def _prometheus_query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())["data"]["result"]  # type: ignore[no-any-return]


def test_prometheus_scrapes_succeed_during_the_attack(daemon: PrivateDaemon,
                                                      tmp_path: Path) -> None:
    binary = require_tool("prometheus", "prometheus")
    host, port = address(daemon)
    config = {"scrape_configs": [{"job_name": "offloadd", "scrape_interval": "1s",
                                  "scrape_timeout": "1s",
                                  "static_configs": [{"targets": [f"{host}:{port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    web = f"127.0.0.1:{free_port()}"
    with holding_every_slot(daemon), open(tmp_path / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={web}"],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            up: list[float] = []
            for _ in range(600):  # scrapes once a second; 3 good ones are all we wait for
                assert process.poll() is None, (tmp_path / "prometheus.log").read_text()
                try:
                    result = _prometheus_query(f"http://{web}",
                                               'sum_over_time(up{job="offloadd"}[5m])')
                    up = [float(series["value"][1]) for series in result]
                except OSError:
                    up = []  # Prometheus still starting
                if up and up[0] >= 3:
                    break
                time.sleep(0.1)
            assert up and up[0] >= 3, f"Prometheus' scrapes failed: up summed {up}"
            # Not one scrape was lost to the attack (each had Prometheus' 1 s timeout).
            failed = _prometheus_query(f"http://{web}",
                                       'count_over_time(up{job="offloadd"}[5m])'
                                       ' - sum_over_time(up{job="offloadd"}[5m])')
            assert float(failed[0]["value"][1]) == 0, "scrapes failed during the attack"
            budget = _prometheus_query(f"http://{web}", "offloadd_arena_budget_bytes")
            assert float(budget[0]["value"][1]) == 32 << 20
        finally:
            process.terminate()
            process.wait(timeout=30)
