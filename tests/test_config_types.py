"""An operator's config mistake is refused at load, naming the key, and the daemon deletes
only scratch dirs it made (issue 32 item 8).

Every ``DaemonConfig`` field is checked by its annotated type and range, from a TOML file,
the flags or Python: a string where a list belongs (``scratch_dirs = "/srv/x"`` was read a
character at a time, and the daemon deleted ``/`` at exit), a bool where a number belongs,
a negative size, NaN, an unknown key. And whatever ``scratch_dirs`` names, a real daemon
deletes a dir at exit only when it created it (or offloadd's launcher made it as scratch)
and it is still the dir it claimed: a dir holding someone's data survives.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from offloadd.config import ConfigError, DaemonConfig
from offloadd.ops.embedded import DaemonStartError, PrivateDaemon
from offloadd.swap.swapdirs import SCRATCH_MARKER

SERVE_WAIT_S = 30.0
"""Longest wait for ``offloadd serve`` to refuse its config (a bound for a hang)."""


def toml_value(value: Any) -> str:
    """``value`` as a TOML literal (TOML has no null: None is never written)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(toml_value(item) for item in value) + "]"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "offloadd.toml"
    path.write_text(text)
    return path


def refused(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        DaemonConfig.from_toml(write_config(tmp_path, text))
    return info.value


def wrong_values(hint: Any) -> list[Any]:
    """Values of the wrong type for a field annotated ``hint`` (written in a TOML file)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in args if arg is not type(None)]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        item = "x" if args[0] is int else 7
        return ["/srv/x", 1, True, [item], {"a": 1}]
    if origin is typing.Annotated:  # a byte count: an int or a size string
        return [True, 1.5, ["1GiB"], "lots", {"a": 1}]
    if origin is typing.Literal:
        return [1, True, "no-such-choice", [args[0]]]
    wrong = {bool: [1, 0, "true", [True]], int: [True, "4", 1.5, [4]],
             float: [True, "30", [1.0], math.nan, math.inf],
             str: [1, True, ["a"], ""]}
    return wrong[hint]


def field_cases() -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(DaemonConfig, include_extras=True)
    return [(item.name, value) for item in dataclasses.fields(DaemonConfig)
            for value in wrong_values(hints[item.name])]


@pytest.mark.parametrize("key, value", field_cases())
def test_every_field_refuses_a_wrong_typed_value_naming_the_key(
        tmp_path: Path, key: str, value: Any) -> None:
    error = refused(tmp_path, f"{key} = {toml_value(value)}\n")
    assert error.key.partition("[")[0] == key, error
    assert key in str(error) and str(tmp_path / "offloadd.toml") in str(error)
    with pytest.raises(ConfigError, match=key):  # and from Python, as the tests build it
        DaemonConfig(**{key: value})


def test_scratch_dirs_as_a_string_is_refused_naming_the_key(tmp_path: Path) -> None:
    error = refused(tmp_path, 'scratch_dirs = "/srv/x"\n')
    assert error.key == "scratch_dirs"
    assert 'scratch_dirs = ["/srv/x"]' in str(error)  # what to write instead


def test_swap_dirs_as_a_string_is_refused_naming_the_key(tmp_path: Path) -> None:
    error = refused(tmp_path, '[offloadd]\nswap-dirs = "/srv/nvme0"\n')
    assert error.key == "swap_dirs"
    assert 'swap_dirs = ["/srv/nvme0"]' in str(error)


@pytest.mark.parametrize("line, key", [
    ("arena_size = -1", "arena_size"), ('arena_size = "-1GiB"', "arena_size"),
    ("swap_size = -4096", "swap_size"), ("max_swap_nbytes_per_uid = -5", "max_swap_nbytes_per_uid"),
    ("max_pending_nbytes_per_uid = 0", "max_pending_nbytes_per_uid"),
    ("job_linger_s = nan", "job_linger_s"), ("hello_timeout_s = inf", "hello_timeout_s"),
    ("exit_when_idle_s = -1", "exit_when_idle_s"), ("optimizer_threads = -1", "optimizer_threads"),
    ("hash_threads = -2", "hash_threads"),
    ("max_metrics_connections = 0", "max_metrics_connections"),
    ("allowed_uids = [-1]", "allowed_uids"), ("allowed_uids = [4294967295]", "allowed_uids"),
    ('scratch_dirs = ["relative/dir"]', "scratch_dirs"), ('scratch_dirs = ["/"]', "scratch_dirs"),
    ('scratch_dirs = ["//."]', "scratch_dirs"), ('swap_dirs = [""]', "swap_dirs"),
    ('socket = ""', "socket"), ('metrics_addr = "9400"', "metrics_addr"),
])
def test_values_out_of_range_are_refused_naming_the_key(
        tmp_path: Path, line: str, key: str) -> None:
    assert refused(tmp_path, line + "\n").key.partition("[")[0] == key


def test_unknown_and_doubled_keys_are_refused(tmp_path: Path) -> None:
    error = refused(tmp_path, 'scratch_dir = ["/run/x"]\n')
    assert error.key == "scratch_dir" and "did you mean 'scratch_dirs'" in str(error)
    assert refused(tmp_path, "io-queue-depth = 4\nio_queue_depth = 8\n").key == "io_queue_depth"
    assert refused(tmp_path, "offloadd = 3\n").key == "offloadd"
    assert refused(tmp_path, "recover = true\n[offloadd]\nmlock = false\n").key == "recover"


def test_good_values_load_as_their_types(tmp_path: Path) -> None:
    config = DaemonConfig.from_toml(write_config(tmp_path, (
        '[offloadd]\narena-size = "64MiB"\nswap_dirs = ["/srv/nvme0", "/srv/nvme1"]\n'
        "exit_when_idle_s = 5\nmax_swap_nbytes_per_uid = \"1GiB\"\nrecover = true\n")))
    assert config.arena_size == 64 << 20 and config.max_swap_nbytes_per_uid == 1 << 30
    assert config.swap_dirs == ["/srv/nvme0", "/srv/nvme1"] and config.recover is True
    assert config.exit_when_idle_s == 5.0 and isinstance(config.exit_when_idle_s, float)


def serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``offloadd serve`` in ``tmp_path`` (relative paths land there); a daemon that starts
    anyway is stopped (SIGTERM) once it said it is ready, and its result returned."""
    command = [sys.executable, "-m", "offloadd", "serve", "--socket",
               str(tmp_path / "d.sock"), "--arena-size", "8MiB", *args]
    process = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=SERVE_WAIT_S)
    except subprocess.TimeoutExpired:  # it started: what would it do at exit?
        process.terminate()
        stdout, stderr = process.communicate(timeout=SERVE_WAIT_S)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_serve_refuses_a_scratch_string_and_deletes_nothing(tmp_path: Path) -> None:
    """The string ``"kept"`` was read as the dirs k, e, p, t (relative here, not /)."""
    for name in "kept":
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "sentinel").write_text("data")
    result = serve(tmp_path, "--config", str(write_config(tmp_path, 'scratch_dirs = "kept"\n')))
    assert result.returncode == 2, result
    assert "scratch_dirs" in result.stderr
    assert all((tmp_path / name / "sentinel").read_text() == "data" for name in "kept")
    assert not (tmp_path / "d.sock").exists()


def test_serve_refuses_a_swap_dirs_string_and_makes_no_dirs(tmp_path: Path) -> None:
    result = serve(tmp_path, "--config", str(write_config(tmp_path, 'swap_dirs = "ab"\n')))
    assert result.returncode == 2 and "swap_dirs" in result.stderr, result
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_serve_checks_flags_too(tmp_path: Path) -> None:
    result = serve(tmp_path, "--exit-when-idle", "nan")
    assert result.returncode == 2 and "exit_when_idle_s" in result.stderr, result


@pytest.mark.parametrize(("args", "key", "named"), [
    (["--socket", "missing/dir/d.sock"], "socket", "its dir missing/dir does not exist"),
    (["--metrics-addr", "no-such-host.invalid:0"], "metrics_addr", "'no-such-host.invalid:0'"),
    (["--socket", "s" * 103 + ".sock"], "socket", "108 bytes, and a unix socket's path holds "
     "at most 107"),
], ids=["socket_dir", "metrics_host", "socket_path_length"])
def test_start_failures_name_the_setting(tmp_path: Path, args: list[str], key: str,
                                         named: str) -> None:
    """An address the daemon cannot listen on is refused naming the setting and the
    value to change, not with a bare errno."""
    result = serve(tmp_path, *args)
    assert result.returncode == 1, result
    assert "offloadd: cannot start:" in result.stderr and named in result.stderr, result
    assert key in result.stderr.rpartition("cannot start:")[2]


def start_with_scratch(tmp_path: Path, scratch: list[Path]) -> PrivateDaemon:
    return PrivateDaemon.start(tmp_path / "d", arena_size="8MiB",
                               scratch_dirs=[str(path) for path in scratch])


def test_a_pre_existing_dir_given_as_scratch_survives_the_daemon(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o700)
    (data / "sentinel").write_text("keep me")
    try:
        daemon = start_with_scratch(tmp_path, [data])
    except DaemonStartError as exc:
        reason = str(exc)
    else:
        daemon.stop()
        reason = "the daemon started"
    assert (data / "sentinel").read_text() == "keep me"
    assert f"scratch dir {data} exists and was not made by offloadd" in reason


def test_the_daemon_deletes_a_scratch_dir_it_created_with_what_was_put_in_it(
        tmp_path: Path) -> None:
    scratch = tmp_path / "made-by-the-daemon"
    daemon = start_with_scratch(tmp_path, [scratch])
    try:
        assert (scratch / SCRATCH_MARKER).read_text().count(f"claimed_by_pid={daemon.pid}") == 1
        (scratch / "by-a-rank" / "deeper").mkdir(parents=True)
        (scratch / "by-a-rank" / "deeper" / "file").write_bytes(b"x")
        os.symlink(tmp_path / "outside", scratch / "link")
        (tmp_path / "outside").mkdir()
        (tmp_path / "outside" / "sentinel").write_text("keep me")
    finally:
        assert daemon.stop() == 0
    assert not scratch.exists()
    assert (tmp_path / "outside" / "sentinel").read_text() == "keep me"


def test_a_dir_put_in_place_of_the_claimed_one_survives(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    daemon = start_with_scratch(tmp_path, [scratch])
    try:
        scratch.rename(tmp_path / "moved-away")
        scratch.mkdir(mode=0o700)  # someone's data now sits at the path
        (scratch / "sentinel").write_text("keep me")
        (scratch / SCRATCH_MARKER).write_text((tmp_path / "moved-away" / SCRATCH_MARKER)
                                              .read_text())  # a copied marker is not the dir
    finally:
        assert daemon.stop() == 0
    assert (scratch / "sentinel").read_text() == "keep me"


def test_a_live_daemons_scratch_dir_is_refused_to_a_second_daemon(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    first = start_with_scratch(tmp_path, [scratch])
    try:
        with pytest.raises(DaemonStartError, match=f"scratch dir {scratch} is held by another"):
            second = PrivateDaemon.start(tmp_path / "d2", arena_size="8MiB",
                                         scratch_dirs=[str(scratch)])
            second.stop()
        assert scratch.is_dir() and first.process.poll() is None
    finally:
        assert first.stop() == 0
    assert not scratch.exists()


def test_a_crashed_daemons_scratch_dir_passes_to_the_next(tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    crashed = start_with_scratch(tmp_path, [scratch])
    crashed.process.kill()
    crashed.stop()
    assert (scratch / SCRATCH_MARKER).exists()  # kill -9: nothing deleted
    restarted = start_with_scratch(tmp_path, [scratch])
    assert restarted.stop() == 0
    assert not scratch.exists()
