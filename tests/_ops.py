"""Helpers for the ops tests (tests/test_ops_*.py): external tools, a daemon with /metrics."""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"


@functools.cache
def _apt_install(package: str) -> str | None:
    """Install a Debian package once per test run; returns why it could not be, or None."""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "not root on a Debian/Ubuntu machine, cannot apt-get install"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
    for command in (install, ["apt-get", "update", "-qq"], install):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode == 0 and command is install:
            return None
    return f"apt-get install {package} failed: {result.stderr.strip()[-300:]}"


def require_tool(binary: str, package: str) -> str:
    """Path of ``binary``, apt-installing ``package`` when missing; skips with the reason."""
    path = shutil.which(binary)
    if path is None:
        reason = _apt_install(package)
        path = shutil.which(binary)
        if path is None:
            pytest.skip(f"{binary} unavailable ({reason or f'{package} has no {binary}'}); "
                        f"install the Debian package {package!r}")
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metrics_port(log_path: str, timeout_s: float = 10.0) -> int:
    """The port a daemon started with ``--metrics-addr 127.0.0.1:0`` logged."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"event=metrics_listening addr=[\d.]+:(\d+)", Path(log_path).read_text())
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise AssertionError(f"daemon logged no metrics address:\n{Path(log_path).read_text()}")


def http_get(url: str, timeout_s: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return bytes(response.read())


def metric_types(exposition: str) -> dict[str, str]:
    """``{family name: type}`` from the ``# TYPE`` lines of a /metrics page."""
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE)}
