"""The tree shows the architecture (DESIGN section 3): each side is a stack of subpackages
that import only downwards, the daemon never imports the rank side, the rank side imports
only the daemon's contract and its private-daemon launcher, and no two modules import each
other, however indirectly.

Checked on the source: every import counts, those under ``TYPE_CHECKING`` and inside
functions included, since a type-only or deferred cycle still ties the modules together
for a reader and for mypy.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 800

DAEMON_CONTRACT = frozenset({"offloadd.protocol", "offloadd.errors", "offloadd.config",
                             "offloadd.formats", "offloadd.moment_codec"})
"""What both sides import: the wire protocol, the errors, the config types, the formats."""
DAEMON_BASE = DAEMON_CONTRACT | {"offloadd", "offloadd.metrics"}
"""The daemon's top-level modules, below every subpackage (metrics: the counters every
layer keeps and the /metrics exporter)."""
DAEMON_LAYERS = ("memory", "swap", "compute", "gpu", "service", "ops")
"""The daemon's subpackages, lowest first."""
DAEMON_ENTRY = frozenset({"offloadd.__main__"})
RANK_SIDE_MAY_IMPORT = DAEMON_CONTRACT | {"offloadd.ops.embedded", "offloadd.memory.node"}
"""The contract, the private-daemon launcher, and the node's memory figures (a rank sizes
the arena it asks for by the figure the daemon admits it by)."""

TRAINER_BASE = frozenset({"trainer.config", "trainer.config_schedulers", "trainer.config_parse",
                          "trainer.deepspeed_features", "trainer.client", "trainer.lease_debug"})
"""The rank side's foundation: its config schema (and the parser under it) and the daemon's
client."""
TRAINER_LAYERS = ("device", "dist", "offload", "zero", "state", "api", "integrations", "demo")
"""The rank side's layers, lowest first (``api`` is the module with ``initialize``)."""
TRAINER_ENTRY = frozenset({"trainer", "trainer.hf", "trainer.deepspeed", "trainer.lightning",
                           "trainer.export"})
"""What users import by name (``import trainer.hf``, ``python -m trainer.export``): above
every layer, and imported by none."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(path): path
            for side in ("offloadd", "trainer") for path in (ROOT / side).rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The longest prefix of ``name`` that is one of our modules."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules():
            return candidate
        parts.pop()
    return None


@functools.cache
def imports_of(module: str) -> frozenset[str]:
    """Our modules that ``module`` imports anywhere in its source."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = _resolve(f"{base}.{alias.name}") or _resolve(base)
                if target:
                    found.add(target)
        elif isinstance(node, ast.Import):
            found.update(t for alias in node.names if (t := _resolve(alias.name)))
    found.discard(module)
    return frozenset(found)


def _layer(module: str, base: frozenset[str], layers: tuple[str, ...],
           entry: frozenset[str]) -> int:
    if module in entry:
        return len(layers) + 1
    if module in base or any(module.startswith(f"{b}.") for b in base if "." in b):
        return 0  # a base module, or a submodule of a base package (trainer.client.*)
    return 1 + layers.index(module.split(".")[1])


def daemon_layer(module: str) -> int:
    return _layer(module, DAEMON_BASE, DAEMON_LAYERS, DAEMON_ENTRY)


def trainer_layer(module: str) -> int:
    return _layer(module, TRAINER_BASE, TRAINER_LAYERS, TRAINER_ENTRY)


def _side(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_a_layer() -> None:
    for module in modules():
        layer = daemon_layer if _side(module) == "offloadd" else trainer_layer
        try:
            layer(module)
        except ValueError:
            pytest.fail(f"{module} is in no layer: add its subpackage to this test's order")


def upward_imports(graph: dict[str, frozenset[str]], side: str) -> list[str]:
    layer = daemon_layer if side == "offloadd" else trainer_layer
    return [f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
            for module in sorted(graph) if _side(module) == side
            for target in sorted(graph[module])
            if _side(target) == side and layer(target) > layer(module)]


def import_graph() -> dict[str, frozenset[str]]:
    return {module: imports_of(module) for module in modules()}


@pytest.mark.parametrize("side", ["offloadd", "trainer"])
def test_layers_import_only_downwards(side: str) -> None:
    upward = upward_imports(import_graph(), side)
    assert not upward, "\n".join(upward)


def test_the_daemon_contract_imports_only_the_contract() -> None:
    """The modules both sides import must not drag a daemon layer into a rank."""
    for module in DAEMON_CONTRACT:
        assert imports_of(module) <= DAEMON_CONTRACT, (module, imports_of(module))


def test_the_daemon_never_imports_the_rank_side() -> None:
    found = [(module, target) for module in sorted(modules()) if _side(module) == "offloadd"
             for target in imports_of(module) if _side(target) == "trainer"]
    assert not found


def test_the_rank_side_imports_only_the_contract_and_the_embedded_daemon() -> None:
    found = [(module, target) for module in sorted(modules()) if _side(module) == "trainer"
             for target in imports_of(module)
             if _side(target) == "offloadd" and target not in RANK_SIDE_MAY_IMPORT]
    assert not found


def test_nothing_imports_an_entry_module() -> None:
    entries = TRAINER_ENTRY | DAEMON_ENTRY
    found = [(module, target) for module in sorted(modules()) for target in imports_of(module)
             if target in entries and module not in entries]
    assert not found


def cycles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles() -> None:
    assert not cycles(import_graph())


def test_no_file_over_800_lines() -> None:
    long = {str(path.relative_to(ROOT)): n for path in modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long


def test_every_module_says_what_it_is() -> None:
    """A docstring at the top of every module; each subpackage's says what it may import."""
    silent = [module for module, path in modules().items()
              if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not silent
    for module, path in modules().items():
        if path.name == "__init__.py" and module.count(".") == 1:
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "import" in docstring.lower(), module


def test_the_checker_sees_a_circle_and_an_upward_import() -> None:
    """The rules above can fail: a type-only back edge and an upward import are caught."""
    graph = import_graph() | {
        "offloadd.memory.shards": imports_of("offloadd.memory.shards") | {"offloadd.service.jobs"},
        "trainer.zero.engine": imports_of("trainer.zero.engine") | {"trainer.state.checkpoint"},
    }
    assert ["offloadd.memory.shards", "offloadd.service.jobs"] in [
        sorted(set(c) & {"offloadd.memory.shards", "offloadd.service.jobs"}) for c in cycles(graph)]
    assert any("trainer.state.checkpoint" in c for c in cycles(graph))
    assert upward_imports(graph, "offloadd") == [
        "offloadd.memory.shards (layer 1) imports offloadd.service.jobs (layer 5)"]
    assert upward_imports(graph, "trainer") == [
        "trainer.zero.engine (layer 4) imports trainer.state.checkpoint (layer 5)"]
