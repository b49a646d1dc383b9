"""The tested version ranges of the optional integrations, checked when one is imported."""

from __future__ import annotations

import importlib.metadata

SUPPORTED: dict[str, tuple[str, str]] = {
    "transformers": ("5.23", "5.24"),
    "accelerate": ("1.15", "1.16"),
    "lightning": ("2.6", "2.7"),
}
"""``[min, max)`` per package: the ranges the ``hf`` and ``lightning`` extras of
pyproject.toml pin (``tests/test_integration_setup.py`` keeps the two in step)."""


class UnsupportedVersionError(ImportError):
    """An installed integration package is outside its tested range; names the range."""


def check_versions(*names: str) -> None:
    """Raise ``UnsupportedVersionError`` unless every named, installed package is in range."""
    from packaging.version import Version

    for name in names:
        low, high = SUPPORTED[name]
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # not installed: the import of that integration fails on its own
        if not Version(low) <= Version(installed) < Version(high):
            extra = "lightning" if name == "lightning" else "hf"
            raise UnsupportedVersionError(
                f"offloadd's {name} integration supports {name}>={low},<{high}; found {name} "
                f"{installed}: pip install 'offloadd[{extra}]' (or '{name}>={low},<{high}')")
