"""Run a script under ``torchrun`` (static rendezvous on loopback) and fail with its log."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _dist import free_port

ROOT = Path(__file__).resolve().parent.parent


def torchrun(script: Path, args: list[str], log_dir: Path, *, nproc: int = 2,
             timeout_s: float = 280, env: dict[str, str] | None = None) -> None:
    """``torchrun --nproc-per-node nproc script *args`` with the project on PYTHONPATH."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{script.stem}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
               str(script), *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(command, env=full_env, stdout=log, stderr=log, cwd=log_dir)
        try:
            code = agent.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            agent.kill()
            code = agent.wait()
    if code:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise AssertionError(f"torchrun {script.name} {' '.join(args)} exited {code}:\n{tail}")


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (an orphan's reaper may not be init). A process
    that ends between the open and the read of its stat file reads as ESRCH
    (``ProcessLookupError``; seen once in CI, in test_journey): gone too."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


def wait_for(what: str, ready: Callable[[], object], within_s: float) -> None:
    """Poll ``ready`` until it is true; fail naming ``what`` after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not ready():
        assert time.monotonic() < deadline, f"{what} within {within_s} s"
        time.sleep(0.05)
