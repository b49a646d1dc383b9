"""systemd deployment: the unit verifies, the sysusers file creates a system user, the example
config loads, and the real daemon speaks sd_notify (READY=1, WATCHDOG=1) on a NOTIFY_SOCKET."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from _ops import DEPLOY

from offloadd.config import DaemonConfig
from offloadd.ops.embedded import PrivateDaemon

UNIT = DEPLOY / "offloadd.service"


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd-analyze is missing (Debian package 'systemd')")
    return path


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_analyze_verify_is_clean(tmp_path: Path) -> None:
    unit = tmp_path / "offloadd.service"
    shutil.copy(UNIT, unit)
    result = subprocess.run([systemd_analyze(), "verify", "--man=no", str(unit)],
                            capture_output=True, text=True, timeout=60)
    complaints = [line for line in result.stderr.splitlines() if "offloadd.service" in line]
    assert result.returncode == 0 and not complaints, result.stderr


def test_unit_exposure_score_stays_low(tmp_path: Path) -> None:
    unit = tmp_path / "offloadd.service"
    shutil.copy(UNIT, unit)
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", "--threshold=30", str(unit)],
        capture_output=True, text=True, timeout=60)
    if "Unknown command verb" in result.stderr or "unrecognized option" in result.stderr:
        pytest.skip(f"this systemd-analyze cannot score offline: {result.stderr.strip()}")
    score = re.search(r"Overall exposure level for offloadd.service: ([\d.]+)", result.stdout)
    assert result.returncode == 0 and score, result.stdout[-1500:] + result.stderr
    assert float(score.group(1)) <= 3.0


def test_unit_lifecycle_memlock_and_gpu_access() -> None:
    settings = unit_settings()
    expected = {"Type": "notify", "RuntimeDirectory": "offloadd", "User": "offloadd",
                "Group": "offloadd", "LimitMEMLOCK": "infinity", "PrivateDevices": "no",
                "DevicePolicy": "closed", "RemoveIPC": "yes"}
    for key, value in expected.items():
        assert settings.get(key) == [value], f"{key}={settings.get(key)}"
    assert settings["WatchdogSec"] and settings["StateDirectory"]
    assert any(v.startswith("char-nvidia") for v in settings["DeviceAllow"])
    assert "MemoryDenyWriteExecute" not in settings and "ProcSubset" not in settings
    assert "--config /etc/offloadd/offloadd.toml" in settings["ExecStart"][0]


def test_sysusers_creates_a_system_user_and_group(tmp_path: Path) -> None:
    binary = shutil.which("systemd-sysusers")
    if binary is None:
        pytest.skip("systemd-sysusers is missing (Debian package 'systemd')")
    (tmp_path / "etc").mkdir()
    result = subprocess.run([binary, f"--root={tmp_path}",
                             str(DEPLOY / "sysusers.d" / "offloadd.conf")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    user = next(line.split(":") for line in passwd.splitlines() if line.startswith("offloadd:"))
    # Below SYS_UID_MAX: logind's RemoveIPC=yes never applies to system users.
    assert int(user[2]) < 1000 and user[5] == "/var/lib/offloadd"
    assert re.search(r"^offloadd:x:\d+:", (tmp_path / "etc" / "group").read_text(), re.M)


def test_example_config_loads_and_documents_every_key() -> None:
    path = DEPLOY / "offloadd.toml"
    config = DaemonConfig.from_toml(path)
    assert config.socket == "/run/offloadd/offloadd.sock"
    assert config.metrics_addr and config.swap_dirs
    text = path.read_text()
    for field in dataclasses.fields(DaemonConfig):
        assert re.search(rf"^#? ?{field.name} = ", text, re.M), f"{field.name} is not documented"


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_daemon_sends_ready_and_watchdog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         abstract: bool) -> None:
    address = f"\0offloadd-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(address)
        notify.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + address[1:] if abstract else address)
        monkeypatch.setenv("WATCHDOG_USEC", "1000000")
        with PrivateDaemon.start(tmp_path / "daemon", arena_size="16MiB"):
            messages = [notify.recv(4096).decode()]
            deadline = time.monotonic() + 10
            while "WATCHDOG=1" not in messages and time.monotonic() < deadline:
                messages.append(notify.recv(4096).decode())
    assert messages[0] == "READY=1"
    assert "WATCHDOG=1" in messages


def test_no_watchdog_pings_without_watchdog_usec(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    address = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as notify:
        notify.bind(address)
        notify.settimeout(1.0)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        monkeypatch.delenv("WATCHDOG_USEC", raising=False)
        with PrivateDaemon.start(tmp_path / "daemon", arena_size="16MiB"):
            assert notify.recv(4096) == b"READY=1"
            with pytest.raises(TimeoutError):
                notify.recv(4096)  # the loop ticks every 0.25 s: pings would arrive by now
