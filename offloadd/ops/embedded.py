"""A private daemon in a child process: for the demo, the tests and the engine's default."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from offloadd.swap.swapdirs import make_dirs as make_dirs  # re-exported to the rank side
from offloadd.swap.swapdirs import make_scratch_dir


class DaemonStartError(RuntimeError):
    pass


MAX_SOCKET_PATH_NBYTES = 107
"""sizeof(sockaddr_un.sun_path) - 1 on Linux."""


def _short_tmp() -> str:
    """A temp dir whose socket paths fit AF_UNIX: ``$TMPDIR`` unless it is long."""
    base = tempfile.gettempdir()
    return base if len(os.fsencode(base)) <= 64 else "/tmp"


class PrivateDaemon:
    """``offloadd serve`` as a child process on a socket in a private directory."""

    def __init__(self, process: subprocess.Popen[bytes], socket_path: str, workdir: str,
                 log_path: str, owns_workdir: tempfile.TemporaryDirectory[str] | None) -> None:
        self.process = process
        self.socket_path = socket_path
        self.workdir = workdir
        self.log_path = log_path
        self._owned = owns_workdir
        self.ready_line = ""
        """The daemon's one ready line (``offloadd ready socket=... metrics_addr=...``)."""
        self.remove_on_stop: list[str] = []
        """Scratch dirs (e.g. private swap dirs) deleted once the daemon has exited."""
        self.scratch_dirs: list[str] = []
        """Dirs the daemon itself deletes when it exits (``start(scratch_dirs=...)``)."""

    @classmethod
    def start(cls, workdir: str | os.PathLike[str] | None = None, *,
              arena_size: int | str = 256 << 20, swap_dirs: list[str] | None = None,
              extra_args: list[str] | None = None, timeout_s: float = 30.0,
              release_swap_at_exit: bool = False, exit_when_idle_s: float | None = None,
              scratch_dirs: list[str] | None = None) -> PrivateDaemon:
        """Start ``offloadd serve`` and wait for its ready line.

        ``exit_when_idle_s``: the daemon ends by itself once its ranks are gone
        (``DaemonConfig.exit_when_idle_s``) and runs in a session of its own, so it
        outlives this process and the signals of its process group (a terminal's Ctrl-C,
        a launcher's killpg) until the last rank is done; ``scratch_dirs`` are deleted
        by the daemon when it exits."""
        owned = None
        if workdir is None:
            owned = tempfile.TemporaryDirectory(prefix="offloadd-")
            workdir = owned.name
        workdir = str(workdir)
        os.makedirs(workdir, exist_ok=True)
        socket_path = os.path.join(workdir, "offloadd.sock")
        short_dir = None
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_NBYTES:
            # A deep workdir (a job's scratch tree, pytest's tmp_path) can pass AF_UNIX's
            # 108-byte limit: the socket then lives in a private dir of its own, short.
            short_dir = make_scratch_dir(_short_tmp())  # the daemon may delete it
            socket_path = os.path.join(short_dir, "offloadd.sock")
            scratch_dirs = [*(scratch_dirs or []), short_dir] if exit_when_idle_s is not None \
                else scratch_dirs
        args = [sys.executable, "-m", "offloadd", "serve", "--socket", socket_path,
                "--arena-size", str(arena_size), "--log-level", "info"]
        for swap_dir in swap_dirs or []:
            args += ["--swap-dir", str(swap_dir)]
        if release_swap_at_exit:  # a private daemon's swap files are its own: gone at its exit
            args.append("--release-swap-at-exit")
        if exit_when_idle_s is not None:
            args += ["--exit-when-idle", str(exit_when_idle_s)]
        for path in scratch_dirs or []:
            args += ["--scratch-dir", str(path)]
        args += extra_args or []
        log_path = os.path.join(workdir, "offloadd.log")
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log_file,
                                       start_new_session=exit_when_idle_s is not None)
        daemon = cls(process, socket_path, workdir, log_path, owned)
        daemon.scratch_dirs = [str(path) for path in scratch_dirs or []]
        if short_dir is not None and exit_when_idle_s is None:
            daemon.remove_on_stop.append(short_dir)
        daemon._wait_ready(timeout_s)
        return daemon

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = _read_line(self.process.stdout, deadline)
        self.ready_line = line
        if not line.startswith("offloadd ready"):
            self.process.kill()
            self.process.wait()
            tail = Path(self.log_path).read_text(errors="replace")[-2000:]
            raise DaemonStartError(f"private offloadd did not start (got {line!r}):\n{tail}")

    @property
    def metrics_addr(self) -> str | None:
        """HOST:PORT of /metrics as bound (``--metrics-addr 127.0.0.1:0`` picks a free port)."""
        for field in self.ready_line.split():
            if field.startswith("metrics_addr="):
                return field.partition("=")[2]
        return None

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (killed after ``timeout_s``)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self._owned is not None:
            self._owned.cleanup()
            self._owned = None
        for path in self.remove_on_stop:
            shutil.rmtree(path, ignore_errors=True)
        self.remove_on_stop = []
        return self.process.returncode

    def detach(self) -> None:
        """Let the daemon run on by itself (``exit_when_idle_s``) while this process goes on:
        close the pipe its ready line came through, and reap it on a thread when it ends.
        Otherwise each daemon a long-lived process started (one per engine) stays a zombie
        holding a pipe until the process exits."""
        if self.process.stdout is not None:
            self.process.stdout.close()
        if self.process.poll() is None:
            threading.Thread(target=self.process.wait, name=f"offloadd-reap-{self.pid}",
                             daemon=True).start()

    def __enter__(self) -> PrivateDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _readable(fd: int, timeout_s: float) -> bool:
    """``fd`` has data (or hung up) within ``timeout_s``; ``poll``, not ``select``, which
    raises for an fd past 1024, as a rank that has opened many files gets."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


def _read_line(stream: IO[bytes], deadline: float) -> str:
    fd = stream.fileno()
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not _readable(fd, remaining):
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()
