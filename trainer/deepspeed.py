"""``import trainer.deepspeed``: the one line a DeepSpeed script adds, before its
``import deepspeed``.

In this process the name ``deepspeed`` then means offloadd's DeepSpeed facade
(``trainer.integrations.hf.install``, which ``import trainer.hf`` runs for HF Trainer and
Accelerate scripts): ``deepspeed.initialize``, ``add_config_arguments``,
``init_distributed``, ``deepspeed.comm``, ``deepspeed.zero``,
``deepspeed.accelerator.get_accelerator``, ``deepspeed.utils.zero_to_fp32``,
``deepspeed.utils``' ``safe_get_full_*`` / ``safe_set_*`` (``trainer.zero.param_state``),
so a script that imports from them (DeepSpeed's own tutorials do) runs unchanged. A script that only
uses ``deepspeed.<name>`` may instead say ``import trainer as deepspeed``.

``python -m trainer.deepspeed [--num_gpus N] script.py args`` is DeepSpeed's ``deepspeed``
launcher on one node (``trainer.integrations.ds_launch``): every rank gets the facade
before the script's first line, so the script needs no added line at all.
"""

import sys

from trainer.integrations.ds_launch import main
from trainer.integrations.hf import DeepSpeedAlreadyImportedError, install

__all__ = ["DeepSpeedAlreadyImportedError", "install", "main"]

if __name__ == "__main__":
    sys.exit(main())
