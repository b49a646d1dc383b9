"""``import trainer.deepspeed``: the one line a DeepSpeed script adds, before its
``import deepspeed``.

In this process the name ``deepspeed`` then means offloadd's DeepSpeed facade
(``trainer.integrations.hf.install``, which ``import trainer.hf`` runs for HF Trainer and
Accelerate scripts): ``deepspeed.initialize``, ``add_config_arguments``,
``init_distributed``, ``deepspeed.comm``, ``deepspeed.zero``,
``deepspeed.accelerator.get_accelerator``, ``deepspeed.utils.zero_to_fp32``, so a script
that imports from them (DeepSpeed's own tutorials do) runs unchanged. A script that only
uses ``deepspeed.<name>`` may instead say ``import trainer as deepspeed``.
"""

from trainer.integrations.hf import DeepSpeedAlreadyImportedError, install

__all__ = ["DeepSpeedAlreadyImportedError", "install"]
