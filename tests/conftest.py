"""Shared fixtures: a real ``offloadd serve`` process on a temp socket, clients, raw sockets.

The ``daemon`` fixture is one daemon per test module (starting one costs ~2 s); every
test gets its own job name (``job``) so tests never share shards. Tests that need a
daemon with a special configuration start their own with ``start_daemon``.
Asyncio tests take ``run_async``, which runs a coroutine under the default loop and under
uvloop (the fixture is parametrized) with a timeout.
"""

from __future__ import annotations

import array
import asyncio
import compileall
import fcntl
import itertools
import multiprocessing.forkserver
import multiprocessing.util
import os
import re
import select
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import uvloop

from offloadd import protocol as p
from offloadd.errors import OverBudgetError
from offloadd.memory.arena import HUGE_PAGE_NBYTES, free_huge_pages
from offloadd.ops.embedded import PrivateDaemon
from trainer import lease_debug
from trainer.client import OffloadClient

T = TypeVar("T")
# Every device copy in the suite goes through the CPU twin copy engine (trainer.device.copy_engine):
# late, threaded copies with events, so release-before-copy races fail here, not on a GPU.
os.environ.setdefault("OFFLOADD_COPY_ENGINE", "twin")
# Daemons the suite starts inherit this: they were started for tests, so they serve the
# twin's copies (offloadd.service.device_copies refuses them elsewhere).
os.environ["OFFLOADD_ACCEPT_TWIN_COPIES"] = "1"
# Plain-torch references compute with the one intra-op thread every rank and script in the
# suite uses (tests/_dist.py, tests/scripts): matmul splits its sums by thread, so a
# reference on two threads differs from the same math on one in the last bits, and Adam
# turns those bits into lr-sized steps wherever a gradient is near zero.
torch.set_num_threads(1)
JOB_ARENA_NBYTES = 4 << 20
"""Arena each test job asks for; small, so one module's jobs fit the daemon's budget."""
ASYNC_TIMEOUT_S = 30.0
_job_counter = itertools.count()

# Every test (and every rank process a test starts) runs with debug leases: a view of a
# shard used after its release raises StaleLeaseError instead of reading another shard.
os.environ[lease_debug.ENV_VAR] = "1"
lease_debug.enable(True)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile the project's sources once, before any test starts a process.

    Each process the suite starts (hundreds of daemons and ranks) imports offloadd, trainer
    and the tests' helpers; where ``PYTHONDONTWRITEBYTECODE`` is set, as on the CI image,
    every one of them compiled those sources again (~0.2-0.7 s of CPU each). Written
    bytecode is still read there. The xdist workers leave this to the controller."""
    if hasattr(session.config, "workerinput"):
        return
    root = Path(__file__).resolve().parent.parent
    for folder in ("offloadd", "trainer", "tests", "examples"):
        compileall.compile_dir(root / folder, quiet=1)


def start_daemon(workdir: os.PathLike[str] | str | None, *, arena_size: int | str = "256MiB",
                 extra_args: list[str] | None = None) -> PrivateDaemon:
    """``offloadd serve`` with Prometheus on a free port (see ``PrivateDaemon.metrics_addr``).

    Its arenas are on 4 KiB pages unless the test says otherwise: under "auto" (the
    daemon's default) they would take the huge pages a concurrent test reserved for its
    own daemon, and round sizes up to 2 MiB in tests that count bytes."""
    args = ["--metrics-addr", "127.0.0.1:0", *(extra_args or [])]
    if not any(arg in ("--arena-hugepages", "--config") for arg in args):
        args += ["--arena-hugepages", "off"]
    return PrivateDaemon.start(workdir, arena_size=arena_size, extra_args=args)


HIDE_NATIVE = """
import importlib.abc
import sys


class NoNative(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "offloadd._native":
            raise ImportError("offloadd._native is hidden from this process (a test)")
        return None


sys.meta_path.insert(0, NoNative())
"""


def hide_native_module(monkeypatch: pytest.MonkeyPatch, scratch: Path) -> None:
    """Processes started after this (a daemon, ranks) cannot import ``offloadd._native``,
    as on an install whose native build failed: a ``sitecustomize`` in ``scratch`` on
    their PYTHONPATH refuses it."""
    hook = scratch / "no-native-hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(HIDE_NATIVE)
    inherited = os.environ.get("PYTHONPATH", "").split(":")
    monkeypatch.setenv("PYTHONPATH", ":".join(filter(None, [str(hook), *inherited])))


def wait_bounce_backed(socket_path: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The daemon's bounce-slot stats once it is done backing the slots, which it does
    once a job outgrows its arena (``SwapSpace.stage_ahead``: up to 128 MiB of its
    memory, and one slot in use at a time meanwhile); asked by ``NodeStatus``, so no
    job is opened for it."""
    from offloadd.ops.status import query_node_status

    deadline = time.monotonic() + timeout_s
    while True:
        swap = query_node_status(socket_path)["node"].get("swap") or {}
        bounce: dict[str, Any] = swap.get("bounce", {})
        if not bounce.get("prefault_running"):
            return bounce
        if time.monotonic() > deadline:
            raise AssertionError(f"the bounce slots were still being backed after "
                                 f"{timeout_s} s: {bounce}")
        time.sleep(0.05)


@pytest.fixture
def strict_device_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin's device memory is its own tensor kind (trainer.device.twin): host/device
    mixes, numpy() of device tensors and host tensors in device collectives fail as on a
    GPU. Rank processes a test starts inherit it. Use: pytest.mark.usefixtures(...)."""
    monkeypatch.setenv("OFFLOADD_COPY_ENGINE", "twin")
    monkeypatch.setenv("OFFLOADD_TWIN_DEVICE", "strict")


def cap_twin_device(monkeypatch: pytest.MonkeyPatch, capacity: int | None) -> None:
    """In this process, the strict twin's device holds ``capacity`` more bytes than are
    allocated now (None: unbounded) until the test ends, and its peak starts again from
    here: a GPU of that size, in-process."""
    import gc

    from trainer.device import twin_memory
    from trainer.device.twin import twin_device

    twin_device()
    gc.collect()  # an earlier engine's device tensors, if a cycle still holds them
    monkeypatch.setattr(twin_memory.memory(), "capacity_nbytes",
                        None if capacity is None else twin_memory.memory_allocated() + capacity)
    twin_memory.reset_peak_memory_stats()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateDaemon]:
    instance = start_daemon(tmp_path_factory.mktemp("offloadd"))
    yield instance
    alive = instance.process.poll() is None
    code = instance.stop()
    assert alive, f"the daemon died during the module; log: {instance.log_path}"
    assert code == 0


_SUITE_TMP = tempfile.gettempdir() if len(tempfile.gettempdir()) <= 32 else "/tmp"
"""Where each test's own temp dir goes: short, so sockets made under it fit AF_UNIX."""


def pytest_configure(config: pytest.Config) -> None:
    """Hazard: multiprocessing makes its temp dir (where the rank fork server of
    tests/_dist.py listens) on first use and keeps it. Made under a test's own dir
    (``test_tmpdir``), as when a test imports _dist inside its body, it went with that
    test, and the next test's ranks failed to reach the fork server. So each pytest process
    makes it here, before any test. Not at this module's import: rank processes import it
    too (a test module's ``from conftest import ...``), and they leave without the
    interpreter's teardown, so each left a ``pymp-*`` dir in /tmp.

    Hazard: the rank fork server keeps the environment it starts with, and a rank
    unpickles its function (importing the test's module, transformers, torch's inductor)
    before it takes its caller's (``_dist._adopt``). Started inside a test, the server
    held that test's ``TORCHINDUCTOR_CACHE_DIR`` under its temp dir, which a later rank's
    imports made again after the test had removed it: empty ``ot-*/torchinductor`` dirs
    in /tmp after a suite run. So the server starts here, with a cache dir that lives as
    long as this process (inside multiprocessing's temp dir, removed at exit)."""
    temp_dir = multiprocessing.util.get_temp_dir()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(temp_dir, "torchinductor")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist's controller runs no test
    from _dist import rank_context

    rank_context()
    multiprocessing.forkserver.ensure_running()


@pytest.fixture(autouse=True)
def test_tmpdir(monkeypatch: pytest.MonkeyPatch,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every temp path a test makes goes to one dir of its own, removed after the test.

    ``TMPDIR`` is set for the test and every process it starts (rank processes, torchrun
    and its ``torchelastic_*`` dirs, private daemons, their default swap dirs), and
    ``tempfile`` in this process uses it too: rank bodies' ``mkdtemp`` calls, checkpoints
    and swap files (gigabytes per suite run otherwise) go with the test.
    """
    tmp_path_factory.getbasetemp()  # fixed once per session, before TMPDIR moves
    root = tempfile.mkdtemp(prefix="ot-", dir=_SUITE_TMP)
    os.chmod(root, 0o755)  # other uids' clients (the trust tests) reach sockets under it
    monkeypatch.setenv("TMPDIR", root)
    monkeypatch.setattr(tempfile, "tempdir", root)
    # inductor puts the cache dir it first derives into the environment, where the next
    # test's ranks found it (the previous test's root, removed): it was made again, and
    # left in /tmp
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "torchinductor"))
    try:
        yield Path(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def job(request: pytest.FixtureRequest) -> str:
    """A job name no other test uses."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:100]
    return f"{name}-{next(_job_counter)}"


@pytest.fixture
def connect(daemon: PrivateDaemon, job: str) -> Iterator[Callable[..., OffloadClient]]:
    """Open blocking clients on the module daemon (default: this test's job, rank 0)."""
    clients: list[OffloadClient] = []

    def open_client(job_name: str | None = None, rank: int = 0, world_size: int = 1,
                    arena_nbytes: int = JOB_ARENA_NBYTES) -> OffloadClient:
        client = OffloadClient.connect(daemon.socket_path, job=job_name or job, rank=rank,
                                       world_size=world_size, arena_nbytes=arena_nbytes,
                                       timeout_s=10)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


@pytest.fixture
def witness(daemon: PrivateDaemon) -> Iterator[Callable[[], None]]:
    """A second, concurrent session on another job; calling it checks that it still works."""
    client = OffloadClient.connect(daemon.socket_path, job=f"witness-{next(_job_counter)}",
                                   arena_nbytes=JOB_ARENA_NBYTES, timeout_s=10)
    rounds = itertools.count()
    client.put("w", b"before")

    def check() -> None:
        assert daemon.process.poll() is None, "the daemon died"
        payload = os.urandom(4096 + next(rounds))
        client.put(f"w{len(payload)}", payload)
        assert client.get(f"w{len(payload)}") == payload
        assert client.get("w") == b"before"
        assert client.stats()["leased_nbytes"] == 0

    check()
    yield check
    client.close()


@pytest.fixture(params=["asyncio", "uvloop"])
def run_async(request: pytest.FixtureRequest) -> Callable[[Awaitable[T]], T]:
    """Run a coroutine to completion on a fresh loop of the parametrized kind, with a timeout."""

    def run(coro: Awaitable[T], timeout_s: float = ASYNC_TIMEOUT_S) -> T:
        async def bounded() -> T:
            loop = asyncio.get_running_loop()
            assert isinstance(loop, uvloop.Loop) == (request.param == "uvloop")
            return await asyncio.wait_for(coro, timeout_s)

        if request.param == "uvloop":
            return uvloop.run(bounded())
        return asyncio.run(bounded())

    return run


# -- raw protocol helpers (for bad input the client library would never send) ------------


def raw_socket(path: str, timeout_s: float = 10.0) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    sock.connect(path)
    return sock


def read_reply(sock: socket.socket) -> tuple[p.Reply | None, list[int]]:
    """One reply frame and any fds that came with it; (None, []) when the daemon closed."""
    header, fds = _recv_with_fds(sock, p.HEADER_NBYTES)
    if len(header) < p.HEADER_NBYTES:
        return None, fds
    (length,) = p.HEADER.unpack(header)
    payload, more = _recv_with_fds(sock, length)
    assert len(payload) == length, "the daemon cut a reply short"
    return p.reply_decoder.decode(payload), fds + more


def _recv_with_fds(sock: socket.socket, nbytes: int) -> tuple[bytes, list[int]]:
    data, fds = b"", array.array("i")
    while len(data) < nbytes:
        chunk, ancdata, _flags, _addr = sock.recvmsg(nbytes - len(data),
                                                     socket.CMSG_SPACE(4 * fds.itemsize))
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
        if not chunk:
            break
        data += chunk
    return data, list(fds)


def served_during(sock: socket.socket, request: p.Request, witness: OffloadClient
                  ) -> tuple[p.Reply, int]:
    """Send ``request`` and count the witness's acquire+release pairs completed before
    its reply arrived (the witness is a session of another job)."""
    sent, arrived, stop = threading.Event(), threading.Event(), threading.Event()
    during = [0]

    def keep_asking() -> None:
        while not stop.is_set():
            was_sent = sent.is_set()
            with witness.acquire("w", "r"):
                pass
            # Not readable and not yet flagged: this pair finished before the reply came.
            if was_sent and not select.select([sock], [], [], 0)[0] and not arrived.is_set():
                during[0] += 1

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        sock.sendall(p.encode_frame(request))
        sent.set()
        select.select([sock], [], [], 120)
        arrived.set()
        reply = read_reply(sock)[0]
    finally:
        stop.set()
        asker.join()
    assert reply is not None
    return reply, during[0]


def is_closed(sock: socket.socket) -> bool:
    """True when the daemon has closed its end (EOF), False if it is silent but open."""
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def hello(sock: socket.socket, job: str, *, rank: int = 0, world_size: int = 1,
          version: int = p.PROTOCOL_VERSION, arena_nbytes: int = JOB_ARENA_NBYTES,
          rid: int = 1) -> p.Reply:
    """Send hello and return the reply; an arena fd that came with it is closed."""
    sock.sendall(p.encode_frame(p.Hello(rid, version, job, rank, world_size, 0, "cpu",
                                        arena_nbytes)))
    reply, fds = read_reply(sock)
    for fd in fds:
        os.close(fd)
    assert reply is not None, "the daemon closed the connection during hello"
    return reply


def call(sock: socket.socket, request: p.Request) -> p.Reply | None:
    sock.sendall(p.encode_frame(request))
    return read_reply(sock)[0]


def error_code(reply: Any) -> str:
    assert isinstance(reply, p.ErrorReply), f"expected an error reply, got {reply!r}"
    return reply.code


@pytest.fixture
def swap_root() -> Iterator[Path]:
    """A temp dir for swap files on /var/tmp (a disk file system with O_DIRECT) when present."""
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    with tempfile.TemporaryDirectory(prefix="offloadd-test-", dir=parent) as root:
        yield Path(root)


# -- huge pages --------------------------------------------------------------------------

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE_PAGES_LOCK = Path("/tmp/offloadd-tests-huge-pages.lock")
"""Held by a test using the node's huge-page pool: another test process (an xdist worker,
a second suite run) resizing or restoring the pool meanwhile would take its pages."""


@pytest.fixture
def huge_pages() -> Iterator[Callable[[int], None]]:
    """``reserve(n)``: make sure ``n`` 2 MiB huge pages are free, growing the pool (as
    root) for this test and restoring it after; skips where that is not possible. Tests
    using it run one at a time across processes (``HUGE_PAGES_LOCK``)."""
    lock = open(HUGE_PAGES_LOCK, "a")  # noqa: SIM115 - held until the teardown below
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield from _huge_page_pool()
    finally:
        lock.close()  # releases the flock


def connect_reserving(socket_path: str, reserve: Callable[[int], None] | None, *,
                      job: str, arena_nbytes: int, attempts: int = 5,
                      **kwargs: Any) -> OffloadClient:
    """Connect to a daemon whose job arena takes 2 MiB huge pages, reserving them
    (``huge_pages``' ``reserve``) right before the hello, and again if a daemon of a
    concurrent test (``arena_hugepages = "auto"``, the default) took them in between: the
    pool is the node's, not this test's. ``reserve`` None: connect once, no reservation."""
    for attempt in range(attempts):
        if reserve is not None:
            reserve(-(-arena_nbytes // HUGE_PAGE_NBYTES))
        try:
            return OffloadClient.connect(socket_path, job=job, arena_nbytes=arena_nbytes,
                                         **kwargs)
        except OverBudgetError as exc:
            if reserve is None or "huge pages" not in str(exc) or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _huge_page_pool() -> Iterator[Callable[[int], None]]:
    original = int(NR_HUGEPAGES.read_text()) if NR_HUGEPAGES.exists() else None

    def reserve(count: int) -> None:
        missing = count - free_huge_pages()
        if missing <= 0:
            return
        if original is None or not os.access(NR_HUGEPAGES, os.W_OK):
            pytest.skip(f"needs {count} free 2 MiB huge pages (sysctl vm.nr_hugepages) or root")
        NR_HUGEPAGES.write_text(str(int(NR_HUGEPAGES.read_text()) + missing))
        if free_huge_pages() < count:
            pytest.skip(f"the kernel could not find {count} free 2 MiB pages")

    yield reserve
    if original is not None and os.access(NR_HUGEPAGES, os.W_OK):
        NR_HUGEPAGES.write_text(str(original))
