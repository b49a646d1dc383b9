"""Hugging Face Trainer and Accelerate on offloadd: ``import trainer.hf`` first.

A script that passes a DeepSpeed config to ``TrainingArguments(deepspeed=...)``
or ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`` trains on
offloadd once it imports this module before transformers/accelerate::

    import trainer.integrations.hf  # noqa: F401  - the one added line
    from transformers import Trainer, TrainingArguments

transformers and accelerate decide whether DeepSpeed is present when they are
imported (``importlib.metadata`` and ``import deepspeed``), so this module, in
this process only, registers ``trainer.integrations.ds_facade`` as the module ``deepspeed``
and a matching distribution record. Nothing is installed on disk: a real
DeepSpeed stays importable in every process that does not import
``trainer.hf``, and one that does gets a clear error if DeepSpeed was already
imported (one of the two must own the name).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import types
from collections.abc import Iterable
from email.message import Message
from pathlib import Path
from typing import Any

import torch

from trainer import api
from trainer.dist import comm
from trainer.integrations import ds_accelerator, ds_facade
from trainer.integrations.versions import check_versions
from trainer.state import zero_to_fp32
from trainer.zero import checkpointing, estimate, external, param_state, partition
from trainer.zero import init as zero_init

FACADE_VERSION = "0.18.0+offloadd"
"""The DeepSpeed version the facade reports: the API level accelerate/transformers
check for (they gate features on ``deepspeed>=0.x``)."""


class DeepSpeedAlreadyImportedError(ImportError):
    """The real DeepSpeed owns the name ``deepspeed`` in this process already."""


class _FacadeDistribution(importlib.metadata.Distribution):
    """The distribution record ``importlib.metadata`` reports for ``deepspeed``."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {FACADE_VERSION}\n"
                    "Summary: offloadd's DeepSpeed facade (trainer.integrations.ds_facade)\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)

    @property
    def metadata(self) -> Message:  # type: ignore[override]
        message = Message()
        message["Name"] = "deepspeed"
        message["Version"] = FACADE_VERSION
        return message


class _FacadeFinder:
    """On ``sys.meta_path``: answers metadata queries for ``deepspeed`` (modules come
    from ``sys.modules``, where ``install`` put them)."""

    def find_spec(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterable[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == "deepspeed":
            return [_FacadeDistribution()]
        return []


def _module(name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name, "offloadd's DeepSpeed facade (trainer.integrations.ds_facade)")
    module.__dict__.update(attributes)
    module.__spec__ = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    module.__path__ = []  # a package, so `from deepspeed.x import y` resolves submodules
    return module


def _facade_modules() -> dict[str, types.ModuleType]:
    comm_names = {name: getattr(comm, name) for name in comm.__all__}
    comm_module = _module("deepspeed.comm",
                          **{**comm_names, "init_distributed": ds_facade.init_distributed})
    modules = {
        "deepspeed.comm": comm_module,
        "deepspeed.zero": _module(
            "deepspeed.zero", Init=zero_init.Init, GatheredParameters=ds_facade.GatheredParameters,
            register_external_parameter=external.register_external_parameter,
            unregister_external_parameter=external.unregister_external_parameter),
        "deepspeed.checkpointing": _module(
            "deepspeed.checkpointing",
            **{name: getattr(checkpointing, name) for name in checkpointing.DEEPSPEED_NAMES}),
        "deepspeed.utils": _module("deepspeed.utils", logger=ds_facade.logger,
                                   **param_state.DEEPSPEED_NAMES,
                                   **{name: getattr(partition, name)
                                      for name in partition.LEAF_NAMES}),
        "deepspeed.utils.zero_to_fp32": _module(
            "deepspeed.utils.zero_to_fp32",
            **{name: getattr(zero_to_fp32, name) for name in zero_to_fp32.DEEPSPEED_NAMES}),
        "deepspeed.checkpoint": _module("deepspeed.checkpoint"),
        "deepspeed.checkpoint.utils": _module(
            "deepspeed.checkpoint.utils",
            clone_tensors_for_torch_save=ds_facade.clone_tensors_for_torch_save),
        "deepspeed.runtime": _module("deepspeed.runtime"),
        "deepspeed.runtime.engine": _module("deepspeed.runtime.engine",
                                            DeepSpeedEngine=ds_facade.DeepSpeedEngine),
        "deepspeed.runtime.utils": _module("deepspeed.runtime.utils",
                                           see_memory_usage=ds_accelerator.see_memory_usage),
        "deepspeed.runtime.zero": _module(
            "deepspeed.runtime.zero", ZeroParamStatus=partition.ZeroParamStatus,
            Init=zero_init.Init, GatheredParameters=ds_facade.GatheredParameters),
        "deepspeed.runtime.zero.partition_parameters": _module(
            "deepspeed.runtime.zero.partition_parameters",
            zero_wrapper_for_fp_tensor_constructor=ds_facade.zero_wrapper_for_fp_tensor_constructor,
            _orig_torch_arange=torch.arange, get_accelerator=ds_accelerator.get_accelerator,
            ZeroParamStatus=partition.ZeroParamStatus, Init=zero_init.Init,
            GatheredParameters=ds_facade.GatheredParameters),
        "deepspeed.runtime.zero.stage3": _module(
            "deepspeed.runtime.zero.stage3",
            **{name: getattr(estimate, name) for name in estimate.ZERO3_NAMES}),
        "deepspeed.runtime.zero.stage_1_and_2": _module(
            "deepspeed.runtime.zero.stage_1_and_2",
            **{name: getattr(estimate, name) for name in estimate.ZERO2_NAMES}),
        "deepspeed.runtime.lr_schedules": _module(
            "deepspeed.runtime.lr_schedules", VALID_LR_SCHEDULES=ds_facade.VALID_LR_SCHEDULES),
        "deepspeed.ops": _module("deepspeed.ops"),
        "deepspeed.ops.adam": _module("deepspeed.ops.adam",
                                      DeepSpeedCPUAdam=ds_facade.DeepSpeedCPUAdam,
                                      FusedAdam=ds_facade.FusedAdam),
        "deepspeed.accelerator": _module("deepspeed.accelerator",
                                         get_accelerator=ds_accelerator.get_accelerator),
        # accelerate launch reads it before it starts torchrun (its multi-node pdsh
        # launcher writes the file; torchrun's, the one offloadd runs under, does not)
        "deepspeed.launcher": _module("deepspeed.launcher"),
        "deepspeed.launcher.runner": _module("deepspeed.launcher.runner",
                                             DEEPSPEED_ENVIRONMENT_NAME=".deepspeed_env"),
    }
    root = _module("deepspeed", __version__=FACADE_VERSION, initialize=ds_facade.initialize,
                   init_distributed=ds_facade.init_distributed,
                   add_config_arguments=api.add_config_arguments,
                   DeepSpeedEngine=ds_facade.DeepSpeedEngine, OFFLOADD_FACADE=True)
    for name, module in modules.items():
        parent, _, leaf = name.rpartition(".")
        setattr(modules.get(parent, root), leaf, module)
    return {"deepspeed": root, **modules}


def _check_import_order() -> None:
    existing = sys.modules.get("deepspeed")
    if existing is not None and not getattr(existing, "OFFLOADD_FACADE", False):
        raise DeepSpeedAlreadyImportedError(
            "DeepSpeed was imported before trainer.hf: put `import trainer.hf` before any "
            "import of transformers, accelerate or deepspeed (or drop it to train with "
            "DeepSpeed)")
    late = [name for name in ("transformers.integrations.deepspeed", "accelerate.utils")
            if name in sys.modules]
    # With a real DeepSpeed installed (not imported) they already saw "present": harmless.
    if late and existing is None and importlib.util.find_spec("deepspeed") is None:
        raise ImportError(
            f"{', '.join(late)} was imported before trainer.hf and has already decided that "
            "DeepSpeed is absent: put `import trainer.hf` before importing transformers' "
            "Trainer/TrainingArguments or accelerate")


def accelerate_main(argv: list[str] | None = None) -> int:
    """``accelerate <argv>`` with ``deepspeed`` meaning offloadd in this process too:
    ``python -m trainer.hf launch --config_file ds.yaml train.py`` is ``accelerate launch``
    of a DeepSpeed config, whose launcher looks for DeepSpeed before it starts torchrun
    (``ImportError: DeepSpeed is not installed`` without it). The training script still
    says ``import trainer.hf`` first, as every process that uses the facade does."""
    from accelerate.commands.accelerate_cli import main

    sys.argv = ["accelerate", *(sys.argv[1:] if argv is None else argv)]
    main()
    return 0


def install() -> None:
    """Make ``deepspeed`` mean offloadd in this process (idempotent)."""
    if getattr(sys.modules.get("deepspeed"), "OFFLOADD_FACADE", False):
        return
    check_versions("transformers", "accelerate")
    _check_import_order()
    sys.modules.update(_facade_modules())
    sys.meta_path.insert(0, _FacadeFinder())


install()
