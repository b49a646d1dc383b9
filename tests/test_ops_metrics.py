"""Metrics, dashboard and alerts against real tools: promtool and a real Prometheus server.

A real daemon (``python -m offloadd serve --metrics-addr``) serves /metrics after some rank
traffic. Its exposition must pass ``promtool check metrics`` and match EXPORTED_METRICS (names,
types, label names); a Prometheus server scrapes it; every PromQL expression of
grafana/offloadd.json and deploy/offloadd-alerts.yml must pass ``promtool check rules``, name
only exported metrics and labels, and be accepted by the live server's query API.
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _ops import DEPLOY, REPO, free_port, http_get, metrics_port, require_tool
from prometheus_client.parser import text_string_to_metric_families

from offloadd import protocol as p
from offloadd.errors import OffloadError
from offloadd.ops.embedded import PrivateDaemon
from trainer.client import OffloadClient

yaml = pytest.importorskip("yaml")

CORE_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "offloadd_requests_total": ("counter", frozenset({"op", "status"})),
    "offloadd_request_duration_seconds": ("histogram", frozenset({"op"})),
    "offloadd_event_loop_lag_seconds": ("histogram", frozenset()),
    "offloadd_sessions": ("gauge", frozenset()),
    "offloadd_sessions_opened_total": ("counter", frozenset({"outcome"})),
    "offloadd_bad_frames_total": ("counter", frozenset({"reason"})),
    "offloadd_limit_rejections_total": ("counter", frozenset({"limit"})),
    "offloadd_arena_budget_bytes": ("gauge", frozenset()),
    "offloadd_arena_size_bytes": ("gauge", frozenset()),
    "offloadd_arena_capacity_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_arena_backed_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_arena_used_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_arena_withheld_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_arena_largest_free_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_arena_leased_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_shards": ("gauge", frozenset({"train_job"})),
    "offloadd_client_buffered_bytes": ("gauge", frozenset()),
    "offloadd_connections_unread": ("gauge", frozenset()),
    "offloadd_build_info": ("gauge", frozenset({"version", "adam_kernel", "io_engine", "python"})),
    "offloadd_optimizer_steps_total": ("counter", frozenset({"status"})),
    "offloadd_optimizer_elements_total": ("counter", frozenset()),
    "offloadd_optimizer_step_duration_seconds": ("histogram", frozenset()),
    "offloadd_device_copies_sessions_total": ("counter", frozenset({"path", "reason"})),
    "offloadd_device_copies_bytes_total": ("counter", frozenset({"direction"})),
    "offloadd_device_copies_readahead_total": ("counter", frozenset({"outcome"})),
    "offloadd_arena_pinned_sessions_total": ("counter", frozenset({"outcome"})),
}
"""What the daemon exports without --swap-dir."""

SWAP_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "offloadd_swap_capacity_bytes": ("gauge", frozenset({"dir"})),
    "offloadd_swap_used_bytes": ("gauge", frozenset({"dir"})),
    "offloadd_job_swap_used_bytes": ("gauge", frozenset({"train_job"})),
    "offloadd_swap_read_bytes_total": ("counter", frozenset({"dir"})),
    "offloadd_swap_written_bytes_total": ("counter", frozenset({"dir"})),
    "offloadd_swap_io_duration_seconds": ("histogram", frozenset({"op"})),
    "offloadd_swap_io_in_flight": ("gauge", frozenset()),
    "offloadd_swap_io_errors_total": ("counter", frozenset({"op"})),
    "offloadd_swap_direct_io": ("gauge", frozenset({"dir"})),
    "offloadd_evictions_total": ("counter", frozenset({"reason"})),
    "offloadd_writeback_bytes_total": ("counter", frozenset()),
    "offloadd_swap_shard_bytes_total": ("counter", frozenset({"op", "kind"})),
    "offloadd_swap_reread_bytes_total": ("counter", frozenset()),
    "offloadd_writeback_unneeded_bytes_total": ("counter", frozenset()),
    "offloadd_clean_writeback_bytes_total": ("counter", frozenset()),
    "offloadd_prefetch_issued_total": ("counter", frozenset()),
    "offloadd_prefetch_hits_total": ("counter", frozenset()),
    "offloadd_prefetch_late_total": ("counter", frozenset()),
    "offloadd_prefetch_wasted_total": ("counter", frozenset()),
    "offloadd_demand_reads_total": ("counter", frozenset()),
    "offloadd_checksum_failures_total": ("counter", frozenset()),
    "offloadd_rank_stall_seconds_total": ("counter", frozenset({"train_job", "rank"})),
    "offloadd_flushes_total": ("counter", frozenset({"status"})),
}
"""The NVMe tier's metrics (exported with --swap-dir). Until offloadd/swap/nvme.py exists this list
is the documented contract the dashboard and alerts are checked against; with it, the daemon
must export exactly these."""

EXPORTED_METRICS = {**CORE_METRICS, **SWAP_METRICS}
HAS_NVME = importlib.util.find_spec("offloadd.swap.nvme") is not None
TARGET_LABELS = frozenset({"instance", "job", "le"})
"""Labels Prometheus adds (instance, job) or histograms carry (le): usable in any expression."""
NON_OFFLOADD_METRICS = frozenset({"up"})
JOB = "opsjob"
LABELS: dict[str, str] = {}
"""Job name -> its train_job label on /metrics (an opaque label; the job's stats name it)."""


# -- a daemon with traffic -------------------------------------------------------------


def _make_traffic(daemon: PrivateDaemon) -> None:
    with OffloadClient.connect(daemon.socket_path, job=JOB, rank=0, world_size=1) as client:
        LABELS[JOB] = client.stats()["metrics_label"]
        state = torch.ones(256, dtype=torch.float32)
        client.put_many({f"u0.{name}": state for name in ("master", "exp_avg", "exp_avg_sq",
                                                            "grad")})
        client.optimizer_step("u0", step=1, lr=1e-3)
        assert client.get("u0.master") != state.numpy().tobytes()
        with pytest.raises(OffloadError):
            client.get("u0.missing")
        _device_copies_traffic(client)
        if HAS_NVME:  # overfill the 32 MiB arena: evictions, a demand read (a stall), a flush
            block = torch.zeros(1 << 20, dtype=torch.float32)
            for i in range(1, 13):
                client.put(f"u{i}.param", block)
            client.get("u1.param")
            client.flush("ops")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(daemon.socket_path)
        raw.sendall(p.HEADER.pack(3) + b"\xc1\xc1\xc1")  # never valid msgpack
        (length,) = p.HEADER.unpack(raw.recv(p.HEADER_NBYTES))
        assert isinstance(p.reply_decoder.decode(raw.recv(length)), p.ErrorReply)


def _device_copies_traffic(client: OffloadClient) -> None:
    """Daemon device copies on the CPU twin: a session's path, its pinning, bytes both ways,
    a stage_in of a session with a read-ahead slot (a miss: nothing learned yet)."""
    from trainer.device.copy_engine import TwinCopyEngine
    from trainer.offload.daemon_copies import open_daemon_copies

    engine = TwinCopyEngine()
    copies, _ = open_daemon_copies(client, engine, num_slots=3, slot_nbytes=1024,
                                   local_rank=0, arena_pinned="pinned", readahead_slots=1)
    assert copies is not None
    try:
        out = torch.empty(256)
        copies.read_into("u0.grad", out)
        copies.write_from("u0.grad", out)
    finally:
        copies.close()
        engine.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PrivateDaemon, int]]:
    workdir = tmp_path_factory.mktemp("metrics")
    swap_dirs = [str(workdir / "swap")] if HAS_NVME else []
    for swap_dir in swap_dirs:
        Path(swap_dir).mkdir()
    with PrivateDaemon.start(workdir, arena_size="64MiB", swap_dirs=swap_dirs,
                             extra_args=["--metrics-addr", "127.0.0.1:0"]) as running:
        _make_traffic(running)
        yield running, metrics_port(running.log_path)


@pytest.fixture(scope="module")
def exposition(daemon: tuple[PrivateDaemon, int]) -> str:
    return http_get(f"http://127.0.0.1:{daemon[1]}/metrics").decode()


def exported(exposition: str) -> dict[str, tuple[str, frozenset[str]]]:
    """``{name: (type, label names)}`` as scraped; counters named with their ``_total``."""
    out = {}
    for family in text_string_to_metric_families(exposition):
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels} - {"le"}
        out[name] = (family.type, frozenset(labels))
    return out


# -- the exposition ---------------------------------------------------------------------


def test_promtool_check_metrics_accepts_live_scrape(exposition: str) -> None:
    promtool = require_tool("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "metrics"], input=exposition,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), (
        f"promtool check metrics complains:\n{result.stdout}{result.stderr}")


def test_exported_metrics_match_the_documented_set(exposition: str) -> None:
    live = exported(exposition)
    expected = EXPORTED_METRICS if HAS_NVME else CORE_METRICS
    assert {n for n in live if n.startswith("offloadd_")} == set(expected), (
        "exported metric families differ from EXPORTED_METRICS in this file: document new "
        "metrics there (and give them a dashboard panel), or restore removed ones")
    for name, (kind, labels) in expected.items():
        live_kind, live_labels = live[name]
        assert live_kind == kind, f"{name} is a {live_kind}, documented as {kind}"
        # Families without samples yet (e.g. no bad frames) show no labels: subset, not equal.
        assert live_labels <= labels, f"{name} has labels {sorted(live_labels)}, not {labels}"


def test_no_metric_label_collides_with_prometheus_target_labels(exposition: str) -> None:
    for name, (_kind, labels) in exported(exposition).items():
        collisions = labels & {"job", "instance"}
        assert not collisions, f"{name} exports {collisions}: Prometheus renames them exported_*"


def test_samples_carry_the_traffic(exposition: str) -> None:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(exposition) for s in family.samples}
    assert samples[("offloadd_requests_total", (("op", "hello"), ("status", "ok")))] >= 1
    assert samples[("offloadd_requests_total", (("op", "acquire"), ("status", "unknown_shard")))]
    assert samples[("offloadd_bad_frames_total", (("reason", "decode"),))] == 1
    assert samples[("offloadd_optimizer_steps_total", (("status", "ok"),))] == 1
    assert samples[("offloadd_optimizer_elements_total", ())] == 256
    assert samples[("offloadd_arena_used_bytes", (("train_job", LABELS[JOB]),))] >= 4 * 1024


# -- PromQL of the dashboard and the alerts ------------------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads((REPO / "grafana" / "offloadd.json").read_text())


def dashboard_exprs() -> list[str]:
    """Every PromQL expression in the dashboard, Grafana variables replaced."""
    exprs = [t["expr"] for panel in dashboard()["panels"] for t in panel.get("targets", [])]
    for variable in dashboard()["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            found = re.fullmatch(r"label_values\((.+),\s*\w+\)", query["query"])
            assert found, f"template {variable['name']}: unexpected query {query['query']!r}"
            exprs.append(found.group(1))
    return [substitute(expr) for expr in exprs]


def substitute(expr: str) -> str:
    expr = expr.replace("$__rate_interval", "1m")
    return re.sub(r"\$\{?(instance|job)\}?", ".*", expr)


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "offloadd-alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def promtool_check_rules(exprs: list[str], tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    rules = {"groups": [{"name": "exprs", "rules": [
        {"record": f"offloadd_check:expr_{i}", "expr": expr} for i, expr in enumerate(exprs)]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, f"promtool rejects:\n{result.stdout}{result.stderr}"


_SELECTOR_LABEL = re.compile(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """Metric names (histogram suffixes stripped) and label names an expression uses."""
    bare = _STRING.sub('""', expr)
    names = set(re.findall(r"\b(offloadd_\w+)", bare)) | (
        set(re.findall(r"\b(\w+)\s*\{", bare)) & NON_OFFLOADD_METRICS)
    names = {re.sub(r"_(bucket|sum|count)$", "", n)
             if re.sub(r"_(bucket|sum|count)$", "", n) in EXPORTED_METRICS else n for n in names}
    labels = set(_SELECTOR_LABEL.findall(bare))
    for group in _GROUPING.findall(bare):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return names, labels


def check_names_and_labels(exprs: list[str], what: str) -> None:
    assert exprs, f"no expressions found in {what}"
    for expr in exprs:
        names, labels = names_and_labels(expr)
        assert names, f"{what}: {expr!r} names no metric"
        unknown = names - set(EXPORTED_METRICS) - NON_OFFLOADD_METRICS
        assert not unknown, f"{what}: {expr!r} uses {unknown}, which the daemon does not export"
        known = set(TARGET_LABELS).union(*(EXPORTED_METRICS.get(n, ("", set()))[1] for n in names))
        assert labels <= known, f"{what}: {expr!r} uses labels {labels - known} no metric has"


def test_dashboard_exprs_pass_promtool(tmp_path: Path) -> None:
    promtool_check_rules(dashboard_exprs(), tmp_path)


def test_dashboard_uses_only_exported_metrics_and_labels() -> None:
    check_names_and_labels(dashboard_exprs(), "grafana/offloadd.json")


def test_alert_rules_pass_promtool_and_use_exported_metrics() -> None:
    promtool = require_tool("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "rules", str(DEPLOY / "offloadd-alerts.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    check_names_and_labels(alert_exprs(), "deploy/offloadd-alerts.yml")


def test_dashboard_layout() -> None:
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "instance", "job"} <= set(variables)
    assert "train_job" in variables["job"]["query"]["query"]
    rows = [panel["title"] for panel in board["panels"] if panel["type"] == "row"]
    for title in ("USE: DRAM arena", "USE: NVMe swap", "Errors", "RED: requests", "Prefetch",
                  "Optimizer and stalls"):
        assert title in rows
    panels = [panel for panel in board["panels"] if panel["type"] != "row"]
    assert len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            if "offloadd_" in expr and "train_job" not in expr and "up{" not in expr:
                assert '$instance"' in expr, f"{panel['title']}: {expr} ignores $instance"
            if "rate(" in expr:
                assert "[$__rate_interval]" in expr, f"{panel['title']}: fixed rate window"
    exprs = " ".join(dashboard_exprs())
    assert "histogram_quantile(0.99" in exprs and "offloadd_rank_stall_seconds_total" in exprs


# -- a real Prometheus server -------------------------------------------------------------


def _query(base: str, expr: str) -> dict[str, Any]:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        return json.loads(http_get(url))  # type: ignore[no-any-return]
    except Exception as exc:  # a 400 carries the parse error in its body
        body = getattr(exc, "read", lambda: b"")().decode(errors="replace")
        raise AssertionError(f"Prometheus rejected {expr!r}: {exc} {body}") from exc


@pytest.fixture(scope="module")
def prometheus(daemon: tuple[PrivateDaemon, int],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = require_tool("prometheus", "prometheus")
    workdir = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": "offloadd", "scrape_interval": "1s",
                                  "static_configs": [{"targets": [f"127.0.0.1:{daemon[1]}"]}]}]}
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError((workdir / "prometheus.log").read_text()[-2000:])
            try:
                scrapes = _query(base, "count_over_time(offloadd_sessions[1m])")
                if float(scrapes["data"]["result"][0]["value"][1]) >= 2:
                    break
            except (AssertionError, OSError, IndexError):
                pass
            time.sleep(0.25)
        else:
            raise AssertionError("Prometheus got no offloadd samples in 30 s:\n"
                                 + (workdir / "prometheus.log").read_text()[-2000:])
        yield base
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_prometheus_receives_samples_of_every_core_metric(prometheus: str) -> None:
    result = _query(prometheus, 'count by (__name__) ({__name__=~"offloadd_.+", job="offloadd"})')
    names = {series["metric"]["__name__"] for series in result["data"]["result"]}
    expected = set()
    for name, (kind, _labels) in CORE_METRICS.items():
        expected |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if kind == "histogram" \
            else {name}
    assert expected <= names, f"no samples in Prometheus for {sorted(expected - names)}"
    up = _query(prometheus, 'up{job="offloadd"}')["data"]["result"]
    assert [series["value"][1] for series in up] == ["1"]


def test_prometheus_keeps_train_job_and_scrape_job_apart(prometheus: str) -> None:
    expr = f'offloadd_arena_capacity_bytes{{job="offloadd", train_job="{LABELS[JOB]}"}}'
    result = _query(prometheus, expr)["data"]["result"]
    assert len(result) == 1 and float(result[0]["value"][1]) > 0
    assert "exported_job" not in result[0]["metric"]


def test_prometheus_evaluates_every_dashboard_and_alert_expression(prometheus: str) -> None:
    for expr in dashboard_exprs() + alert_exprs():
        reply = _query(prometheus, expr)
        assert reply["status"] == "success", f"{expr}: {reply}"
    utilisation = next(e for e in dashboard_exprs() if "offloadd_arena_used_bytes" in e
                       and "/" in e and "largest" not in e)
    assert _query(prometheus, utilisation)["data"]["result"], "arena utilisation panel is empty"
