"""The private daemon's lifetime as users run training: ``tests/scripts/lifetime_train.py``
(ZeRO-3, NVMe offload, no ``engine.close()``) under torchrun with two real rank processes.

- Local rank 0, which started the daemon, exits first: rank 1 still works with the daemon
  and finishes with exit 0; then the daemon exits and deletes its scratch dirs.
- kill -9 of local rank 0 mid-training: the daemon does not stay behind as an orphan.
- A script that never closes its engine closes its job at interpreter exit: a node daemon
  does not keep its arena for ``job_linger_s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _dist import free_port
from _torchrun import process_gone, wait_for
from conftest import call, raw_socket, start_daemon

from offloadd import protocol as p

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "lifetime_train.py"
RUN_WAIT_S = 240.0
"""Longest a launch may take (a hang bound on a loaded 2-core machine, not a speed claim)."""
GONE_WAIT_S = 60.0
"""Longest wait for the daemon to exit and its scratch dirs to go."""
NEVER_S = 3600.0
"""A grace no test outlives: a daemon gone before it shows the clean, at-once exit."""


def command(tmp_path: Path, *script_args: str, nproc: int = 2) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
                if nproc > 1 else [sys.executable])
    return [*launcher, str(SCRIPT), "--nvme", str(tmp_path / "nvme"), "--out", str(tmp_path),
            *script_args]


def launch(tmp_path: Path, *script_args: str, nproc: int = 2) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "run.log", "wb")  # noqa: SIM115 - the child holds it; closed at exit
    try:
        return subprocess.Popen(command(tmp_path, *script_args, nproc=nproc), env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()


def finish(tmp_path: Path, run: subprocess.Popen[bytes]) -> int:
    try:
        return run.wait(RUN_WAIT_S)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        pytest.fail("the run hung:\n" + log_tail(tmp_path))


def log_tail(tmp_path: Path) -> str:
    return (tmp_path / "run.log").read_text(errors="replace")[-4000:]


def read_report(tmp_path: Path, rank: int) -> dict[str, Any]:
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def assert_daemon_gone(tmp_path: Path, report: dict[str, Any]) -> None:
    """The daemon rank 0 started exited and deleted its socket and swap scratch dirs."""
    scratch = [Path(path) for path in report["scratch_dirs"]]
    assert len(scratch) == 2, scratch  # the socket dir and one dir under nvme_path
    assert any(path.parent == tmp_path / "nvme" for path in scratch), scratch
    try:
        wait_for("the private daemon exits", lambda: process_gone(report["daemon_pid"]),
                 GONE_WAIT_S)
    except AssertionError:
        os.kill(report["daemon_pid"], signal.SIGKILL)  # leave no orphan behind the test
        raise
    wait_for("its scratch dirs are deleted",
             lambda: not any(path.exists() for path in scratch), GONE_WAIT_S)
    assert not (tmp_path / "nvme").exists()  # created for the job, removed with it


def test_rank0_exits_first_and_rank1_still_finishes(tmp_path: Path) -> None:
    run = launch(tmp_path, "--rank0-first", "--grace", str(NEVER_S))
    code = finish(tmp_path, run)
    assert code == 0, log_tail(tmp_path)
    assert "rank 0 done" in log_tail(tmp_path)
    assert json.loads((tmp_path / "rank1.done").read_text()), "rank 1 read no state"
    rank0 = read_report(tmp_path, 0)
    assert read_report(tmp_path, 1)["daemon_pid"] == rank0["daemon_pid"]  # one per node
    assert_daemon_gone(tmp_path, rank0)


def test_kill_9_of_rank0_mid_training_leaves_no_daemon_behind(tmp_path: Path) -> None:
    run = launch(tmp_path, "--until-killed", "--grace", "1")
    try:
        wait_for("both ranks train", lambda: all(
            (tmp_path / f"rank{rank}.json").exists() for rank in (0, 1)), RUN_WAIT_S)
        rank0 = read_report(tmp_path, 0)
        os.kill(rank0["pid"], signal.SIGKILL)
        assert finish(tmp_path, run) != 0  # torchrun reports the killed rank
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert_daemon_gone(tmp_path, rank0)


def test_a_script_without_engine_close_closes_its_job_at_exit(tmp_path: Path) -> None:
    job = "no-close"
    with start_daemon(tmp_path / "d", arena_size="256MiB",
                      extra_args=["--swap-dir", str(tmp_path / "swap")]) as daemon:
        run = launch(tmp_path, "--socket", daemon.socket_path, "--job", job, nproc=1)
        assert finish(tmp_path, run) == 0, log_tail(tmp_path)
        log = Path(daemon.log_path).read_text()
        assert f"event=close_job session=1 job={job}" in log, log[-2000:]
        status = call(raw_socket(daemon.socket_path), p.NodeStatus(1))
        assert isinstance(status, p.StatsOk), status
        # freed now, not after the daemon's job_linger_s (300 s): no job, no arena reserved
        assert status.stats["jobs"] == {}, status.stats["jobs"]
        assert status.stats["node"]["reserved_nbytes"] == 0, status.stats["node"]
