"""``import trainer.hf``: the one line an HF Trainer or Accelerate script adds (before
transformers or accelerate is imported). It installs the DeepSpeed facade
(``trainer.integrations.hf``) so their DeepSpeed code paths run on offloadd."""

from trainer.integrations.hf import DeepSpeedAlreadyImportedError, install

__all__ = ["DeepSpeedAlreadyImportedError", "install"]
