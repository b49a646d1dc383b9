"""Prometheus metrics, counted in plain fields on the hot path and exported at scrape time.

The request path only increments integers in dicts and lists it owns; the
prometheus-client collector turns them into metric families when /metrics is
scraped (from the HTTP server's thread). That keeps per-request cost to a
few hundred nanoseconds and keeps label cardinality bounded: labels are op,
status, train_job, swap dir and reason, never shard ids.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

log = logging.getLogger(__name__)

JOB_LABEL = "train_job"
"""Label naming the training job on per-job metrics. Not ``job``: Prometheus attaches its
scrape job as ``job`` and would rename ours to ``exported_job``."""

LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.5, 2.5, 10.0,
)


class Histogram:
    """Fixed-bucket histogram counted in a list; exported cumulatively at scrape time."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def count(self) -> int:
        return sum(self.counts)

    def plus(self, other: Histogram) -> Histogram:
        """A new histogram holding the observations of both (same bounds)."""
        both = Histogram(self.bounds)
        both.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        both.total = self.total + other.total
        return both

    def buckets(self) -> list[tuple[str, float]]:
        running, out = 0.0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


def histogram_family(name: str, doc: str, labelnames: list[str],
                     series: Iterable[tuple[list[str], Histogram]]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labelnames)
    for labels, hist in series:
        family.add_metric(labels, hist.buckets(), hist.total)
    return family


class Counters:
    """A labelled counter kept as ``dict[label tuple, number]``."""

    def __init__(self, name: str, doc: str, labelnames: list[str]) -> None:
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self.values: defaultdict[tuple[str, ...], float] = defaultdict(float)

    def add(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] += amount

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(list(labels), value)
        return family


MetricSource = Callable[[], Iterable[Metric]]


class DaemonMetrics:
    """The daemon's metric state; components register sources for their own families."""

    def __init__(self) -> None:
        self.requests = Counters(
            "offloadd_requests", "Control requests handled, by op and status.", ["op", "status"]
        )
        """Failed requests by op and error code; ok ones are counted by ``request_seconds``."""
        self.request_seconds: defaultdict[str, Histogram] = defaultdict(Histogram)
        """Durations of the ok requests of each op: their count is the ok counter, so an ok
        request costs the hot path one histogram observe and no counter."""
        self.failed_seconds: defaultdict[str, Histogram] = defaultdict(Histogram)
        """Durations of the failed requests of each op (exported summed with the ok ones)."""
        self.loop_lag = Histogram((1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0))
        self.sessions_opened = Counters(
            "offloadd_sessions_opened", "Sessions opened since start, by outcome.", ["outcome"]
        )
        self.bad_frames = Counters(
            "offloadd_bad_frames", "Frames rejected at the protocol boundary.", ["reason"]
        )
        self.sources: list[MetricSource] = []

    def observe_request(self, op: str, status: str, seconds: float) -> None:
        if status == "ok":
            self.request_seconds[op].observe(seconds)
        else:
            self.requests.values[(op, status)] += 1
            self.failed_seconds[op].observe(seconds)

    def ok_histogram(self, op: str) -> Histogram:
        """Where an ok ``op`` request is observed: a session holds it to skip the look-ups."""
        return self.request_seconds[op]

    def own_families(self) -> Iterator[Metric]:
        requests = self.requests.family()
        ok_requests = list(self.request_seconds.items())
        for op, hist in ok_requests:
            requests.add_metric([op, "ok"], hist.count())
        yield requests
        yield self.sessions_opened.family()
        yield self.bad_frames.family()
        empty = Histogram()
        both = {op: hist.plus(empty) for op, hist in ok_requests}
        for op, hist in list(self.failed_seconds.items()):
            both[op] = hist.plus(both.get(op, empty))
        yield histogram_family(
            "offloadd_request_duration_seconds",
            "Time from decoding a request to queuing its reply.",
            ["op"],
            [([op], hist) for op, hist in both.items()],
        )
        yield histogram_family(
            "offloadd_event_loop_lag_seconds",
            "How late the event loop ran a periodic timer (loop health).",
            [],
            [([], self.loop_lag)],
        )


class _Collector:
    def __init__(self, metrics: DaemonMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self.metrics.own_families()
        for source in list(self.metrics.sources):
            try:
                yield from source()
            except Exception:  # a broken source must not take /metrics down
                log.exception("event=metrics_source_failed source=%r", source)


def build_registry(metrics: DaemonMetrics) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(metrics))
    return registry


def gauge(name: str, doc: str, value: float, labelnames: list[str] | None = None,
          series: Iterable[tuple[list[str], float]] | None = None) -> GaugeMetricFamily:
    if labelnames is None:
        return GaugeMetricFamily(name, doc, value=value)
    family = GaugeMetricFamily(name, doc, labels=labelnames)
    for labels, sample in series or ():
        family.add_metric(labels, sample)
    return family


def serve_metrics(registry: CollectorRegistry, host: str, port: int, *,
                  idle_timeout_s: float = 10.0, max_connections: int = 8,
                  request_timeout_s: float | None = None) -> BoundedMetricsServer:
    """Start the /metrics HTTP server on its own thread; returns the server (has .shutdown()).

    Each connection is served on a thread of its own, so connections are bounded
    (``max_connections``). A connection has ``request_timeout_s`` (default:
    ``idle_timeout_s``) from its accept to send its whole request and take the reply, and
    no read may wait longer than ``idle_timeout_s``: a client that dribbles a byte now and
    then cannot keep a slot. When every slot is taken, a new connection takes the slot of
    the oldest one that has not sent its whole request yet (a scraper sends its request
    at once, so only a stalling client loses its slot): held slots cannot keep a scrape out.
    """
    handler = type("MetricsHandler", (MetricsHandler,),
                   {"registry": registry, "timeout": idle_timeout_s})
    server = BoundedMetricsServer((host, port), handler, max_connections,
                                  request_timeout_s or idle_timeout_s)
    threading.Thread(target=server.serve_forever, name="offloadd-metrics", daemon=True).start()
    log.info("event=metrics_listening addr=%s:%d", host, server.server_address[1])
    return server


class MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics: the registry in Prometheus' text format; one request per connection."""

    registry: CollectorRegistry
    server: BoundedMetricsServer
    timeout: ClassVar[float | None]  # the socket's timeout (StreamRequestHandler): idle go

    def do_GET(self) -> None:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        if not self.server.request_read(self.request):
            return  # cut (deadline or evicted) while its head was read: nobody to answer
        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            self.send_error(404, "only /metrics is served here")
            return
        body = generate_latest(self.registry)
        if not self.server.reply_ready(self.request):
            return  # cut while the registry was collected
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not log events


class _Connection:
    """One accepted /metrics connection: when its time is up and whether it still reads."""

    __slots__ = ("cut", "deadline", "reading")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        """time.monotonic() by which the whole exchange must be done."""
        self.reading = True
        """Its request head is not read yet (it may be evicted for a newcomer)."""
        self.cut = False
        """Its socket was shut down (deadline passed or evicted)."""


def _head_waiting(sock: socket.socket) -> bool:
    """Whether a whole request head waits in the socket's receive queue, unread; never
    waits for data.

    The peek goes through a duplicate descriptor: ``sock`` has the handler's idle timeout,
    and CPython polls a socket that has a timeout for data before every recv, MSG_DONTWAIT
    or not. Peeking at ``sock`` itself waited (under the server's lock) for a stalling
    client's next byte: every eviction took one of a slowloris' rounds, and a scrape queued
    behind a few of them answered in a second instead of milliseconds. The duplicate has
    no timeout of its own, so its recv is the kernel's non-blocking peek."""
    try:
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:
            pending = peek.recv(MAX_HEAD_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:  # nothing there (EAGAIN), the peer is gone, or the socket is closed
        return False
    return b"\r\n\r\n" in pending


MAX_HEAD_PEEK = 65536
"""Bytes of a request head looked at (http.server refuses longer lines anyway)."""


def _cut(sock: socket.socket) -> None:
    # shutdown, not close: the handler's thread still owns the descriptor; its blocked
    # read or write returns at once and the thread ends, freeing the slot.
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # the peer is already gone


class BoundedMetricsServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with at most ``max_connections`` connections (and threads),
    each cut once ``request_timeout_s`` since its accept have passed.

    Hazard: a socket is shut down from this server's thread while its handler's thread
    uses it. ``_lock`` orders that against the handler's close, so a shutdown never hits
    a descriptor number the kernel has already handed to a newer connection.
    """

    daemon_threads = True
    request_queue_size = 128
    """The listen backlog (socketserver's default is 5): a burst of connects waits in the
    kernel to be accepted (and to evict a stalled connection) instead of having its SYNs
    dropped and retried a second later."""
    eviction_grace_s = 5.0
    """Longest the accept loop waits for an evicted connection's thread to end."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 max_connections: int, request_timeout_s: float = 10.0) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        self.request_timeout_s = request_timeout_s
        self.refused = 0
        """Connections closed at once: no slot, none could be freed."""
        self.evicted = 0
        """Connections cut before their request was whole, for a newer connection."""
        self.expired = 0
        """Connections cut because their request_timeout_s passed."""
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Connection] = {}
        """Connections holding a slot, oldest first."""
        self._ending: list[threading.Thread] = []
        """Handler threads that gave their slot back and are ending."""
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False) and not self._take_a_reading_slot():
            self.refused += 1
            self.shutdown_request(request)
            return
        self._join_ended()
        with self._lock:
            self._open[request] = _Connection(time.monotonic() + self.request_timeout_s)
        try:
            super().process_request(request, client_address)
        except BaseException:
            with self._lock:
                if self._open.pop(request, None) is not None:
                    self.slots.release()
            raise

    def _join_ended(self) -> None:
        """Wait for the threads whose slots were given back to end, before a new one starts.

        Hazard: a handler gives its slot back in its last lines, and its thread ends after.
        A connection accepted meanwhile started its thread beside it: one thread over the
        bound, and more on a loaded host, where a burst of idle connections held 4 slots
        and 5 handler threads (tests/test_daemon_metrics.py)."""
        with self._lock:
            ending, self._ending = self._ending, []
        for thread in ending:
            thread.join(self.eviction_grace_s)

    def shutdown_request(self, request: Any) -> None:
        """Close a connection; one that held a slot (its handler thread, at its end) gives
        the slot back in the same step. Hazard: given back after, a scrape that came once
        the client saw the close found neither a free slot nor a cut connection to wait
        for, and was refused (tests/test_daemon_metrics.py, under load)."""
        with self._lock:  # see the class note
            held = self._open.pop(request, None) is not None
            super().shutdown_request(request)
            if held:
                self._ending.append(threading.current_thread())
                self.slots.release()

    def request_read(self, request: Any) -> bool:
        """The handler has read a whole request head: it may no longer be evicted, and the
        reply gets a deadline of its own (the time the daemon takes to answer is not the
        client's). False when the connection was cut meanwhile (nothing to write to)."""
        with self._lock:
            connection = self._open.get(request)
            if connection is None or connection.cut:
                return False
            connection.reading = False
            connection.deadline = time.monotonic() + self.request_timeout_s
            return True

    def reply_ready(self, request: Any) -> bool:
        """The reply's body is made: its writing gets a deadline of its own, so a daemon
        slow to collect (a loaded node) does not eat the time a client has to read it.
        False when the connection was cut meanwhile."""
        return self.request_read(request)

    def service_actions(self) -> None:
        """Cut every connection past its deadline (run by serve_forever each poll)."""
        now = time.monotonic()
        with self._lock:
            for sock, connection in self._open.items():
                if connection.cut or now < connection.deadline:
                    continue
                if connection.reading and _head_waiting(sock):
                    # The client sent its whole request; this busy daemon has not read it
                    # yet. Its thread will: that is no slowloris.
                    connection.deadline = now + self.request_timeout_s
                    continue
                connection.cut = True
                self.expired += 1
                _cut(sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            # A cut or vanished connection's handler fails on its socket: expected.
            log.debug("event=metrics_connection_failed client=%s", client_address,
                      exc_info=True)
        else:
            log.exception("event=metrics_request_failed client=%s", client_address)

    def _take_a_reading_slot(self) -> bool:
        """Evict the oldest connection still sending its request and wait for its slot;
        with none to evict, wait for the slot of one already cut (expired or evicted: its
        thread is on its way out). Without that wait, a scrape that came just after the
        idle connections were cut was refused while their threads wound down."""
        with self._lock:
            oldest = next((item for item in self._open.items()
                           if item[1].reading and not item[1].cut
                           and not _head_waiting(item[0])), None)
            if oldest is None:
                if not any(connection.cut for connection in self._open.values()):
                    return False
            else:
                sock, connection = oldest
                connection.cut = True
                self.evicted += 1
                _cut(sock)
        return self.slots.acquire(timeout=self.eviction_grace_s)
