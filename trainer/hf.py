"""``import trainer.hf``: the one line an HF Trainer or Accelerate script adds (before
transformers or accelerate is imported). It installs the DeepSpeed facade
(``trainer.integrations.hf``) so their DeepSpeed code paths run on offloadd.

``python -m trainer.hf launch --config_file ds.yaml train.py`` is ``accelerate launch``
for a DeepSpeed config (``accelerate_main``): its launcher needs the facade as well."""

import sys

from trainer.integrations.hf import DeepSpeedAlreadyImportedError, accelerate_main, install

__all__ = ["DeepSpeedAlreadyImportedError", "accelerate_main", "install"]

if __name__ == "__main__":
    sys.exit(accelerate_main())
