"""Container deployment, checked without a Docker engine: the compose files parse and point at
files that exist, Prometheus accepts its config, Grafana's provisioning finds the dashboard, and
the Dockerfile has the stage/ARG/USER/HEALTHCHECK layout the compose file relies on."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _ops import DEPLOY, REPO, require_tool

yaml = pytest.importorskip("yaml", reason="PyYAML parses the compose and provisioning files")


def load(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    return load(DEPLOY / "compose.yaml")  # type: ignore[no-any-return]


def bind_mounts(service: dict[str, Any]) -> dict[str, str]:
    """``{host path: container path}`` of a service's relative bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            mounts[source] = target
    return mounts


def test_compose_services_and_node_settings() -> None:
    services = compose()["services"]
    assert set(services) == {"offloadd", "prometheus", "grafana"}
    daemon = services["offloadd"]
    assert (DEPLOY / daemon["build"]["context"] / daemon["build"]["dockerfile"]).is_file()
    assert daemon["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert daemon["shm_size"] and daemon["ipc"] == "shareable"
    assert "--metrics-addr" in daemon["command"]
    assert any(v.endswith(":/run/offloadd") for v in daemon["volumes"])
    # Ports are published on loopback only: /metrics names jobs, Grafana has an admin login.
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port


def test_compose_bind_mounts_exist() -> None:
    for name, service in compose()["services"].items():
        for source in bind_mounts(service):
            assert (DEPLOY / source).exists(), f"{name} mounts missing {source}"
    gpu = load(DEPLOY / "compose.gpu.yaml")["services"]["offloadd"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda"
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "prometheus")
    services = compose()["services"]
    mounts = bind_mounts(services["prometheus"])
    in_container = {target: DEPLOY / source for source, target in mounts.items()}
    config = load(DEPLOY / "prometheus.yml")
    config["rule_files"] = [str(in_container[path]) for path in config["rule_files"]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    (scrape,) = config["scrape_configs"]
    assert scrape["job_name"] == "offloadd"
    assert scrape["static_configs"][0]["targets"] == ["offloadd:9464"]
    assert in_container["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus.yml"


def test_grafana_provisioning_finds_dashboard_and_datasource() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = {target: (DEPLOY / source).resolve() for source, target in
              bind_mounts(grafana).items()}
    provisioning = mounts["/etc/grafana/provisioning"]
    (datasource,) = load(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    (provider,) = load(provisioning / "dashboards" / "offloadd.yml")["providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == (REPO / "grafana").resolve()
    assert json.loads((dashboards / "offloadd.json").read_text())["uid"] == "offloadd"


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    out: list[tuple[str, list[tuple[str, str]]]] = []
    for instruction, args in dockerfile():
        if instruction == "FROM":
            out.append((args, []))
        elif out:
            out[-1][1].append((instruction, args))
    return out


def test_dockerfile_variants_via_build_arg() -> None:
    instructions = dockerfile()
    assert instructions[0] == ("ARG", "VARIANT=cpu"), "VARIANT must be declared before any FROM"
    froms = [args for instruction, args in instructions if instruction == "FROM"]
    assert any(f.endswith("AS base-cpu") for f in froms)
    assert any(f.endswith("AS base-cuda") and "nvidia/cuda" in f for f in froms)
    assert "base-${VARIANT} AS build" in froms and froms[-1] == "base-${VARIANT} AS runtime"
    for base, body in stages():
        if "base-cuda" in base:
            assert any("[cuda]" in args for _, args in body), "the CUDA variant installs cupy"


def test_dockerfile_runtime_stage_layout() -> None:
    _base, runtime = stages()[-1]
    kinds = [instruction for instruction, _ in runtime]
    assert kinds.index("USER") < kinds.index("ENTRYPOINT")
    assert dict(runtime)["USER"] == "offloadd"
    assert "HEALTHCHECK" in kinds and "offloadd\", \"status" in dict(runtime)["HEALTHCHECK"]
    assert json.loads(dict(runtime)["ENTRYPOINT"])[:2] == ["offloadd", "serve"]
    assert "9464" in dict(runtime)["EXPOSE"]
    for base, body in stages():
        for instruction, args in body:
            if instruction == "COPY" and "--from" not in args:
                for source in args.split()[:-1]:
                    assert (REPO / source).exists(), f"{base}: COPY {source} is missing"
