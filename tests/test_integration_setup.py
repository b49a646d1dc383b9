"""The integrations are optional and never shadow DeepSpeed: no ``deepspeed`` module or
distribution ships with offloadd; ``import trainer.hf`` makes the name mean offloadd in
its own process only, refuses to run after transformers/accelerate or a real DeepSpeed
were imported, and installed versions outside the tested ranges fail naming the range."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from trainer.integrations import versions

ROOT = Path(__file__).resolve().parent.parent


def python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          timeout=120)


def test_extras_pin_the_supported_ranges() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    pins = {requirement.split(">=")[0]: requirement
            for requirement in extras["hf"] + extras["lightning"]}
    assert set(pins) == set(versions.SUPPORTED)
    for name, (low, high) in versions.SUPPORTED.items():
        assert pins[name] == f"{name}>={low},<{high}"


def test_nothing_named_deepspeed_ships() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "deepspeed" not in project["tool"]["scikit-build"]["wheel"]["packages"]
    assert not list(ROOT.glob("deepspeed*")) and project["project"]["name"] != "deepspeed"
    found = python("import importlib.util as u; s = u.find_spec('deepspeed'); "
                   "print(s.origin if s else None)")
    assert found.returncode == 0 and str(ROOT) not in found.stdout


def test_import_trainer_hf_makes_deepspeed_mean_offloadd_in_this_process() -> None:
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    result = python(
        "import trainer.hf, deepspeed, importlib.metadata as m\n"
        "from transformers.integrations.deepspeed import is_deepspeed_available\n"
        "from accelerate.utils import is_deepspeed_available as accelerate_sees\n"
        "from trainer.integrations.ds_facade import initialize\n"
        "assert deepspeed.OFFLOADD_FACADE and deepspeed.initialize is initialize\n"
        "assert is_deepspeed_available() and accelerate_sees()\n"
        "print(m.version('deepspeed'))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("+offloadd")


def test_import_after_transformers_is_refused_with_the_fix() -> None:
    pytest.importorskip("accelerate", reason="the hf extra is not installed")
    result = python("import transformers.trainer\nimport trainer.hf")
    if importlib.util.find_spec("deepspeed") is not None:
        # A real DeepSpeed is installed (not imported): transformers already saw one
        # present, as it will see the facade, so the late import is harmless and accepted.
        assert result.returncode == 0, result.stderr
        return
    assert result.returncode != 0
    assert "put `import trainer.hf` before" in result.stderr


def test_a_real_deepspeed_already_imported_is_not_replaced() -> None:
    result = python("import sys, types\nsys.modules['deepspeed'] = types.ModuleType('deepspeed')"
                    "\nimport trainer.hf")
    assert result.returncode != 0
    assert "DeepSpeedAlreadyImportedError" in result.stderr
    assert "drop it to train with DeepSpeed" in result.stderr


def test_versions_outside_the_range_name_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    monkeypatch.setitem(versions.SUPPORTED, "transformers", ("0.1", "0.2"))
    with pytest.raises(versions.UnsupportedVersionError,
                       match=r"transformers>=0.1,<0.2; found transformers .*offloadd\[hf\]"):
        versions.check_versions("transformers")
    versions.check_versions("accelerate", "lightning")  # the installed ones are in range
