"""DeepSpeed's ``deepspeed.utils.zero_to_fp32``, over offloadd's checkpoints.

The guides of HF Trainer and Accelerate take a ZeRO checkpoint's fp32 weights out in
two ways, and both work on checkpoints that ``save_checkpoint`` wrote:

- online, in the training script (``import trainer.hf`` registers this module as
  ``deepspeed.utils.zero_to_fp32``)::

      from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
      model = load_state_dict_from_zero_checkpoint(trainer.model, checkpoint_dir)

- offline, with the script ``save_checkpoint`` leaves beside ``latest`` (as DeepSpeed
  copies its own there)::

      cd checkpoint-500 && python zero_to_fp32.py . out_dir [--safe_serialization]
          [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters]

Same names, parameters and outputs as DeepSpeed's (0.15 on): ``out_dir`` gets
``pytorch_model.bin`` (or ``model.safetensors``), sharded with an index above
``max_shard_size``. Where they differ:

- an output path ending in ``.bin``/``.pt``/``.pth`` that is not a directory gets one
  state dict file, as HF's guide (``python zero_to_fp32.py . pytorch_model.bin``) and
  DeepSpeed before 0.15 (``output_file=``) write it;
- safetensors hold a tied weight once, under its first name (``from_pretrained`` ties it
  again), where DeepSpeed's safetensors writer refuses shared tensors;
- ``lazy_mode=True`` is accepted and gives real tensors (each is read from the
  memory-mapped rank files either way);
- ``load_state_dict_from_zero_checkpoint`` also fills a model whose ZeRO-3 engine
  released its parameters (DeepSpeed's ``load_state_dict`` meets their empty storage as
  a size mismatch). As with DeepSpeed, the model is then a plain CPU model, no longer
  usable by its engine.

A checkpoint saved with ``exclude_frozen_parameters=True`` (HF Trainer's PEFT runs)
converts to what it holds: the trained parameters and the buffers, as DeepSpeed's does.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

from trainer.state.export import ExportError, consolidate_checkpoint, export_checkpoint
from trainer.state.hf_checkpoint import (
    BIN_WEIGHTS,
    SAFE_WEIGHTS,
    TORCH_SAVE_SUFFIXES,
    CheckpointError,
)

SCRIPT_NAME = "zero_to_fp32.py"
"""The converter script ``save_checkpoint`` leaves in a save directory."""
SCRIPT = f'''#!/usr/bin/env python3
"""This checkpoint directory's fp32 weights, without torch.distributed or a GPU.

DeepSpeed's {SCRIPT_NAME}, for offloadd's checkpoints (trainer.state.zero_to_fp32)::

    python {SCRIPT_NAME} . out_dir [--safe_serialization] [--max_shard_size 5GB]
        [-t TAG] [--exclude_frozen_parameters]
"""
import sys

from trainer.state.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''
DEEPSPEED_NAMES = ("get_fp32_state_dict_from_zero_checkpoint",
                   "convert_zero_checkpoint_to_fp32_state_dict",
                   "load_state_dict_from_zero_checkpoint")
"""What ``deepspeed.utils.zero_to_fp32`` offers that ``trainer.hf`` registers."""


def get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
        exclude_frozen_parameters: bool = False, lazy_mode: bool = False
        ) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 parameters and its buffers as one CPU state dict (a tied
    weight under each of its names, as one tensor). ``checkpoint_dir`` is the directory
    given to ``save_checkpoint``; ``tag`` defaults to its ``latest``."""
    del lazy_mode  # real tensors either way (see module docstring)
    state, _ = consolidate_checkpoint(checkpoint_dir, tag,
                                      exclude_frozen=exclude_frozen_parameters, whole=False)
    return state


def convert_zero_checkpoint_to_fp32_state_dict(
        checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str] | None = None,
        max_shard_size: int | str | None = "5GB", safe_serialization: bool = False,
        tag: str | None = None, exclude_frozen_parameters: bool = False, *,
        output_file: str | os.PathLike[str] | None = None) -> Path:
    """Write the checkpoint's fp32 weights into ``output_dir`` as DeepSpeed does (see
    module docstring), or into the one file ``output_file`` (DeepSpeed before 0.15);
    returns what was written. ``max_shard_size=None``: never sharded."""
    if (output_dir is None) == (output_file is None):
        raise TypeError("convert_zero_checkpoint_to_fp32_state_dict() takes output_dir "
                        "(a directory) or output_file (one state dict file), one of them")
    out = Path(output_file if output_file is not None else output_dir)  # type: ignore[arg-type]
    one_file = output_file is not None or (out.suffix in TORCH_SAVE_SUFFIXES
                                           and not out.is_dir())
    return export_checkpoint(
        checkpoint_dir, out, tag=tag, weights_only=True, directory=not one_file,
        weights_name=SAFE_WEIGHTS if safe_serialization else BIN_WEIGHTS,
        max_shard_size=sys.maxsize if max_shard_size is None else max_shard_size,
        exclude_frozen=exclude_frozen_parameters)


def load_state_dict_from_zero_checkpoint(model: nn.Module,
                                         checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it
    (``strict=False``, as DeepSpeed does); returns the model. Parameters a ZeRO-3 engine
    released get storage of their full shape first (see module docstring)."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    for name, param in model.named_parameters():
        value = state.get(name)
        if value is not None and param.numel() == 0 and value.numel() != 0:
            param.data = torch.empty(value.shape, dtype=param.dtype)
    model.load_state_dict(state, strict=False)
    return model


def write_script(save_dir: str | os.PathLike[str]) -> Path:
    """Leave the converter script in ``save_dir`` (executable), as DeepSpeed does."""
    path = Path(save_dir) / SCRIPT_NAME
    partial = path.with_name(path.name + ".partial")
    partial.write_text(SCRIPT, encoding="utf-8")
    partial.chmod(0o755)
    os.replace(partial, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=SCRIPT_NAME,
        description="Write a ZeRO checkpoint's fp32 weights as a state dict (DeepSpeed's "
                    "zero_to_fp32.py, for offloadd's checkpoints).")
    parser.add_argument("checkpoint_dir",
                        help="the directory given to save_checkpoint, e.g. path/checkpoint-12")
    parser.add_argument("output_dir",
                        help="a directory for the weight files (e.g. path/checkpoint-12-out), "
                             "or one file ending in .bin/.pt/.pth")
    parser.add_argument("--max_shard_size", default="5GB",
                        help="the largest weight file before sharding (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors instead of torch.save files")
    parser.add_argument("-t", "--tag", default=None,
                        help="checkpoint tag, e.g. global_step1 (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out the parameters the run did not train")
    parser.add_argument("-d", "--debug", action="store_true",
                        help="list the files written")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (ExportError, CheckpointError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.debug:
        for file in sorted(written.iterdir()) if written.is_dir() else [written]:
            print(f"{file} ({file.stat().st_size} bytes)")
    print(f"Saved fp32 weights to {written}")
    return 0
