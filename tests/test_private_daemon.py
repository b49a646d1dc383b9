"""The private daemon's lifetime, at the daemon: ``offloadd serve --exit-when-idle S`` serves
its ranks until the last one is done, then exits and deletes its ``--scratch-dir`` dirs.

A rank's connection closed without ``close_job`` is what the daemon sees when the rank is
killed (kill -9, the OOM killer): the kernel closes its socket. The same lifetime under
torchrun, with real rank processes, is in ``test_private_daemon_ranks.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import JOB_ARENA_NBYTES, call, hello, raw_socket

from offloadd import protocol as p
from offloadd.ops.embedded import PrivateDaemon, make_scratch_dir
from trainer.client import OffloadClient

EXIT_WAIT_S = 60.0
"""Longest wait for a daemon that should exit (a bound for a hang, not a speed claim)."""
NEVER_S = 3600.0
"""An idle grace no test outlives: an exit then proves the at-once path."""


def start_private(tmp_path: Path, idle_s: float) -> PrivateDaemon:
    """A daemon as the trainer starts it, its swap dir and another dir its scratch (the
    trainer's socket dir is one too; here the log must outlive the daemon): one made as
    scratch by its launcher, the swap dir made by the daemon itself."""
    scratch, swap_dir = Path(make_scratch_dir(tmp_path, "scratch-")), tmp_path / "swap"
    (scratch / "left-by-the-rank").write_bytes(b"x")
    return PrivateDaemon.start(tmp_path / "d", arena_size="32MiB", swap_dirs=[str(swap_dir)],
                               release_swap_at_exit=True, exit_when_idle_s=idle_s,
                               scratch_dirs=[str(scratch), str(swap_dir)])


def connect(daemon: PrivateDaemon, job: str, rank: int = 0) -> OffloadClient:
    return OffloadClient.connect(daemon.socket_path, job=job, rank=rank, world_size=2,
                                 arena_nbytes=JOB_ARENA_NBYTES, timeout_s=10)


def exit_code(daemon: PrivateDaemon) -> int:
    """Wait for a daemon that should exit by itself; a hang fails the test (and kills it)."""
    try:
        return daemon.process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        daemon.stop()
        pytest.fail(f"the private daemon did not exit; log: {daemon.log_path}")


def log_of(daemon: PrivateDaemon) -> str:
    return Path(daemon.log_path).read_text(errors="replace")


@pytest.fixture
def private_daemons():
    """Started daemons, stopped at teardown whatever the test did (a no-op once exited)."""
    started: list[PrivateDaemon] = []
    yield started
    for daemon in started:
        daemon.stop()


def test_the_daemon_serves_the_last_rank_after_the_first_closed(
        tmp_path: Path, private_daemons, job: str) -> None:
    daemon = start_private(tmp_path, NEVER_S)
    private_daemons.append(daemon)
    rank0, rank1 = connect(daemon, job, 0), connect(daemon, job, 1)
    rank1.put("u0.master", b"rank 1 still trains")
    rank0.put("u0.master", b"rank 0 is done")
    rank0.close_job()  # local rank 0, which started the daemon, finishes first
    assert daemon.process.poll() is None
    assert rank1.get("u0.master") == b"rank 1 still trains"
    swap_dir = Path(daemon.scratch_dirs[1])
    assert swap_dir.exists()
    rank1.close_job()
    assert exit_code(daemon) == 0
    assert "reason=every_job_closed" in log_of(daemon)
    assert all(not Path(path).exists() for path in daemon.scratch_dirs)
    assert not Path(daemon.socket_path).exists()


def test_killed_ranks_end_the_daemon_after_the_grace(
        tmp_path: Path, private_daemons, job: str) -> None:
    daemon = start_private(tmp_path, 1.0)
    private_daemons.append(daemon)
    ranks = [raw_socket(daemon.socket_path) for _ in range(2)]
    for rank, sock in enumerate(ranks):
        assert isinstance(hello(sock, job, rank=rank, world_size=2), p.HelloOk)
    ranks[0].close()  # a kill -9: the connection ends without close_job
    assert daemon.process.poll() is None, "rank 1 still holds the job"
    reply = call(ranks[1], p.Alloc(2, ["u0.master"], [4096], ["float32"]))
    assert reply is not None and not isinstance(reply, p.ErrorReply), reply
    ranks[1].close()
    assert exit_code(daemon) == 0
    assert "reason=idle" in log_of(daemon)
    assert all(not Path(path).exists() for path in daemon.scratch_dirs)


def fork_rank_that_leaves_a_child_holding_its_socket(daemon: PrivateDaemon, job: str) -> int:
    """A rank process says hello, forks a child that inherits its connection (as a forked
    DataLoader or pool worker does) and dies; returns the child's pid."""
    read_end, write_end = os.pipe()
    rank_pid = os.fork()
    if rank_pid == 0:  # pragma: no cover - runs in the forked rank
        try:
            sock = raw_socket(daemon.socket_path)
            hello(sock, job)
            child = os.fork()
            if child == 0:
                os.close(write_end)  # the test reads until the rank's end closes
                time.sleep(EXIT_WAIT_S * 2)  # holds the socket; killed by the test
                os._exit(0)
            os.write(write_end, str(child).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(rank_pid, 0)
    with os.fdopen(read_end, "rb") as pipe:
        return int(pipe.read())


def test_a_dead_ranks_session_ends_while_a_child_still_holds_its_socket(
        tmp_path: Path, private_daemons, job: str) -> None:
    daemon = start_private(tmp_path, 1.0)
    private_daemons.append(daemon)
    child = fork_rank_that_leaves_a_child_holding_its_socket(daemon, job)
    try:
        assert exit_code(daemon) == 0
    finally:
        os.kill(child, signal.SIGKILL)
    assert "event=peer_exited" in log_of(daemon)
    assert all(not Path(path).exists() for path in daemon.scratch_dirs)


def test_a_daemon_no_rank_ever_reaches_exits_after_the_grace(
        tmp_path: Path, private_daemons) -> None:
    daemon = start_private(tmp_path, 1.0)  # its starter died before saying hello
    private_daemons.append(daemon)
    assert exit_code(daemon) == 0
    assert all(not Path(path).exists() for path in daemon.scratch_dirs)


def test_an_admin_query_is_not_a_rank(tmp_path: Path, private_daemons) -> None:
    daemon = start_private(tmp_path, 1.0)
    private_daemons.append(daemon)
    with raw_socket(daemon.socket_path) as admin:  # `offloadd status` held open
        admin.sendall(p.encode_frame(p.NodeStatus(1)))
        assert exit_code(daemon) == 0


def test_a_node_daemon_without_the_flag_keeps_serving(tmp_path: Path, private_daemons,
                                                        job: str) -> None:
    daemon = PrivateDaemon.start(tmp_path / "d", arena_size="32MiB")
    private_daemons.append(daemon)
    connect(daemon, job).close_job()
    with connect(daemon, job) as again:  # the daemon is still there for the next job
        again.put("a", b"x")
    assert daemon.process.poll() is None


def test_exit_when_idle_must_not_be_negative(tmp_path: Path) -> None:
    from offloadd.config import DaemonConfig

    with pytest.raises(ValueError, match="exit_when_idle_s must be >= 0"):
        DaemonConfig(socket=str(tmp_path / "s"), exit_when_idle_s=-1.0)


def test_a_second_job_on_the_node_gets_a_daemon_of_its_own(tmp_path: Path,
                                                             private_daemons) -> None:
    """Two torchrun jobs on one node, same config (workdir and nvme_path): each local
    rank 0 starts a daemon, and neither takes the other's socket or swap dir."""
    from trainer.config import parse_config
    from trainer.offload.daemon_connect import _start_private_daemon

    offload = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    config = parse_config({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
        "offloadd": {"workdir": str(tmp_path / "work"), "private_exit_grace_s": NEVER_S}})
    first = _start_private_daemon(config, "train", 32 << 20)
    private_daemons.append(first)
    second = _start_private_daemon(config, "train", 32 << 20)
    private_daemons.append(second)
    assert first.socket_path != second.socket_path
    assert not set(first.scratch_dirs) & set(second.scratch_dirs)
    first_rank, second_rank = connect(first, "train"), connect(second, "train")
    first_rank.put("u0.master", b"first job")
    second_rank.put("u0.master", b"second job")
    first_rank.close_job()
    assert exit_code(first) == 0
    assert second_rank.get("u0.master") == b"second job"  # the second job trains on
    second_rank.close_job()
    assert exit_code(second) == 0
    assert list((tmp_path / "nvme").iterdir()) == []


def test_a_workdir_too_deep_for_af_unix_gets_a_short_socket_dir(tmp_path: Path) -> None:
    """sun_path holds 107 bytes: a deep workdir (a scratch tree, pytest-xdist's tmp_path)
    must not stop the daemon from starting; its socket goes to a private short dir,
    removed when it stops."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    daemon = PrivateDaemon.start(deep, arena_size="32MiB")
    try:
        socket_dir = Path(daemon.socket_path).parent
        assert len(os.fsencode(str(deep / "offloadd.sock"))) > 107
        assert socket_dir != deep and (socket_dir.stat().st_mode & 0o777) == 0o700
        with OffloadClient.connect(daemon.socket_path, job="deep") as client:
            client.put("a", b"reached")
            assert client.get("a") == b"reached"
    finally:
        assert daemon.stop() == 0
    assert not socket_dir.exists()


HIGH_FDS = r'''
import os, resource, sys
import torch
from offloadd.ops.embedded import PrivateDaemon
from offloadd.swap import ioengine
from trainer.client import OffloadClient

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY and hard < 2048:
    print("SKIP hard fd limit", hard)
    sys.exit(0)
resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # a rank with many files
with PrivateDaemon.start(arena_size=8 << 20) as daemon:       # reads its ready line
    client = OffloadClient.connect(daemon.socket_path, job="fds", arena_nbytes=2 << 20)
    assert client._sock.fileno() > 1024, client._sock.fileno()
    torch.manual_seed(0)
    state = {name: torch.randn(4096) for name in ("master", "grad")}
    state.update(exp_avg=torch.zeros(4096), exp_avg_sq=torch.zeros(4096))
    client.put_many({f"u.{name}": value for name, value in state.items()})
    handle = client.optimizer_step_async("u", step=1, lr=1e-2)
    while not handle.done():
        client.poll_replies()                                   # polls the socket
    handle.wait()
    param = state["master"].clone().requires_grad_()
    param.grad = state["grad"].clone()
    torch.optim.AdamW([param], lr=1e-2, weight_decay=0.0).step()
    ours = torch.frombuffer(bytearray(client.get("u.master")), dtype=torch.float32)
    torch.testing.assert_close(ours, param.detach(), rtol=1e-6, atol=1e-7)
    client.close()
print("io_uring:", ioengine._io_uring_refusal() or "usable")      # probes through an eventfd
print("OK")
'''


def test_a_rank_with_fds_past_1024_starts_a_daemon_and_polls_its_replies(tmp_path: Path
                                                                           ) -> None:
    """A rank that has opened many files (datasets' shards, dataloader pipes) has its
    sockets and pipes numbered past 1024, where ``select.select`` raises ValueError: the
    private daemon's ready line, the client's reply poll (each speculative step) and the
    io_uring probe use ``poll``."""
    script = tmp_path / "high_fds.py"
    script.write_text(HIGH_FDS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0 and done.stdout.endswith("OK\n"), done.stdout + done.stderr


ENGINES_ONE_AFTER_ANOTHER = r'''
import os, sys, time
sys.path.insert(0, sys.argv[1])
import trainer
from _dist import base_config, make_batch, make_model

def children():
    """(pid, state) of this process's children, zombies included."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
        except OSError:
            continue
        if fields[1] == str(os.getpid()):
            found.append((int(pid), fields[0]))
    return found

fds = []
for index in range(3):
    config = base_config(zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}})
    engine, _, _, _ = trainer.initialize(model=make_model(index), config=config)
    engine.backward(engine(*make_batch(0, 0, 0, 4)))
    engine.step()
    engine.close()
    fds.append(len(os.listdir("/proc/self/fd")))
deadline = time.monotonic() + 30
while children() and time.monotonic() < deadline:
    time.sleep(0.1)
print("children", children(), "fds", fds)
'''


def test_engines_one_after_another_leave_no_zombie_daemons(tmp_path: Path) -> None:
    """Each engine without a node daemon starts a private one, which ends by itself after
    the job's last rank; a process that builds engine after engine (a sweep, a notebook)
    reaps each once it has ended and keeps no pipe to it: no zombies, no fds piling up."""
    script = tmp_path / "engines.py"
    script.write_text(ENGINES_ONE_AFTER_ANOTHER)
    done = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    last = done.stdout.splitlines()[-1]
    assert last.startswith("children [] fds "), last
    fds = last.partition(" fds ")[2]
    assert len(set(fds.strip("[]").split(", "))) == 1, last
