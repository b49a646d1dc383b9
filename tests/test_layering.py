"""The swap tier's modules depend one way: shard table below swap space, swap space below
tier, tier below jobs (issue 12). Checked on the source, TYPE_CHECKING imports included,
since a type-only cycle still ties the modules together for a reader and for mypy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "offloadd"

# module -> the swap-tier modules it must not import (they sit above it)
LAYERS = {
    "shards": {"scheduler", "nvme", "tier", "jobs"},
    "scheduler": {"nvme", "tier", "jobs"},
    "nvme": {"tier", "jobs"},
    "tier": {"jobs"},
}


def offloadd_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("offloadd."):
                names.add(node.module.split(".")[1])
            elif node.module == "offloadd":
                names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("offloadd."))
    return names


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_swap_tier_modules_import_only_downwards(module: str) -> None:
    upward = offloadd_imports(module) & LAYERS[module]
    assert not upward, f"offloadd/{module}.py imports {sorted(upward)}, which sit above it"
