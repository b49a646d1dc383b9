"""DeepSpeed launcher-side conveniences: ``add_config_arguments(parser)`` and the
``initialize(args=...)`` config lookup, so a DeepSpeed script's argument handling runs
unchanged with ``import trainer as deepspeed``."""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` flags (same names)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable the engine (accepted for DeepSpeed compatibility)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed-style JSON config file")
    return parser


def config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config ``initialize`` parses: ``config``, else ``config_params``, else
    ``args.deepspeed_config``; two of them at once is an error, as in DeepSpeed."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    given = [source for source in (config, config_params) if source is not None]
    if from_args is not None and given:
        raise ValueError("initialize() got a config both in args.deepspeed_config and in "
                         "config=/config_params=: pass only one")
    if given:
        return given[0]
    if from_args is not None:
        if not isinstance(from_args, (str, os.PathLike)) or not os.path.exists(from_args):
            raise ValueError(f"args.deepspeed_config={from_args!r} is not an existing JSON "
                             "file path")
        return from_args
    raise ValueError("initialize() needs config= (a dict, a JSON path or an EngineConfig) "
                     "or args with a deepspeed_config attribute")


FULL_RESTORE = {"load_module_strict": True, "load_optimizer_states": True,
                "load_lr_scheduler_states": True, "load_module_only": False}
"""DeepSpeed's ``load_checkpoint`` options and the values that mean "restore everything"."""


def check_full_restore(options: dict[str, bool]) -> None:
    """Accept DeepSpeed's ``load_checkpoint`` options at their full-restore values only."""
    unknown = sorted(set(options) - set(FULL_RESTORE))
    if unknown:
        raise TypeError(f"load_checkpoint() got unexpected keyword arguments {unknown} "
                        f"(DeepSpeed's options here: {sorted(FULL_RESTORE)})")
    partial = {key: value for key, value in options.items() if value != FULL_RESTORE[key]}
    if partial:
        raise ValueError(
            f"load_checkpoint({', '.join(f'{k}={v}' for k, v in partial.items())}) is not "
            "supported: checkpoints restore the model, optimizer and scheduler together. For "
            "weights only, load trainer.state.checkpoint.consolidate_fp32_state_dict(engine)'s "
            "output into a fresh model before initialize()")
