"""``python -m trainer.export <save_dir> <out>``: a checkpoint's consolidated 16-bit (or fp32)
weights as HF files (``trainer.state.export``)."""

import sys

from trainer.state.export import export_checkpoint, main

__all__ = ["export_checkpoint", "main"]

if __name__ == "__main__":
    sys.exit(main())
